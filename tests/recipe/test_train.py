"""Training under DeepSpeed on 2 CPU ranks (gloo): every precision mode trains with a falling loss
and holds the bytes per parameter it promises; resume reproduces the uninterrupted run; the
non-finite guard skips, counts and stops."""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import pytest

from ..dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[2]
ENV = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}


def ds_json(tmp: Path, name: str, micro: int = 16, accumulation: int = 1) -> str:
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    cfg["gradient_accumulation_steps"] = accumulation
    if "fp16" in cfg:  # start near the scale this tiny model needs instead of halving from 2**16
        cfg["fp16"]["initial_scale_power"] = 8
    path = tmp / name
    path.write_text(json.dumps(cfg))
    return str(path)


def train_cfg(data: Path, out: Path, ds: str, **kw: object) -> dict:
    cfg = {
        "deepspeed_config": ds,
        "output_dir": str(out),
        "steps": 24,
        "log_every": 1,
        "seed": 0,
        "model": {"preset": "tiny"},
        "data": {"train_data": str(data / "train.csv"), "val_data": str(data / "val.csv"), "workers": 0, "vocab_size": 300},
        "optim": {"lr": 2e-3, "warmup_steps": 2, "schedule": "constant", "weight_decay": 0.0},
    }
    for k, v in kw.items():
        if isinstance(v, dict):
            cfg[k].update(v)
        else:
            cfg[k] = v
    return cfg


def losses_of(run_dir: str | Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}


def _train_worker(rank: int, world: int, cfgs: list[dict], fail: str | int | None) -> list:
    import recipe.train as T
    from recipe.config import config_from_dict
    from recipe.loss import LossResult

    # the non-finite guard: a loss that is NaN on every call ("always"), on rank 1's calls 3 and 4
    # ("steps3-4") or on rank 1's call N (an int)
    if fail is not None:
        base = T.ClipLoss

        class Flaky(base):
            calls = 0

            def forward(self, *a, **k):
                loss, metrics = super().forward(*a, **k)
                Flaky.calls += 1
                on_rank1 = {"steps3-4": (3, 4)}.get(fail) if isinstance(fail, str) else (fail,)  # loss calls
                bad = fail == "always" or (on_rank1 is not None and Flaky.calls in on_rank1 and rank == 1)
                return LossResult(loss * float("nan") if bad else loss, metrics)

        T.ClipLoss = Flaky
    out = []
    for cfg in cfgs:
        try:
            out.append(T.train(config_from_dict(cfg)))
        except FloatingPointError as e:
            out.append({"error": str(e)})
    return out


def run(cfgs: list[dict], fail: str | None = None) -> list:
    return run_distributed(_train_worker, 2, cfgs, fail, init_process_group=False, env=ENV, timeout_s=900)


# bytes per parameter each mode promises for (partition, state) of SR and mastered groups at
# world size W (ZeRO shards partition and state by W; stage 0 updates the module's own tensors).
# Mastered bf16 groups: the exact master's 2-byte low half + fp32 statistics (optim.master16); fp16: a
# 4-byte fp32 master.
PROMISES = {
    "zero1_bf16_halfmaster.json": dict(module=2, sr=(2, 4), master=(2, 10), shard=True),
    "zero2_bf16_halfmaster.json": dict(module=2, sr=(2, 4), master=(2, 10), shard=True),
    "zero3_bf16_halfmaster.json": dict(module=2, sr=(2, 4), master=(2, 10), shard=True),
    "zero0_fp16_sr_lossscale.json": dict(module=2, sr=(0, 4), master=(0, 12), shard=False),
    "zero0_bf16_sr.json": dict(module=2, sr=(0, 4), master=(0, 10), shard=False),
    "zero2_fp32.json": dict(module=4, sr=(4, 8), master=(4, 8), shard=True),
}


