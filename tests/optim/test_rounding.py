"""Stochastic rounding against an independent float64 reference of the two neighbours.

Statistical bounds: a mean of N proportional draws between neighbours lo < hi has standard deviation
(hi - lo) * sqrt(p (1 - p) / N) <= (hi - lo) / (2 sqrt(N)); tests allow 6 such deviations (a false
failure probability below 2e-9 per element); seeds are fixed, so the tests are deterministic.
"""

from __future__ import annotations

import math

import pytest
import torch

from optim import stochastic_round
from optim.rounding import (
    _as_i32,
    _keyed_hash_int,
    derive_key,
    key_words,
    keyed_hash,
    random_bits,
    random_bits_reference,
)

from .sr_reference import FORMATS, assert_neighbours_with_unbiased_mean, neighbours

HALF = [torch.bfloat16, torch.float16]


def sample_values(dtype: torch.dtype, kind: str, n: int = 64) -> torch.Tensor:
    seed = {"normal": 1, "subnormal": 2, "near_max": 3}[kind] + (10 if dtype == torch.float16 else 0)
    g = torch.Generator().manual_seed(seed)
    u = torch.rand(n, generator=g, dtype=torch.float64)
    sign = torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    _, emin, fmax = FORMATS[dtype]
    if kind == "normal":
        v = torch.exp2(u * 20 - 10)
    elif kind == "subnormal":
        v = u * 2.0**emin  # below the smallest normal, including values below the smallest subnormal
    else:  # near max
        v = fmax * (1 - u * 0.01)
    return (sign * v).float()


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["normal", "subnormal", "near_max"])
def test_outputs_are_neighbours_and_mean_is_unbiased(dtype: torch.dtype, kind: str) -> None:
    x = sample_values(dtype, kind)
    draws = 4000
    out = torch.stack([stochastic_round(x, dtype, seed=s) for s in range(draws)])
    assert_neighbours_with_unbiased_mean(out, x, dtype)


@pytest.mark.parametrize("dtype", HALF)
def test_equal_mode_picks_each_neighbour_half_the_time(dtype: torch.dtype) -> None:
    x = sample_values(dtype, "normal", 32)
    draws = 4000
    out = torch.stack([stochastic_round(x, dtype, mode="equal", seed=s) for s in range(draws)]).double()
    for i, xi in enumerate(x.tolist()):
        lo, hi = neighbours(xi, dtype)
        if lo == hi:
            assert bool((out[:, i] == lo).all())
            continue
        frac_hi = (out[:, i] == hi).double().mean().item()
        assert bool(((out[:, i] == lo) | (out[:, i] == hi)).all())
        assert abs(frac_hi - 0.5) <= 6 * 0.5 / math.sqrt(draws)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("mode", ["proportional", "equal"])
