"""recipe/step.py: the recipe-managed routes' gradient multiplier (inverse loss scale x clipping factor)
and the norm it reports, against a float64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from recipe.precision import DynamicLossScaler, Precision
from recipe.step import grad_multiplier


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
    from recipe.engine import engine_config
    from recipe.precision import resolve_precision
    from recipe.step import step_kwargs

    deepspeed.init_distributed(dist_backend="gloo")
    ds = json.loads((Path(__file__).resolve().parents[2] / "ds_configs" / name).read_text())
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
    from ..dist_utils import run_distributed
    from .test_train import ENV

    (out,) = run_distributed(_engine_step_worker, 1, name, init_process_group=False, env=ENV, timeout_s=300)
    assert out["norm"] > 10  # clipping is active
    for got, want in zip(out["got"], out["want"]):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
