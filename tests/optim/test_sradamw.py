"""SRAdamW against torch.optim.AdamW and float32 references, state handling, seeds, bad input, and
the skip decision on the device (masked updates, bookkeeping settled later) against the immediate one."""

from __future__ import annotations

import contextlib
import copy
import io
import math
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from optim import SRAdamW, _triton, sradamw_update_
from optim.master16 import split_master
from optim.rounding import derive_key

from ..dist_utils import run_distributed
from ..precompile import precompile
from .sr_reference import (
    assert_neighbours_with_unbiased_mean,
    assert_same_bits,
    assert_same_optimizer_bits,
    defer_skips,
)

ROOT = Path(__file__).resolve().parents[2]

HALF = [torch.bfloat16, torch.float16]


def make_params(dtype: torch.dtype = torch.float32, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(17, 5), (33,), (4, 3, 2), (1,)]
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in shapes]


def grads_for(params: list[torch.Tensor], step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(p.shape, generator=g) * scale for p in params]


def run(opt: torch.optim.Optimizer, params: list[torch.Tensor], steps: int, start: int = 0, scale: float = 1.0) -> None:
    for t in range(start, start + steps):
        for p, g in zip(params, grads_for(params, t, scale)):
            p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_float32_matches_torch_adamw(weight_decay: float) -> None:
    # The float32 route computes AdamW with its own (IEEE, one square root and one division) order of
    # operations, so it is compared with float64 AdamW: after 100 steps its error is at most twice
    # that of torch's float32 AdamW (measured ratio ~1), and it stays within 4e-6 of torch's float32.
    ref, ours = make_params(), make_params()
    ref64 = [torch.nn.Parameter(p.detach().double()) for p in make_params()]
    kw = dict(lr=3e-3, betas=(0.9, 0.99), eps=1e-7, weight_decay=weight_decay)
    run(torch.optim.AdamW(ref, **kw), ref, 100)
    run(torch.optim.AdamW(ref64, **kw), ref64, 100)
    run(SRAdamW(ours, **kw), ours, 100)
    err_torch = max((a.double() - r).abs().max().item() for a, r in zip(ref, ref64))
    err_ours = max((b.double() - r).abs().max().item() for b, r in zip(ours, ref64))
    assert 0 < err_ours <= 2 * err_torch, (err_ours, err_torch)
    for a, b in zip(ref, ours):
        rel = ((a - b).abs() / a.abs().clamp(min=1e-6)).max().item()
        assert rel <= 4e-6, rel


