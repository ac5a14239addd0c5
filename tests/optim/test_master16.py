"""The exact float32 master in two extra bytes (optim.master16) against the float32-master path.

References: the split/join pair against every float32 exponent and a float64 nearest-bfloat16
reference (ties away from zero); SRAdamW with ``master_format="split"`` against the same optimizer
with a float32 master over many steps whose weights cross exponent boundaries, subnormals and zero:
the joined master must equal the float32 master bit for bit at every step, on the eager path, the
CPU kernel and the (interpreted) fused kernel.
"""

from __future__ import annotations

import pytest
import torch

from optim import SRAdamW, _cpu_kernel, _triton
from optim import triton_kernel as tk
from optim.master16 import join_master, split_master

from .sr_reference import assert_same_bits

_KERNEL_BUILDS = _cpu_kernel.available  # before the conftest fixture replaces it


def _patterns() -> torch.Tensor:
    """float32 bit patterns: every exponent x random significands x both signs, plus specials and the
    significands next to the rounding boundary (low half 0x7FFF, 0x8000, 0x8001, 0xFFFF)."""
    g = torch.Generator().manual_seed(0)
    exponents = torch.arange(256, dtype=torch.int64).repeat_interleave(64)
    mantissas = torch.randint(0, 1 << 23, (exponents.numel(),), generator=g, dtype=torch.int64)
    lows = torch.tensor([0x0000, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int64)
    edge = ((torch.randint(0, 1 << 7, (256 * 5,), generator=g, dtype=torch.int64) << 16)
            | lows.repeat(256))
    exponents = torch.cat([exponents, torch.arange(256, dtype=torch.int64).repeat_interleave(5)])
    mantissas = torch.cat([mantissas, edge])
    mag = (exponents << 23) | mantissas
    bits = torch.cat([mag, mag | (1 << 31), torch.tensor([0x7F7F7FFF, 0x7F7F8000, 0x00008000, 0x80008000])])
    return ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32)  # uint32 patterns as int32


