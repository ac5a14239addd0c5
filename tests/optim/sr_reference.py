"""References shared by the optim tests: the float64 half-precision neighbours of a value, the
statistical check of stochastic rounding against them, and bit-for-bit tensor comparison."""

from __future__ import annotations

import math

import torch

FORMATS = {  # mantissa bits incl. the implicit one, smallest normal exponent, largest finite
    torch.bfloat16: (8, -126, float(torch.finfo(torch.bfloat16).max)),
    torch.float16: (11, -14, 65504.0),
}


def neighbours(x: float, dtype: torch.dtype) -> tuple[float, float]:
    """(lo, hi) around a finite x with |lo| <= |x| <= |hi|, from float64 arithmetic, signed as x.

    Values beyond the largest finite value are treated as that value (saturation).
    """
    bits, emin, fmax = FORMATS[dtype]
    a = min(abs(x), fmax)
    if a == 0.0:
        return (x, x)
    e = max(math.frexp(a)[1] - 1, emin)
    ulp = math.ldexp(1.0, e - bits + 1)
    lo = math.floor(a / ulp) * ulp
    hi = lo if lo == a else lo + ulp
    s = math.copysign(1.0, x)
    return (s * lo, s * hi)


def assert_neighbours_with_unbiased_mean(draws: torch.Tensor, targets: torch.Tensor, dtype: torch.dtype) -> None:
    """Every draw ``draws[:, i]`` is one of the two ``dtype`` neighbours of ``targets[i]`` and their mean
    is within 6 standard deviations of it: a mean of N proportional draws between neighbours lo < hi
    has standard deviation ``(hi - lo) sqrt(p (1 - p) / N) <= (hi - lo) / (2 sqrt(N))``."""
    draws = draws.double()
    for i, xi in enumerate(targets.tolist()):
        lo, hi = neighbours(xi, dtype)
        col = draws[:, i]
        assert bool(((col == lo) | (col == hi)).all()), (xi, lo, hi, col.unique())
        bound = 6 * abs(hi - lo) / (2 * math.sqrt(draws.shape[0]))
        assert abs(col.mean().item() - xi) <= bound + 1e-300, (xi, col.mean().item(), bound)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Equal dtypes, shapes and bit patterns; NaNs must match in position (their payloads may differ)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), what
    int_type = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    ia, ib = a.contiguous().view(int_type)[~nan_a], b.contiguous().view(int_type)[~nan_b]
    bad = (ia != ib).nonzero().flatten()
    examples = f"e.g. {a[~nan_a][bad[:3]]} vs {b[~nan_b][bad[:3]]}"
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {ia.numel()} differ, {examples}"


def state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The tensors of ``p``'s optimizer state (moments, master, float16 bounds) and its step."""
    return {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor)}


def assert_same_optimizer_bits(ref: torch.optim.Optimizer, ref_params: list[torch.Tensor],
                               other: torch.optim.Optimizer, params: list[torch.Tensor], what: str = "") -> None:
    """Parameters and every state tensor (step counters included) of two optimizers are bit-identical."""
    for i, (p, q) in enumerate(zip(ref_params, params)):
        assert_same_bits(p, q, f"{what} tensor {i} ({p.dtype}) param")
        mine, theirs = state_tensors(ref, p), state_tensors(other, q)
        assert mine.keys() == theirs.keys(), (what, i, mine.keys(), theirs.keys())
        for name, value in mine.items():
            assert_same_bits(value, theirs[name], f"{what} tensor {i} ({p.dtype}) {name}")


def defer_skips(opt: torch.optim.Optimizer, defer: bool = True) -> torch.optim.Optimizer:
    """Makes this SRAdamW treat every skip flag as a device flag, even in CPU memory: its steps are
    issued with masked stores and their bookkeeping settled later, as for CUDA tensors (or, with
    ``defer=False``, read every flag at once, even on a GPU)."""
    opt._defers = lambda flag: defer
    return opt
