"""Float64 reference for the two half-precision neighbours of a value (shared by the SR tests)."""

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
