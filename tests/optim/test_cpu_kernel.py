"""The CPU kernel (``optim._cpu_kernel``, ``SRAdamW``'s default on CPU tensors) against the eager
definition, bit for bit, on every weight/state route, with one and several threads; its float16
conversions over every float16 bit pattern; one call per specialisation; the build cache; and the
fallback when nothing can be built.
"""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

from optim import SRAdamW, _cpu_kernel
from optim.functional import TensorStep, apply_update_

from .sr_reference import assert_same_bits, assert_same_optimizer_bits, defer_skips

pytestmark = pytest.mark.skipif(not _cpu_kernel.available(), reason=f"the CPU kernel cannot be built here: "
                                f"{_cpu_kernel.unavailable_reason()}")


def params(dtype: torch.dtype, seed: int = 0, big: bool = False) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (1000,), (3,), (1,)] + ([(300, 400)] if big else [])  # big: several threads' blocks
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def grads(ps: list[torch.nn.Parameter], step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g) * scale for p in ps]
    out[0][0, :3] = 0.0  # zero gradients: zero second moments
    out[1][:50] *= 1e-6  # tiny ones: float16 subnormal states
    return out


ROUTES = {
    "bf16 weights, bf16 SR states": (torch.bfloat16, {}),
    "fp16 weights, fp16 scaled SR states": (torch.float16, {}),
    "bf16 weights, fp32 states": (torch.bfloat16, {"state_dtype": torch.float32}),
    "bf16 weights + split master, bf16 SR states": (torch.bfloat16, {"master_weights": True}),
    "bf16 weights + fp32 master, fp32 states": (torch.bfloat16, {"master_weights": True, "master_format": "fp32",
                                                                "state_dtype": torch.float32}),
    "fp16 weights + fp32 master, fp16 states": (torch.float16, {"master_weights": True}),
    "fp32": (torch.float32, {}),
    "bf16, nearest rounding": (torch.bfloat16, {"weight_rounding": "nearest", "state_rounding": "nearest"}),
    "fp16, nearest rounding": (torch.float16, {"weight_rounding": "nearest", "state_rounding": "nearest"}),
    "bf16 clamped, fp16 states": (torch.bfloat16, {"state_dtype": torch.float16, "clamp": (-0.3, 0.3)}),
}


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("route", list(ROUTES))
def test_cpu_kernel_equals_eager(route: str, threads: int) -> None:
    dtype, kw = ROUTES[route][0], dict(ROUTES[route][1])
    clamp = kw.pop("clamp", None)
    ref_ps, ps = params(dtype, big=True), params(dtype, big=True)
    groups = lambda xs: [{"params": xs, **({"clamp": clamp} if clamp else {})}]  # noqa: E731
    ref = SRAdamW(groups(ref_ps), lr=1e-2, weight_decay=0.1, seed=3, fused=False, **kw)
    opt = SRAdamW(groups(ps), lr=1e-2, weight_decay=0.1, seed=3, **kw)
    assert opt._update_for(torch.device("cpu")) is _cpu_kernel.cpu_updates_
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for t in range(4):
            for a, b, g in zip(ref_ps, ps, grads(ps, t)):
                a.grad, b.grad = g.to(dtype), g.to(dtype)
            ref.step()
            opt.step()
            assert_same_optimizer_bits(ref, ref_ps, opt, ps, f"{route}, step {t}")
    finally:
        torch.set_num_threads(before)