def nearest_copy(master: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The weight a master gives: bfloat16 the split form's high half (nearest, ties away from zero),
    float16 torch's round-to-nearest-even conversion."""
    return split_master(master)[0] if dtype == torch.bfloat16 else master.to(dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_master_weight_group_matches_float32_adamw(dtype: torch.dtype) -> None:
    half = make_params(dtype)
    ref = [torch.nn.Parameter(p.detach().float()) for p in half]
    kw = dict(lr=1e-3, weight_decay=0.05)
    opt_ref = torch.optim.AdamW(ref, **kw)
    opt = SRAdamW(half, master_weights=True, state_dtype=torch.float32, **kw)
    for t in range(50):
        for p, r, g in zip(half, ref, grads_for(half, t)):
            p.grad = g.to(dtype)
            r.grad = g.to(dtype).float()  # the same (half-representable) gradient
        opt_ref.step()
        opt.step()
    for p, r in zip(half, ref):
        master = opt.master(p)  # bf16: the split form (optim.master16), fp16: a float32 state tensor
        assert master.dtype == torch.float32 and ("master_low" in opt.state[p]) == (dtype == torch.bfloat16)
        assert ((master - r).abs() / r.abs().clamp(min=1e-6)).max().item() <= 1e-6
        assert torch.equal(p, nearest_copy(master, dtype))


@pytest.mark.parametrize("dtype", HALF)
def test_sr_weights_are_neighbours_of_the_float32_update_and_unbiased(dtype: torch.dtype) -> None:
    # One step from the same start: the SR result is one of the two half neighbours of the
    # float32 AdamW result, and its mean over seeds matches it (6 sigma on 2000 draws).
    base = torch.randn(64, generator=torch.Generator().manual_seed(3)).to(dtype)
    grad = torch.randn(64, generator=torch.Generator().manual_seed(4)).to(dtype)
    ref = torch.nn.Parameter(base.float())
    ref.grad = grad.float()
    torch.optim.AdamW([ref], lr=1e-3, weight_decay=0.1).step()
    target = ref.detach().double()
    draws = []
    for seed in range(2000):
        p = torch.nn.Parameter(base.clone())
        p.grad = grad.clone()
        SRAdamW([p], lr=1e-3, weight_decay=0.1, state_dtype=torch.float32, seed=seed).step()
        draws.append(p.detach().double())
    assert_neighbours_with_unbiased_mean(torch.stack(draws), target, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_small_updates_survive_with_sr_and_stall_with_round_to_nearest(dtype: torch.dtype) -> None:
    # Each update (~lr: Adam is scale-free) is below half a unit in the last place: bf16 weights in
    # [1, 2) (spacing 2**-7) with lr 1e-4; fp16 weights in [512, 1024) (spacing 0.5) with lr 2e-2.
    # Per element the SR displacement
    # after T steps has standard deviation <= ulp * sqrt(T * lr / ulp); averaged over 4096 elements
    # that is < 1 % of the expected displacement T * lr, so 5 % is a > 5 sigma bound.
    lr = 1e-4 if dtype == torch.bfloat16 else 2e-2
    base = 1.0 if dtype == torch.bfloat16 else 512.0
    start = (base * (1 + torch.rand(4096, generator=torch.Generator().manual_seed(0)))).to(dtype)
    target = torch.zeros(4096)

    def train(p: torch.nn.Parameter, opt: torch.optim.Optimizer) -> torch.Tensor:
        for _ in range(300):
            p.grad = (p.detach().float() - target).to(p.dtype)  # pull towards 0
            opt.step()
        return p.detach().double()

    p32 = torch.nn.Parameter(start.float())
    w32 = train(p32, torch.optim.AdamW([p32], lr=lr, weight_decay=0.0))
    p_sr = torch.nn.Parameter(start.clone())
    w_sr = train(p_sr, SRAdamW([p_sr], lr=lr, weight_decay=0.0, state_dtype=torch.float32, seed=1))
    p_rn = torch.nn.Parameter(start.clone())
    w_rn = train(p_rn, SRAdamW([p_rn], lr=lr, weight_decay=0.0, state_dtype=torch.float32, weight_rounding="nearest"))
    moved32 = (start.double() - w32).mean().item()
    assert abs(moved32 / (300 * lr) - 1) < 0.01
    assert torch.equal(w_rn, start.double())  # round-to-nearest never moves
    assert abs((start.double() - w_sr).mean().item() / moved32 - 1) <= 0.05


def test_bf16_state_round_to_nearest_ratchets_sr_does_not() -> None:
    # v <- beta2 v + (1 - beta2) g^2 stored in bf16: RTN cannot represent the small decay of v and
    # drifts upward; SR stays unbiased. Compared with a float32 recursion on the same gradients.
    n, steps, beta2 = 256, 20_000, 0.999
    gen = torch.Generator().manual_seed(0)
    v32 = torch.zeros(n)
    v_rn = torch.zeros(n, dtype=torch.bfloat16)
    v_sr = torch.zeros(n, dtype=torch.bfloat16)
    from optim import stochastic_round

    for t in range(steps):
        g2 = torch.randn(n, generator=gen) ** 2
        v32 = beta2 * v32 + (1 - beta2) * g2
        v_rn = (beta2 * v_rn.float() + (1 - beta2) * g2).to(torch.bfloat16)
        v_sr = stochastic_round(beta2 * v_sr.float() + (1 - beta2) * g2, torch.bfloat16, seed=t)
    ratio_rn = (v_rn.double().mean() / v32.double().mean()).item()
    ratio_sr = (v_sr.double().mean() / v32.double().mean()).item()
    assert ratio_rn > 1.5, ratio_rn
    assert abs(ratio_sr - 1) <= 0.03, ratio_sr


def test_float16_states_do_not_underflow_for_tiny_gradients() -> None:
    # gradients ~1e-6: g^2 ~ 1e-12 is far below float16's smallest subnormal (6e-8).
    ref, ours = make_params(), make_params()
    start = [p.detach().clone() for p in ref]
    kw = dict(lr=1e-3, weight_decay=0.0)
    run(SRAdamW(ref, state_dtype=torch.float32, **kw), ref, 200, scale=1e-6)
    opt = SRAdamW(ours, state_dtype=torch.float16, **kw)
    run(opt, ours, 200, scale=1e-6)
    d_ref = torch.cat([(p - s).flatten() for p, s in zip(ref, start)]).double()
    d_our = torch.cat([(p - s).flatten() for p, s in zip(ours, start)]).double()
    assert ((d_our - d_ref).norm() / d_ref.norm()).item() <= 0.03
    st = opt.state[ours[0]]
    assert st["exp_avg"].dtype == torch.float16 and st["exp_avg_sq"].dtype == torch.float16
    assert bool((st["exp_avg_sq"] != 0).float().mean() > 0.99)  # not flushed to zero


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("dtype", HALF)
def test_half_weights_and_states_track_float32(dtype: torch.dtype, state_dtype: torch.dtype) -> None:
    # A least-squares problem: SR half weights + SR half states reach the float32 loss within 2 %.
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(256, 32, generator=gen)
    x_true = torch.randn(32, generator=gen)
    b = a @ x_true

    def loss_after(p: torch.nn.Parameter, opt: torch.optim.Optimizer) -> float:
        for _ in range(300):
            p.grad = None
            loss = ((a @ p.float() - b) ** 2).mean()
            loss.backward()
            opt.step()
        return ((a @ p.detach().float() - b) ** 2).mean().item()

    p32 = torch.nn.Parameter(torch.zeros(32))
    l32 = loss_after(p32, torch.optim.AdamW([p32], lr=1e-2, weight_decay=0.0))
    ph = torch.nn.Parameter(torch.zeros(32, dtype=dtype))
    lh = loss_after(ph, SRAdamW([ph], lr=1e-2, weight_decay=0.0, state_dtype=state_dtype, seed=2))
    initial = (b**2).mean().item()
    assert l32 < 0.05 * initial
    assert abs(lh - l32) <= 0.02 * initial


def test_mixed_groups_keep_their_dtypes() -> None:
    text = make_params(torch.bfloat16, 1)
    image = make_params(torch.bfloat16, 2)
    opt = SRAdamW(
        [
            {"params": text, "state_dtype": torch.bfloat16},
            {"params": image, "master_weights": True, "state_dtype": torch.float32},
        ],
        lr=1e-3,
    )
    run(opt, text + image, 3)
    for p in text:
        s = opt.state[p]
        assert "master" not in s and s["exp_avg"].dtype == torch.bfloat16 and s["exp_avg_sq"].dtype == torch.bfloat16
    for p in image:
        s = opt.state[p]
        assert s["master_low"].dtype == torch.int16 and s["exp_avg"].dtype == torch.float32
        assert torch.equal(p, nearest_copy(opt.master(p), torch.bfloat16))


@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_state_dict_round_trip_resumes_bit_identically(state_dtype: torch.dtype) -> None:
    def build(seed: int) -> tuple[list[torch.nn.Parameter], SRAdamW]:
        ps = make_params(torch.bfloat16, 0) + make_params(torch.float16, 1)
        opt = SRAdamW(
            [{"params": ps[:4], "state_dtype": state_dtype}, {"params": ps[4:], "master_weights": True}],
            lr=1e-2,
            seed=seed,
        )
        return ps, opt

    ps, opt = build(seed=11)
    run(opt, ps, 5)
    buf = io.BytesIO()
    torch.save({"model": [p.detach().clone() for p in ps], "opt": opt.state_dict()}, buf)
    run(opt, ps, 5, start=5)
    expected = [p.detach().clone() for p in ps]

    ps2, opt2 = build(seed=999)  # another seed: the saved one must win
    buf.seek(0)
    ck = torch.load(buf, weights_only=False)
    with torch.no_grad():
        for p, v in zip(ps2, ck["model"]):
            p.copy_(v)
    opt2.load_state_dict(ck["opt"])
    assert opt2.seed == 11
    for p in ps2[:4]:
        assert opt2.state[p]["exp_avg"].dtype == state_dtype
    for p in ps2[4:]:
        assert opt2.state[p]["master"].dtype == torch.float32
    if state_dtype == torch.float16:
        assert opt2.state[ps2[0]]["exp_avg_bound"].dtype == torch.float32
    run(opt2, ps2, 5, start=5)
    for a, b in zip(expected, ps2):
        assert torch.equal(a, b)


def test_seed_and_rank_change_the_noise() -> None:
    def final(seed: int, rank: int | None) -> torch.Tensor:
        ps = make_params(torch.bfloat16)
        run(SRAdamW(ps, lr=1e-3, seed=seed, rank=rank), ps, 3)
        return torch.cat([p.detach().flatten() for p in ps])

    a = final(1, None)
    assert torch.equal(a, final(1, 0))
    assert not torch.equal(a, final(2, None))
    assert not torch.equal(a, final(1, 1))


def test_flat_partition_chunking_is_invisible() -> None:
    # A ZeRO-style flat partition processed in small chunks equals one pass: the noise is keyed by
    # the global element index.
    n = 10_007
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    results = []
    for chunk in (n, 1000, 333):
        p = p0.clone()
        m = torch.zeros(n, dtype=torch.float16)
        v = torch.zeros(n, dtype=torch.float16)
        one = torch.ones(())
        sradamw_update_(
            p, g, m, v, step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1,
            keys=(derive_key(1), derive_key(2)), exp_avg_scales=(one, one * 2**-4),
            exp_avg_sq_scales=(one, one * 2**-10), chunk_size=chunk,
        )
        results.append((p, m, v))
    for r in results[1:]:
        for a, b in zip(results[0], r):
            assert torch.equal(a, b)


def test_grad_scale_and_found_inf() -> None:
    ref, ours = make_params(), make_params()
    opt_ref, opt = SRAdamW(ref, lr=1e-3), SRAdamW(ours, lr=1e-3)
    for t in range(5):
        for p, q, g in zip(ref, ours, grads_for(ref, t)):
            p.grad = g.clone()
            q.grad = g * 1024.0
        opt_ref.step()
        opt.step(grad_scale=torch.tensor(1024.0), found_inf=torch.tensor(0.0))
    for a, b in zip(ref, ours):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)
    before = [p.detach().clone() for p in ours]
    opt.step(inv_grad_scale=1 / 1024.0, found_inf=torch.tensor(1.0))
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ours))
    assert int(opt.state[ours[0]]["step"]) == 5