def _nearest_ties_away(w: torch.Tensor) -> torch.Tensor:
    """float64 reference: the bfloat16 nearest to each finite float32 (ties away from zero)."""
    wb = w.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    down_bits = wb & 0xFFFF0000
    up_bits = down_bits + 0x10000  # the next bfloat16 away from zero (same sign)
    as_f64 = lambda b: ((b + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32).double()  # noqa: E731
    w64, down, up = w.double(), as_f64(down_bits), as_f64(up_bits)
    pick_up = (w64 - down).abs() >= (up - w64).abs()  # a tie goes away from zero
    return torch.where(pick_up, up, down).to(torch.bfloat16)  # exact: both are bfloat16 values


def test_split_join_give_back_every_float32() -> None:
    w = _patterns().view(torch.float32)
    hi, lo = split_master(w)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert_same_bits(join_master(hi, lo), w, "join(split(w))")
    nan = torch.isnan(w)
    assert bool(torch.isnan(hi[nan]).all())
    finite = torch.isfinite(w) & ((w.view(torch.int32) & 0x7FFFFFFF) < 0x7F7F8000)
    assert_same_bits(hi[finite], _nearest_ties_away(w[finite]), "high half = nearest bfloat16, ties away")
    big = torch.isfinite(w) & ~finite
    assert bool(torch.isinf(hi[big]).all())  # documented: beyond 0x7F7F8000 the weight is infinite
    # only exact ties differ from torch's round-to-nearest-even conversion
    differs = hi[finite].view(torch.int16) != w[finite].to(torch.bfloat16).view(torch.int16)
    low = (w[finite].view(torch.int32) & 0xFFFF)
    assert bool((low[differs] == 0x8000).all()) and int(differs.sum()) > 0


def _crafted(n: int, seed: int) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """bf16 weights that cross exponent boundaries (near powers of two), float32-subnormal ones, and
    small ones whose updates change their sign; 40 steps of gradients for them."""
    g = torch.Generator().manual_seed(seed)
    near_pow2 = torch.exp2(torch.randint(-20, 20, (n,), generator=g).float()) * (1 - 2.0**-9 * torch.rand(n, generator=g))
    subnormal = torch.randn(n, generator=g) * 2.0**-130
    near_zero = torch.randn(n, generator=g) * 1e-4
    params = [x.to(torch.bfloat16) for x in (near_pow2, subnormal, near_zero)]
    grads = [[torch.randn(n, generator=g).to(torch.bfloat16) for _ in params] for _ in range(40)]
    return params, grads


def _run(path: str, fmt: str, monkeypatch: pytest.MonkeyPatch, params0, grads, check) -> None:
    if path == "cpu kernel":
        if not _KERNEL_BUILDS():
            pytest.skip(f"the CPU kernel cannot be built here: {_cpu_kernel.unavailable_reason()}")
    monkeypatch.setattr(_cpu_kernel, "available", lambda: path == "cpu kernel")  # conftest forces eager elsewhere
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = SRAdamW(
        [{"params": ps[:1], "weight_decay": 0.1},
         {"params": ps[1:2], "weight_decay": 0.0, "lr": 1e-41},  # float32-subnormal steps on subnormal weights
         {"params": ps[2:], "weight_decay": 0.0, "clamp": (-3e-4, 3e-4)}],
        lr=3e-3, state_dtype=torch.float32, master_weights=True, master_format=fmt,
        fused={"eager": False, "cpu kernel": None, "kernel": True}[path],
    )
    for t, step_grads in enumerate(grads):
        for p, gr in zip(ps, step_grads):
            p.grad = gr.clone()
        opt.step()
        check(t, ps, opt)


PATHS = [
    "eager",
    "cpu kernel",
    pytest.param("kernel", marks=pytest.mark.skipif(not (_triton.is_available() and tk.interpreting()),
                                                    reason="the interpreted kernel runs on CPU tensors only here")),
]


@pytest.mark.parametrize("path", PATHS)
def test_split_master_is_the_float32_master_bit_for_bit(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    n = 700
    params0, grads = _crafted(n, seed=1)
    masters, weights, states = [], [], []
    _run("eager", "fp32", monkeypatch, params0, grads,
         lambda t, ps, opt: (masters.append([opt.state[p]["master"].clone() for p in ps]),
                             weights.append([p.detach().clone() for p in ps]),
                             states.append([opt.state[p]["exp_avg_sq"].clone() for p in ps])))
    sign_changes, binade_changes = 0, 0

    def check(t: int, ps: list[torch.Tensor], opt: SRAdamW) -> None:
        nonlocal sign_changes, binade_changes
        for i, p in enumerate(ps):
            st = opt.state[p]
            assert "master" not in st and st["master_low"].dtype == torch.int16
            w = join_master(p.detach(), st["master_low"])
            assert_same_bits(w, masters[t][i], f"{path} step {t} tensor {i}: joined master")
            assert_same_bits(p.detach(), _nearest_ties_away(masters[t][i]), f"{path} step {t}: weight")
            assert_same_bits(st["exp_avg_sq"], states[t][i], f"{path} step {t}: statistics")
            # the weights of the two formats differ at exact ties only
            tie = (masters[t][i].view(torch.int32) & 0xFFFF) == 0x8000
            same = p.detach().view(torch.int16) == weights[t][i].view(torch.int16)
            assert bool((same | tie).all())
            if t:
                prev = masters[t - 1][i]
                sign_changes += int((torch.signbit(prev) != torch.signbit(masters[t][i])).sum())
                binade_changes += int(((prev.view(torch.int32) >> 23) != (masters[t][i].view(torch.int32) >> 23)).sum())

    _run(path, "split", monkeypatch, params0, grads, check)
    # the walk covered what it was built for
    assert sign_changes > 100 and binade_changes > 1000
    sub = masters[-1][1]
    assert bool(((sub.abs() < 2.0**-126) & (sub != masters[0][1])).sum() > n // 2)  # moving subnormal masters


def test_split_master_state_bytes_and_checkpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cpu_kernel, "available", lambda: False)
    params0, grads = _crafted(300, seed=2)
    ps = [torch.nn.Parameter(p.clone()) for p in params0]
    opt = SRAdamW(ps, lr=1e-3, state_dtype=torch.float32, master_weights=True)  # "split" is the default
    for p, gr in zip(ps, grads[0]):
        p.grad = gr.clone()
    opt.step()
    state_bytes = sum(v.numel() * v.element_size() for st in opt.state.values() for v in st.values()
                      if isinstance(v, torch.Tensor) and v.numel() > 1)
    assert state_bytes == sum(p.numel() for p in ps) * (2 + 4 + 4)  # low half + two float32 statistics
    # a resumed optimizer continues bit for bit, the int16 halves kept as int16
    sd = opt.state_dict()
    ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    opt2 = SRAdamW(ps2, lr=1e-3, state_dtype=torch.float32, master_weights=True, seed=5)
    opt2.load_state_dict(sd)
    for a, b, gr in zip(ps, ps2, grads[1]):
        a.grad, b.grad = gr.clone(), gr.clone()
    opt.step()
    opt2.step()
    for a, b in zip(ps, ps2):
        assert opt2.state[b]["master_low"].dtype == torch.int16
        assert_same_bits(a, b)
        assert_same_bits(opt.state[a]["master_low"], opt2.state[b]["master_low"])
    # a float32-master checkpoint keeps its form under the split default
    old = [torch.nn.Parameter(p.clone()) for p in params0]
    opt_old = SRAdamW(old, lr=1e-3, state_dtype=torch.float32, master_weights=True, master_format="fp32")
    for p, gr in zip(old, grads[0]):
        p.grad = gr.clone()
    opt_old.step()
    opt3 = SRAdamW([torch.nn.Parameter(p.detach().clone()) for p in old], lr=1e-3, state_dtype=torch.float32,
                   master_weights=True)
    opt3.load_state_dict(opt_old.state_dict())
    assert all("master" in st and "master_low" not in st for st in opt3.state.values())


def test_master_format_is_checked_and_float16_keeps_a_float32_master() -> None:
    with pytest.raises(ValueError, match="master_format"):
        SRAdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], master_weights=True, master_format="int8")
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    opt = SRAdamW([p], master_weights=True, fused=False)
    p.grad = torch.ones_like(p)
    opt.step()
    assert opt.state[p]["master"].dtype == torch.float32 and "master_low" not in opt.state[p]