def test_loss_scale_skip_flag_and_noise_offsets() -> None:
    # A tensor grad scale and a device-style skip flag, and ZeRO-style noise offsets crossing 2**32
    # inside one block (the kernel splits the block there) through the functional interface.
    ref_ps, ps = params(torch.float16, 1), params(torch.float16, 1)
    ref = defer_skips(SRAdamW(ref_ps, lr=1e-2, fused=False))
    opt = defer_skips(SRAdamW(ps, lr=1e-2))
    for t, found in enumerate([0.0, 1.0, 0.0]):
        for a, b, g in zip(ref_ps, ps, grads(ps, t, scale=1024.0)):
            a.grad, b.grad = g.half(), g.half()
        ref.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor(found))
        opt.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor(found))
        assert opt.skipped_steps == ref.skipped_steps
        assert_same_optimizer_bits(ref, ref_ps, opt, ps, f"step {t}")

    gen = torch.Generator().manual_seed(5)
    n = 3000
    tensors = [torch.randn(n, generator=gen).bfloat16() for _ in range(4)]
    for offset in ((1 << 32) - 1000, (1 << 40) + 17, (1 << 33) - n):
        a, b = [x.clone() for x in tensors], [x.clone() for x in tensors]
        kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, keys=(7, 8), index_offset=offset)
        apply_update_(TensorStep(*a, **kw), chunk_size=512)
        assert _cpu_kernel.cpu_updates_([TensorStep(*b, **kw)], grad_mul=0.5 if offset >> 40 else None) == 1 \
            or offset >> 40
        if offset >> 40:  # the same call with the multiplier on the eager side too
            a = [x.clone() for x in tensors]
            apply_update_(TensorStep(*a, **kw), grad_mul=0.5, chunk_size=512)
        for x, y in zip(a, b):
            assert_same_bits(x, y, f"offset {offset}")  # exp_avg_sq < 0 here: NaNs in the weights


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_float16_conversions_over_every_bit_pattern(rounding: str) -> None:
    """Every float16 pattern (subnormals, infinities, NaNs included) as weight and statistics, updated
    towards values that round to every float16 class (overflow, the subnormal range, zero): the
    kernel's integer float16 conversions against torch's."""
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    g = torch.Generator().manual_seed(9)
    grad = (torch.randn(every.numel(), generator=g) * torch.exp2(torch.randint(-30, 17, (every.numel(),),
                                                                              generator=g).float())).half()
    m = every.flip(0).clone()
    v = every.abs().roll(7).clone()
    kw = dict(step=3, lr=2.0, beta1=0.5, beta2=0.75, eps=1e-8, weight_decay=0.5, keys=(11, 12),  # decay 0
              weight_rounding=rounding, state_rounding=rounding)
    a = [every.clone(), grad, m.clone(), v.clone()]
    b = [every.clone(), grad, m.clone(), v.clone()]
    apply_update_(TensorStep(*a, **kw))
    _cpu_kernel.cpu_updates_([TensorStep(*b, **kw)])
    for name, x, y in zip(("param", "grad", "exp_avg", "exp_avg_sq"), a, b):
        assert_same_bits(x, y, f"{rounding}: {name}")
    out = torch.cat([a[0], a[2], a[3]])
    classes = (out.isinf().sum(), out.isnan().sum(), ((out.abs() < 2.0**-14) & (out != 0)).sum(), (out == 0).sum(),
               (out.abs() >= 1).sum())
    assert all(int(c) >= 5 for c in classes), classes  # every class was produced


def test_one_call_per_specialisation_whatever_the_number_of_tensors() -> None:
    ps = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (1, 5, 77, 4096, 70000)]
    ps32 = [torch.nn.Parameter(torch.randn(n)) for n in (3, 9)]
    opt = SRAdamW([{"params": ps}, {"params": ps32}], lr=1e-3)
    calls = []
    real = _cpu_kernel.cpu_updates_

    def counting(specs, **kw):
        calls.append(real(specs, **kw))
        return calls[-1]

    for p in ps + ps32:
        p.grad = torch.randn_like(p)
    opt._update_for = lambda device: counting  # noqa: E731
    opt.step()
    assert calls == [2]  # bf16 SR and fp32: one kernel call each


