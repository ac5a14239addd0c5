"""Gradient accumulation under DeepSpeed (CPU ranks, gloo): the contrastive batch of ``global`` is the
whole optimizer step. With micro-batch m and accumulation k, ``--contrastive-batch global`` trains as
micro-batch m·k without accumulation (per-step loss, gradient norm and weights, to fp32 summation
order) at world size 1 and 2, under ZeRO-1, 2 and 3, with gradient checkpointing, and on the fp16
route to fp16 tolerance; ``micro`` does not. The optimizer steps once per k micro-batches from the
first step, and resuming in the middle of such a run continues bit-identically."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recipe.run import checkpoint

from ...dist_utils import run_distributed
from ..test_train import ENV, _train_worker, ds_json, train_cfg

M, K, STEPS = 4, 4, 4


def _ds(tmp: Path, name: str, micro: int, accumulation: int, stage: int | None = None) -> str:
    path = Path(ds_json(tmp, name, micro=micro, accumulation=accumulation))
    if stage is not None:
        cfg = json.loads(path.read_text())
        cfg["zero_optimization"]["stage"] = stage
        path = path.with_name(f"stage{stage}_{path.name}")
        path.write_text(json.dumps(cfg))
    out = path.with_name(f"m{micro}k{accumulation}_{path.name}")
    out.write_text(path.read_text())
    return str(out)


def _cfg(data: Path, out: Path, ds: str, mode: str, **kw: object) -> dict:
    kw.setdefault("steps", STEPS)
    cfg = train_cfg(data, out, ds, contrastive_batch=mode, optim={"warmup_steps": 0}, **kw)
    cfg["data"]["val_data"] = None  # no evaluation: these runs compare training only
    return cfg


def _rows(run_dir: Path) -> dict[int, dict]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if r["kind"] == "train"}


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    tag = checkpoint.complete_checkpoints(run_dir / "checkpoints")[-1]
    return torch.load(tag / checkpoint.MODEL_WEIGHTS, map_location="cpu", weights_only=True)


def _train(world: int, cfgs: list[dict]) -> None:
    run_distributed(_train_worker, world, cfgs, None, init_process_group=False, env=ENV, timeout_s=900)


def _assert_same_training(a: Path, b: Path, loss_rtol: float, weight_atol: float) -> None:
    ra, rb = _rows(a), _rows(b)
    assert sorted(ra) == sorted(rb) == list(range(1, STEPS + 1))
    for s in ra:
        assert rb[s]["loss"] == pytest.approx(ra[s]["loss"], rel=loss_rtol, abs=0), (s, ra[s]["loss"], rb[s]["loss"])
        # DeepSpeed's norm, or the recipe's on the ZeRO-0 routes (recipe.training.step.grad_multiplier)
        assert rb[s]["grad_norm"] == pytest.approx(ra[s]["grad_norm"], rel=max(loss_rtol, 1e-4)), s
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=0, atol=weight_atol, msg=name)


CASES = {
    # name: (DeepSpeed JSON, ZeRO stage override, extra config, loss rtol, weight atol)
    "zero2-fp32": ("zero2_fp32.json", None, {}, 1e-5, 1e-5),
    "zero1-fp32": ("zero2_fp32.json", 1, {}, 1e-5, 1e-5),
    "zero3-fp32": ("zero2_fp32.json", 3, {}, 1e-5, 1e-5),
    "zero2-fp32-checkpointing": ("zero2_fp32.json", None, {"model": {"preset": "tiny", "grad_checkpointing": True}},
                                 1e-5, 1e-5),
    # SigLIP: the cache carries the logit bias's gradient as well as the scale's
    "siglip-zero2-fp32": ("zero2_fp32.json", None, {"loss": "siglip", "loss_mode": "chunked", "chunk_size": 8},
                          1e-5, 1e-5),
    # fp16 weights and activations: equal to fp16 rounding (the micro-batch size changes the sums); the
    # weights to 2 x lr: Adam moves a parameter whose gradient is near zero by ~lr per step in the
    # direction of its sign, which the rounding can flip (a bias measured 3.1e-3 apart, -0.0021 vs
    # +0.0010, on the loader's uint8-resized pixels; 1.6e-3 on timm's PIL-resized ones)
    "fp16-route": ("zero0_fp16_sr_lossscale.json", None, {}, 2e-3, 4e-3),
    # bf16 weights, gradients accumulated in bf16: equal to bf16 rounding, which compounds over the
    # steps (the gradient norm at step 4 measured 1.3 % apart on the loader's uint8-resized pixels,
    # 0.2 % on timm's PIL-resized ones; the losses 0.2 %)
    "bf16-zero0-route": ("zero0_bf16_sr.json", None, {}, 2e-2, 1e-2),
}


@pytest.mark.parametrize("world", [1, 2])
def test_global_contrastive_batch_trains_as_one_big_batch(world: int, data: Path, tmp_path: Path) -> None:
    """World 1 and 2, ZeRO-2 fp32: (m, k) global == (m·k, 1); (m, k) micro differs; both step at once."""
    big = _cfg(data, tmp_path / "big", _ds(tmp_path, "zero2_fp32.json", M * K, 1), "global")
    glob = _cfg(data, tmp_path / "global", _ds(tmp_path, "zero2_fp32.json", M, K), "global")
    micro = _cfg(data, tmp_path / "micro", _ds(tmp_path, "zero2_fp32.json", M, K), "micro")
    _train(world, [big, glob, micro])
    _assert_same_training(tmp_path / "big", tmp_path / "global", 1e-5, 1e-5)

    rb, rg, rm = (_rows(tmp_path / n) for n in ("big", "global", "micro"))
    for rows, mode, size in ((rg, "global", M * K * world), (rm, "micro", M * world)):
        assert [(r["contrastive_batch"], r["contrastive_batch_size"]) for r in rows.values()] == [(mode, size)] * STEPS
    assert json.loads((tmp_path / "global" / "config.json").read_text())["contrastive_batch"] == "global"
    # micro contrasts fewer pairs: a different (lower) loss from the first step on
    assert rm[1]["loss"] < rb[1]["loss"] - 0.1, (rm[1]["loss"], rb[1]["loss"])
    # both modes take an optimizer step at the first k micro-batches, with a finite gradient norm
    init = math.exp(math.log(1 / 0.07))
    for rows in (rg, rm):
        assert rows[1]["logit_scale"] != pytest.approx(init, rel=1e-6)
        assert all(math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0 for r in rows.values())
        assert rows[STEPS]["samples_per_s"] > 0


@pytest.mark.parametrize("case", [c for c in CASES if c != "zero2-fp32"])
def test_global_contrastive_batch_equivalence_holds_across_modes(case: str, data: Path, tmp_path: Path) -> None:
    """ZeRO-1 and 3, gradient checkpointing, SigLIP, and the fp16 route (to fp16 tolerance), at world size 2."""
    name, stage, extra, loss_rtol, weight_atol = CASES[case]
    big = _cfg(data, tmp_path / "big", _ds(tmp_path, name, M * K, 1, stage), "global", **extra)
    glob = _cfg(data, tmp_path / "global", _ds(tmp_path, name, M, K, stage), "global", **extra)
    _train(2, [big, glob])
    _assert_same_training(tmp_path / "big", tmp_path / "global", loss_rtol, weight_atol)
    if case.startswith("siglip"):  # the bias starts at -10, is learned and logged; the scale starts at 10
        rows = _rows(tmp_path / "global")
        assert rows[1]["logit_scale"] == pytest.approx(10.0, rel=1e-2)
        assert all(-10.1 < r["logit_bias"] < -9.0 for r in rows.values())
        assert rows[STEPS]["logit_bias"] != rows[1]["logit_bias"]


def test_resume_with_accumulation_continues_bit_identically(data: Path, tmp_path: Path) -> None:
    ds = _ds(tmp_path, "zero2_bf16_halfmaster.json", M, K)
    full = _cfg(data, tmp_path / "full", ds, "global", steps=6, save_every=3)
    resumed = _cfg(data, tmp_path / "resumed", ds, "global", steps=6,
                   resume=str(tmp_path / "full" / "checkpoints" / "step00000003"))
    _train(2, [full, resumed])
    a, b = _rows(tmp_path / "full"), _rows(tmp_path / "resumed")
    assert sorted(b) == [4, 5, 6]
    for s in b:
        assert b[s]["loss"] == a[s]["loss"], (s, a[s]["loss"], b[s]["loss"])
