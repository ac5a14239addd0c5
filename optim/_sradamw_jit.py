"""Device code of the fused SRAdamW kernel, and the metadata row layout it shares with the host.

The host side (dtype groups, launch) and the design notes are in :mod:`optim.triton_kernel`. Each
tensor of a launch has one *metadata row* of int64 words, laid out by :mod:`optim._rows` (shared with
the CPU kernel): the host fills rows by those names and the kernel reads them through constexpr
globals bound from the same enums.

Triton comes from :func:`optim._triton.load` (the one availability policy); without it the layout
is still defined and the kernel names are ``None``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any

from ._triton import load
from ._rows import INT_WORDS, ROW_WORDS, Kind, Master, Slot, Word

triton, tl = load()

__all__ = ["Word", "Slot", "Kind", "Master", "INT_WORDS", "ROW_WORDS", "sradamw_kernel", "grad_amax_kernel"]


sradamw_kernel: Any = None  # the @triton.jit kernel; None without Triton
grad_amax_kernel: Any = None  # the gradients' maxima of a step plan (optim.triton_kernel.GradAmax)

if triton is not None:

    def _constexprs(*members: IntEnum) -> tuple:
        return tuple(tl.constexpr(int(m)) for m in members)

    # The layout as constexpr globals: the only globals a compiled kernel may read, and Triton hashes
    # their values into its cache key, so a changed layout recompiles.
    _P, _G, _M, _V, _MASTER = _constexprs(Word.P, Word.G, Word.M, Word.V, Word.MASTER)
    _M_SCALE_OLD, _M_SCALE_NEW = _constexprs(Word.M_SCALE_OLD, Word.M_SCALE_NEW)
    _V_SCALE_OLD, _V_SCALE_NEW = _constexprs(Word.V_SCALE_OLD, Word.V_SCALE_NEW)
    _NUMEL, _NOISE_BASE = _constexprs(Word.NUMEL, Word.NOISE_BASE)
    _A_P, _B_P, _A_S, _B_S = _constexprs(Word.A_P, Word.B_P, Word.A_S, Word.B_S)
    _DECAY, _BETA1, _ONE_MINUS_BETA1 = _constexprs(Slot.DECAY, Slot.BETA1, Slot.ONE_MINUS_BETA1)
    _BETA2, _ONE_MINUS_BETA2 = _constexprs(Slot.BETA2, Slot.ONE_MINUS_BETA2)
    _EPS_HAT, _NEG_STEP, _GRAD_MUL = _constexprs(Slot.EPS_HAT, Slot.NEG_STEP, Slot.GRAD_MUL)
    _CLAMP_MIN, _CLAMP_MAX = _constexprs(Slot.CLAMP_MIN, Slot.CLAMP_MAX)
    _F32, _BF16 = _constexprs(Kind.F32, Kind.BF16)
    _INT_WORDS, _ROW_WORDS = tl.constexpr(INT_WORDS), tl.constexpr(ROW_WORDS)
    _GOLDEN = tl.constexpr(0x9E3779B9)
    _LAST_START = tl.constexpr(1 << 32)  # noise index low halves live in [0, 2**32)

    @triton.jit
    def _keyed_hash(x, a, b):
        """optim.rounding._keyed_hash_int on uint32 (wrap-around arithmetic): lowbias32 of ``x + a``
        with ``b`` xored in after the first multiplication."""
        x = x + a
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15) ^ b
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _words(row, A: tl.constexpr, B: tl.constexpr, hi0, lo, lo0, STRADDLE: tl.constexpr):
        """The key words ``(a, b)`` of one stream for the block's elements. ``a`` carries the high half
        of the noise index (``a ^ hi * golden``): one scalar per block, or, in a block whose indices
        cross a multiple of 2**32 (STRADDLE), per element (``lo < lo0`` marks the second segment)."""
        a = tl.load(row + A).to(tl.uint32)
        b = tl.load(row + B).to(tl.uint32)
        a0 = a ^ (hi0 * _GOLDEN)
        if STRADDLE:
            a0 = tl.where(lo >= lo0, a0, a ^ ((hi0 + 1) * _GOLDEN))
        return a0, b

    @triton.jit
    def _typed(addr, start, dtype: tl.constexpr, ALIGNED: tl.constexpr):
        """An int64 address as a pointer, advanced to the block's first element ``start`` (a scalar: the
        per-element offsets stay 32-bit); 16-byte alignment must be stated on the pointer itself for
        Triton to vectorise (a hint on the integer is lost in the cast). ``start`` is a multiple of the
        block (>= 16 elements), so an aligned tensor's block start is aligned too."""
        ptr = addr.to(tl.pointer_type(dtype)) + start
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
    def _load_f32(addr, start, offs, mask, KIND: tl.constexpr, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Loads float32 / bfloat16 (as bits) / float16 values at ``addr`` and widens to float32."""
        if KIND == _F32:
            x = _load(_typed(addr, start, tl.float32, ALIGNED) + offs, mask, MASKED)
        elif KIND == _BF16:
            bits = _load(_typed(addr, start, tl.uint16, ALIGNED) + offs, mask, MASKED)
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
        else:
            x = _load(_typed(addr, start, tl.float16, ALIGNED) + offs, mask, MASKED).to(tl.float32)
        return x

    @triton.jit
    def _store(addr, start, offs, mask, val, ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Stores ``val`` (its dtype decides the pointer type)."""
        ptr = _typed(addr, start, val.dtype, ALIGNED) + offs
        if MASKED:
            tl.store(ptr, val, mask=mask)
        else:
            tl.store(ptr, val)

    @triton.jit
    def _sr_bf16_bits(x, r16):
        """optim.rounding._round_bf16 (proportional, noise ``r16`` in [0, 2**16)): bfloat16 bits.

        Adding the noise to the magnitude's bits and truncating the low 16 rounds up exactly when
        ``low + r16 >= 2**16``; finite values beyond the largest bfloat16 saturate (the ``min``),
        infinities stay, NaN becomes the quiet NaN torch's conversion gives (0x7FC0), sign kept."""
        xb = x.to(tl.uint32, bitcast=True)
        mag = xb & 0x7FFFFFFF
        rounded = tl.minimum(mag, 0x7F7F0000) + r16  # < 2**31: the sign bit is free
        special = tl.where(mag > 0x7F800000, 0x7FC00000, 0x7F800000)
        out = tl.where(mag < 0x7F800000, rounded, special) | (xb & 0x80000000)
        return (out >> 16).to(tl.uint16)

    @triton.jit
    def _rne_bf16_bits(x):
        """Round-to-nearest-even float32 -> bfloat16 bits (torch's conversion; NaN -> 0x7FC0)."""
        xb = x.to(tl.uint32, bitcast=True)
        is_nan = (xb & 0x7FFFFFFF) > 0x7F800000
        r = (xb + (0x7FFF + ((xb >> 16) & 1))) >> 16
        return tl.where(is_nan, 0x7FC0, r).to(tl.uint16)

    @triton.jit
    def _sr_f16(x, r16):
        """optim.rounding._round_f16 (proportional, noise ``r16`` in [0, 2**16), its top 13 bits used):
        x rounded to float16, saturating at 65504; infinities and NaN stay, sign kept.

        The product by 2**-112 maps float16's grid onto float32's: float16's normal range onto the
        lowest normal binades (13 significand bits dropped), its subnormal range onto float32's
        subnormals with spacing 2**13 units, so one add-and-truncate of the 13 low bits rounds both.
        The product rounds bits below float32's subnormal unit to nearest, as the reference's
        addition of 2**-14 does (the same grid), and the kernel keeps subnormals (no ``.ftz``)."""
        c = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
        y = c * 1.925929944387236e-34  # 2**-112
        yb = y.to(tl.uint32, bitcast=True) + (r16 >> 3)  # the sign bit stays: |y| < 2**-96
        rounded = (yb & 0xFFFFE000).to(tl.float32, bitcast=True) * 5.192296858534828e+33  # 2**112, exact
        return tl.where(tl.abs(x) < float("inf"), rounded, x).to(tl.float16)

    @triton.jit
    def _store_rounded(addr, start, offs, mask, x, r16, KIND: tl.constexpr, SR: tl.constexpr,
                       ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """Writes float32 x to storage of KIND: exact, stochastic (noise r16) or round-to-nearest."""
        if KIND == _F32:
            _store(addr, start, offs, mask, x, ALIGNED, MASKED)
        elif KIND == _BF16:
            if SR:
                _store(addr, start, offs, mask, _sr_bf16_bits(x, r16), ALIGNED, MASKED)
            else:
                _store(addr, start, offs, mask, _rne_bf16_bits(x), ALIGNED, MASKED)
        else:
            if SR:
                _store(addr, start, offs, mask, _sr_f16(x, r16), ALIGNED, MASKED)
            else:
                _store(addr, start, offs, mask, x.to(tl.float16), ALIGNED, MASKED)

    @triton.jit
    def _block(row, frow, gmul_ptr, start, offs, mask, hi0, lo, lo0,
               P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
               MASTER: tl.constexpr, SCALE_M: tl.constexpr, SCALE_V: tl.constexpr,
               SR_P: tl.constexpr, SR_M: tl.constexpr, SR_V: tl.constexpr, GMUL: tl.constexpr, CLAMP: tl.constexpr,
               ALIGNED: tl.constexpr, MASKED: tl.constexpr):
        """The update of one block of one tensor (optim.functional.update_block_, operation for
        operation; ``MASKED`` blocks are the partial tail and blocks whose noise index crosses a
        multiple of 2**32). Element ``offs[j]`` (int32, within the block) is the tensor's element
        ``start + offs[j]``."""
        p_addr = tl.load(row + _P)
        g_addr = tl.load(row + _G)
        m_addr = tl.load(row + _M)
        v_addr = tl.load(row + _V)
        w_addr = tl.load(row + _MASTER)

        g = _load_f32(g_addr, start, offs, mask, G_KIND, ALIGNED, MASKED)
        if GMUL == 1:
            g = g * tl.load(frow + _GRAD_MUL)
        elif GMUL == 2:
            g = g * tl.load(gmul_ptr)
        if MASTER == 1:
            w = _load_f32(w_addr, start, offs, mask, _F32, ALIGNED, MASKED)
        elif MASTER == 2:  # optim.master16.join_master
            hb = _load(_typed(p_addr, start, tl.uint16, ALIGNED) + offs, mask, MASKED).to(tl.uint32)
            lb = _load(_typed(w_addr, start, tl.uint16, ALIGNED) + offs, mask, MASKED).to(tl.uint32)
            w = (((hb & 0x8000) << 16) | (((hb & 0x7FFF) - (lb >> 15)) << 16) | lb).to(tl.float32, bitcast=True)
        else:
            w = _load_f32(p_addr, start, offs, mask, P_KIND, ALIGNED, MASKED)
        m = _load_f32(m_addr, start, offs, mask, M_KIND, ALIGNED, MASKED)
        v = _load_f32(v_addr, start, offs, mask, V_KIND, ALIGNED, MASKED)

        # one correctly rounded float32 operation each, no contraction (enable_fp_fusion=False);
        # float16 statistics are updated in their scaled form (optim.functional._scaled: the factors
        # are per-program scalars, exact products with powers of two)
        m_decay = tl.load(frow + _BETA1)
        m_in = tl.load(frow + _ONE_MINUS_BETA1)
        v_decay = tl.load(frow + _BETA2)
        v_in = tl.load(frow + _ONE_MINUS_BETA2)
        neg_step = tl.load(frow + _NEG_STEP)
        if SCALE_M:
            m_new = _scalar(row, _M_SCALE_NEW)
            m_inv = tl.math.div_rn(1.0, m_new)  # exact: a power of two within the normal range
            m_decay = m_decay * (_scalar(row, _M_SCALE_OLD) * m_inv)
            m_in = m_in * m_inv
            neg_step = neg_step * m_new
        if SCALE_V:
            v_new = _scalar(row, _V_SCALE_NEW)
            v_inv = tl.math.div_rn(1.0, v_new)
            v_decay = v_decay * (_scalar(row, _V_SCALE_OLD) * v_inv)
            v_in = v_in * v_inv
        w = w * tl.load(frow + _DECAY)
        m = m * m_decay + g * m_in
        v = v * v_decay + (g * g) * v_in
        v_true = v
        if SCALE_V:
            v_true = v * v_new
        # m and v are stored before the division and the square root: fewer values are live across
        # their slow-path calls (registers: see tests/optim/test_triton_kernel.py's sm_90 budget)
        num = m * neg_step
        h = lo
        if SR_M or SR_V:  # one hash for both statistics: high half exp_avg, low half exp_avg_sq
            a_s, b_s = _words(row, _A_S, _B_S, hi0, lo, lo0, MASKED)
            h = _keyed_hash(lo, a_s, b_s)
        _store_rounded(m_addr, start, offs, mask, m, h >> 16, M_KIND, SR_M, ALIGNED, MASKED)
        _store_rounded(v_addr, start, offs, mask, v, h & 0xFFFF, V_KIND, SR_V, ALIGNED, MASKED)
        w = w + tl.math.div_rn(num, tl.math.sqrt_rn(v_true) + tl.load(frow + _EPS_HAT))
        if CLAMP:  # NaN stays NaN
            lo_bound = tl.load(frow + _CLAMP_MIN)
            hi_bound = tl.load(frow + _CLAMP_MAX)
            w = tl.where(w < lo_bound, lo_bound, tl.where(w > hi_bound, hi_bound, w))

        if MASTER == 1:
            _store(w_addr, start, offs, mask, w, ALIGNED, MASKED)
            _store_rounded(p_addr, start, offs, mask, w, lo, P_KIND, False, ALIGNED, MASKED)
        elif MASTER == 2:  # optim.master16.split_master: high half nearest (ties away), low half as is
            wb = w.to(tl.uint32, bitcast=True)
            mag = wb & 0x7FFFFFFF
            hi = tl.where(mag > 0x7F800000, 0x7FC00000, (mag + 0x8000) & 0xFFFF0000) | (wb & 0x80000000)
            _store(p_addr, start, offs, mask, (hi >> 16).to(tl.uint16), ALIGNED, MASKED)
            _store(w_addr, start, offs, mask, (wb & 0xFFFF).to(tl.uint16), ALIGNED, MASKED)
        else:
            h_p = lo
            if SR_P:
                a_p, b_p = _words(row, _A_P, _B_P, hi0, lo, lo0, MASKED)
                h_p = _keyed_hash(lo, a_p, b_p)
            _store_rounded(p_addr, start, offs, mask, w, h_p >> 16, P_KIND, SR_P, ALIGNED, MASKED)

    @triton.jit
    def _sradamw_kernel(table_ptr, ftable_ptr, blocks_ptr, skip_ptr, gmul_ptr,
                        P_KIND: tl.constexpr, G_KIND: tl.constexpr, M_KIND: tl.constexpr, V_KIND: tl.constexpr,
                        MASTER: tl.constexpr, SCALE_M: tl.constexpr, SCALE_V: tl.constexpr,
                        SR_P: tl.constexpr, SR_M: tl.constexpr, SR_V: tl.constexpr,
                        GMUL: tl.constexpr, CLAMP: tl.constexpr, HAS_SKIP: tl.constexpr,
                        ALIGNED: tl.constexpr, BLOCK: tl.constexpr):
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
        offs = tl.arange(0, BLOCK)  # int32 offsets within the block (the block's start is in the pointers)
        first = tl.load(row + _NOISE_BASE) + start  # noise index of the block's first element
        hi0 = (first >> 32).to(tl.uint32)
        lo0 = first.to(tl.uint32)
        lo = lo0 + tl.arange(0, BLOCK).to(tl.uint32)  # low halves of the noise indices (wrap at 2**32)
        go = True
        if HAS_SKIP:
            go = tl.load(skip_ptr) == 0.0
        if go:
            if (start + BLOCK <= n) & ((first & 0xFFFFFFFF) <= _LAST_START - BLOCK):
                _block(row, frow, gmul_ptr, start, offs, offs < BLOCK, hi0, lo, lo0, P_KIND, G_KIND, M_KIND,
                       V_KIND, MASTER, SCALE_M, SCALE_V, SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, False)
            else:  # the partial tail block, or a block whose noise indices cross a multiple of 2**32
                inside = offs < tl.minimum(n - start, BLOCK).to(tl.int32)
                _block(row, frow, gmul_ptr, start, offs, inside, hi0, lo, lo0, P_KIND, G_KIND, M_KIND,
                       V_KIND, MASTER, SCALE_M, SCALE_V, SR_P, SR_M, SR_V, GMUL, CLAMP, ALIGNED, True)

    sradamw_kernel = _sradamw_kernel

    # The maxima's reduction: Triton's own ``tl.max`` is a library ``@jit`` function, decorated when
    # Triton is imported (compiled, if something imported Triton before ``TRITON_INTERPRET`` was set,
    # as DeepSpeed does), so kernels reduce with the builtin ``tl.reduce`` and Triton's element-wise max
    # as the combine function (the interpreter maps it to numpy), as recipe/loss/fused_kernels.py does.
    _imax = getattr(tl.standard, "_elementwise_max", None)
    if _imax is None:  # pragma: no cover - other Triton versions (slow interpreter path)

        @triton.jit
        def _imax(a, b):
            return tl.maximum(a, b)

    @triton.jit
    def _grad_amax_kernel(addr_ptr, numel_ptr, index_ptr, blocks_ptr, out_ptr, WIDE: tl.constexpr,
                          BLOCK: tl.constexpr):
        """One program = one block of one gradient: the largest magnitude's bit pattern of the block
        (sign bit cleared: for non-negative floats the order of the patterns is the order of the values,
        infinity above every finite value and NaN above infinity), maxed into ``out_ptr[j]`` (int32) for
        the block's tensor ``j``. ``blocks_ptr``: int32 ``(row, block)`` pairs over the launch's tensors,
        ``index_ptr``: int32, each row's ``j``; ``addr_ptr``/``numel_ptr``: int64 address and length of
        every tensor ``j``. ``WIDE``: 32-bit elements (float32), else 16-bit (bfloat16, float16)."""
        pid = tl.program_id(0)
        r = tl.load(blocks_ptr + 2 * pid)
        start = tl.load(blocks_ptr + 2 * pid + 1).to(tl.int64) * BLOCK
        j = tl.load(index_ptr + r)
        addr = tl.load(addr_ptr + j)
        n = tl.load(numel_ptr + j)
        offs = tl.arange(0, BLOCK)
        inside = offs < tl.minimum(n - start, BLOCK).to(tl.int32)
        if WIDE:
            x = tl.load(addr.to(tl.pointer_type(tl.int32)) + start + offs, mask=inside, other=0)
            m = tl.reduce(x & 0x7FFFFFFF, 0, _imax)
        else:
            x = tl.load(addr.to(tl.pointer_type(tl.int16)) + start + offs, mask=inside, other=0)
            m = tl.reduce(x.to(tl.int32) & 0x7FFF, 0, _imax)
        tl.atomic_max(out_ptr + j, m)

    grad_amax_kernel = _grad_amax_kernel
