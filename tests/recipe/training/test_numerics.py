"""recipe.training.numerics: the sampled telemetry against references computed on the whole tensors, no host
reads inside the step, the flag, and the keys in a real run's metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from optim import SRAdamW
from recipe.training.numerics import NumericsMonitor, build_numerics

LOG100 = math.log(100.0)
BETAS = (0.9, 0.98)
EPS = 1e-6
ROUTES = {  # weight / statistics dtype, learning rate (a mix of kept and dropped updates at |w| in [1e-3, 4])
    "bf16": (torch.bfloat16, 1e-3),
    "fp16": (torch.float16, 1e-4),
}


# --------------------------------------------------------------------------------------------------
# the reference: the definition of optim.functional on whole tensors, judged in float64
# --------------------------------------------------------------------------------------------------


def f32_scale(bound: float) -> float:
    """The power-of-two scale of a float16 statistic with this bound (float64 arithmetic)."""
    e = math.frexp(bound)[1] if bound > 0 else 0
    return 2.0 ** min(max(e - 14, -126), 127)


def spacing_halves(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 half distances from |w| to the next larger and the next smaller magnitude in w's dtype."""
    mag = w.abs()
    bits = mag.view(torch.int16).to(torch.int32)
    up = (bits + 1).to(torch.int16).view(w.dtype).double() - mag.double()
    down = mag.double() - (bits - 1).clamp(min=0).to(torch.int16).view(w.dtype).double()
    down = torch.where(mag == 0, up, down)
    return up / 2, down / 2


def reference_step(p, g, m, v, step, lr, wd, sdt, bounds=None, clamp=None) -> dict:
    """One step of the definition in float32 operations on whole tensors; what it implies, decided in float64."""
    f = torch.float32
    b1, b2 = BETAS
    t = step + 1
    neg_step = torch.tensor(-(lr * math.sqrt(1 - b2**t) / (1 - b1**t)), dtype=f)
    eps_hat = torch.tensor(EPS * math.sqrt(1 - b2**t), dtype=f)
    gf, w = g.to(f), p.to(f)
    scale_old = scale_new = (1.0, 1.0)
    if bounds is not None:  # float16 statistics: stored / scale
        amax = float(g.abs().max().double())
        new = (b1 * bounds[0] + (1 - b1) * amax, b2 * bounds[1] + (1 - b2) * amax * amax)
        scale_old = (f32_scale(bounds[0]), f32_scale(bounds[1]))
        scale_new = (f32_scale(new[0]), f32_scale(new[1]))
    m32 = (m.to(f) * scale_old[0]) * b1 + gf * torch.tensor(1 - b1, dtype=f)
    v32 = (v.to(f) * scale_old[1]) * b2 + (gf * gf) * torch.tensor(1 - b2, dtype=f)
    w_unc = w * torch.tensor(1 - lr * wd, dtype=f) + (m32 * neg_step) / (v32.sqrt() + eps_hat)
    w_new = w_unc if clamp is None else w_unc.clamp(*clamp)
    delta = w_new.double() - w.double()
    up, down = spacing_halves(p)
    away = (delta > 0) == (p.double() >= 0)
    half = torch.where(away, up, down)
    out = {"moved": int((delta != 0).sum()), "below": int(((delta != 0) & (delta.abs() < half)).sum())}
    for name, x, s in (("m", m32, scale_new[0]), ("v", v32, scale_new[1])):
        stored = (x.double() / s).to(sdt)  # round to nearest, as the test's optimizer stores
        live = x != 0
        out[f"{name}_n"] = int(live.sum())
        out[f"{name}_under"] = int((live & (stored == 0)).sum())
        out[f"{name}_sat"] = int((live & (stored.double().abs() >= torch.finfo(sdt).max)).sum())
    out["scales"] = [math.log2(s) for s in scale_new]
    if clamp is not None:
        unc64 = w.double() * (1 - lr * wd) + (m32.double() * float(neg_step)) / (v32.double().sqrt() + float(eps_hat))
        out["clamp_held"] = bool(((unc64 < clamp[0]) | (unc64 > clamp[1])).any())
    return out


