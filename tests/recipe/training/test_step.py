"""recipe/training/step.py: the recipe-managed routes' gradient multiplier (inverse loss scale x clipping factor)
and the norm it reports, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from recipe.training.precision import DynamicLossScaler, Precision
from recipe.training.step import grad_multiplier


def _module(dtype: torch.dtype, scale: float, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(33, 17), torch.nn.LayerNorm(17), torch.nn.Linear(17, 5)).to(dtype)
    for p in m.parameters():
        p.grad = (torch.randn(p.shape, dtype=torch.float64) * scale).to(dtype)
    m[1].bias.grad = None  # a parameter without a gradient is left out
    return m


@pytest.mark.parametrize("dtype,loss_scale,clip", [(torch.float16, 2.0**12, 1.0), (torch.float16, 2.0**12, 1e4),
                                                    (torch.bfloat16, 1.0, 0.5), (torch.bfloat16, 1.0, 1e4)])
def test_multiplier_and_norm_match_float64(dtype: torch.dtype, loss_scale: float, clip: float) -> None:
    """norm = ||unscaled gradients||_2 (float64 reference, rel 1e-6); multiplier = 1/scale x min(1, clip /
    (norm + 1e-6)), below and above the clipping threshold."""
    scaler = DynamicLossScaler(scale=loss_scale) if dtype == torch.float16 else None
    prec = Precision("fp16" if scaler else "bf16", 0, dtype, dtype, True, scaler, clip)
    m = _module(dtype, scale=loss_scale * 0.05)
    mul, norm = grad_multiplier(m, prec)
    ref = math.sqrt(sum((p.grad.double() / loss_scale).pow(2).sum().item() for p in m.parameters() if p.grad is not None))
    assert norm.item() == pytest.approx(ref, rel=1e-6)
    assert mul.dtype == torch.float32 and mul.item() == pytest.approx(min(1.0, clip / (ref + 1e-6)) / loss_scale, rel=1e-6)


def test_scaled_fp16_gradients_do_not_overflow_the_norm() -> None:
    """Scaled fp16 gradients near fp16's max: their squares overflow fp16, not the fp32 per-gradient norms."""
    prec = Precision("fp16", 0, torch.float16, torch.float16, True, DynamicLossScaler(scale=2.0**16), 1.0)
    m = _module(torch.float16, scale=2.0e4)
    mul, norm = grad_multiplier(m, prec)
    assert math.isfinite(norm.item()) and 0 < mul.item() < 2.0**-16


def test_without_clipping_no_norm_and_a_non_finite_gradient_gives_a_non_finite_norm() -> None:
    prec = Precision("fp16", 0, torch.float16, torch.float16, True, DynamicLossScaler(scale=2.0**8), 0.0)
    mul, norm = grad_multiplier(_module(torch.float16, 1.0), prec)
    assert norm is None and mul.item() == 2.0**-8
    prec = Precision("bf16", 0, torch.bfloat16, torch.bfloat16, True, None, 1.0)
    m = _module(torch.bfloat16, 1.0)
    m[0].weight.grad[0, 0] = float("inf")
    mul, norm = grad_multiplier(m, prec)
    assert not math.isfinite(norm.item())  # the optimizer's gradient check then skips the step


def _engine_step_worker(rank: int, world: int, name: str) -> dict:
    """One DeepSpeed engine step on a recipe-managed route with gradients far above the clipping
    threshold, next to SRAdamW's eager definition stepping the same gradients with the recipe's
    multiplier: DeepSpeed itself must not touch the gradients (it clips at 1.0 when the JSON has no
    ``gradient_clipping``)."""
    import json
    from pathlib import Path

    import deepspeed

    from optim import SRAdamW
    from recipe.training.engine import engine_config
    from recipe.training.precision import resolve_precision
    from recipe.training.step import step_kwargs

    deepspeed.init_distributed(dist_backend="gloo")
    ds = json.loads((Path(__file__).resolve().parents[3] / "ds_configs" / name).read_text())
    ds["train_micro_batch_size_per_gpu"] = 1
    prec, cfg = resolve_precision(ds)
    assert prec.recipe_managed and prec.recipe_clip == 1.0
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 8), torch.nn.Linear(8, 4)).to(prec.param_dtype)
    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in model.parameters()]
    opt = SRAdamW([{"params": list(model.parameters()), "name": "all"}], lr=1e-2, rank=0)
    ref = SRAdamW([{"params": ref_params, "name": "all"}], lr=1e-2, rank=0, fused=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=engine_config(cfg, world, opt))
    scale = prec.loss_scaler.scale if prec.loss_scaler else 1.0
    for p, q in zip(model.parameters(), ref_params):
        g = (torch.randn(p.shape) * 50.0 * min(scale, 2.0**8)).to(p.dtype)  # norm >> 1 (and scaled)
        p.grad, q.grad = g, g.clone()
    if prec.loss_scaler:
        prec.loss_scaler.scale = min(scale, 2.0**8)
    mul, norm = grad_multiplier(engine.module, prec)
    with step_kwargs(opt, inv_grad_scale=mul):
        engine.step()
    ref.step(inv_grad_scale=mul)  # the very multiplier the engine step passed
    return {"got": [p.detach().clone() for p in model.parameters()], "want": [q.detach().clone() for q in ref_params],
            "norm": float(norm)}


