"""Triton kernels of the fused contrastive loss (host side and design: :mod:`recipe.loss.fused`).

``fwd_kernel`` streams ``scale * a @ b^T`` tile by tile keeping online row (and column)
log-sum-exp statistics; ``bwd_kernel`` recomputes one tile of a column band and writes
``scale * dS`` with the tile's share of the logit-scale gradient. Triton comes from
:func:`optim._triton.load` (the one availability policy); without it both names are ``None``.

The kernels call only Triton builtins, never Triton's own ``@jit`` library functions (``tl.max``,
``tl.sum``, ``tl.zeros``, ``tl.cdiv``): those are decorated when Triton is imported, compiled or
interpreted, and a process that imported Triton before ``TRITON_INTERPRET=1`` was set (torch's
dynamo imports it) would mix the two. Reductions go through the builtin ``tl.reduce`` with the
library's combine functions, which the interpreter recognises and runs as numpy reductions.
"""

from __future__ import annotations

from optim._triton import load

triton, tl = load()

__all__ = ["bwd_kernel", "fwd_kernel"]

# fmt: off  (kernel signatures and expressions are laid out by hand)
if triton is not None:
    _MAX = getattr(tl.standard, "_elementwise_max", None)
    _SUM = getattr(tl.standard, "_sum_combine", None)
    if _MAX is None or _SUM is None:  # pragma: no cover - other Triton versions (slow interpreter path)

        @triton.jit
        def _MAX(a, b):
            return tl.maximum(a, b)

        @triton.jit
        def _SUM(a, b):
            return a + b

    @triton.jit
    def _expm1(x):
        """``exp(x) - 1`` without cancellation (|x| < 0.5: Taylor to x^8, error < 2e-8 relative)."""
        poly = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (
            1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320))))))))
        return tl.where(tl.abs(x) < 0.5, poly, tl.exp(x) - 1.0)

    # Register budget (sm_90, ``ptxas -v``; ``benchmarks/kernel_report.py`` prints it): one live fp32
    # 2-D tile costs BM * BN / (32 * num_warps) registers per thread, a column vector in the
    # ``wgmma`` accumulator layout BN / 4 per thread (replicated by every warp), a row vector about
    # BM / (16 * num_warps). Two CTAs of 8 warps per SM need <= 128 registers (the host caps them,
    # ``FusedConfig.max_registers``). The forward therefore
    # * builds no 2-D masks: padding rows and columns are clamped to the last valid one for the
    #   operand loads (unpredicated ``cp.async``) and excluded by a 0 / -inf bias added to the logits
    #   (``fma(dots, scale, bias)`` rounds as ``dots * scale``), so one tile of logits serves rows,
    #   columns and the "before target" maxima;
    # * reduces each tile's column statistics first and merges them with the stored ones through a
    #   per-program scratch in global memory (written, barrier, read back in a one-column-per-thread
    #   layout): Triton would otherwise run the merge -- loads, exponentials, stores and 64-bit
    #   addresses of BN / 4 columns per thread -- in the accumulator's replicated column layout
    #   (128 x 64 over 8 warps, uncapped: 196 registers that way, 126 this way);
    # * floors the shift of an all-padding row or column at -FLT_MAX instead of selecting a value,
    #   so that ``-inf - shift`` is ``-inf`` (never NaN) without a predicate.
    # The backward (one tile, no running state) keeps masked operand loads and one final select:
    # fewer registers there than the bias form under the 128 cap (118 vs 128 bf16, 127 vs spills fp16).
    # Triton is SSA: ``del`` of a tensor does not end its live range; only the data flow does.

    @triton.jit
    def _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, MASK_MN: tl.constexpr,
                  EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """fp32 ``a_tile @ b_tile^T`` over the whole feature dimension, K step ``BK``; ``MASK_MN``:
        padding rows and columns load as 0 (otherwise the pointers address valid rows only)."""
        offs_k = tl.arange(0, BK)
        acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
        for k in range(0, D, BK):
            if EVEN_K:
                if MASK_MN:
                    a = tl.load(a_ptrs + k, mask=row_ok[:, None], other=0.0)
                    b = tl.load(b_ptrs + k, mask=col_ok[:, None], other=0.0)
                else:
                    a = tl.load(a_ptrs + k)
                    b = tl.load(b_ptrs + k)
            else:
                k_ok = (k + offs_k) < D
                if MASK_MN:
                    a = tl.load(a_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
                else:
                    a = tl.load(a_ptrs + k, mask=k_ok[None, :], other=0.0)
                    b = tl.load(b_ptrs + k, mask=k_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter multiplies 16-bit operands as raw bits: give it fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def fwd_kernel(
        a_ptr, b_ptr, scale_ptr,
        row_m_ptr, row_l_ptr, row_mb_ptr, pos_ptr, col_ptr, scratch_ptr,
        M, N, D, stride_a, stride_b, offset, P_R, P_C,
        COL_STATS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        """Online row (and column) log-sum-exp statistics of ``scale * a @ b^T``.

        Program ``(pr, pc)``: row tiles ``pr, pr + P_R, ...``; the ``pc``-th of ``P_C`` near-equal
        contiguous ranges of column tiles. Per row, over its column range, it
        writes to row ``pc`` of the row buffers the running max, ``sum exp(logit - max)`` and the
        max over the columns *before* the row's target (``offset + row``); it stores the positive
        logit of the rows whose target it meets. With ``COL_STATS`` it merges the same statistics
        per column over its row tiles (the "before" max over rows above the diagonal) into row
        ``pr`` of ``col_ptr``: ``(P_R, n_col_tiles * BN, 3)`` records (max, sum, max before),
        initialised to ``(-inf, 0, -inf)`` by the host, through its ``3 * BN`` floats of
        ``scratch_ptr`` (program ``pr * P_C + pc``).
        The arg-max of a row is its target exactly when ``positive == max > max before target``
        (``torch.argmax`` returns the first maximum), which needs no index bookkeeping per element.
        """
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        n_row_tiles = (M + BM - 1) // BM
        n_col_tiles = (N + BN - 1) // BN
        ct_lo = pc * n_col_tiles // P_C
        ct_hi = (pc + 1) * n_col_tiles // P_C
        scale = tl.load(scale_ptr)
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        floor = -3.4028234663852886e38  # -FLT_MAX: the shift of an all-padding row or column
        c_base = pr.to(tl.int64) * (n_col_tiles * BN)  # this program's row of the column statistics
        offs_c = tl.arange(0, BN)
        scratch = scratch_ptr + (pr * P_C + pc).to(tl.int64) * (3 * BN)
        for rt in range(pr, n_row_tiles, P_R):
            rows = rt * BM + offs_m
            row_ok = rows < M
            row_bias = tl.where(row_ok, 0.0, float("-inf"))
            targets = rows + offset
            first_target = rt * BM + offset
            a_ptrs = a_ptr + tl.minimum(rows, M - 1).to(tl.int64)[:, None] * stride_a + offs_k[None, :]
            run_m = tl.full((BM,), float("-inf"), dtype=tl.float32)
            run_l = tl.full((BM,), 0.0, dtype=tl.float32)
            run_mb = tl.full((BM,), float("-inf"), dtype=tl.float32)
            for ct in range(ct_lo, ct_hi):
                cols = ct * BN + offs_n
                col_bias = tl.where(cols < N, 0.0, float("-inf"))
                b_ptrs = b_ptr + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_b + offs_k[None, :]
                dots = _dot_tile(a_ptrs, b_ptrs, row_ok, row_ok, D, BM, BN, BK, False, EVEN_K, UPCAST, PRECISION)
                # the logits, padding rows and columns -inf: one tile serves both directions
                s = (dots * scale + col_bias[None, :]) + row_bias[:, None]
                t_m = tl.reduce(s, 1, _MAX)
                new_m = tl.maximum(tl.maximum(run_m, t_m), floor)
                run_l = run_l * tl.exp(run_m - new_m) + tl.reduce(tl.exp(s - new_m[:, None]), 1, _SUM)
                run_m = new_m
                if COL_STATS:  # square block, offset 0: column j's target is row j
                    # the tile's own column statistics go through this program's scratch, so that
                    # their merge with the stored ones runs in a compact layout (a column per
                    # thread) instead of the accumulator's column slices (BN / 4 values per thread,
                    # replicated by every warp)
                    c_m = tl.maximum(tl.reduce(s, 0, _MAX), floor)
                    tl.store(scratch + offs_n, c_m)
                    tl.store(scratch + BN + offs_n, tl.reduce(tl.exp(s - c_m[None, :]), 0, _SUM))
                # the maxima before the targets (rows: over the columns before the row's target;
                # columns: over the rows before the column's target); the tile's logits die here
                if ct * BN + BN <= first_target:  # left of the targets: every column precedes
                    run_mb = tl.maximum(run_mb, t_m)
                elif ct * BN < first_target + BM:  # the tile meets the targets of some rows
                    before = tl.where(cols[None, :] < targets[:, None], s, float("-inf"))
                    run_mb = tl.maximum(run_mb, tl.reduce(before, 1, _MAX))
                    hit = cols[None, :] == targets[:, None]  # a valid row's target is a valid column
                    pos = tl.reduce(tl.where(hit, s, 0.0), 1, _SUM)
                    mine = row_ok & (targets >= ct * BN) & (targets < ct * BN + BN)
                    tl.store(pos_ptr + rows, pos, mask=mine)
                    if COL_STATS:
                        above = tl.where(rows[:, None] < cols[None, :], s, float("-inf"))
                        tl.store(scratch + 2 * BN + offs_n, tl.reduce(above, 0, _MAX))
                elif COL_STATS:  # right of the targets: every row precedes the columns' targets
                    tl.store(scratch + 2 * BN + offs_n, c_m)
                if COL_STATS:  # the merge, on vectors in the scratch's layout
                    tl.debug_barrier()
                    col = col_ptr + (c_base + ct * BN + offs_c) * 3  # (max, sum, max before)
                    tile_m = tl.load(scratch + offs_c)
                    old_m = tl.load(col)
                    new_cm = tl.maximum(old_m, tile_m)
                    tile_l = tl.load(scratch + BN + offs_c)
                    tl.store(col + 1, tl.load(col + 1) * tl.exp(old_m - new_cm) + tile_l * tl.exp(tile_m - new_cm))
                    tl.store(col, new_cm)
                    if ct * BN + BN > first_target:  # some rows precede some columns' targets
                        tl.store(col + 2, tl.maximum(tl.load(col + 2), tl.load(scratch + 2 * BN + offs_c)))
                    tl.debug_barrier()  # the next tile rewrites the scratch
            r_off = pc.to(tl.int64) * M + rows
            tl.store(row_m_ptr + r_off, run_m, mask=row_ok)
            tl.store(row_l_ptr + r_off, run_l, mask=row_ok)
            tl.store(row_mb_ptr + r_off, run_mb, mask=row_ok)

    @triton.jit
    def bwd_kernel(
        a_ptr, b_ptr, scale_ptr, out_scale_ptr, pos_ptr,
        row_m_ptr, row_ll_ptr, row_g_ptr,
        col_m_ptr, col_ll_ptr, col_g_ptr,
        ds_ptr, sgrad_ptr,
        M, D, stride_a, stride_b, stride_ds, offset, col0, band_w,
        SYMMETRIC: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """One recomputed tile of the band ``[col0, col0 + band_w)``: writes ``out_scale * dS`` and
        the tile's ``sum dS * dots`` (the logit-scale gradient's share).

        ``dS_ij = g_i (P_ij - [j = offset + i])`` with ``P_ij = exp(logit_ij - max_i - log sum_i)``,
        plus, with ``SYMMETRIC``, ``h_j (Q_ij - [i = j])`` with ``Q`` the column softmax. The target
        entries are ``g_i expm1(log P_ii)`` with ``log P_ii`` from the positive logit the forward
        saved (no cancellation, and no per-element bookkeeping of the diagonal). ``out_scale`` is
        the logit scale, times a power of two for fp16 ``dS`` (the host's range scaling).
        """
        pid = tl.program_id(0)
        n_rt = (M + BM - 1) // BM
        n_ct = (band_w + BN - 1) // BN
        per_group = GROUP_M * n_ct
        first_rt = (pid // per_group) * GROUP_M
        group_size = tl.minimum(n_rt - first_rt, GROUP_M)
        rt = first_rt + (pid % per_group) % group_size
        ct = (pid % per_group) // group_size

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        rows = rt * BM + offs_m
        row_ok = rows < M
        lcols = ct * BN + offs_n
        col_ok = lcols < band_w
        cols = col0 + lcols
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
        dots = _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D, BM, BN, BK, True, EVEN_K, UPCAST, PRECISION)
        scale = tl.load(scale_ptr)
        logits = dots * scale

        m_r = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)
        ll_r = tl.load(row_ll_ptr + rows, mask=row_ok, other=0.0)
        g_r = tl.load(row_g_ptr + rows, mask=row_ok, other=0.0)
        ds = g_r[:, None] * tl.exp((logits - m_r[:, None]) - ll_r[:, None])
        if SYMMETRIC:
            m_c = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
            ll_c = tl.load(col_ll_ptr + cols, mask=col_ok, other=0.0)
            g_c = tl.load(col_g_ptr + cols, mask=col_ok, other=0.0)
            ds += g_c[None, :] * tl.exp((logits - m_c[None, :]) - ll_c[None, :])
        first_target = rt * BM + offset
        if (col0 + ct * BN < first_target + BM) & (col0 + ct * BN + BN > first_target):
            pos_r = tl.load(pos_ptr + rows, mask=row_ok, other=0.0)
            d_target = g_r * _expm1((pos_r - m_r) - ll_r)
            if SYMMETRIC:  # square block: row i's target is column offset + i (offset: the row chunk's start)
                targets = rows + offset
                d_target += tl.load(col_g_ptr + targets, mask=row_ok, other=0.0) * _expm1(
                    (pos_r - tl.load(col_m_ptr + targets, mask=row_ok, other=0.0))
                    - tl.load(col_ll_ptr + targets, mask=row_ok, other=0.0)
                )
            ds = tl.where(cols[None, :] == (rows + offset)[:, None], d_target[:, None], ds)
        ds = tl.where(row_ok[:, None] & col_ok[None, :], ds, 0.0)
        tl.store(sgrad_ptr + pid, tl.reduce(tl.reduce(ds * dots, 1, _SUM), 0, _SUM))
        out = ds_ptr + rows.to(tl.int64)[:, None] * stride_ds + lcols[None, :]
        out_scale = tl.load(out_scale_ptr)
        tl.store(out, (ds * out_scale).to(ds_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

else:  # pragma: no cover - exercised only without Triton
    fwd_kernel = bwd_kernel = None

# fmt: on
