"""Device code of the fused SRAdamW kernel, and the metadata row layout it shares with the host.

The host side (dtype groups, metadata table, launch) and the design notes are in
:mod:`optim.triton_kernel`. Each tensor of a launch has one *metadata row* of int64 words: the
:class:`Word` part (addresses, length, noise index and keys), then the :class:`Slot` part (float32
hyperparameters, two per word). Both are defined here once, by name: the host fills rows by these
names and the kernel reads them through constexpr globals bound from the same enums.

Triton comes from :func:`optim._triton.load` (the one availability policy); without it the layout
is still defined and the kernel names are ``None``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from ._triton import load

triton, tl = load()

__all__ = ["Word", "Slot", "Kind", "INT_WORDS", "ROW_WORDS", "sradamw_kernel", "fma"]


class Word(IntEnum):
    """The int64 words of a metadata row."""

    P = 0  # address of the parameter
    G = 1  # address of the gradient
    M = 2  # address of exp_avg
    V = 3  # address of exp_avg_sq
    MASTER = 4  # address of the float32 master (0: none)
    M_SCALE_OLD = 5  # addresses of exp_avg's (old, new) 0-dim float32 state scales (0: none)
    M_SCALE_NEW = 6
    V_SCALE_OLD = 7  # the same for exp_avg_sq
    V_SCALE_NEW = 8
    NUMEL = 9  # number of elements
    NOISE_BASE = 10  # noise index of element 0
    KEY_P = 11  # noise keys of the weight, exp_avg and exp_avg_sq streams, in [0, 2**32)
    KEY_M = 12
    KEY_V = 13
    LERP_SMALL = 14  # 1 when the lerp weight 1 - beta1 is below 0.5 (torch's lerp picks its formula by it)
    SALT_P = 15  # _hash32_int(key ^ salt) of each key: the key-only half of optim.rounding._segment_key
    SALT_M = 16
    SALT_V = 17


class Slot(IntEnum):
    """The float32 hyperparameters after the :class:`Word` part, rounded as the PyTorch path rounds them."""

    DECAY = 0  # 1 - lr * weight_decay
    LERP = 1  # lerp coefficient: 1 - beta1, or (1 - beta1) - 1 when LERP_SMALL is 0
    BETA2 = 2
    ONE_MINUS_BETA2 = 3
    BC2_SQRT = 4  # sqrt(1 - beta2**step)
    EPS = 5
    NEG_STEP = 6  # -lr / (1 - beta1**step)
    GRAD_MUL = 7  # a Python grad_mul (GMUL == 1)
    CLAMP_MIN = 8
    CLAMP_MAX = 9


INT_WORDS = len(Word)
ROW_WORDS = INT_WORDS + (len(Slot) + 1) // 2  # the float part padded to whole words


class Kind(IntEnum):
    """Storage dtype codes of the kernel's ``*_KIND`` constexpr arguments."""

    F32 = 0
    BF16 = 1
    F16 = 2


sradamw_kernel: Any = None  # the @triton.jit kernel; None without Triton
fma: Any = None  # its single-rounding a * b + c helper (@triton.jit), for tests