def test_libraries_are_cached_and_a_missing_compiler_falls_back_to_eager(tmp_path: Path, no_compiler) -> None:
    spec = tuple(dict(P_KIND=1, G_KIND=1, M_KIND=1, V_KIND=1, MASTER=0, SCALE_M=False, SCALE_V=False, SR_P=True,
                      SR_M=True, SR_V=True, GMUL=0, CLAMP=False).items())
    assert _cpu_kernel.library_path(spec).exists()  # built by available() above, in the default cache
    with no_compiler(_cpu_kernel) as fresh:  # a fresh module state: a cache directory of its own, no compiler
        with pytest.warns(RuntimeWarning, match="no-such-compiler"):
            assert not fresh.available()
        assert "no-such-compiler" in fresh.unavailable_reason()
        ps = [torch.nn.Parameter(torch.randn(8).bfloat16())]
        ps[0].grad = torch.randn(8).bfloat16()
        opt = SRAdamW(ps, lr=1e-3)
        from optim import sradamw

        assert opt._update_for(torch.device("cpu")) is sradamw._pytorch_updates_
        opt.step()  # the eager definition
        assert not any((tmp_path / "cache").glob("*.so"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_grad_amax_matches_torch(dtype: torch.dtype) -> None:
    """One call's maxima against torch's aminmax per tensor: empty, 1-element, multi-block tensors
    (several threads), signed zeros, subnormals, infinities and NaNs."""
    g = torch.Generator().manual_seed(4)
    sizes = [0, 1, 5, 70_000, 300_000]
    grads = [(torch.randn(n, generator=g) * 3).to(dtype) for n in sizes]
    grads += [torch.tensor([-0.0, 0.0]).to(dtype), torch.full((9,), -0.0).to(dtype)]
    tiny = torch.finfo(dtype).tiny
    grads += [torch.tensor([tiny / 4, -tiny / 2]).to(dtype), torch.tensor([1.0, -float("inf"), 2.0]).to(dtype)]
    nan_late = (torch.randn(300_000, generator=g)).to(dtype)
    nan_late[-3] = float("nan")
    grads += [nan_late, torch.tensor([float("inf"), float("nan")]).to(dtype), torch.randn(20, 30).to(dtype).t()]
    before = torch.get_num_threads()
    for threads in (1, 2):
        torch.set_num_threads(threads)
        try:
            got = _cpu_kernel.grad_amax(grads)
        finally:
            torch.set_num_threads(before)
        for i, x in enumerate(grads):
            want = x.float().abs().max() if x.numel() else torch.tensor(0.0)
            if torch.isnan(want):
                assert torch.isnan(got[i]), (i, got[i])
            else:
                assert_same_bits(got[i], want, f"tensor {i}")



def test_a_compiler_refusing_openmp_or_native_flags_still_builds(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The first flag set is refused (an unknown flag stands in for -fopenmp on a compiler without
    OpenMP): a fallback set builds, and the kernel gives the eager path's bits."""
    monkeypatch.setenv("SRADAMW_CPU_CACHE", str(tmp_path / "cache"))
    fresh = importlib.reload(_cpu_kernel)
    try:
        monkeypatch.setattr(fresh, "FLAGS", (*fresh.FLAGS, "-fno-such-flag-here"))
        assert fresh.available(), fresh.unavailable_reason()
        assert len(list((tmp_path / "cache").glob("*.so"))) == 2  # the update route and the maxima
        assert all(not fresh.library_path(None, fresh.AMAX_SOURCE, flags).exists() for flags in [fresh.FLAGS])
        gen = torch.Generator().manual_seed(3)
        tensors = [torch.randn(5000, generator=gen).bfloat16() for _ in range(4)]
        tensors[3] = tensors[3].abs()
        kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, keys=(5, 6))
        a, b = [x.clone() for x in tensors], [x.clone() for x in tensors]
        apply_update_(TensorStep(*a, **kw))
        fresh.cpu_updates_([TensorStep(*b, **kw)])
        for x, y in zip(a, b):
            assert_same_bits(x, y)
    finally:
        monkeypatch.undo()
        importlib.reload(_cpu_kernel)


def test_states_are_checked_once_and_sizes_every_step() -> None:
    """SRAdamW checks its states when it loads them (a state of another size is named there), and the
    kernel still checks every step the sizes its addresses depend on (a parameter resized under the
    optimizer is named instead of being read out of bounds)."""
    small = [torch.nn.Parameter(torch.randn(10).bfloat16())]
    small[0].grad = torch.randn(10).bfloat16()
    opt = SRAdamW(small, lr=1e-3)
    opt.step()
    big = [torch.nn.Parameter(torch.randn(12).bfloat16())]
    with pytest.raises(ValueError, match=r"parameter 0 \(\(12,\), torch.bfloat16\) does not match its saved 'exp_avg'"):
        SRAdamW(big, lr=1e-3).load_state_dict(opt.state_dict())

    small[0].data = torch.randn(12).bfloat16()  # resized under the optimizer: its states have 10 elements
    small[0].grad = torch.randn(12).bfloat16()
    with pytest.raises(ValueError, match="exp_avg has 10 elements, param 12"):
        opt.step()
