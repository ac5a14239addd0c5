"""An exact float32 master in two extra bytes: the bfloat16 weight is its high half.

A float32 value ``w`` (bit pattern ``W``) is stored as

* ``hi``: the bfloat16 ``(|W| + 0x8000) >> 16`` with ``W``'s sign: ``w`` rounded to the nearest
  bfloat16, ties away from zero (round-to-nearest-even would need a 17th bit to undo: at a tie both
  an even high half rounded down and an odd one rounded up give the same even result);
* ``lo``: the low 16 bits of ``W`` as an int16.

The high half of ``|W|`` is ``hi`` when ``lo``'s top bit is clear and ``hi - 1`` when it is set (the
half-up rounding carried exactly then), so ``W == ((|hi| - carry) << 16 | lo) | sign``: every float32
bit pattern comes back, subnormals, signed zeros, infinities and the exponent boundaries included
(a carry out of the significand into the exponent is undone the same way). Two exceptions, both
outside training's range: a NaN master gives a NaN weight and comes back as a NaN (its payload may
not), and finite values from 0x7F7F8000 on (|w| >= 3.3961e38) give an infinite weight, although
their master still comes back exactly.

So a mastered bfloat16 parameter costs 2 bytes of weight + 2 bytes of ``lo`` instead of 2 + 4, and
the optimizer's update sees the same float32 master bit for bit (``SRAdamW`` with
``master_weights=True`` on bfloat16 parameters; ``optim.functional.update_block_`` takes an int16
``master`` as this form). The fused kernel (``optim._sradamw_jit``) computes the same bits.
"""

from __future__ import annotations

import torch

from .rounding import _as_i32

__all__ = ["join_master", "split_master", "split_bits"]


def join_master(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The float32 master of a bfloat16 high half and its low half (same shapes).

    Args:
        hi: bfloat16 tensor (the parameter).
        lo: int16 tensor (the optimizer state), or int32 holding the same values.

    Returns:
        float32 tensor ``w`` with ``split_master(w) == (hi, lo)`` bit for bit (up to NaN payloads).
    """
    # hi's bits through the exact bfloat16 -> float32 conversion (a shift), not a 16-bit view: torch's
    # CPU compiler does not vectorise 16-bit integers
    h = hi.float().view(torch.int32)
    low = lo.to(torch.int32) & 0xFFFF
    carry = low >> 15  # the half-up rounding carried into the high half
    return ((h & _as_i32(0x80000000)) | ((h & 0x7FFF0000) - (carry << 16)) | low).view(torch.float32)


def split_bits(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of a float32 tensor with ``lo`` as int32 values in int16's range (what
    :func:`split_master` narrows; the update stores it into the int16 state)."""
    wb = w.view(torch.int32)
    mag = wb & 0x7FFFFFFF
    # |W| + 0x8000 stays below 2**31 for every non-NaN pattern; a NaN keeps a quiet NaN high half
    hi_mag = torch.where(mag > 0x7F800000, 0x7FC00000, (mag + 0x8000) & _as_i32(0xFFFF0000))
    hi = (hi_mag | (wb & _as_i32(0x80000000))).view(torch.float32).to(torch.bfloat16)  # exact: low half 0
    return hi, ((wb & 0xFFFF) ^ 0x8000) - 0x8000  # the low 16 bits, sign-extended


def split_master(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hi, lo)`` of a float32 tensor: the bfloat16 weight (nearest, ties away from zero) and the
    int16 low half of the bit pattern (see the module docstring)."""
    hi, lo = split_bits(w)
    return hi, lo.to(torch.int16)
