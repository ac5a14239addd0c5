"""Fused multi-tensor Triton kernel for the SRAdamW step.

One launch per *dtype group* (tensors sharing parameter / gradient / state dtypes, master and
state-scale presence, rounding modes and pointer alignment) updates every tensor of that group in a
single pass: it reads ``p, g, m, v`` (and the float32 master and the float16 state scales when
present), computes the AdamW update in float32 with the operations, operand order and fused
multiply-adds of :func:`optim.functional.sradamw_update_` as the PyTorch CPU kernels execute it, and
writes ``p, m, v`` back, rounding half-precision values stochastically with the counter-based noise
of :mod:`optim.rounding` (``random_bits_reference(key, j)`` for element ``j``), generated in the
kernel: no noise tensor is read or written.

Multi-tensor launch (the chosen design): per step the host builds one small int64 *metadata table*
per group, a row per tensor holding its data pointers (p, g, m, v, master, the four scale scalars),
its length, its first noise index, its three noise keys and its float32 hyperparameters
(bit-packed in the same row), and uploads it with one asynchronous copy. A cached *block table*
maps each program to ``(tensor row, block within the tensor)``. Every program loads its row (a few
scalars, cached), turns the addresses into typed pointers and streams one block of ``BLOCK``
elements with 64-bit offsets. Full blocks take an unmasked path so the loads and stores vectorise
(pointers that are 16-byte aligned are annotated as such; tensors with unaligned pointers form their
own group without the hint). Hundreds of small tensors therefore cost one launch per dtype group.

Bit-exactness: under ``TRITON_INTERPRET=1`` the kernel reproduces the PyTorch path on the CPU bit for
bit (tests/test_fused.py), with one exception: torch's float32 CPU ``sqrt`` goes through a vector
math library and is not always correctly rounded (on the development machine one result in five is
an ulp off), while the kernel uses the IEEE square root, so the tests take the reference's square
root from numpy. The arithmetic is written to be device independent: division and square root are
correctly rounded (``div_rn``/``sqrt_rn``), the fused multiply-adds are exactly the ones the PyTorch
CPU kernels use (``lerp`` and ``addcmul``; emulated exactly in float64 under the interpreter, which
has no FMA), and the compiler may not contract other products (``enable_fp_fusion=False``), so the
compiled kernel should match the same CPU reference; the ``gpu``-marked tests check that where a GPU
is present. The PyTorch path *on CUDA* is another matter: torch's CUDA ``addcmul`` and division by a
Python scalar order or contract operations differently, so it can differ from both by an ulp in a
float32 intermediate, which in rare elements moves a stochastic rounding decision to the other
neighbour.

Triton is imported only when this module is imported, which :mod:`optim` does lazily (the first
fused step). ``TRITON_INTERPRET=1`` must be set before that import: it is read when the kernels are
decorated. Interpreted kernels run on CPU tensors only (the metadata table holds raw host
addresses); compiled kernels run on CUDA tensors only.
"""

from __future__ import annotations

import math
import struct
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .rounding import _HI_SALT, _M32, _as_i32
from .rounding import _hash32 as _hash32_tensor

try:  # the only place Triton is imported
    import triton
    import triton.language as tl

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None
    tl = None
    _IMPORT_ERROR = exc

__all__ = [
    "TensorStep",
    "sradamw_fused_",
    "sradamw_update_fused_",
    "is_available",
    "interpreting",
    "unavailable_reason",
    "DEFAULT_BLOCK",
    "DEFAULT_NUM_WARPS",
]

#: Elements per program and warps per program on the GPU. 2048 elements over 16 warps is 4 per
#: thread: an 8-byte vector per 16-bit tensor and a 16-byte one per float32 tensor. Compiled for
#: sm_90, every dtype group then needs 53-64 registers (8 per thread would need ~155), so two
#: programs (32 warps) stay resident per SM to keep enough loads in flight.
DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 16

_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_ROUNDINGS = ("stochastic", "nearest")