@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_one_element_scale_as_gradscaler_keeps_it(state_dtype: torch.dtype) -> None:
    """GradScaler's scale has shape [1]: it steps exactly like a 0-d scale, fp16 scaled states included;
    a scale of several values is an error naming the arguments."""
    out = []
    for scale in (torch.tensor(1024.0), torch.tensor([1024.0])):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 64).half())
        opt = SRAdamW([{"params": [p], "state_dtype": state_dtype, "master_weights": False}], lr=1e-3, seed=3)
        for t in range(3):
            p.grad = (torch.sin(torch.arange(64.0) + t) * 1024).half()
            opt.step(grad_scale=scale)
        out.append(p.detach().clone())
    assert torch.equal(out[0], out[1]) and not torch.equal(out[0], torch.linspace(-1, 1, 64).half())
    with pytest.raises(ValueError, match="must hold one value, got shape"):
        opt.step(grad_scale=torch.tensor([1.0, 2.0]))


def test_grad_scaler_drives_the_step() -> None:
    """GradScaler hands the scale over as attributes; eps = 0.1 makes an update from still-scaled
    gradients (1024x) differ visibly from the unscaled one."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    ref = copy.deepcopy(model)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    opt, opt_ref = SRAdamW(model.parameters(), lr=1e-2, eps=0.1), SRAdamW(ref.parameters(), lr=1e-2, eps=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    for _ in range(5):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
        opt_ref.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        opt_ref.step()
    for a, b in zip(model.parameters(), ref.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    scaler.scale(torch.nn.functional.mse_loss(model(x), y) * float("inf")).backward()
    scaler.step(opt)  # the scaler's found_inf skips the step
    assert opt.skipped_steps == 1 and all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_nonfinite_gradients_skip_or_raise(bad: float) -> None:
    ps = make_params(torch.bfloat16)
    opt = SRAdamW(ps, lr=1e-3)
    run(opt, ps, 2)
    before = [p.detach().clone() for p in ps]
    states = copy.deepcopy(opt.state_dict()["state"])
    for p, g in zip(ps, grads_for(ps, 9)):
        p.grad = g.to(p.dtype)
    ps[-1].grad[0] = bad  # only the last tensor is bad: nothing at all may change
    opt.step()
    assert opt.skipped_steps == 1
    assert all(torch.equal(a, b) for a, b in zip(before, ps))
    for k, st in states.items():
        for name, v in st.items():
            after = opt.state_dict()["state"][k][name]
            assert torch.equal(v, after) if isinstance(v, torch.Tensor) else v == after
    strict = SRAdamW(ps, lr=1e-3, nonfinite="raise")
    with pytest.raises(FloatingPointError):
        strict.step()
    assert all(torch.equal(a, b) for a, b in zip(before, ps))


@pytest.mark.parametrize(
    "kwargs, name",
    [
        (dict(lr=-1.0), "lr"),
        (dict(lr=float("nan")), "lr"),
        (dict(betas=(1.0, 0.999)), "betas"),
        (dict(betas=(0.9, -0.1)), "betas"),
        (dict(eps=-1e-8), "eps"),
        (dict(weight_decay=-0.1), "weight_decay"),
        (dict(state_dtype=torch.int8), "state_dtype"),
        (dict(master_weights="yes"), "master_weights"),
        (dict(weight_rounding="up"), "weight_rounding"),
        (dict(state_rounding="down"), "state_rounding"),
        (dict(seed=-1), "seed"),
        (dict(nonfinite="ignore"), "nonfinite"),
    ],
)
def test_invalid_hyperparameters_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=name):
        SRAdamW(make_params(), **kwargs)


def test_invalid_group_and_param_dtype() -> None:
    with pytest.raises(ValueError, match="lr"):
        SRAdamW([{"params": make_params(), "lr": -2.0}])
    with pytest.raises(ValueError, match="params"):
        SRAdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])


def test_group_clamp_projects_the_update() -> None:
    # A group clamp keeps the weight (and its fp32 master) in range: CLIP's logit-scale clamp.
    p = torch.nn.Parameter(torch.tensor([4.5, 0.05], dtype=torch.bfloat16))
    opt = SRAdamW([{"params": [p], "clamp": (0.0, math.log(100)), "master_weights": True}], lr=0.5, weight_decay=0.0)
    p.grad = torch.tensor([-1.0, 1.0], dtype=torch.bfloat16)  # pushes 4.5 up and 0.05 down
    opt.step()
    master = opt.master(p)
    assert master.tolist() == [pytest.approx(math.log(100)), 0.0]
    assert torch.equal(p, nearest_copy(master, torch.bfloat16))
    with pytest.raises(ValueError, match="clamp"):
        SRAdamW([{"params": [torch.nn.Parameter(torch.zeros(1))], "clamp": (1.0, 0.0)}])



def test_optim_imports_torch_only_and_steps_without_triton() -> None:
    # optim is importable on its own (no recipe, deepspeed or, eagerly, triton) and steps without
    # Triton; fused=True then fails naming Triton
    code = textwrap.dedent(
        """
        import sys
        import optim
        loaded = {m.split('.')[0] for m in sys.modules} & {'recipe', 'deepspeed', 'triton', 'transformers', 'timm'}
        assert not loaded, loaded
        sys.modules['triton'] = None  # from here on, importing triton fails
        import torch
        p = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16))
        p.grad = torch.ones(5, dtype=torch.bfloat16)
        optim.SRAdamW([p], lr=0.1).step()
        assert bool((p < 1).all())
        error = None
        try:
            optim.SRAdamW([p], fused=True)
        except ValueError as e:
            error = str(e)
        assert error is not None and 'fused' in error and 'Triton' in error, f'fused=True without Triton: {error}'
        print('ok')
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


