"""Stochastic rounding from float32 to bfloat16 and float16, and its counter-based noise.

The noise is a pure function of ``(key, element index)``: a 32-bit key is derived on the host from
the seed, the data-parallel rank, the tensor's position in the optimizer, the step and the stream
(weight or statistics), and every element hashes its global index with that key (one lowbias32 hash
with the key injected twice, see :func:`random_bits_reference`). A rounding takes its noise from 16 of
the 32 bits (float16 from the top 13 of them), so one hash serves two roundings (the optimizer's two statistics). The same definition is used
by the PyTorch paths here and by the fused GPU kernel, so all draw the same numbers, a run is
reproducible from ``(seed, step)`` alone, and a ZeRO partition of any length (beyond 2**31 elements
included) is processed chunk by chunk without any stored generator state.

Rounding rules (both target dtypes):

* ``mode="proportional"`` rounds ``x`` to the neighbour above ``|x|`` (in magnitude) with probability
  ``(|x| - lo) / (hi - lo)``, so ``E[result] == x``. The probability is quantised to the dropped bits:
  bfloat16 draws 16 bits of noise for its 16 dropped bits, float16 13 bits for its 13 (exact in the
  normal range); in float16's subnormal range (below 2**-14, spacing 2**-24) the distance is first
  rounded to the nearest 2**-13 of the spacing (one float32 addition, see :func:`_round_f16`), a bias
  of at most 2**-38 in absolute value.
* ``mode="equal"`` picks either neighbour with probability 1/2 (unbiased only on average over x;
  float16 values below 2**-38 are rounded to zero).
* Representable values are returned exactly; ``±0``, ``±inf`` and NaN are preserved; finite values
  beyond the largest finite value of the target saturate to ``±max`` instead of becoming infinite;
  float16's subnormal range (spacing 2**-24 below 2**-14) is rounded with its true spacing.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["stochastic_round", "random_bits", "random_bits_reference", "derive_key", "round_with_bits"]

Mode = Literal["proportional", "equal"]

_M32 = 0xFFFFFFFF
_H1 = 0x7FEB352D  # lowbias32 multipliers (Chris Wellons' hash-prospector)
_H2 = 0x846CA68B
_GOLDEN = 0x9E3779B9
_A_SALT = 0x68BC21EB  # key word salts (see key_words)
_B_SALT = 0x2C1B3C6D
# The largest finite values (bfloat16's as float32 bits) are literals inside the rounding functions:
# torch.compile lifts a float module global into a graph input (a tensor it keeps alive), a literal
# stays a constant.

# ----------------------------------------------------------------------------------------------
# Counter-based random bits
# ----------------------------------------------------------------------------------------------
def _hash32_int(x: int) -> int:
    """lowbias32 on a Python int (host-side key derivation)."""
    x &= _M32
    x ^= x >> 16
    x = (x * _H1) & _M32
    x ^= x >> 15
    x = (x * _H2) & _M32
    x ^= x >> 16
    return x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of an int32 tensor holding uint32 bit patterns."""
    return (x >> k) & ((1 << (32 - k)) - 1)


def _as_i32(c: int) -> int:
    """A uint32 constant as the int32 with the same bits."""
    c &= _M32
    return c - (1 << 32) if c >= 1 << 31 else c


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor of uint32 bit patterns (multiplication wraps modulo 2**32)."""
    x = x ^ _srl(x, 16)
    x = x * _as_i32(_H1)
    x = x ^ _srl(x, 15)
    x = x * _as_i32(_H2)
    return x ^ _srl(x, 16)


def derive_key(*parts: int) -> int:
    """Folds integers (seed, rank, tensor index, step, stream...) into one 32-bit key.

    Each part may be any non-negative Python int; parts wider than 32 bits are folded 32 bits at a
    time, so 64-bit seeds and steps are distinct keys.

    Args:
        *parts: The integers to fold, in order.

    Returns:
        A key in ``[0, 2**32)``.
    """
    h = 0x2545F491
    for part in parts:
        part = int(part)
        if part < 0:
            raise ValueError(f"key parts must be non-negative, got {part}")
        while True:
            h = _hash32_int((h ^ (part & _M32)) + _GOLDEN)
            part >>= 32
            if part == 0:
                break
    return h


def key_words(key: int) -> tuple[int, int]:
    """The two 32-bit words a key enters the element hash through: ``(a, b)``.

    ``a = h(key ^ salt_a)`` is added to the low half of the element index (the high half is xored
    into it as ``hi * golden``), ``b = h(key ^ salt_b)`` in the middle of the hash. Computed once per key
    on the host; the kernels and the PyTorch paths receive these words, not the key.
    """
    key &= _M32
    return _hash32_int(key ^ _A_SALT), _hash32_int(key ^ _B_SALT)


def _hash32_i64(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int64 tensor of values in [0, 2**32) (products wrap modulo 2**64; the low 32 bits
    are kept, so the result equals :func:`_hash32_int` element by element)."""
    x = x ^ (x >> 16)
    x = (x * _H1) & _M32
    x = x ^ (x >> 15)
    x = (x * _H2) & _M32
    return x ^ (x >> 16)