@pytest.mark.parametrize("name", sorted(PROMISES))
def test_precision_mode_trains_and_holds_its_bytes_per_param(name: str, data: Path, tmp_path: Path) -> None:
    cfg = train_cfg(data, tmp_path / "run", ds_json(tmp_path, name))
    final = run([cfg])[0][0]
    losses = losses_of(tmp_path / "run")
    first = sum(losses[s] for s in range(1, 5)) / 4
    last = sum(losses[s] for s in range(21, 25)) / 4
    assert all(math.isfinite(v) for v in losses.values())
    assert last < first - 0.1, losses  # memorising 64 pairs: the loss falls clearly
    assert final["nonfinite_steps"] == 0

    promise, mem = PROMISES[name], final["memory"]
    world = final["world_size"]
    n = mem["params"]
    # ZeRO-3 also shards the module's own weights
    module = promise["module"] / world if name.startswith("zero3") else promise["module"]
    assert mem["module_weights"] == pytest.approx(module, abs=0.05)
    shard = world if promise["shard"] else 1
    for gname, g in mem["groups"].items():
        frac = final["memory"]["group_params"][gname] / n
        master = gname.startswith("image") or gname == "logit_scale"
        part_b, state_b = promise["master" if master else "sr"]
        # ZeRO pads each flat partition to an alignment; allow that padding (a few elements per group)
        pad = 64 / n
        assert g["partition"] == pytest.approx(frac * part_b / shard, abs=pad * 4), (gname, g)
        assert g["state"] == pytest.approx(frac * state_b / shard, abs=pad * 12), (gname, g)


@pytest.mark.parametrize("name", ["zero2_bf16_halfmaster.json", "zero3_bf16_halfmaster.json", "zero0_fp16_sr_lossscale.json",
                                  "zero0_bf16_sr.json"])
def test_resume_continues_bit_identically(name: str, data: Path, tmp_path: Path) -> None:
    ds = ds_json(tmp_path, name)
    full = train_cfg(data, tmp_path / "full", ds, steps=8, save_every=4)
    resumed = train_cfg(data, tmp_path / "resumed", ds, steps=8, resume=str(tmp_path / "full" / "checkpoints" / "step00000004"))
    run([full, resumed])
    a, b = losses_of(tmp_path / "full"), losses_of(tmp_path / "resumed")
    if name.startswith("zero2"):
        # standalone evaluation of the last checkpoint reproduces the run's final evaluation
        from recipe.evaluate import main as evaluate_main

        final = [json.loads(x) for x in (tmp_path / "full" / "metrics.jsonl").read_text().splitlines()][-1]
        standalone = evaluate_main(["--checkpoint", str(tmp_path / "full"), "--weights", "module"])  # as the run
        assert standalone["step"] == 8 and standalone["eval_samples"] == final["eval_samples"] == 24
        for k in ("zeroshot_top1", "i2t_r1", "t2i_r5"):
            assert abs(standalone[k] - final[k]) <= 1 / 24 + 1e-6, k  # one sample (float32 metrics)
    assert sorted(b) == [5, 6, 7, 8]
    for s in (5, 6, 7, 8):
        # bit-identical continuation (the fp16 route too: its replicated weights draw the same noise on
        # every rank, so the checkpoint's rank-0 copy is every rank's copy)
        assert b[s] == a[s], (s, a[s], b[s])


def test_nonfinite_guard_skips_counts_and_stops(data: Path, tmp_path: Path) -> None:
    ds = ds_json(tmp_path, "zero2_bf16_halfmaster.json")
    flaky = train_cfg(data, tmp_path / "flaky", ds, steps=6)
    results = run([flaky], fail="steps3-4")
    assert results[0][0]["nonfinite_steps"] == 2 and results[1][0]["nonfinite_steps"] == 2  # both ranks skip
    assert all(math.isfinite(v) for v in (results[0][0]["final_loss"],))
    stop = train_cfg(data, tmp_path / "stop", ds, steps=6, max_nonfinite_in_row=3)
    results = run([stop], fail="always")
    assert "3 non-finite steps in a row" in results[0][0]["error"]


# --------------------------------------------------------------------------------------------------
# one rank: the engine settings chosen from the world size (recipe.training.engine.engine_config)
# --------------------------------------------------------------------------------------------------