# ----------------------------------------------------------------------------------------------
# The skip decision on the device: masked updates, bookkeeping settled at the next step
# ----------------------------------------------------------------------------------------------
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
CUDA = torch.cuda.is_available()


def _interpreted_kernel() -> bool:
    if not _triton.is_available():
        return False
    from optim import triton_kernel

    return triton_kernel.interpreting()


# (device, fused): the PyTorch path and the interpreted kernel with the deferred path forced on CPU
# tensors (defer_skips); on CUDA both take it by themselves (the flags live on the GPU).
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs CUDA")]
PATHS = [
    pytest.param("cpu", False, id="cpu-pytorch"),
    pytest.param("cpu", True, id="cpu-fused", marks=pytest.mark.skipif(
        not _interpreted_kernel(), reason="the kernel runs interpreted on CPU tensors only without CUDA")),
    pytest.param("cuda", False, id="cuda-pytorch", marks=ON_GPU),
    pytest.param("cuda", True, id="cuda-fused", marks=ON_GPU),
]


def skip_groups(device: str) -> list[dict]:
    """One group per (param dtype, state dtype, master): every kind of stored tensor, float16 bounds
    included; one group clamps, one parameter is not contiguous."""
    gen = torch.Generator().manual_seed(5)
    groups = []
    for pd in DTYPES:
        for sd in DTYPES:
            for master in [False, True] if pd != torch.float32 else [False]:
                w = (torch.randn(15, 20, generator=gen) * 0.3).to(pd)
                p = torch.nn.Parameter(w.t().to(device) if len(groups) == 3 else w.to(device))
                groups.append(dict(params=[p], state_dtype=sd, master_weights=master, weight_decay=0.1))
    groups[1]["clamp"] = (-0.3, 0.3)
    return groups