def test_special_and_representable_values(dtype: torch.dtype, mode: str) -> None:
    fmax = FORMATS[dtype][2]
    tiny = torch.finfo(dtype).smallest_normal
    representable = torch.tensor([1.0, -1.5, 2.0**-3, tiny, -tiny, fmax, -fmax, tiny * 2**-3], dtype=dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf")])
    for s in range(50):
        r = stochastic_round(representable.float(), dtype, mode=mode, seed=s)
        assert torch.equal(r, representable)
        sp = stochastic_round(specials, dtype, mode=mode, seed=s)
        assert torch.equal(sp.float(), specials)
        assert torch.equal(torch.signbit(sp), torch.signbit(specials))  # -0 keeps its sign
        nan = stochastic_round(torch.tensor([float("nan"), -float("nan")]), dtype, mode=mode, seed=s)
        assert bool(torch.isnan(nan).all())


@pytest.mark.parametrize("dtype", HALF)
def test_finite_overflow_saturates(dtype: torch.dtype) -> None:
    fmax = FORMATS[dtype][2]
    # finite float32 values beyond the target's largest finite value (65520 rounds to inf in float16)
    big = [65504 * 1.0001, 65520.0, 1e38] if dtype == torch.float16 else [3.3896e38, 3.4e38, 3.4028e38]
    big = torch.tensor(big + [-v for v in big])
    assert bool((big.double().abs() > fmax).all())
    for s in range(200):
        r = stochastic_round(big, dtype, seed=s).double()
        assert torch.equal(r, big.double().sign() * fmax)


def test_float16_subnormals_are_not_flushed() -> None:
    # 1e-8 lies between 0 and 2**-24 (~5.96e-8): it must round up with probability 1e-8 / 2**-24.
    x = torch.full((200_000,), 1e-8)
    r = stochastic_round(x, torch.float16, seed=3).double()
    p = 1e-8 / 2.0**-24
    frac = (r == 2.0**-24).double().mean().item()
    assert set(r.unique().tolist()) <= {0.0, 2.0**-24}
    assert abs(frac - p) <= 6 * math.sqrt(p * (1 - p) / x.numel())
    # a value in the subnormal range with spacing 2**-24
    y = torch.full((200_000,), 3.3 * 2.0**-24)
    ry = stochastic_round(y, torch.float16, seed=4).double()
    assert set(ry.unique().tolist()) == {3 * 2.0**-24, 4 * 2.0**-24}
    assert abs(ry.mean().item() - y[0].item()) <= 6 * 2.0**-24 / (2 * math.sqrt(y.numel()))


def test_stagnation_round_to_nearest_loses_small_updates_sr_keeps_them() -> None:
    # 10,000 updates of 1e-4 onto bf16 weights of 1.0 (spacing 2**-7 there, 2**-6 above 2.0).
    n, steps, delta = 512, 10_000, 1e-4
    w_rtn = torch.ones(n, dtype=torch.bfloat16)
    w_sr = torch.ones(n, dtype=torch.bfloat16)
    for t in range(steps):
        w_rtn = (w_rtn.float() + delta).to(torch.bfloat16)
        w_sr = stochastic_round(w_sr.float() + delta, torch.bfloat16, seed=t)
    kept_rtn = (w_rtn.double().mean().item() - 1.0) / (steps * delta)
    kept_sr = (w_sr.double().mean().item() - 1.0) / (steps * delta)
    assert kept_rtn == 0.0
    assert abs(kept_sr - 1.0) <= 0.03, kept_sr


def test_generator_and_seed_reproducibility() -> None:
    x = torch.randn(1000) * 3
    a = stochastic_round(x, torch.bfloat16, seed=7)
    assert torch.equal(a, stochastic_round(x, torch.bfloat16, seed=7))
    assert not torch.equal(a, stochastic_round(x, torch.bfloat16, seed=8))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    a16 = stochastic_round(x, torch.float16, generator=g1)
    assert torch.equal(a16, stochastic_round(x, torch.float16, generator=g2))
    with pytest.raises(ValueError, match="dtype"):
        stochastic_round(x, torch.float32)
    with pytest.raises(ValueError, match="mode"):
        stochastic_round(x, torch.bfloat16, mode="up")
    with pytest.raises(ValueError, match="generator or seed"):
        stochastic_round(x, torch.bfloat16, seed=1, generator=g1)


@pytest.mark.parametrize("offset", [0, 12_345, 2**31 - 7, 2**32 - 9, 2**33 + 5, 2**62])
def test_random_bits_match_scalar_definition_beyond_int32(offset: int) -> None:
    key = 0xDEADBEEF
    got = (random_bits(key, offset, 16).to(torch.int64) & 0xFFFFFFFF).tolist()
    assert got == [random_bits_reference(key, offset + i) for i in range(16)]


def test_random_bits_are_uniform() -> None:
    n = 1 << 20
    r = random_bits(12345, 0, n).to(torch.int64) & 0xFFFFFFFF
    u = r.double() / 2**32
    assert abs(u.mean().item() - 0.5) <= 6 * math.sqrt(1 / 12 / n)
    # every bit is set half of the time (32 tests, 6 sigma each)
    for b in range(32):
        frac = ((r >> b) & 1).double().mean().item()
        assert abs(frac - 0.5) <= 6 * 0.5 / math.sqrt(n), b
    # neighbouring elements are uncorrelated
    c = torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()
    assert abs(c) <= 6 / math.sqrt(n)


# ----------------------------------------------------------------------------------------------
# The noise streams the optimizer uses: one 32-bit hash feeds two 16-bit roundings
# ----------------------------------------------------------------------------------------------
def _halves(key: int, n: int, offset: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    r = random_bits(key, offset, n).to(torch.int64) & 0xFFFFFFFF
    return (r >> 16).double(), (r & 0xFFFF).double()


def _corr(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.corrcoef(torch.stack([a, b]))[0, 1].item()


def _chi2(counts: torch.Tensor) -> float:
    expected = counts.sum().item() / counts.numel()
    return ((counts.double() - expected) ** 2 / expected).sum().item()


def test_sixteen_bit_halves_are_uniform_and_independent() -> None:
    # Bounds: chi-square with 255 degrees of freedom below 255 + 6 * sqrt(2 * 255) (mean + 6 sigma);
    # correlations of n pairs below 6 / sqrt(n).
    n = 1 << 20
    hi, lo = _halves(derive_key(3, 0, 7, 11, 1), n)
    bound = 255 + 6 * math.sqrt(2 * 255)
    for half in (hi, lo):
        assert _chi2(torch.bincount((half / 256).long(), minlength=256)) <= bound
        assert abs(_corr(half[:-1], half[1:])) <= 6 / math.sqrt(n)  # neighbouring elements
    joint = (hi / 4096).long() * 16 + (lo / 4096).long()  # 16 x 16 cells of the (exp_avg, exp_avg_sq) pair
    assert _chi2(torch.bincount(joint, minlength=256)) <= bound
    assert abs(_corr(hi, lo)) <= 6 / math.sqrt(n)


def test_streams_steps_and_tensors_are_uncorrelated() -> None:
    # The optimizer's keys: derive_key(seed, rank, tensor index, step, stream). The weight stream vs
    # the statistics stream, step t vs t + 1, and neighbouring tensors draw uncorrelated noise at the
    # same elements; and no stream is a shifted copy of another (the key enters the hash twice).
    n = 1 << 18
    base = (5, 0, 3, 100)
    ref_hi, ref_lo = _halves(derive_key(*base, 1), n)
    others = {
        "weight stream": derive_key(*base[:3], 100, 0),
        "next step": derive_key(*base[:3], 101, 1),
        "next tensor": derive_key(5, 0, 4, 100, 1),
        "other rank": derive_key(5, 1, 3, 100, 1),
    }
    for name, key in others.items():
        hi, lo = _halves(key, n)
        for a in (ref_hi, ref_lo):
            for b in (hi, lo):
                assert abs(_corr(a, b)) <= 6 / math.sqrt(n), name
    # shifted copies: with the additive first key word a, a plain lowbias32(j + a) would make stream 2
    # equal stream 1 shifted by a1 - a2; the second key word breaks that
    k1, k2 = derive_key(1), derive_key(2)
    (a1, _), (a2, _) = key_words(k1), key_words(k2)
    shift = (a2 - a1) % (1 << 32)
    r1 = random_bits(k1, shift, 4096).to(torch.int64) & 0xFFFFFFFF
    r2 = random_bits(k2, 0, 4096).to(torch.int64) & 0xFFFFFFFF
    assert int((r1 == r2).sum()) <= 2


def test_keyed_hash_matches_its_scalar_definition() -> None:
    for key in (0, 1, 0xFFFFFFFF, derive_key(9)):
        a, b = key_words(key)
        for lo in (0, 1, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF):
            x = torch.tensor([_as_i32(lo)], dtype=torch.int32)
            got = keyed_hash(x, a, b).item() & 0xFFFFFFFF
            assert got == _keyed_hash_int(lo, a, b) == random_bits_reference(key, lo)
