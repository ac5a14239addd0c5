"""The EMA (``--ema-decay``) on the fp16 route and with ``--compile``, and the fp16 route's logged
``grad_norm``: short runs of the tiny preset under DeepSpeed (2 CPU ranks), checked against references.

* EMA: every checkpoint's EMA is the previous one updated with that checkpoint's live weights by the
  EMA's recurrence, bit for bit (noise from :mod:`optim.rounding`; the first from the weights the engine
  held before step 1, captured in the run), and it follows a float64 EMA of the recorded module weights
  within the stochastic rounding's bound (an unbiased error: its mean over the elements is zero within
  5 sigma). On the fp16 route (loss scale 2**14: this model's first steps overflow) an overflow step
  leaves the EMA and its update count as they were (:mod:`recipe.training.ema`); under ``--compile`` an
  evaluation of the EMA mid-run swaps its tensors into the compiled towers, and training goes on without
  recompiling.
* grad_norm: every fp16 step that did not overflow logs the float64 norm of the unscaled all-reduced
  gradients (captured just before the optimizer step), an overflow step logs ``"inf"``; metrics.jsonl is
  strict JSON (non-finite values are strings).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from recipe.training.ema import ema_decay_at

from ...dist_utils import run_distributed
from .test_ema import _expected, _param_names, _weights
from ..test_train import ENV, ds_json, train_cfg

DECAY = 0.9


def _worker(rank: int, world: int, cfgs: list[dict], compiled: bool) -> list[dict[str, Any]]:
    """Trains each config; records the weights the EMA starts from, the float64 norm of the unscaled
    gradients of every step (where the recipe computes its own), and with ``compiled`` the graphs Dynamo
    compiled, making any recompilation after the first step an error."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import recipe.training.step as S
    import recipe.train as T
    from recipe.config import config_from_dict

    norms: list[float] = []
    initial: dict[str, torch.Tensor] = {}
    multiplier, build_ema, train_step = S.grad_multiplier, T.build_ema, T.train_step

    def capturing(params, prec):  # type: ignore[no-untyped-def]
        grads = [p.grad for p in params if p.grad is not None]
        scale = prec.loss_scaler.scale if prec.loss_scaler is not None else 1.0
        norms.append(math.sqrt(sum(float(g.double().square().sum()) for g in grads)) / scale)
        return multiplier(params, prec)

    def recording(engine, cfg):  # type: ignore[no-untyped-def]
        initial.update({k: v.detach().clone() for k, v in engine.module.state_dict().items()})
        return build_ema(engine, cfg)

    def step_then_forbid_recompiles(*args, **kwargs):  # type: ignore[no-untyped-def]
        result = train_step(*args, **kwargs)
        torch._dynamo.config.error_on_recompile = compiled
        return result

    S.grad_multiplier, T.build_ema, T.train_step = capturing, recording, step_then_forbid_recompiles
    out = []
    for cfg in cfgs:
        norms.clear()
        initial.clear()
        torch._dynamo.config.error_on_recompile = False
        graphs = counters["stats"]["unique_graphs"]
        final = T.train(config_from_dict(cfg))
        out.append({"final": final, "norms": list(norms), "initial": dict(initial),
                    "graphs": counters["stats"]["unique_graphs"] - graphs})
    torch._dynamo.config.error_on_recompile = False
    return out


def _rows(run: Path, kind: str = "train") -> dict[int, dict[str, Any]]:
    def strict(token: str) -> None:
        raise ValueError(f"metrics.jsonl holds the bare JSON token {token}")

    rows = [json.loads(line, parse_constant=strict) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == kind}