def _one_rank_engines_worker(rank: int, world: int, name: str) -> dict:
    import torch

    import recipe.training.engine as E
    from recipe.config import ModelConfig, TrainConfig
    from recipe.loss import ClipLoss
    from recipe.model import create_model
    from recipe.training.precision import resolve_precision
    from recipe.training.step import TrainState, train_step

    E.init_distributed()
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    cfg["train_micro_batch_size_per_gpu"] = 8
    keep = E.engine_config
    arms = []
    for chosen in (False, True):  # DeepSpeed's defaults as the JSON gives them, then the recipe's choices
        E.engine_config = keep if chosen else (lambda c, w, o: c)
        try:
            prec, ds = resolve_precision(cfg)
            torch.manual_seed(0)
            model = create_model("tiny")
            engine, opt, _ = E.build_engine(model, TrainConfig(model=ModelConfig(preset="tiny")), prec, ds)
        finally:
            E.engine_config = keep
        arms.append((engine, opt, prec, TrainState()))
    g = torch.Generator().manual_seed(1)
    batch = {
        "pixel_values": torch.randn(8, 3, 32, 32, generator=g),
        "input_ids": torch.randint(3, 300, (8, 16), generator=g),
        "attention_mask": torch.ones(8, 16, dtype=torch.long),
    }
    batch["input_ids"][:, 0], batch["input_ids"][:, -1] = 1, 2  # the tiny preset's begin and end of text
    loss_fn = ClipLoss(validate=False)
    losses: list[list[float]] = [[], []]
    for step in range(4):
        for i, (engine, opt, prec, state) in enumerate(arms):
            fn = functools.partial(_nan_loss, loss_fn) if step == 2 else loss_fn  # step 2: a NaN loss
            r = train_step(engine, opt, fn, prec, [batch], state, max_nonfinite_in_row=5)
            losses[i].append(float("nan") if r.skipped else float(r.loss))
    a, b = (e.module.state_dict() for e, *_ in arms)
    return {
        "losses": losses,
        "equal": all(torch.equal(a[k], b[k]) for k in a),
        "nonfinite": [s.nonfinite_steps for *_, s in arms],
        "contiguous": [e.optimizer.contiguous_gradients for e, *_ in arms],
        "check_overflow": [e.optimizer.check_grad_overflow for e, *_ in arms],
    }


def _nan_loss(loss_fn, *args, **kwargs):
    from recipe.loss import LossResult

    loss, metrics = loss_fn(*args, **kwargs)
    return LossResult(loss * float("nan"), metrics)


@pytest.mark.parametrize("name", ["zero1_bf16_halfmaster.json", "zero2_bf16_halfmaster.json", "zero2_fp32.json"])
def test_one_rank_engine_settings_change_no_result(name: str) -> None:
    """One rank, ZeRO 1/2: without contiguous gradient buckets and without DeepSpeed's overflow check
    (bf16; SRAdamW's check owns it), training is bit for bit what DeepSpeed's defaults give, a
    non-finite step included."""
    (got,) = run_distributed(_one_rank_engines_worker, 1, name, init_process_group=False, env=ENV, timeout_s=600)
    assert got["equal"], got
    defaults, chosen = got["losses"]
    assert [math.isnan(x) for x in chosen] == [False, False, True, False], chosen
    assert [x for x in defaults if not math.isnan(x)] == [x for x in chosen if not math.isnan(x)], got["losses"]
    assert got["nonfinite"] == [1, 1]
    assert got["contiguous"] == [True, False]
    assert got["check_overflow"][1] is False and got["check_overflow"][0] is ("bf16" in name)


def test_one_rank_resume_continues_bit_identically(data: Path, tmp_path: Path) -> None:
    """One rank, ZeRO-2 bf16 (no contiguous gradient buckets there): resume reproduces the run."""
    ds = ds_json(tmp_path, "zero2_bf16_halfmaster.json")
    full = train_cfg(data, tmp_path / "full", ds, steps=6, save_every=3)
    resumed = train_cfg(data, tmp_path / "resumed", ds, steps=6, resume=str(tmp_path / "full" / "checkpoints" / "step00000003"))
    run_distributed(_train_worker, 1, [full, resumed], None, init_process_group=False, env=ENV, timeout_s=900)
    a, b = losses_of(tmp_path / "full"), losses_of(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for s in (4, 5, 6):
        assert b[s] == a[s], (s, a[s], b[s])