def set_grads(params: list[torch.Tensor], step: int, scale: float, nan: bool = False) -> None:
    gen = torch.Generator().manual_seed(200 + step)
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen) * scale).to(device=p.device, dtype=p.dtype)
    if nan:
        params[-1].grad[0, 0] = float("nan")  # one element of one tensor: nothing at all may change


def snapshot(opt: SRAdamW, params: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of every stored tensor: parameters, moments, masters, float16 bounds (not the steps)."""
    out = [p.detach().clone() for p in params]
    for p in params:
        out += [v.clone() for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and k != "step"]
    return out


# step -> (gradient magnitude, a NaN gradient, step() keyword arguments); found_inf as a Python number,
# a tensor that is zero, a tensor that is one, and non-finite gradients (check_finite)
SKIP_SCHEDULE = [
    (1e-3, False, {}),
    (1024.0 * 3.0, False, {"inv_grad_scale": 1 / 1024.0, "found_inf": 0.0}),
    (1.0, False, {"found_inf": torch.tensor(1.0)}),
    (1.0, True, {}),
    (512.0 * 1e-2, False, {"grad_scale": torch.tensor(512.0), "found_inf": torch.tensor(0.0)}),
    (1.0, True, {"inv_grad_scale": torch.tensor(0.5)}),
    (1e-4, False, {}),
]


def skip_schedule(device: str, fused: bool, check: bool = True) -> None:
    """The steps of the test below: the immediate decision (``ref``) and the deferred one (``opt``) on the
    same gradients; ``check=False`` only steps (a dry run: :func:`tests.precompile.precompile`)."""
    ref_groups, groups = skip_groups(device), skip_groups(device)
    ref_params, params = [g["params"][0] for g in ref_groups], [g["params"][0] for g in groups]
    ref = defer_skips(SRAdamW(ref_groups, lr=2e-2, betas=(0.9, 0.99), seed=3, fused=fused), defer=False)
    opt = SRAdamW(groups, lr=2e-2, betas=(0.9, 0.99), seed=3, fused=fused)
    if device == "cpu":  # on a GPU the flags live there: deferred by itself
        defer_skips(opt)
    # a skipped first step: nothing changes (the deferred path creates the states, at step 0)
    set_grads(ref_params, -1, 1.0, nan=True)
    set_grads(params, -1, 1.0, nan=True)
    before = [p.detach().clone() for p in params]
    ref.step()
    opt.step()
    if check:
        assert ref.skipped_steps == opt.skipped_steps == 1
        for p, b in zip(params, before):
            assert_same_bits(p, b, "first step skipped")
            assert int(opt.state[p].get("step", 0)) == 0
    for t, (scale, nan, kwargs) in enumerate(SKIP_SCHEDULE):
        set_grads(ref_params, t, scale, nan)
        set_grads(params, t, scale, nan)
        skipped = nan or float(kwargs.get("found_inf", 0.0)) != 0.0
        before = snapshot(opt, params) if check else []
        kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        ref.step(**kwargs)
        opt.step(**kwargs)
        if check and skipped:  # before anything is settled: every stored tensor keeps its bits
            for i, (a, b) in enumerate(zip(before, snapshot(opt, params))):
                assert_same_bits(a, b, f"step {t}: stored tensor {i} changed in a skipped step")
        settled = opt.skipped_steps  # settles the deferred decision
        if check:
            assert settled == ref.skipped_steps
            assert_same_optimizer_bits(ref, ref_params, opt, params, f"step {t}")
    if check:
        assert ref.skipped_steps == 4
        assert {int(ref.state[p]["step"]) for p in ref_params} == {4}
        assert opt.state_dict()["sr"]["skipped_steps"] == 4


@pytest.mark.parametrize("device, fused", PATHS)
def test_device_skip_flag_matches_the_immediate_decision_bit_for_bit(device: str, fused: bool) -> None:
    # The same steps through the immediate decision (flags read on the host) and the deferred one
    # (flags applied on the device as masked stores, bookkeeping settled at the next step), on the
    # same device and path: finite steps are bit-identical, a skipped step leaves every stored
    # tensor's bits, advances no step counter and is counted once settled.
    if device == "cuda" and fused:  # ~100 kernel specialisations: compiled ahead, in parallel
        precompile(lambda: skip_schedule(device, fused, check=False))
    skip_schedule(device, fused)


@contextlib.contextmanager
def no_host_reads() -> Iterator[None]:
    """Fails on any read of a tensor's value into Python (what would synchronise with a GPU).

    Reads of int64 CPU tensors stay allowed: the per-tensor step counters are CPU tensors by design
    (``int()`` of one, or ``tolist()`` of them stacked); the flags and scales are float or bool."""
    def guard(name: str):
        real = getattr(torch.Tensor, name)

        def fail(self: torch.Tensor, *args, **kwargs):
            if self.dtype == torch.int64 and self.device.type == "cpu":
                return real(self, *args, **kwargs)
            raise AssertionError(f"host read of a tensor of shape {tuple(self.shape)} inside step()")

        return fail

    mp = pytest.MonkeyPatch()
    for name in ("item", "tolist", "__bool__", "__float__"):
        mp.setattr(torch.Tensor, name, guard(name))
    try:
        yield
    finally:
        mp.undo()


def test_check_finite_and_found_inf_tensor_are_not_read_in_step() -> None:
    # With device flags (forced here on CPU tensors) step() reads no tensor: not the non-finite check,
    # not found_inf, not the grad scale; reading skipped_steps afterwards settles the decision.
    ref_params = [p for p in make_params(torch.bfloat16)]
    params = [p.detach().clone().requires_grad_() for p in ref_params]
    ref = SRAdamW(ref_params, lr=1e-2, state_dtype=torch.float16)
    opt = defer_skips(SRAdamW(params, lr=1e-2, state_dtype=torch.float16))
    schedule = [(False, 0.0, 0), (True, 0.0, 1), (False, 1.0, 2), (False, 0.0, 2)]  # inf grad, found_inf, skipped
    for t, (bad, found, skipped) in enumerate(schedule):
        for p, q, g in zip(ref_params, params, grads_for(ref_params, t)):
            p.grad, q.grad = g.to(p.dtype), g.to(q.dtype)
        if bad:
            ref_params[1].grad[3] = params[1].grad[3] = float("inf")
        ref.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(found))
        with no_host_reads():
            opt.step(grad_scale=torch.tensor(4.0), found_inf=torch.tensor(found))
        assert opt.skipped_steps == ref.skipped_steps == skipped
        assert_same_optimizer_bits(ref, ref_params, opt, params, f"step {t}")
    with pytest.raises(AssertionError, match="host read"), no_host_reads():
        defer_skips(SRAdamW(params, lr=1e-2, nonfinite="raise")).step()  # raising must read the flag


def test_nonfinite_raise_reads_the_device_flag_and_found_inf_still_skips() -> None:
    ps = make_params(torch.bfloat16)
    opt = defer_skips(SRAdamW(ps, lr=1e-3, nonfinite="raise"))
    run(opt, ps, 2)
    before = snapshot(opt, ps)
    ps[0].grad[0] = float("nan")
    with pytest.raises(FloatingPointError):
        opt.step()
    opt.step(found_inf=torch.tensor(1.0))  # a found_inf skip is counted, not raised (both flags set)
    assert opt.skipped_steps == 1
    for a, b in zip(before, snapshot(opt, ps)):
        assert_same_bits(a, b)
    assert {int(opt.state[p]["step"]) for p in ps} == {2}


def _dist_skip_worker(rank: int, world: int) -> dict:
    # Rank 1 alone has a NaN gradient at the second step: the all-reduced flag skips it on both ranks,
    # read at once (CPU) or applied on the device (deferred); the result equals a run without that step.
    results = {}
    for variant in ("reference", "immediate", "deferred"):
        ps = make_params(torch.bfloat16)
        opt = SRAdamW(ps, lr=1e-2, state_dtype=torch.float16, seed=1)
        if variant == "deferred":
            defer_skips(opt)
        for t in range(3):
            if variant == "reference" and t == 1:
                continue
            for p, g in zip(ps, grads_for(ps, t)):
                p.grad = g.to(p.dtype)
            if t == 1 and rank == 1:
                ps[2].grad[0, 0, 0] = float("nan")
            opt.step()
        results[variant] = {"params": [p.detach().clone() for p in ps], "skipped": opt.skipped_steps,
                            "steps": [int(opt.state[p]["step"]) for p in ps]}
    return results


def test_nonfinite_flag_is_reduced_over_ranks() -> None:
    for rank, res in enumerate(run_distributed(_dist_skip_worker, 2, timeout_s=240)):
        ref = res["reference"]
        assert ref["skipped"] == 0 and ref["steps"] == [2] * 4
        for variant in ("immediate", "deferred"):
            got = res[variant]
            assert got["skipped"] == 1 and got["steps"] == [2] * 4, (rank, variant)
            for a, b in zip(ref["params"], got["params"]):
                assert_same_bits(a, b, f"rank {rank} {variant}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype, kw", [(torch.bfloat16, {}), (torch.float16, {}), (torch.bfloat16, {"master_weights": True})])
def test_cuda_step_does_not_synchronise(dtype: torch.dtype, kw: dict) -> None:
    # Steady-state steps with the default non-finite check, a device loss scale and a device found_inf
    # (the fp16 loss-scaling route) issue no synchronising CUDA call (torch's sync debug mode raises on
    # one). The device is idle before each checked step, so the previous step's skip flag has arrived.
    ps = [torch.nn.Parameter(p.detach().to("cuda", dtype)) for p in make_params()]
    opt = SRAdamW(ps, lr=1e-3, **kw)
    scale, found = torch.tensor([1024.0], device="cuda"), torch.zeros(1, device="cuda")
    for t in range(4):
        for p, g in zip(ps, grads_for(ps, t, scale=1024.0)):
            p.grad = g.to("cuda", dtype)
        torch.cuda.synchronize()
        if t >= 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step(grad_scale=scale, found_inf=found)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert opt.skipped_steps == 0


def test_an_empty_parameter_with_a_gradient_steps_on_the_eager_path() -> None:
    """The eager path's gradient maxima (no C++ compiler on the machine) take an empty tensor (0, as the
    C++ reduction gives) instead of failing in ``aminmax``; the other tensors step as torch's AdamW."""
    empty, p = torch.nn.Parameter(torch.zeros(0)), torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    ref = torch.nn.Parameter(p.detach().clone())
    empty.grad, p.grad, ref.grad = torch.zeros(0), torch.tensor([0.5, 0.25, -1.0]), torch.tensor([0.5, 0.25, -1.0])
    opt = SRAdamW([empty, p], lr=0.1, weight_decay=0.0, fused=False)
    torch_opt = torch.optim.AdamW([ref], lr=0.1, weight_decay=0.0)
    opt.step()
    torch_opt.step()
    assert empty.numel() == 0 and opt.state[empty]["step"] == 1
    torch.testing.assert_close(p, ref, rtol=0, atol=1e-6)