def fold_key(h: torch.Tensor, part: torch.Tensor | int) -> torch.Tensor:
    """One step of :func:`derive_key` for many keys at once: ``derive_key(*parts, part)`` from the int64
    tensor ``h = derive_key(*parts)``, for parts in ``[0, 2**32)`` (a host-side helper: one tensor
    operation per step for all tensors instead of a Python hash per tensor)."""
    return _hash32_i64(((h ^ part) + _GOLDEN) & _M32)


def key_words_tensor(keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`key_words` of an int64 tensor of keys, element by element."""
    keys = keys & _M32
    return _hash32_i64(keys ^ _A_SALT), _hash32_i64(keys ^ _B_SALT)


def _segment_word(a: int, hi: int) -> int:
    """The first key word for the elements whose index has high 32 bits ``hi``."""
    return a ^ ((hi * _GOLDEN) & _M32)


def _keyed_hash_int(x: int, a: int, b: int) -> int:
    """The element hash on Python ints: lowbias32 of ``x + a`` (mod 2**32) with ``b`` xored in after its
    first multiplication (two key injections: streams of different keys are not shifts of each other;
    the addition lets a kernel fold ``a`` into the block's first index)."""
    x = (x + a) & _M32
    x ^= x >> 16
    x = (x * _H1) & _M32
    x ^= (x >> 15) ^ b
    x = (x * _H2) & _M32
    x ^= x >> 16
    return x


def random_bits_reference(key: int, index: int) -> int:
    """The noise of one element, in plain Python: the definition :func:`random_bits` vectorises.

    ``r = H(lo32(index) + (a ^ (hi32(index) * golden)), b)`` with ``(a, b) = key_words(key)`` and ``H``
    lowbias32 with ``b`` xored in after the first multiplication (see :func:`_keyed_hash_int`).
    """
    a, b = key_words(key)
    return _keyed_hash_int(index & _M32, _segment_word(a, index >> 32), b)


def keyed_hash(lo: torch.Tensor, a: int | torch.Tensor, b: int | torch.Tensor) -> torch.Tensor:
    """:func:`_keyed_hash_int` on an int32 tensor of uint32 bit patterns; ``a``/``b`` as int32 values
    (Python ints or int32 tensors that broadcast)."""
    if isinstance(a, int):
        a = _as_i32(a)
    if isinstance(b, int):
        b = _as_i32(b)
    x = lo + a  # wraps modulo 2**32
    x = x ^ _srl(x, 16)
    x = x * _as_i32(_H1)
    x = x ^ _srl(x, 15) ^ b
    x = x * _as_i32(_H2)
    return x ^ _srl(x, 16)


def _index_lo(lo0: int, n: int, device: torch.device | str) -> torch.Tensor:
    """int32 tensor of the uint32 patterns ``lo0 .. lo0 + n - 1`` (all below 2**32)."""
    if lo0 + n <= 1 << 31:
        return torch.arange(lo0, lo0 + n, dtype=torch.int32, device=device)
    # indices past 2**31: shift into int32 range, then flip the top bit back (exact)
    lo = torch.arange(lo0 - (1 << 31), lo0 + n - (1 << 31), dtype=torch.int64, device=device)
    return lo.to(torch.int32) ^ _as_i32(1 << 31)


def random_bits(key: int, offset: int, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Uniform 32-bit random integers for elements ``offset .. offset + n - 1`` under ``key``.

    Element ``j`` gets :func:`random_bits_reference` ``(key, j)``. Indices are 64-bit (any offset
    below 2**63 is safe); the high half of the index enters through the first key word, so a range
    crossing a multiple of 2**32 is split there.

    The optimizer draws one such 32-bit value per element for its two half-precision statistics
    (the high 16 bits round ``exp_avg``, the low 16 bits ``exp_avg_sq``) and one for the weight; a
    rounding uses 16 bits (:func:`round_with_bits` reads the high half of what it is given).

    Args:
        key: A 32-bit key from :func:`derive_key`.
        offset: Global index of the first element.
        n: Number of elements.
        device: Device of the result.

    Returns:
        An int32 tensor of ``n`` uint32 bit patterns (use :func:`_srl`-style logical shifts).
    """
    a, b = key_words(key)
    pieces = []
    pos = 0
    while pos < n or not pieces:
        j = offset + pos
        hi, lo0 = j >> 32, j & _M32
        seg = min(n - pos, (1 << 32) - lo0)
        pieces.append(keyed_hash(_index_lo(lo0, seg, device), _segment_word(a, hi), b))
        pos += seg
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# ----------------------------------------------------------------------------------------------
# Rounding with given bits
# ----------------------------------------------------------------------------------------------
def _check_target(dtype: torch.dtype) -> None:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")


def _check_mode(mode: str) -> None:
    if mode not in ("proportional", "equal"):
        raise ValueError(f"mode must be 'proportional' or 'equal', got {mode!r}")


def _round_bf16(x: torch.Tensor, bits: torch.Tensor, mode: Mode) -> torch.Tensor:
    xb = x.view(torch.int32)
    mag = xb & 0x7FFFFFFF
    finite = mag < 0x7F800000
    sat = mag.clamp(max=0x7F7F0000)  # finite overflow saturates to the largest bfloat16
    if mode == "proportional":
        # adding the noise to the 16 bits that are dropped carries into the kept ones exactly when
        # low + r >= 2**16 (the same decision as the kernel; < 2**31, so the sign bit stays free)
        rounded = sat + _srl(bits, 16)
    else:
        low = sat & 0xFFFF
        rounded = (sat - low) + (((low != 0) & (bits < 0)).to(torch.int32) << 16)  # top bit
    special = ((mag > 0x7F800000).to(torch.int32) << 22) | 0x7F800000  # NaN -> the quiet NaN, inf stays
    out = (torch.where(finite, rounded, special) | (xb & _as_i32(0x80000000))) & _as_i32(0xFFFF0000)
    return out.view(torch.float32).to(torch.bfloat16)  # exact: the low half is zero


def _round_f16(x: torch.Tensor, bits: torch.Tensor, mode: Mode) -> torch.Tensor:
    # Below float16's normal range (2**-14) the spacing is 2**-24 whatever the exponent: adding 2**-14
    # (one float32 addition, round to nearest) moves such a value into the binade [2**-14, 2**-13),
    # whose float16 spacing is the same 2**-24, and subtracting it after the rounding is exact. Every
    # value then drops exactly the 13 low bits of its float32 significand. (Written with two bit casts
    # only: on the CPU each one costs Inductor's loop a pass through memory.)
    a = x.abs().clamp(max=65504.0)  # finite overflow saturates to the largest float16
    offset = torch.where(a < 2.0**-14, 2.0**-14, 0.0)
    shifted = (a + offset).view(torch.int32)
    if mode == "proportional":
        # 13 bits of noise added to the 13 dropped bits carry into the kept ones exactly when
        # low + r >= 2**13 (the kernel's decision)
        rounded = (shifted + _srl(bits, 19)) & ~0x1FFF
    else:
        low = shifted & 0x1FFF
        rounded = (shifted - low) + (((low != 0) & (bits < 0)).to(torch.int32) << 13)  # top bit
    mag = rounded.view(torch.float32) - offset  # exact: both are multiples of the spacing
    return torch.where(torch.isfinite(x), torch.copysign(mag, x), x).to(torch.float16)  # exact; inf/NaN stay


def round_with_bits(
    x: torch.Tensor, dtype: torch.dtype, bits: torch.Tensor, mode: Mode = "proportional"
) -> torch.Tensor:
    """Rounds float32 ``x`` to ``dtype`` with the given uniform 32-bit integers.

    This is the single definition of the rounding decision; the fused kernel reproduces it.

    Args:
        x: A float32 tensor (any shape, contiguous).
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        bits: int32 tensor of ``x.numel()`` uint32 bit patterns (as from :func:`random_bits`).
        mode: ``"proportional"`` or ``"equal"``.

    Returns:
        A tensor of ``dtype`` with ``x``'s shape.
    """
    _check_target(dtype)
    _check_mode(mode)
    if x.dtype != torch.float32:
        raise ValueError(f"x must be float32, got {x.dtype}")
    flat = x.reshape(-1)
    bits = bits.reshape(-1)
    out = _round_bf16(flat, bits, mode) if dtype == torch.bfloat16 else _round_f16(flat, bits, mode)
    return out.view(x.shape)


def stochastic_round(
    x: torch.Tensor,
    dtype: torch.dtype,
    *,
    mode: Mode = "proportional",
    generator: torch.Generator | None = None,
    seed: int | None = None,
) -> torch.Tensor:
    """Stochastically rounds a float32 tensor to bfloat16 or float16.

    Args:
        x: Values to round; cast to float32 first if another floating dtype.
        dtype: ``torch.bfloat16`` or ``torch.float16``.
        mode: ``"proportional"`` (round up with probability equal to the distance from the lower
            neighbour over the spacing, unbiased) or ``"equal"`` (each neighbour with probability 1/2).
        generator: Draw the noise from this ``torch.Generator`` (its state advances).
        seed: Draw counter-based noise keyed by this seed instead (same seed, same result, the
            generator state is untouched). Mutually exclusive with ``generator``; with neither, the
            global torch generator is used.

    Returns:
        The rounded tensor of ``dtype``, same shape and device as ``x``.

    Raises:
        ValueError: On an unsupported ``dtype`` or ``mode``, or both ``generator`` and ``seed``.
    """
    _check_target(dtype)
    _check_mode(mode)
    if generator is not None and seed is not None:
        raise ValueError("pass either generator or seed, not both")
    if not x.is_floating_point():
        raise ValueError(f"x must be a floating-point tensor, got {x.dtype}")
    x32 = x.to(torch.float32).contiguous()
    n = x32.numel()
    if seed is not None:
        bits = random_bits(derive_key(seed), 0, n, device=x32.device)
    else:
        bits = torch.randint(-(1 << 31), 1 << 31, (n,), dtype=torch.int32, device=x32.device, generator=generator)
    return round_with_bits(x32, dtype, bits, mode)
