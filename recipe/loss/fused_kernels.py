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

__all__ = ["fwd_kernel", "bwd_kernel"]

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

    @triton.jit
    def _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """fp32 ``a_tile @ b_tile^T`` over the whole feature dimension, K step ``BK``."""
        offs_k = tl.arange(0, BK)
        acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
        for k in range(0, D, BK):
            if EVEN_K:
                a = tl.load(a_ptrs + k, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs + k, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k + offs_k) < D
                a = tl.load(a_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter multiplies 16-bit operands as raw bits: give it fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def fwd_kernel(
        a_ptr, b_ptr, scale_ptr,
        row_m_ptr, row_l_ptr, row_mb_ptr, pos_ptr,
        col_m_ptr, col_l_ptr, col_mb_ptr,
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
        ``pr`` of the column buffers (initialised to ``-inf``, 0, ``-inf`` by the host).
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
        for rt in range(pr, n_row_tiles, P_R):
            rows = rt * BM + offs_m
            row_ok = rows < M
            targets = rows + offset
            first_target = rt * BM + offset
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
            run_m = tl.full((BM,), float("-inf"), dtype=tl.float32)
            run_l = tl.full((BM,), 0.0, dtype=tl.float32)
            run_mb = tl.full((BM,), float("-inf"), dtype=tl.float32)
            for ct in range(ct_lo, ct_hi):
                cols = ct * BN + offs_n
                col_ok = cols < N
                b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
                dots = _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D, BM, BN, BK, EVEN_K, UPCAST, PRECISION)
                logits = dots * scale
                # rows: padding columns are -inf
                s_r = tl.where(col_ok[None, :], logits, float("-inf"))
                t_m = tl.reduce(s_r, 1, _MAX)
                new_m = tl.maximum(run_m, t_m)
                run_l = run_l * tl.exp(run_m - new_m) + tl.reduce(tl.exp(s_r - new_m[:, None]), 1, _SUM)
                run_m = new_m
                if ct * BN + BN <= first_target:  # every column precedes every target of the tile
                    run_mb = tl.maximum(run_mb, t_m)
                elif ct * BN < first_target + BM:  # the tile meets the targets of some rows
                    before = tl.where(cols[None, :] < targets[:, None], s_r, float("-inf"))
                    run_mb = tl.maximum(run_mb, tl.reduce(before, 1, _MAX))
                    hit = cols[None, :] == targets[:, None]
                    pos = tl.reduce(tl.where(hit, logits, 0.0), 1, _SUM)
                    mine = row_ok & (targets >= ct * BN) & (targets < ct * BN + BN)
                    tl.store(pos_ptr + rows, pos, mask=mine)
                if COL_STATS:  # columns: padding rows are -inf; square block, offset 0
                    s_c = tl.where(row_ok[:, None], logits, float("-inf"))
                    c_m = tl.reduce(s_c, 0, _MAX)
                    c_off = pr.to(tl.int64) * N + cols
                    old_m = tl.load(col_m_ptr + c_off, mask=col_ok, other=0.0)
                    old_l = tl.load(col_l_ptr + c_off, mask=col_ok, other=0.0)
                    new_cm = tl.maximum(old_m, c_m)
                    new_l = old_l * tl.exp(old_m - new_cm) + tl.reduce(tl.exp(s_c - new_cm[None, :]), 0, _SUM)
                    tl.store(col_m_ptr + c_off, new_cm, mask=col_ok)
                    tl.store(col_l_ptr + c_off, new_l, mask=col_ok)
                    if rt * BM + BM <= ct * BN:  # every row precedes every column's target row
                        old_mb = tl.load(col_mb_ptr + c_off, mask=col_ok, other=0.0)
                        tl.store(col_mb_ptr + c_off, tl.maximum(old_mb, c_m), mask=col_ok)
                    elif rt * BM < ct * BN + BN:
                        old_mb = tl.load(col_mb_ptr + c_off, mask=col_ok, other=0.0)
                        above = tl.reduce(tl.where(rows[:, None] < cols[None, :], s_c, float("-inf")), 0, _MAX)
                        tl.store(col_mb_ptr + c_off, tl.maximum(old_mb, above), mask=col_ok)
            r_off = pc.to(tl.int64) * M + rows
            tl.store(row_m_ptr + r_off, run_m, mask=row_ok)
            tl.store(row_l_ptr + r_off, run_l, mask=row_ok)
            tl.store(row_mb_ptr + r_off, run_mb, mask=row_ok)

    @triton.jit
    def bwd_kernel(
        a_ptr, b_ptr, scale_ptr, pos_ptr,
        row_m_ptr, row_ll_ptr, row_g_ptr,
        col_m_ptr, col_ll_ptr, col_g_ptr,
        ds_ptr, sgrad_ptr,
        M, D, stride_a, stride_b, stride_ds, offset, col0, band_w,
        SYMMETRIC: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """One recomputed tile of the band ``[col0, col0 + band_w)``: writes ``scale * dS`` and the
        tile's ``sum dS * dots`` (the logit-scale gradient's share).

        ``dS_ij = g_i (P_ij - [j = offset + i])`` with ``P_ij = exp(logit_ij - max_i - log sum_i)``,
        plus, with ``SYMMETRIC``, ``h_j (Q_ij - [i = j])`` with ``Q`` the column softmax. The target
        entries are ``g_i expm1(log P_ii)`` with ``log P_ii`` from the positive logit the forward
        saved (no cancellation, and no per-element bookkeeping of the diagonal).
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
        dots = _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D, BM, BN, BK, EVEN_K, UPCAST, PRECISION)
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
            if SYMMETRIC:  # square block, offset 0: row i's target is column i
                d_target += tl.load(col_g_ptr + rows, mask=row_ok, other=0.0) * _expm1(
                    (pos_r - tl.load(col_m_ptr + rows, mask=row_ok, other=0.0))
                    - tl.load(col_ll_ptr + rows, mask=row_ok, other=0.0)
                )
            ds = tl.where(cols[None, :] == (rows + offset)[:, None], d_target[:, None], ds)
        ds = tl.where(row_ok[:, None] & col_ok[None, :], ds, 0.0)
        tl.store(sgrad_ptr + pid, tl.reduce(tl.reduce(ds * dots, 1, _SUM), 0, _SUM))
        out = ds_ptr + rows.to(tl.int64)[:, None] * stride_ds + lcols[None, :]
        tl.store(out, (ds * scale).to(ds_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

else:  # pragma: no cover - exercised only without Triton
    fwd_kernel = bwd_kernel = None

# fmt: on