@pytest.mark.parametrize("name", ["zero0_fp16_sr_lossscale.json", "zero0_bf16_sr.json"])
def test_deepspeed_does_not_clip_the_recipe_managed_gradients(name: str) -> None:
    """The recipe clips by SRAdamW's multiplier; the engine step must hand SRAdamW the gradients as
    they are (they were clipped twice on the fp16 route: DeepSpeed's default clipping at 1.0 applied
    to the loss-scaled gradients when the recipe removed the key)."""
    from ...dist_utils import run_distributed
    from ..test_train import ENV

    (out,) = run_distributed(_engine_step_worker, 1, name, init_process_group=False, env=ENV, timeout_s=300)
    assert out["norm"] > 10  # clipping is active
    for got, want in zip(out["got"], out["want"]):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


# --------------------------------------------------------------------------------------------------
# the recipe's gradient all-reduce (recipe-managed routes): communication_data_type
# --------------------------------------------------------------------------------------------------


def test_communication_data_type_is_taken_over_as_the_all_reduce_dtype() -> None:
    """The JSON's ``communication_data_type`` picks the recipe's all-reduce dtype (bf16 in the shipped
    ``zero0_bf16_sr.json``) and is not handed to DeepSpeed; absent, the old default (None); anything
    but fp32 or the gradients' own dtype is an error."""
    import json
    from pathlib import Path

    from recipe.training.precision import ConfigError, resolve_precision

    root = Path(__file__).resolve().parents[3] / "ds_configs"
    shipped = json.loads((root / "zero0_bf16_sr.json").read_text())
    prec, cfg = resolve_precision(shipped)
    assert prec.reduce_dtype == torch.bfloat16 and "communication_data_type" not in cfg
    assert resolve_precision({**shipped, "communication_data_type": "FP32"})[0].reduce_dtype == torch.float32
    assert resolve_precision({k: v for k, v in shipped.items() if k != "communication_data_type"})[0].reduce_dtype is None
    fp16 = json.loads((root / "zero0_fp16_sr_lossscale.json").read_text())
    assert resolve_precision(fp16)[0].reduce_dtype is None
    assert resolve_precision({**fp16, "communication_data_type": "fp32"})[0].reduce_dtype == torch.float32
    for cfg, value in ((shipped, "fp16"), (fp16, "bf16"), (shipped, "int8")):
        with pytest.raises(ConfigError, match=f"communication_data_type '{value}'"):
            resolve_precision({**cfg, "communication_data_type": value})
    # ZeRO-1/2/3 JSONs keep the key for DeepSpeed
    z2 = json.loads((root / "zero2_bf16_halfmaster.json").read_text())
    assert resolve_precision({**z2, "communication_data_type": "fp32"})[1]["communication_data_type"] == "fp32"


def _allreduce_worker(rank: int, world: int) -> dict:
    from recipe.training.overlap import OverlappedAllReduce

    out = {}
    for name, dtype in (("default", None), ("fp32", torch.float32), ("bf16", torch.bfloat16)):
        torch.manual_seed(rank)
        params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.bfloat16)) for n in (1000, 7, 3000)]
        for p in params:
            p.grad = torch.randn(p.shape, dtype=torch.float64).to(torch.bfloat16)
        out[f"{name}_in"] = [p.grad.clone() for p in params]
        reducer = OverlappedAllReduce(params, dtype, bucket_bytes=4000)  # several buckets, all sent by finish()
        reducer.finish()
        reducer.close()
        out[name] = [p.grad.clone() for p in params]
    return out


def test_gradient_all_reduce_in_bf16_and_fp32() -> None:
    """3 ranks: fp32 (the default without the key) rounds the mean once; bf16 differs from it by at most
    W - 1 bf16 roundings of the running sum; either is the same on every rank (the replicas stay equal).
    2 ranks: bf16 and fp32 agree bit for bit."""
    from ...dist_utils import run_distributed

    res = run_distributed(_allreduce_worker, 3)
    inputs = [torch.cat([g.double() for g in r["fp32_in"]]) for r in res]
    mean = sum(inputs) / 3
    for kind in ("default", "fp32", "bf16"):
        got = [torch.cat(r[kind]) for r in res]
        assert all(g.dtype == torch.bfloat16 for g in got)
        assert all(torch.equal(got[0].view(torch.int16), g.view(torch.int16)) for g in got[1:]), kind
    assert torch.equal(torch.cat(res[0]["default"]), torch.cat(res[0]["fp32"]))
    assert torch.equal(torch.cat(res[0]["fp32"]), mean.to(torch.bfloat16))  # one rounding
    bf = torch.cat(res[0]["bf16"]).double()
    bound = sum(x.abs() for x in inputs) / 3 * (3 * 2.0**-8)  # 2 sum roundings + the division, relative 2^-8 each
    assert bool(((bf - mean).abs() <= bound).all())
    assert not torch.equal(bf, torch.cat(res[0]["fp32"]).double())  # three ranks: the sum was rounded in bf16
    # two ranks: round(a + b) / 2 is round((a + b) / 2), so bf16 gives the fp32 route's bits
    two = run_distributed(_allreduce_worker, 2)
    assert all(torch.equal(torch.cat(r["bf16"]).view(torch.int16), torch.cat(r["fp32"]).view(torch.int16)) for r in two)