# Metadata row (int64 words): 0-8 addresses of p, g, m, v, master, m scale old/new, v scale old/new;
# 9 numel; 10 noise index of element 0; 11-13 keys (weight, exp_avg, exp_avg_sq); 14 lerp weight
# below 0.5; 15-17 the keys' salted hashes (segment keys without the high-half term). Then the
# float32 hyperparameters, two per word: decay, lerp coefficient, beta2, 1 - beta2,
# sqrt(bias correction 2), eps, -step size, grad multiplier, clamp min, clamp max.
_NI = 18  # int64 words before the float part
_NF = 10  # float32 values
_ROW = _NI + _NF // 2
_ALIGN = 16  # bytes


def is_available() -> bool:
    """Whether Triton imported (the kernel can be built)."""
    return triton is not None


def unavailable_reason() -> str:
    """Why Triton is not usable ("" when it is)."""
    return "" if _IMPORT_ERROR is None else f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"


def interpreting() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_sradamw_kernel, InterpretedFunction)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _hash32(x):
        """lowbias32 on uint32 (wrap-around multiplication), as optim.rounding._hash32_int."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        x = x ^ (x >> 16)
        return x

    @triton.jit
    def _noise(lo, in_first, hi0, key, key_salted):
        """random_bits_reference(key, j) for the indices j = hi:lo of one block.

        ``key_salted`` is ``_hash32_int(key ^ salt)`` from the host, so the segment key of high half
        ``hi`` is ``key_salted ^ hi * golden``; a block spans at most two high halves, ``hi0`` and
        ``hi0 + 1`` (``in_first`` tells which).
        """
        seg = tl.where(in_first, key_salted ^ (hi0 * 0x9E3779B9), key_salted ^ ((hi0 + 1) * 0x9E3779B9))
        return _hash32(_hash32(lo ^ key) ^ seg)

    @triton.jit
    def _fma(a, b, c, EMULATE: tl.constexpr):
        """Single-rounding float32 a * b + c.

        Compiled: the hardware FMA. Interpreted (numpy has no FMA): the exact product and sum in
        float64 rounded to odd, then to float32, which equals the single rounding (53 >= 2 * 24 + 2).
        """
        if EMULATE:
            p = a.to(tl.float64) * b.to(tl.float64)  # exact
            cc = c.to(tl.float64)
            s = p + cc
            bb = s - p
            err = (p - (s - bb)) + (cc - bb)  # exact error of s (TwoSum)
            bits = s.to(tl.int64, bitcast=True)
            finite = tl.abs(s) < float("inf")
            fix = finite & (err != 0.0) & ((bits & 1) == 0)
            toward_larger = (err > 0.0) == (s > 0.0)  # move |s| up when err has the sign of s
            bits = tl.where(fix, tl.where(toward_larger, bits + 1, bits - 1), bits)
            return bits.to(tl.float64, bitcast=True).to(tl.float32)
        else:
            return tl.fma(a, b, c)

    @triton.jit
    def _typed(addr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        """An int64 address as a pointer; 16-byte alignment must be stated on the pointer itself for
        Triton to vectorise (a hint on the integer is lost in the cast)."""
        ptr = addr.to(tl.pointer_type(dtype))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _load_f32(addr, offs, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Loads float32 / bfloat16 (as bits) / float16 values at ``addr`` and widens to float32."""
        if KIND == 0:
            ptr = _typed(addr, tl.float32, ALIGNED) + offs
            if MASKED:
                x = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first")
            else:
                x = tl.load(ptr, eviction_policy="evict_first")
        elif KIND == 1:
            ptr = _typed(addr, tl.uint16, ALIGNED) + offs
            if MASKED:
                b = tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
            else:
                b = tl.load(ptr, eviction_policy="evict_first")
            x = (b.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            ptr = _typed(addr, tl.float16, ALIGNED) + offs
            if MASKED:
                x = tl.load(ptr, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
            else:
                x = tl.load(ptr, eviction_policy="evict_first").to(tl.float32)
        return x

    @triton.jit
    def _store(addr, offs, mask, val, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Stores ``val`` (its dtype decides the pointer type)."""
        ptr = _typed(addr, val.dtype, ALIGNED) + offs
        if MASKED:
            tl.store(ptr, val, mask=mask)
        else:
            tl.store(ptr, val)

    @triton.jit
    def _sr_bf16_bits(x, r):
        """optim.rounding._round_bf16 (proportional): bfloat16 bits of the rounded float32 x."""
        xb = x.to(tl.uint32, bitcast=True)
        mag = xb & 0x7FFFFFFF
        finite = mag < 0x7F800000
        low_part = tl.minimum(mag, 0x7F7F0000) & 0xFFFF
        up = (low_part + (r >> 16)) >= 0x10000
        rounded = (tl.minimum(mag, 0x7F7F0000) - low_part) + (up.to(tl.uint32) << 16)
        nonfinite = tl.where(mag > 0x7F800000, mag | 0x00400000, mag)  # NaN stays NaN
        out = tl.where(finite, rounded, nonfinite) | (xb & 0x80000000)
        return (out >> 16).to(tl.uint16)

    @triton.jit
    def _rne_bf16_bits(x):
        """Round-to-nearest-even float32 -> bfloat16 bits (torch's conversion; NaN -> 0x7FC0)."""
        xb = x.to(tl.uint32, bitcast=True)
        is_nan = (xb & 0x7FFFFFFF) > 0x7F800000
        r = (xb + (0x7FFF + ((xb >> 16) & 1))) >> 16
        return tl.where(is_nan, 0x7FC0, r).to(tl.uint16)

    @triton.jit
    def _sr_f16(x, r):
        """optim.rounding._round_f16 (proportional): x rounded to float16 with noise r."""
        a = tl.abs(x)
        finite = a < float("inf")
        a = tl.where(finite, tl.minimum(a, 65504.0), 0.0)
        e = ((a.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        e = tl.maximum(e, -14)  # subnormals share the smallest binade's spacing
        ulp = ((e + 117) << 23).to(tl.float32, bitcast=True)  # 2**(e - 10)
        inv_ulp = ((137 - e) << 23).to(tl.float32, bitcast=True)  # 2**(10 - e): a * inv_ulp == a / ulp
        q = a * inv_ulp
        fl = tl.floor(q)
        frac = q - fl
        up = (r >> 8).to(tl.float32) < frac * 16777216.0
        mag = (fl + up.to(tl.float32)) * ulp
        signed = (mag.to(tl.uint32, bitcast=True) | (x.to(tl.uint32, bitcast=True) & 0x80000000)).to(tl.float32, bitcast=True)
        return tl.where(finite, signed, x).to(tl.float16)

    @triton.jit
    def _store_rounded(addr, offs, mask, x, r, KIND: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Writes float32 x to storage of KIND: exact, stochastic (noise r) or round-to-nearest."""
        if KIND == 0:
            _store(addr, offs, mask, x, ALIGNED, MASKED)
        elif KIND == 1:
            if SR:
                _store(addr, offs, mask, _sr_bf16_bits(x, r), ALIGNED, MASKED)
            else:
                _store(addr, offs, mask, _rne_bf16_bits(x), ALIGNED, MASKED)
        else:
            if SR:
                _store(addr, offs, mask, _sr_f16(x, r), ALIGNED, MASKED)
            else:
                _store(addr, offs, mask, x.to(tl.float16), ALIGNED, MASKED)

    @triton.jit
    def _block(
        row,
        frow,
        gmul_ptr,
        start,
        offs,
        mask,
        P_KIND: tl.constexpr,
        G_KIND: tl.constexpr,
        M_KIND: tl.constexpr,
        V_KIND: tl.constexpr,
        MASTER: tl.constexpr,
        SCALE_M: tl.constexpr,
        SCALE_V: tl.constexpr,
        SR_P: tl.constexpr,
        SR_M: tl.constexpr,
        SR_V: tl.constexpr,
        GMUL: tl.constexpr,
        CLAMP: tl.constexpr,
        ALIGNED: tl.constexpr,
        EMULATE_FMA: tl.constexpr,
        MASKED: tl.constexpr,
    ):
        """The update of one block of one tensor (the body of optim.functional.sradamw_update_)."""
        p_addr = tl.load(row + 0)
        g_addr = tl.load(row + 1)
        m_addr = tl.load(row + 2)
        v_addr = tl.load(row + 3)
        w_addr = tl.load(row + 4)
        decay = tl.load(frow + 0)
        lerp_coeff = tl.load(frow + 1)
        beta2 = tl.load(frow + 2)
        one_minus_beta2 = tl.load(frow + 3)
        bc2_sqrt = tl.load(frow + 4)
        eps = tl.load(frow + 5)
        neg_step = tl.load(frow + 6)

        g = _load_f32(g_addr, offs, mask, G_KIND, ALIGNED, MASKED)
        if GMUL == 1:
            g = g * tl.load(frow + 7)
        elif GMUL == 2:
            g = g * tl.load(gmul_ptr)
        if MASTER:
            w = _load_f32(w_addr, offs, mask, 0, ALIGNED, MASKED)
        else:
            w = _load_f32(p_addr, offs, mask, P_KIND, ALIGNED, MASKED)
        m = _load_f32(m_addr, offs, mask, M_KIND, ALIGNED, MASKED)
        v = _load_f32(v_addr, offs, mask, V_KIND, ALIGNED, MASKED)
        if SCALE_M:
            m = m * tl.load(tl.load(row + 5).to(tl.pointer_type(tl.float32)))
        if SCALE_V:
            v = v * tl.load(tl.load(row + 7).to(tl.pointer_type(tl.float32)))

        w = w * decay
        # lerp(m, g, wt) as torch's kernels: fma(wt, g - m, m) for |wt| < 0.5, else fma(wt - 1, g - m, g)
        small = tl.load(row + 14) != 0
        m = _fma(lerp_coeff, g - m, tl.where(small, m, g), EMULATE_FMA)
        # v * beta2, then addcmul(g, g, value=1 - beta2) = fma(value * g, g, v)
        v = v * beta2
        v = _fma(one_minus_beta2 * g, g, v, EMULATE_FMA)
        denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
        # addcdiv(m, denom, value=-step_size) = w + (value * m) / denom
        w = w + tl.math.div_rn(neg_step * m, denom)
        if CLAMP:  # w.clamp_(min, max): NaN stays NaN
            lo_bound = tl.load(frow + 8)
            hi_bound = tl.load(frow + 9)
            w = tl.where(w < lo_bound, lo_bound, tl.where(w > hi_bound, hi_bound, w))

        if SCALE_M:
            m = tl.math.div_rn(m, tl.load(tl.load(row + 6).to(tl.pointer_type(tl.float32))))
        if SCALE_V:
            v = tl.math.div_rn(v, tl.load(tl.load(row + 8).to(tl.pointer_type(tl.float32))))

        # noise index j = first index of the tensor + element offset (64-bit), split hi:lo
        if SR_P or SR_M or SR_V:
            base = tl.load(row + 10)
            idx = base + offs
            lo = idx.to(tl.uint32)
            hi0 = ((base + start) >> 32).to(tl.uint32)
            in_first = (idx >> 32).to(tl.uint32) == hi0
        else:
            lo = offs.to(tl.uint32)
            in_first = lo == lo
            hi0 = 0
        if SR_M:
            r_m = _noise(lo, in_first, hi0, tl.load(row + 12).to(tl.uint32), tl.load(row + 16).to(tl.uint32))
        else:
            r_m = lo
        if SR_V:
            r_v = _noise(lo, in_first, hi0, tl.load(row + 13).to(tl.uint32), tl.load(row + 17).to(tl.uint32))
        else:
            r_v = lo
        _store_rounded(m_addr, offs, mask, m, r_m, M_KIND, SR_M, ALIGNED, MASKED)
        _store_rounded(v_addr, offs, mask, v, r_v, V_KIND, SR_V, ALIGNED, MASKED)
        if MASTER:
            _store(w_addr, offs, mask, w, ALIGNED, MASKED)
            _store_rounded(p_addr, offs, mask, w, lo, P_KIND, False, ALIGNED, MASKED)
        else:
            if SR_P:
                r_p = _noise(lo, in_first, hi0, tl.load(row + 11).to(tl.uint32), tl.load(row + 15).to(tl.uint32))
            else:
                r_p = lo
            _store_rounded(p_addr, offs, mask, w, r_p, P_KIND, SR_P, ALIGNED, MASKED)

    @triton.jit
    def _sradamw_kernel(
        table_ptr,
        ftable_ptr,
        blocks_ptr,
        skip_ptr,
        gmul_ptr,
        P_KIND: tl.constexpr,
        G_KIND: tl.constexpr,
        M_KIND: tl.constexpr,
        V_KIND: tl.constexpr,
        MASTER: tl.constexpr,
        SCALE_M: tl.constexpr,
        SCALE_V: tl.constexpr,
        SR_P: tl.constexpr,
        SR_M: tl.constexpr,
        SR_V: tl.constexpr,
        GMUL: tl.constexpr,
        CLAMP: tl.constexpr,
        HAS_SKIP: tl.constexpr,
        ALIGNED: tl.constexpr,
        EMULATE_FMA: tl.constexpr,
        ROW: tl.constexpr,
        NI: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        """One program = one block of one tensor of the group (see the block table)."""
        pid = tl.program_id(0)
        t = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
        b = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64)
        row = table_ptr + t * ROW
        frow = ftable_ptr + t * (2 * ROW) + 2 * NI
        n = tl.load(row + 9)
        start = b * BLOCK
        offs = start + tl.arange(0, BLOCK)  # int64 element offsets
        go = True
        if HAS_SKIP:
            go = tl.load(skip_ptr) == 0.0
        if go:
            if start + BLOCK <= n:
                _block(row, frow, gmul_ptr, start, offs, offs < n, P_KIND, G_KIND, M_KIND, V_KIND, MASTER, SCALE_M, SCALE_V,
                       SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, EMULATE_FMA, False)
            else:
                _block(row, frow, gmul_ptr, start, offs, offs < n, P_KIND, G_KIND, M_KIND, V_KIND, MASTER, SCALE_M, SCALE_V,
                       SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, EMULATE_FMA, True)


# ----------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------
@dataclass
class TensorStep:
    """Everything one tensor's update needs; the fields mirror :func:`optim.sradamw_update_`.

    Attributes:
        param: Parameter (float32, bfloat16 or float16); a non-contiguous one is updated through a
            contiguous copy.
        grad: Its gradient (float32, bfloat16 or float16), same number of elements.
        exp_avg: First moment storage, contiguous.
        exp_avg_sq: Second moment storage, contiguous.
        step: Step number after this update (1 for the first step).
        lr: Learning rate.
        beta1: First moment decay.
        beta2: Second moment decay.
        eps: Denominator term.
        weight_decay: Decoupled weight decay coefficient.
        keys: Noise keys of the (weight, exp_avg, exp_avg_sq) streams.
        master: Optional float32 master copy (contiguous); ``param`` then gets its nearest copy.
        exp_avg_scales: ``(old, new)`` 0-dim float32 scales of a float16 ``exp_avg`` on its device.
        exp_avg_sq_scales: Same for ``exp_avg_sq``.
        weight_rounding: ``"stochastic"`` or ``"nearest"`` for half weights without master.
        state_rounding: ``"stochastic"`` or ``"nearest"`` for half statistics.
        clamp: Optional ``(min, max)`` projection of the updated float32 weight (before rounding).
        index_offset: Noise index of element 0 (the PyTorch path uses 0; a ZeRO partition may pass
            its offset in the flat buffer so that the noise follows the global element index).
    """

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    keys: tuple[int, int, int]
    master: torch.Tensor | None = None
    exp_avg_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    exp_avg_sq_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    weight_rounding: str = "stochastic"
    state_rounding: str = "stochastic"
    clamp: tuple[float, float] | None = None
    index_offset: int = 0


def _check_ready(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError(f"the fused SRAdamW kernel needs Triton ({unavailable_reason()})")
    if interpreting():
        if device.type != "cpu":
            raise RuntimeError("under TRITON_INTERPRET=1 the fused SRAdamW kernel runs on CPU tensors only")
    elif device.type != "cuda":
        raise RuntimeError(
            f"the fused SRAdamW kernel needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 before "
            "optim.triton_kernel is imported to run it on CPU tensors"
        )


def _validate(s: TensorStep) -> None:
    """Raises ``ValueError`` on dtypes, sizes, devices, layouts or options the kernel cannot take."""
    p = s.param
    n, device = p.numel(), p.device
    for name, t in (("param", p), ("grad", s.grad), ("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq), ("master", s.master)):
        if t is None:
            continue
        if t.dtype not in _KIND or (name == "master" and t.dtype != torch.float32):
            raise ValueError(f"{name}: dtype {t.dtype} is not supported (float32, bfloat16 or float16; master float32)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, param on {device}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param {n}")
        if name in ("exp_avg", "exp_avg_sq", "master") and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, sc in (("exp_avg_scales", s.exp_avg_scales), ("exp_avg_sq_scales", s.exp_avg_sq_scales)):
        if sc is not None and (
            len(sc) != 2 or any(x.dtype != torch.float32 or x.numel() != 1 or x.device != device for x in sc)
        ):
            raise ValueError(f"{name} must be two 1-element float32 tensors on the param's device")
    if s.weight_rounding not in _ROUNDINGS or s.state_rounding not in _ROUNDINGS:
        bad = "weight_rounding" if s.weight_rounding not in _ROUNDINGS else "state_rounding"
        raise ValueError(f"{bad} must be 'stochastic' or 'nearest', got {getattr(s, bad)!r}")
    if s.clamp is not None and not (len(s.clamp) == 2 and float(s.clamp[0]) <= float(s.clamp[1])):
        raise ValueError(f"clamp must be None or a (min, max) pair with min <= max, got {s.clamp!r}")
    if s.index_offset < 0 or s.index_offset + n > 1 << 63:
        raise ValueError(f"index_offset {s.index_offset} out of range")


def _salted(keys: torch.Tensor) -> torch.Tensor:
    """The key-only half of ``optim.rounding._segment_key`` (the kernel adds the high-half term).

    Args:
        keys: int64 tensor of 32-bit keys.

    Returns:
        int64 tensor of ``_hash32_int(key ^ salt)``, in ``[0, 2**32)``.
    """
    as_i32 = (keys & _M32).to(torch.int32)  # int64 -> int32 keeps the low 32 bits
    return _hash32_tensor(as_i32 ^ _as_i32(_HI_SALT)).to(torch.int64) & _M32


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest even), as torch casts a Python scalar operand."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def _float_fields(s: TensorStep, grad_mul: float, weight: float) -> list[float]:
    """Float32 hyperparameters of one row, in the order and rounding of the PyTorch path.

    ``weight`` is the float32 lerp weight ``1 - beta1``; every other value is rounded to float32
    when the row is packed, as torch rounds a Python scalar operand of a float32 operation.
    """
    lerp_coeff = weight if abs(weight) < 0.5 else weight - 1.0  # exact in float32
    bias_correction1 = 1 - s.beta1**s.step
    return [
        1 - s.lr * s.weight_decay,
        lerp_coeff,
        s.beta2,
        1 - s.beta2,
        math.sqrt(1 - s.beta2**s.step),
        s.eps,
        -(s.lr / bias_correction1),
        grad_mul,
        float(s.clamp[0]) if s.clamp is not None else 0.0,
        float(s.clamp[1]) if s.clamp is not None else 0.0,
    ]


_BLOCK_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _block_table(numels: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """int32 ``[n_blocks, 2]``: (tensor row, block index) per program; cached by layout."""
    key = (numels, block, str(device))
    hit = _BLOCK_TABLES.get(key)
    if hit is not None:
        _BLOCK_TABLES.move_to_end(key)
        return hit
    counts = torch.tensor([max(1, -(-n // block)) if n else 0 for n in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(rows.numel(), dtype=torch.int64) - torch.repeat_interleave(starts, counts)
    table = torch.stack([rows, local], 1).to(torch.int32)
    table = table.to(device, non_blocking=False)
    _BLOCK_TABLES[key] = table
    while len(_BLOCK_TABLES) > 64:
        _BLOCK_TABLES.popitem(last=False)
    return table


def _launch(blocks: torch.Tensor, device: torch.device, *args, **kwargs) -> None:
    """Launches one program per row of ``blocks`` on ``device`` (Triton uses the current device)."""
    if device.type == "cuda":
        with torch.cuda.device(device):
            _sradamw_kernel[(blocks.shape[0],)](*args, **kwargs)
    else:
        _sradamw_kernel[(blocks.shape[0],)](*args, **kwargs)


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _group_key(s: TensorStep, grad: torch.Tensor, aligned: bool, gmul_mode: int) -> tuple:
    p_half = s.param.dtype != torch.float32
    master = s.master is not None
    sr_p = p_half and not master and s.weight_rounding == "stochastic"
    sr_m = s.exp_avg.dtype != torch.float32 and s.state_rounding == "stochastic"
    sr_v = s.exp_avg_sq.dtype != torch.float32 and s.state_rounding == "stochastic"
    return (
        _KIND[s.param.dtype],
        _KIND[grad.dtype],
        _KIND[s.exp_avg.dtype],
        _KIND[s.exp_avg_sq.dtype],
        master,
        s.exp_avg_scales is not None,
        s.exp_avg_sq_scales is not None,
        sr_p,
        sr_m,
        sr_v,
        gmul_mode,
        s.clamp is not None,
        aligned,
    )


def sradamw_fused_(
    steps: Sequence[TensorStep],
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    block_size: int | None = None,
    num_warps: int | None = None,
) -> int:
    """Applies one SRAdamW step to many tensors with one kernel launch per dtype group.

    Args:
        steps: The tensors and their per-tensor hyperparameters, all on one device.
        grad_mul: Multiplies every gradient first (an inverse loss scale): a Python float or a
            1-element tensor (read on the device, no synchronisation).
        found_inf: Optional 1-element tensor; when nonzero at run time the kernels change nothing
            (read on the device, no synchronisation).
        block_size: Elements per program (a power of two, default :data:`DEFAULT_BLOCK`).
        num_warps: Warps per program on the GPU (default :data:`DEFAULT_NUM_WARPS`).

    Returns:
        The number of kernel launches issued.

    Raises:
        RuntimeError: Triton missing, or tensors on a device the kernel cannot run on.
        ValueError: Unsupported dtypes, mismatched sizes or devices, bad rounding names.
    """
    steps = [s for s in steps if s.param.numel() > 0]
    if not steps:
        return 0
    device = steps[0].param.device
    _check_ready(device)
    block = DEFAULT_BLOCK if block_size is None else int(block_size)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block}")
    warps = DEFAULT_NUM_WARPS if num_warps is None else int(num_warps)

    gmul_mode, gmul_value, gmul_tensor = 0, 1.0, None
    if isinstance(grad_mul, torch.Tensor):
        if grad_mul.numel() != 1:
            raise ValueError("grad_mul must be a scalar or a 1-element tensor")
        gmul_mode, gmul_tensor = 2, grad_mul.detach().reshape(1).to(device=device, dtype=torch.float32)
    elif grad_mul is not None:
        gmul_mode, gmul_value = 1, float(grad_mul)
    skip = None
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
            raise ValueError("found_inf must be a 1-element tensor")
        skip = found_inf.detach().reshape(1).to(device=device, dtype=torch.float32)

    groups: dict[tuple, list[tuple[TensorStep, torch.Tensor, torch.Tensor]]] = {}
    for s in steps:
        if s.param.device != device:
            raise ValueError(f"all tensors must be on one device ({device}); got {s.param.device}")
        _validate(s)
        param = s.param if s.param.is_contiguous() else s.param.contiguous()
        grad = s.grad.detach()
        grad = grad if grad.is_contiguous() else grad.contiguous()
        ptrs = [param, grad, s.exp_avg, s.exp_avg_sq] + ([s.master] if s.master is not None else [])
        aligned = all(t.data_ptr() % _ALIGN == 0 for t in ptrs)
        groups.setdefault(_group_key(s, grad, aligned, gmul_mode), []).append((s, param, grad))

    launches = 0
    for key, items in groups.items():
        p_kind, g_kind, m_kind, v_kind, master, scale_m, scale_v, sr_p, sr_m, sr_v, _, clamp, aligned = key
        ints = []
        floats = []
        for s, param, grad in items:
            ms = s.exp_avg_scales or (None, None)
            vs = s.exp_avg_sq_scales or (None, None)
            weight = _f32(1 - s.beta1)
            ints.append(
                [
                    param.data_ptr(),
                    grad.data_ptr(),
                    s.exp_avg.data_ptr(),
                    s.exp_avg_sq.data_ptr(),
                    s.master.data_ptr() if s.master is not None else 0,
                    ms[0].data_ptr() if ms[0] is not None else 0,
                    ms[1].data_ptr() if ms[1] is not None else 0,
                    vs[0].data_ptr() if vs[0] is not None else 0,
                    vs[1].data_ptr() if vs[1] is not None else 0,
                    param.numel(),
                    int(s.index_offset),
                    int(s.keys[0]) & 0xFFFFFFFF,
                    int(s.keys[1]) & 0xFFFFFFFF,
                    int(s.keys[2]) & 0xFFFFFFFF,
                    int(abs(weight) < 0.5),
                    0,  # 15-17: salted keys, filled below for the whole group at once
                    0,
                    0,
                ]
            )
            floats.append(_float_fields(s, gmul_value, weight))
        int_part = torch.tensor(ints, dtype=torch.int64)
        int_part[:, 15:18] = _salted(int_part[:, 11:14])
        host = torch.cat([int_part, torch.tensor(floats, dtype=torch.float32).view(torch.int64)], dim=1).contiguous()
        table = _upload(host, device)
        blocks = _block_table(tuple(param.numel() for _, param, _ in items), block, device)
        _launch(
            blocks,
            device,
            table,
            table.view(torch.float32),
            blocks,
            skip if skip is not None else table,
            gmul_tensor if gmul_tensor is not None else table.view(torch.float32),
            P_KIND=p_kind,
            G_KIND=g_kind,
            M_KIND=m_kind,
            V_KIND=v_kind,
            MASTER=master,
            SCALE_M=scale_m,
            SCALE_V=scale_v,
            SR_P=sr_p,
            SR_M=sr_m,
            SR_V=sr_v,
            GMUL=gmul_mode,
            CLAMP=clamp,
            HAS_SKIP=skip is not None,
            ALIGNED=aligned,
            EMULATE_FMA=interpreting(),
            ROW=_ROW,
            NI=_NI,
            BLOCK=block,
            num_warps=warps,
            enable_fp_fusion=False,
        )
        launches += 1
        for s, param, _ in items:
            if param is not s.param:
                s.param.copy_(param)
    return launches


def sradamw_update_fused_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    keys: tuple[int, int, int],
    master: torch.Tensor | None = None,
    exp_avg_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    exp_avg_sq_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    grad_mul: torch.Tensor | float | None = None,
    weight_rounding: str = "stochastic",
    state_rounding: str = "stochastic",
    clamp: tuple[float, float] | None = None,
    found_inf: torch.Tensor | None = None,
    index_offset: int = 0,
    block_size: int | None = None,
) -> None:
    """The fused kernel on one tensor, with :func:`optim.sradamw_update_`'s signature.

    Extra arguments: ``found_inf`` (a device flag: nonzero means do nothing), ``index_offset`` (see
    :class:`TensorStep`) and ``block_size``.
    """
    sradamw_fused_(
        [
            TensorStep(
                param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
                weight_decay=weight_decay, keys=keys, master=master, exp_avg_scales=exp_avg_scales,
                exp_avg_sq_scales=exp_avg_sq_scales, weight_rounding=weight_rounding,
                state_rounding=state_rounding, clamp=clamp, index_offset=index_offset,
            )
        ],
        grad_mul=grad_mul,
        found_inf=found_inf,
        block_size=block_size,
    )