if triton is not None:

    def _constexprs(*members: IntEnum) -> tuple:
        return tuple(tl.constexpr(int(m)) for m in members)

    # The layout as constexpr globals: the only globals a compiled kernel may read, and Triton hashes
    # their values into its cache key, so a changed layout recompiles.
    _P, _G, _M, _V, _MASTER = _constexprs(Word.P, Word.G, Word.M, Word.V, Word.MASTER)
    _M_SCALE_OLD, _M_SCALE_NEW = _constexprs(Word.M_SCALE_OLD, Word.M_SCALE_NEW)
    _V_SCALE_OLD, _V_SCALE_NEW = _constexprs(Word.V_SCALE_OLD, Word.V_SCALE_NEW)
    _NUMEL, _NOISE_BASE, _LERP_SMALL = _constexprs(Word.NUMEL, Word.NOISE_BASE, Word.LERP_SMALL)
    _KEY_P, _KEY_M, _KEY_V = _constexprs(Word.KEY_P, Word.KEY_M, Word.KEY_V)
    _SALT_P, _SALT_M, _SALT_V = _constexprs(Word.SALT_P, Word.SALT_M, Word.SALT_V)
    _DECAY, _LERP, _BETA2, _ONE_MINUS_BETA2 = _constexprs(Slot.DECAY, Slot.LERP, Slot.BETA2, Slot.ONE_MINUS_BETA2)
    _BC2_SQRT, _EPS, _NEG_STEP, _GRAD_MUL = _constexprs(Slot.BC2_SQRT, Slot.EPS, Slot.NEG_STEP, Slot.GRAD_MUL)
    _CLAMP_MIN, _CLAMP_MAX = _constexprs(Slot.CLAMP_MIN, Slot.CLAMP_MAX)
    _F32, _BF16 = _constexprs(Kind.F32, Kind.BF16)
    _INT_WORDS, _ROW_WORDS = tl.constexpr(INT_WORDS), tl.constexpr(ROW_WORDS)

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
    def _noise(row, KEY: tl.constexpr, SALT: tl.constexpr, lo, in_first, hi0):
        """random_bits_reference(key, j) for the indices j = hi:lo of one block, key in word KEY.

        Word ``SALT`` holds ``_hash32_int(key ^ salt)``, so the segment key of high half ``hi`` is
        ``salted ^ hi * golden``; a block spans at most two high halves, ``hi0`` and ``hi0 + 1``
        (``in_first`` tells which).
        """
        key = tl.load(row + KEY).to(tl.uint32)
        salted = tl.load(row + SALT).to(tl.uint32)
        seg = tl.where(in_first, salted ^ (hi0 * 0x9E3779B9), salted ^ ((hi0 + 1) * 0x9E3779B9))
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

    fma = _fma

    @triton.jit
    def _typed(addr, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        """An int64 address as a pointer; 16-byte alignment must be stated on the pointer itself for
        Triton to vectorise (a hint on the integer is lost in the cast)."""
        ptr = addr.to(tl.pointer_type(dtype))
        if ALIGNED:
            ptr = tl.multiple_of(ptr, 16)
        return ptr

    @triton.jit
    def _scalar(row, WORD: tl.constexpr):
        """The float32 scalar whose address is in word WORD (a float16 state scale)."""
        return tl.load(tl.load(row + WORD).to(tl.pointer_type(tl.float32)))

    @triton.jit
    def _load(ptr, mask, MASKED: tl.constexpr):
        """Streams one block in (masked in the partial block); masked-off lanes are never stored."""
        if MASKED:
            x = tl.load(ptr, mask=mask, other=0, eviction_policy="evict_first")
        else:
            x = tl.load(ptr, eviction_policy="evict_first")
        return x

    @triton.jit
    def _load_f32(addr, offs, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Loads float32 / bfloat16 (as bits) / float16 values at ``addr`` and widens to float32."""
        if KIND == _F32:
            x = _load(_typed(addr, tl.float32, ALIGNED) + offs, mask, MASKED)
        elif KIND == _BF16:
            bits = _load(_typed(addr, tl.uint16, ALIGNED) + offs, mask, MASKED)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = _load(_typed(addr, tl.float16, ALIGNED) + offs, mask, MASKED).to(tl.float32)
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
        sign = x.to(tl.uint32, bitcast=True) & 0x80000000
        signed = (mag.to(tl.uint32, bitcast=True) | sign).to(tl.float32, bitcast=True)
        return tl.where(finite, signed, x).to(tl.float16)

    @triton.jit
    def _store_rounded(addr, offs, mask, x, r, KIND: tl.constexpr, SR: tl.constexpr, ALIGNED: tl.constexpr,
                       MASKED: tl.constexpr):
        """Writes float32 x to storage of KIND: exact, stochastic (noise r) or round-to-nearest."""
        if KIND == _F32:
            _store(addr, offs, mask, x, ALIGNED, MASKED)
        elif KIND == _BF16:
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
    def _adamw_scalars(frow):
        """The row's AdamW scalars: decay, lerp coefficient, beta2, 1 - beta2, sqrt of the second bias
        correction, eps, -step size."""
        return (tl.load(frow + _DECAY), tl.load(frow + _LERP), tl.load(frow + _BETA2), tl.load(frow + _ONE_MINUS_BETA2),
                tl.load(frow + _BC2_SQRT), tl.load(frow + _EPS), tl.load(frow + _NEG_STEP))

    @triton.jit
    def _block(row, frow, gmul_ptr, start, offs, mask,
               P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
               MASTER: tl.constexpr, SCALE_M: tl.constexpr, SCALE_V: tl.constexpr,
               SR_P: tl.constexpr, SR_M: tl.constexpr, SR_V: tl.constexpr, GMUL: tl.constexpr, CLAMP: tl.constexpr,
               ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr, MASKED: tl.constexpr):
        """The update of one block of one tensor (the body of optim.functional.apply_update_)."""
        p_addr = tl.load(row + _P)
        g_addr = tl.load(row + _G)
        m_addr = tl.load(row + _M)
        v_addr = tl.load(row + _V)
        w_addr = tl.load(row + _MASTER)
        decay, lerp_coeff, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step = _adamw_scalars(frow)

        g = _load_f32(g_addr, offs, mask, G_KIND, ALIGNED, MASKED)
        if GMUL == 1:
            g = g * tl.load(frow + _GRAD_MUL)
        elif GMUL == 2:
            g = g * tl.load(gmul_ptr)
        if MASTER:
            w = _load_f32(w_addr, offs, mask, _F32, ALIGNED, MASKED)
        else:
            w = _load_f32(p_addr, offs, mask, P_KIND, ALIGNED, MASKED)
        m = _load_f32(m_addr, offs, mask, M_KIND, ALIGNED, MASKED)
        v = _load_f32(v_addr, offs, mask, V_KIND, ALIGNED, MASKED)
        if SCALE_M:
            m = m * _scalar(row, _M_SCALE_OLD)
        if SCALE_V:
            v = v * _scalar(row, _V_SCALE_OLD)

        w = w * decay
        # lerp(m, g, wt) as torch's kernels: fma(wt, g - m, m) for |wt| < 0.5, else fma(wt - 1, g - m, g)
        small = tl.load(row + _LERP_SMALL) != 0
        m = _fma(lerp_coeff, g - m, tl.where(small, m, g), EMULATE_FMA)
        # v * beta2, then addcmul(g, g, value=1 - beta2) = fma(value * g, g, v)
        v = v * beta2
        v = _fma(one_minus_beta2 * g, g, v, EMULATE_FMA)
        denom = tl.math.div_rn(tl.math.sqrt_rn(v), bc2_sqrt) + eps
        # addcdiv(m, denom, value=-step_size) = w + (value * m) / denom
        w = w + tl.math.div_rn(neg_step * m, denom)
        if CLAMP:  # w.clamp_(min, max): NaN stays NaN
            lo_bound = tl.load(frow + _CLAMP_MIN)
            hi_bound = tl.load(frow + _CLAMP_MAX)
            w = tl.where(w < lo_bound, lo_bound, tl.where(w > hi_bound, hi_bound, w))

        if SCALE_M:
            m = tl.math.div_rn(m, _scalar(row, _M_SCALE_NEW))
        if SCALE_V:
            v = tl.math.div_rn(v, _scalar(row, _V_SCALE_NEW))

        # noise index j = first index of the tensor + element offset (64-bit), split hi:lo
        if SR_P or SR_M or SR_V:
            base = tl.load(row + _NOISE_BASE)
            idx = base + offs
            lo = idx.to(tl.uint32)
            hi0 = ((base + start) >> 32).to(tl.uint32)
            in_first = (idx >> 32).to(tl.uint32) == hi0
        else:
            lo = offs.to(tl.uint32)
            in_first = lo == lo
            hi0 = 0
        if SR_M:
            r_m = _noise(row, _KEY_M, _SALT_M, lo, in_first, hi0)
        else:
            r_m = lo
        if SR_V:
            r_v = _noise(row, _KEY_V, _SALT_V, lo, in_first, hi0)
        else:
            r_v = lo
        _store_rounded(m_addr, offs, mask, m, r_m, M_KIND, SR_M, ALIGNED, MASKED)
        _store_rounded(v_addr, offs, mask, v, r_v, V_KIND, SR_V, ALIGNED, MASKED)
        if MASTER:
            _store(w_addr, offs, mask, w, ALIGNED, MASKED)
            _store_rounded(p_addr, offs, mask, w, lo, P_KIND, False, ALIGNED, MASKED)
        else:
            if SR_P:
                r_p = _noise(row, _KEY_P, _SALT_P, lo, in_first, hi0)
            else:
                r_p = lo
            _store_rounded(p_addr, offs, mask, w, r_p, P_KIND, SR_P, ALIGNED, MASKED)

    @triton.jit
    def _sradamw_kernel(table_ptr, ftable_ptr, blocks_ptr, skip_ptr, gmul_ptr,
                        P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                        MASTER: tl.constexpr, SCALE_M: tl.constexpr, SCALE_V: tl.constexpr,
                        SR_P: tl.constexpr, SR_M: tl.constexpr, SR_V: tl.constexpr,
                        GMUL: tl.constexpr, CLAMP: tl.constexpr, HAS_SKIP: tl.constexpr,
                        ALIGNED: tl.constexpr, EMULATE_FMA: tl.constexpr, BLOCK: tl.constexpr):
        """One program = one block of one tensor of the group (see the block table).

        ``table_ptr`` is the int64 metadata table (:class:`Word` words of each row), ``ftable_ptr``
        the same memory as float32 (:class:`Slot` values after the words), ``blocks_ptr`` the int32
        ``(row, block)`` pairs, ``skip_ptr`` a float32 flag (nonzero: change nothing, ``HAS_SKIP``)
        and ``gmul_ptr`` a float32 gradient multiplier (``GMUL == 2``).
        """
        pid = tl.program_id(0)
        t = tl.load(blocks_ptr + 2 * pid).to(tl.int64)
        b = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64)
        row = table_ptr + t * _ROW_WORDS
        frow = ftable_ptr + t * (2 * _ROW_WORDS) + 2 * _INT_WORDS
        n = tl.load(row + _NUMEL)
        start = b * BLOCK
        offs = start + tl.arange(0, BLOCK)  # int64 element offsets
        go = True
        if HAS_SKIP:
            go = tl.load(skip_ptr) == 0.0
        if go:
            if start + BLOCK <= n:
                _block(row, frow, gmul_ptr, start, offs, offs < n, P_KIND, G_KIND, M_KIND, V_KIND, MASTER, SCALE_M,
                       SCALE_V, SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, EMULATE_FMA, False)
            else:
                _block(row, frow, gmul_ptr, start, offs, offs < n, P_KIND, G_KIND, M_KIND, V_KIND, MASTER, SCALE_M,
                       SCALE_V, SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, EMULATE_FMA, True)

    sradamw_kernel = _sradamw_kernel