def constructed(dtype: torch.dtype, n: int, seed: int, huge: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights of magnitude log-uniform in [1e-3, 4] with random signs; gradients mostly N(0, 1), 10 %
    tiny (their exp_avg_sq underflows in storage) and, with ``huge``, 5 % whose square overflows
    float32 (exp_avg_sq saturates); the last 64 are zero weights with zero gradients, as ZeRO's padding
    of a flat partition (no update, zero statistics: counted nowhere)."""
    gen = torch.Generator().manual_seed(seed)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    w = sign * torch.exp(torch.empty(n).uniform_(math.log(1e-3), math.log(4.0), generator=gen))
    g = torch.randn(n, generator=gen)
    kind = torch.rand(n, generator=gen)
    tiny = 3e-20 if dtype == torch.bfloat16 else 2.0**-20
    g = torch.where(kind < 0.10, tiny * torch.sign(g), g)
    if huge:
        g = torch.where((kind >= 0.10) & (kind < 0.15), 1e20 * torch.sign(g), g)
    w[-64:], g[-64:] = 0.0, 0.0
    return w.to(dtype), g.to(dtype)


def build(dtype: torch.dtype, lr: float, n: int):
    """Two SR groups (decayed and not), a mastered float32-state group (not reported), a clamped
    float32 logit scale ``[at the bound, ZeRO-like padding 0]``."""
    w1, g1 = constructed(dtype, n, 1, huge=dtype == torch.bfloat16)
    w2, g2 = constructed(dtype, n // 2, 2, huge=False)
    w3, g3 = constructed(dtype, 64, 3, huge=False)
    params = [torch.nn.Parameter(x) for x in (w1, w2, w3)]
    for p, g in zip(params, (g1, g2, g3)):
        p.grad = g
    logit = torch.nn.Parameter(torch.tensor([LOG100 - 1e-5, 0.0]))
    logit.grad = torch.tensor([-1.0, 0.0])
    groups = [
        {"name": "text.decay", "params": [params[0]], "weight_decay": 0.1},
        {"name": "text.no_decay", "params": [params[1]], "weight_decay": 0.0},
        {"name": "image.decay", "params": [params[2]], "master_weights": True, "state_dtype": torch.float32},
        {"name": "logit_scale", "params": [logit], "weight_decay": 0.0, "clamp": (0.0, LOG100),
         "master_weights": True, "state_dtype": torch.float32},
    ]
    opt = SRAdamW(groups, lr=lr, betas=BETAS, eps=EPS, state_dtype=dtype, state_rounding="nearest", fused=False,
                  seed=3)
    return opt, params, logit


def run_and_reference(route: str, n: int, sample: int, logit_grads: list[float]):
    dtype, lr = ROUTES[route]
    opt, params, logit = build(dtype, lr, n)
    mon = NumericsMonitor(opt, every=1, sample_per_tensor=sample).attach()
    ref = {k: 0 for k in ("moved", "below", "m_n", "m_under", "m_sat", "v_n", "v_under", "v_sat")}
    per_group = {"text.decay": [0, 0], "text.no_decay": [0, 0]}
    scales, clamp_held = [], 0
    for step, lg in enumerate(logit_grads):
        logit.grad = torch.tensor([lg, 0.0])
        for p, group in zip(params[:2], opt.param_groups[:2]):
            st = opt.state.get(p) or {}
            m = st.get("exp_avg", torch.zeros_like(p))
            v = st.get("exp_avg_sq", torch.zeros_like(p))
            bounds = None
            if dtype == torch.float16:
                bounds = (float(st["exp_avg_bound"]), float(st["exp_avg_sq_bound"])) if st else (0.0, 0.0)
            r = reference_step(p.detach().clone(), p.grad, m.clone(), v.clone(), step, lr, group["weight_decay"],
                               dtype, bounds)
            for k in ref:
                ref[k] += r[k]
            per_group[group["name"]][0] += r["below"]
            per_group[group["name"]][1] += r["moved"]
            scales.append(r["scales"])
        st = opt.state.get(logit) or {}
        r = reference_step(logit.detach().clone(), logit.grad, st.get("exp_avg", torch.zeros(2)),
                           st.get("exp_avg_sq", torch.zeros(2)), step, lr, 0.0, torch.float32, clamp=(0.0, LOG100))
        clamp_held += r["clamp_held"]
        opt.step()
        mon.end_step(skipped=False)
    return mon.read(), ref, per_group, scales, clamp_held / len(logit_grads), n + n // 2


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_whole_tensor_sample_matches_the_reference(route: str) -> None:
    got, ref, per_group, scales, clamp, total = run_and_reference(route, 4096, 1 << 20, [-1.0, -1.0, 5.0])
    tol = 2.0 / total  # an element within a float32 rounding of the half-ulp threshold may differ
    assert 0.05 < ref["below"] / ref["moved"] < 0.95  # the construction mixes kept and dropped updates
    assert got["numerics/sr_below_half_ulp"] == pytest.approx(ref["below"] / ref["moved"], abs=tol)
    for name, (below, moved) in per_group.items():
        assert got[f"numerics/sr_below_half_ulp/{name}"] == pytest.approx(below / moved, abs=4.0 / total)
    for key, num, den in (("exp_avg_underflow", "m_under", "m_n"), ("exp_avg_sq_underflow", "v_under", "v_n"),
                          ("exp_avg_saturated", "m_sat", "m_n"), ("exp_avg_sq_saturated", "v_sat", "v_n")):
        assert got[f"numerics/{key}"] == pytest.approx(ref[num] / ref[den], abs=tol), key
    assert ref["v_under"] / ref["v_n"] > 0.05  # forced underflow of the tiny gradients' statistics
    if route == "bf16":
        assert ref["v_sat"] / ref["v_n"] > 0.02  # forced saturation (the squares overflow)
        assert "numerics/exp_avg_scale_log2_min" not in got  # no float16 statistics, no scales
    else:
        ks = torch.tensor(scales)
        assert got["numerics/exp_avg_scale_log2_min"] == ks[:, 0].min().item()
        assert got["numerics/exp_avg_scale_log2_max"] == ks[:, 0].max().item()
        assert got["numerics/exp_avg_sq_scale_log2_min"] == ks[:, 1].min().item()
        assert got["numerics/exp_avg_sq_scale_log2_max"] == ks[:, 1].max().item()
    # pushed past the bound twice, then away from it; the padding-like 0 never counts
    assert clamp == pytest.approx(2 / 3) and got["numerics/logit_scale_clamped"] == pytest.approx(clamp)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_a_sample_estimates_the_whole_tensor_shares(route: str) -> None:
    got, ref, *_ = run_and_reference(route, 40_000, 2048, [1.0, 1.0])
    samples = 2 * 2 * 2048  # two tensors of more than 2048 elements, two steps
    for key, num, den in (("sr_below_half_ulp", "below", "moved"), ("exp_avg_sq_underflow", "v_under", "v_n")):
        p = ref[num] / ref[den]
        sigma = math.sqrt(p * (1 - p) / samples) * math.sqrt(2)  # one index sample serves both steps
        assert abs(got[f"numerics/{key}"] - p) < 5 * sigma + 1e-3, (key, got[f"numerics/{key}"], p)
    assert got["numerics/logit_scale_clamped"] == 0.0


def test_skipped_steps_are_dropped_and_read_starts_a_new_window() -> None:
    opt, params, logit = build(torch.bfloat16, 1e-3, 256)
    mon = NumericsMonitor(opt, every=1).attach()
    opt.step()
    mon.end_step(skipped=True)
    assert mon.read() == {}
    opt.step()
    mon.end_step(skipped=False)
    first = mon.read()
    assert 0 < first["numerics/sr_below_half_ulp"] < 1 and mon.read() == {}
    mon.detach()
    opt.step()
    mon.end_step(skipped=False)
    assert mon.read() == {}  # detached: nothing sampled


def test_no_host_reads_inside_the_step(monkeypatch: pytest.MonkeyPatch) -> None:
    for route in ("bf16", "fp16"):
        dtype, lr = ROUTES[route]
        opt, params, logit = build(dtype, lr, 4096)
        mon = NumericsMonitor(opt, every=1, sample_per_tensor=512)
        calls = []
        with monkeypatch.context() as mp:
            for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__"):
                original = getattr(torch.Tensor, name)

                def spy(self, *a, _name=name, _original=original, **k):
                    calls.append(_name)
                    return _original(self, *a, **k)

                mp.setattr(torch.Tensor, name, spy)
            for _ in range(2):  # the first step creates the state, the second reads it
                mon.before_step(torch.tensor(0.5))
                opt.step(inv_grad_scale=0.5)  # (the optimizer's own reads are its business)
                calls.clear()
                mon.after_step()
                mon.end_step(skipped=False)
                assert calls == [], (route, calls)
        # the same with the before-step part isolated
        with monkeypatch.context() as mp:
            mp.setattr(torch.Tensor, "item", lambda self: calls.append("item"))
            mp.setattr(torch.Tensor, "tolist", lambda self: calls.append("tolist"))
            mp.setattr(torch.Tensor, "cpu", lambda self, *a, **k: calls.append("cpu"))
            mon.before_step(None)
        assert calls == []
        assert 0 < mon.read()["numerics/sr_below_half_ulp"] < 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_no_device_synchronisation_on_cuda() -> None:
    dtype, lr = ROUTES["fp16"]
    opt, params, logit = build(dtype, lr, 1 << 16)
    for group in opt.param_groups:
        for p in group["params"]:
            p.data, p.grad = p.data.cuda(), p.grad.cuda()
    mon = NumericsMonitor(opt, every=1, sample_per_tensor=1024).attach()
    opt.step()  # creates the state (and may synchronise on its own)
    mon.end_step(skipped=False)
    torch.cuda.synchronize()
    scale = torch.tensor(0.5, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        mon.before_step(scale)
        mon.after_step()
        mon.end_step(skipped=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert 0 < mon.read()["numerics/sr_below_half_ulp"] < 1


def test_flag_default_off_and_bad_values() -> None:
    from recipe.config import parse_args

    opt, *_ = build(torch.bfloat16, 1e-3, 64)
    assert build_numerics(opt, None, 7).every == 7  # unset: every log step
    assert build_numerics(opt, 3, 7).every == 3
    assert build_numerics(opt, 0, 7) is None
    with pytest.raises(ValueError, match="--numerics-every must be >= 0, got -1"):
        parse_args(["--numerics-every", "-1"])
    with pytest.raises(ValueError, match=">= 0"):
        NumericsMonitor(opt, every=-2)


# --------------------------------------------------------------------------------------------------
# a real run: 2 CPU ranks, ZeRO-2 bf16 (flat partitions, per-group steps), the keys in metrics.jsonl
# --------------------------------------------------------------------------------------------------


def test_run_logs_numerics(data: Path, tmp_path: Path) -> None:
    from ..test_train import ds_json, run, train_cfg

    cfg = train_cfg(data, tmp_path / "run", ds_json(tmp_path, "zero2_bf16_halfmaster.json"), steps=4, log_every=2,
                    numerics_every=1, eval_every=0)
    cfg["data"]["val_data"] = None
    run([cfg])
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    train = {r["step"]: r for r in rows if r["kind"] == "train"}
    own = {r["step"]: r for r in rows if r["kind"] == "numerics"}
    assert sorted(train) == [2, 4] and sorted(own) == [1, 3]  # log steps carry them; the others get a row
    for r in [*train.values(), *own.values()]:
        assert 0 < r["numerics/sr_below_half_ulp"] < 1, r
        for key in ("exp_avg_underflow", "exp_avg_sq_underflow", "exp_avg_saturated", "exp_avg_sq_saturated"):
            assert 0 <= r[f"numerics/{key}"] < 0.5, (key, r)
        assert r["numerics/logit_scale_clamped"] == 0.0  # starts at log(1/0.07), far from the clamp
        assert "numerics/sr_below_half_ulp/text.decay" in r
    assert any((tmp_path / "run" / "tensorboard").iterdir())