def _overflowed(rows: dict[int, dict[str, Any]]) -> dict[int, bool]:
    """Whether each step was an fp16 overflow step (its ``overflow_steps`` count went up)."""
    before, out = 0, {}
    for s in sorted(rows):
        out[s] = rows[s]["overflow_steps"] > before
        before = rows[s]["overflow_steps"]
    return out


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of ``dtype`` at magnitude ``|x|`` (float64; subnormal spacing below the normal range)."""
    mantissa = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    exponent = torch.floor(torch.log2(x.abs().clamp_min(torch.finfo(dtype).tiny)))
    return torch.exp2(exponent - mantissa)


def _check_ema(run: Path, steps: int, initial: dict[str, torch.Tensor], skipped: dict[int, bool],
               warmup: bool, dtype: torch.dtype) -> int:
    """The checks of the module docstring on checkpoints 1..steps; returns the number of EMA updates."""
    names = _param_names(run)
    prev_ema, prev_live = initial, initial
    ref = {n: initial[n].double() for n in names}
    peak = {n: initial[n].double().abs() for n in names}
    updates = 0
    for s in range(1, steps + 1):
        live, ema = _weights(run, s, "model_weights.pt"), _weights(run, s, "ema_weights.pt")
        assert list(ema) == list(live) == list(initial), s  # the model's names, in its order
        assert all(ema[n].dtype == dtype for n in names), s
        client = torch.load(run / "checkpoints" / f"step{s:08d}" / "rank00000.pt", weights_only=False)
        if skipped[s]:  # weights, EMA and its update count as they were
            assert all(torch.equal(live[k], prev_live[k]) for k in live), s
            assert all(torch.equal(ema[k], prev_ema[k]) for k in ema), s
        else:
            d = ema_decay_at(DECAY, warmup, updates)
            updates += 1
            exp = _expected(prev_ema, live, names, d, 0, updates)
            assert all(torch.equal(ema[k], exp[k]) for k in exp), s  # bit for bit
            for n in names:
                ref[n] = d * ref[n] + (1 - d) * live[n].double()
                peak[n] = torch.maximum(peak[n], live[n].double().abs())
        assert client["ema"]["updates"] == updates, s
        prev_ema, prev_live = ema, live
    assert updates >= 3
    # float64 reference: each update's stochastic rounding errs by less than one ulp at the largest
    # magnitude the element had (the fp32 update adds ~2**-13 of an ulp), earlier errors decay by d <= 1
    err = torch.cat([((ema[n].double() - ref[n]) / _ulp(2 * peak[n], dtype)).reshape(-1) for n in names])
    assert err.abs().max().item() <= updates, err.abs().max().item()
    # unbiased: each element's error is a sum of <= `updates` independent zero-mean terms of variance
    # <= 1/4 (in those ulps); the mean over the elements is within 5 sigma of 0
    sigma = 0.5 * math.sqrt(updates)
    assert abs(err.mean().item()) <= 5 * sigma / math.sqrt(err.numel()), (err.mean().item(), err.numel())
    moved = sum(int((ema[n] != live[n]).sum()) for n in names)
    # an average, not the live weights (with --ema-warmup the last decay is 4/13: a quarter-way average
    # of bf16 weights that moved little lands on them for about half of the elements)
    assert moved > 0.25 * err.numel(), (moved, err.numel())
    return updates


# --------------------------------------------------------------------------------------------------
# the fp16 route: one run, EMA and grad_norm
# --------------------------------------------------------------------------------------------------

FP16_STEPS = 8


@pytest.fixture(scope="module")
def fp16_run(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("fp16_ema")
    ds = Path(ds_json(tmp, "zero0_fp16_sr_lossscale.json"))
    cfg = json.loads(ds.read_text())
    cfg["fp16"]["initial_scale_power"] = 14  # this model overflows at 2**14 in its first steps, not at 2**12
    ds.write_text(json.dumps(cfg))
    run = tmp / "run"
    train = train_cfg(data, run, str(ds), steps=FP16_STEPS, save_every=1, optim={"ema_decay": DECAY})
    train["data"]["val_data"] = None
    ranks = run_distributed(_worker, 2, [train], False, init_process_group=False, env=ENV, timeout_s=900)
    return {"run": run, "ranks": [r[0] for r in ranks]}


def test_fp16_ema_skips_overflow_steps_and_follows_the_reference(fp16_run: dict[str, Any]) -> None:
    run, result = fp16_run["run"], fp16_run["ranks"][0]
    skipped = _overflowed(_rows(run))
    assert 1 <= sum(skipped.values()) <= FP16_STEPS - 3, skipped  # both kinds of step happened
    updates = _check_ema(run, FP16_STEPS, result["initial"], skipped, False, torch.float16)
    final = result["final"]
    assert final["overflow_steps"] == sum(skipped.values()) and final["nonfinite_steps"] == 0
    assert final["ema"]["updates"] == updates == FP16_STEPS - sum(skipped.values())


def test_fp16_grad_norm_is_the_unscaled_norm_and_inf_on_overflow(fp16_run: dict[str, Any]) -> None:
    rows = _rows(fp16_run["run"])  # strict JSON: no bare Infinity/NaN
    skipped = _overflowed(rows)
    norms = [r["norms"] for r in fp16_run["ranks"]]
    assert len(norms[0]) == FP16_STEPS  # every step; the replicas agree:
    torch.testing.assert_close(*(torch.tensor(n, dtype=torch.float64) for n in norms), rtol=0, atol=0, equal_nan=True)
    for s, row in rows.items():
        reference = norms[0][s - 1]  # float64, of the all-reduced gradients the step clipped
        if skipped[s]:
            assert not math.isfinite(reference), (s, reference)  # a real overflow (inf, or NaN where infs met)
            assert row["grad_norm"] == "inf", (s, row["grad_norm"])
            assert float(row["grad_norm"]) == math.inf
        else:
            assert isinstance(row["grad_norm"], float) and math.isfinite(row["grad_norm"]), (s, row)
            assert row["grad_norm"] == pytest.approx(reference, rel=1e-5), (s, row["grad_norm"], reference)
    assert sum(not v for v in skipped.values()) >= 3


# --------------------------------------------------------------------------------------------------
# --compile
# --------------------------------------------------------------------------------------------------


@pytest.mark.slow  # about 60 s: two ranks compile the towers on 2 cores
def test_compiled_ema_follows_the_reference_and_evaluates_without_recompiling(data: Path, tmp_path: Path) -> None:
    # the default route (bf16 at ZeRO-0): the EMA lives next to the module's bf16 weights
    ds = ds_json(tmp_path, "zero0_bf16_sr.json")
    run = tmp_path / "compiled"
    cfg = train_cfg(data, run, ds, steps=4, save_every=1, eval_every=2, model={"compile": True},
                    optim={"lr": 5e-4, "ema_decay": DECAY, "ema_warmup": True})
    result = run_distributed(_worker, 2, [cfg], True, init_process_group=False, env=ENV, timeout_s=1200)[0][0]
    assert result["graphs"] > 0  # the towers ran compiled; no recompilation after step 1 (else it raised)
    updates = _check_ema(run, 4, result["initial"], dict.fromkeys(range(1, 5), False), True, torch.bfloat16)
    final = result["final"]
    assert final["ema"]["updates"] == updates == 4
    evals = _rows(run, "eval")
    assert sorted(evals) == [2] and "ema_retrieval_r1" in evals[2] and "ema_zeroshot_top1" in final
    assert not any("_orig_mod" in k for k in _weights(run, 4, "ema_weights.pt"))
