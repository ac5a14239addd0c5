"""The ``"chunked"`` loss mode: tiled online log-sum-exp cross-entropy that never materialises the
``M x B`` logit block (the backward recomputes each tile).

Two kernels share the tile machinery (:class:`_Products`, :func:`_spans`):

* :func:`symmetric_chunked_cross_entropy`, used when a rank's block is the whole square ``B x B``
  matrix (world size 1): the image-to-text logits are the transpose of the text-to-image ones, so one
  product per tile feeds both directions (row statistics for image-to-text, column statistics for
  text-to-image) in the forward, and one recompute per tile gives the gradient of both directions in
  the backward: ``8 B^2 D`` matmul flops in all (the floor of any ``O(B D)``-memory loss), where two
  independent directions cost ``16 B^2 D``.
* :func:`chunked_cross_entropy`, one direction of a rectangular ``M x K`` block (the local rows
  against the gathered side), used twice at world sizes above 1.

Per tile only a handful of whole-tile passes run (product, maxima, ``exp`` and sums; in the backward
``exp`` and the gradient products), into two (bf16 features on the CPU: three) ``chunk x chunk``
fp32 scratch buffers allocated once per call; features are converted to fp32 one span at a time and
the row-side gradient is accumulated one row span at a time, so the extra memory is the tiles plus
one fp32 ``(K, D)`` accumulator (and the returned gradients). Accuracy
(first arg-max equals the positive) is decided without arg-max reductions: a row is correct when its
positive logit equals the row maximum and every logit *before* the target column is strictly
smaller, the exact condition for ``argmax`` (first maximum) to land on the target.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import GatheredBatch, ModeOutput, with_bias
from .matmul import addmm_f32_, grad_matmul_dtype, mm_f32, no_autocast

__all__ = ["chunked_cross_entropy", "chunked_mode", "symmetric_chunked_cross_entropy"]

_NEG_INF = float("-inf")


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(i, min(n, i + chunk)) for i in range(0, n, chunk)]


def _diagonal_band(r0: int, r1: int, c0: int, c1: int, offset: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of tile rows ``[r0, r1)`` whose target column ``offset + i`` is in ``[c0, c1)``."""
    return max(r0, c0 - offset), min(r1, c1 - offset)


class _Products:
    """The tile products of ``scale * a @ b.T`` and of its gradient, with fp32 results, row span by row
    span (:meth:`rows` selects the span, then :meth:`logits` / :meth:`accumulate` per column tile).

    Products run in fp32 (fp32 features are used in place, other dtypes converted one span at a time:
    no ``(B, D)`` copy) except for 16-bit features on CUDA, which use fp32-output products of the
    features themselves (:func:`~recipe.loss.matmul.mm_f32`). The gradient products follow
    :func:`~recipe.loss.matmul.grad_matmul_dtype`: for bf16 features the gradient tile is cast to bf16
    (on the CPU the bf16 product is rounded to bf16 per tile before the fp32 accumulation: an error of
    the order of the bf16 rounding of the returned gradient itself). The logit-scale gradient
    ``sum_ij G_ij (a_i . b_j)`` is taken from the fp32 row accumulators (``sum_i a_i . (G b)_i``)
    when their products are fp32, else summed per tile from the fp32 gradient tile and the unscaled
    products, which :meth:`logits` then keeps.

    Gradients: ``acc`` (``(rows, D)`` fp32, this span's ``G b``) is finished into ``grad_a`` by
    :meth:`finish_rows`; ``acc_b`` (``(K, D)`` fp32, ``G^T a`` over all spans) by :meth:`finish`.
    """

    def __init__(self, a: Tensor, b: Tensor, scale: Tensor, chunk: int) -> None:
        self.a, self.b, self.scale = a, b, scale
        self.gdtype = grad_matmul_dtype(a.dtype)
        self.cuda16 = a.is_cuda and a.dtype in (torch.float16, torch.bfloat16)
        self.bf16_grads = self.gdtype == torch.bfloat16 and not self.cuda16  # bf16 products on the CPU
        self.s_from_acc = not (self.cuda16 or self.bf16_grads)  # fp32 gradient products
        if not self.s_from_acc and not self.cuda16:
            self.dots_buf = torch.empty(min(chunk, a.shape[0]) * min(chunk, b.shape[0]), device=a.device)
        self.dots: Tensor | None = None
        self.r0 = self.r1 = 0
        self.a_r: Tensor | None = None
        self.grad_s = torch.zeros((), dtype=torch.float32, device=a.device)

    @staticmethod
    def _f32(t: Tensor) -> Tensor:
        return t if t.dtype == torch.float32 else t.float()

    def rows(self, r0: int, r1: int) -> None:
        """Selects rows ``[r0, r1)`` of ``a`` for the next tiles."""
        self.r0, self.r1 = r0, r1
        self.a_r = self.a[r0:r1] if self.cuda16 else self._f32(self.a[r0:r1])

    def logits(self, c0: int, c1: int, out: Tensor) -> Tensor:
        """``scale * a[rows] @ b[c0:c1].T`` in fp32, in ``out``'s storage on the CPU."""
        if self.cuda16:
            self.dots = mm_f32(self.a_r, self.b[c0:c1].mT)
            return self.dots * self.scale
        shape = (self.r1 - self.r0, c1 - c0)
        tile = out[: shape[0] * shape[1]].view(shape)
        b_c = self._f32(self.b[c0:c1])
        if self.s_from_acc:
            return torch.mm(self.a_r, b_c.mT, out=tile).mul_(self.scale)
        self.dots = torch.mm(self.a_r, b_c.mT, out=self.dots_buf[: tile.numel()].view(shape))
        return torch.mul(self.dots, self.scale, out=tile)

    def accumulate(self, grad: Tensor, c0: int, c1: int, acc: Tensor | None, acc_b: Tensor | None, need_s: bool) -> None:
        """``acc += grad @ b[c0:c1]`` and ``acc_b[c0:c1] += grad.T @ a[rows]`` for the last tile."""
        if self.s_from_acc:
            if acc is not None:
                acc.addmm_(grad, self._f32(self.b[c0:c1]))
            if acc_b is not None:
                acc_b[c0:c1].addmm_(grad.mT, self.a_r)
            return
        if need_s:  # d/d scale = sum_ij G_ij * dots_ij, in fp32 before the cast
            self.grad_s += torch.dot(grad.view(-1), self.dots.reshape(-1))
        g = grad.to(self.gdtype)
        if self.bf16_grads:
            if acc is not None:
                acc.add_(torch.mm(g, self.b[c0:c1]))
            if acc_b is not None:
                acc_b[c0:c1].add_(torch.mm(g.mT, self.a[self.r0 : self.r1]))
        else:
            if acc is not None:
                addmm_f32_(acc, g, self.b[c0:c1])
            if acc_b is not None:
                addmm_f32_(acc_b[c0:c1], g.mT, self.a[self.r0 : self.r1])

    def row_accumulator(self, grad_a: Tensor | None, need_s: bool) -> Tensor | None:
        """Zeroed fp32 ``(rows, D)`` accumulator of the selected rows: a view of ``grad_a`` when that
        is fp32, ``None`` when neither ``grad_a`` nor (from it) the scale gradient is needed."""
        if grad_a is None and not (need_s and self.s_from_acc):
            return None
        if grad_a is not None and grad_a.dtype == torch.float32:
            return grad_a[self.r0 : self.r1].zero_()
        return torch.zeros(self.r1 - self.r0, self.a.shape[1], dtype=torch.float32, device=self.a.device)

    def finish_rows(self, acc: Tensor | None, grad_a: Tensor | None, need_s: bool) -> None:
        """Scale-gradient share and ``grad_a`` rows of the selected span."""
        if acc is None:
            return
        if need_s and self.s_from_acc:
            self.grad_s += torch.dot(acc.view(-1), self.a_r.reshape(-1))
        if grad_a is not None:
            acc.mul_(self.scale)
            if grad_a.dtype != torch.float32:  # else acc is a view of grad_a
                grad_a[self.r0 : self.r1] = acc

    def buffers(self, need_a: bool, need_b: bool) -> tuple[Tensor | None, Tensor | None]:
        """``(grad_a, acc_b)``: the output buffer of ``a``'s gradient and the fp32 ``(K, D)``
        accumulator of ``b``'s (``None`` where not needed)."""
        grad_a = torch.empty_like(self.a) if need_a else None
        acc_b = torch.zeros(self.b.shape, dtype=torch.float32, device=self.b.device) if need_b else None
        return grad_a, acc_b

    def finish(self, acc_b: Tensor | None, need_s: bool) -> tuple[Tensor | None, Tensor | None]:
        """``(grad_b, grad_scale)``."""
        grad_b = None if acc_b is None else acc_b.mul_(self.scale).to(self.b.dtype)
        return grad_b, (self.grad_s.reshape(self.scale.shape) if need_s else None)


def _scratch(chunk: int, rows: int, cols: int, device: torch.device) -> tuple[Tensor, Tensor]:
    n = min(chunk, rows) * min(chunk, cols)
    return torch.empty(n, dtype=torch.float32, device=device), torch.empty(n, dtype=torch.float32, device=device)


def _online_update(run_max: Tensor, run_sum: Tensor, tile: Tensor, tile_max: Tensor, dim: int, work: Tensor) -> None:
    """Merges a tile into running (max, sum of exp) along ``dim`` (1: rows, 0: columns), in place;
    ``work`` is the scratch for ``exp(tile - max)`` (may be ``tile`` itself)."""
    new_max = torch.maximum(run_max, tile_max)
    run_sum.mul_(torch.exp(run_max - new_max))
    shift = new_max[:, None] if dim == 1 else new_max[None, :]
    run_sum.add_(torch.sub(tile, shift, out=work).exp_().sum(dim=dim))
    run_max.copy_(new_max)


def _before_mask(r0: int, r1: int, c0: int, c1: int, offset: int, device: torch.device) -> Tensor:
    """``mask[i, j]``: column ``c0 + j`` lies before the target column ``offset + r0 + i``."""
    cols = torch.arange(c0, c1, device=device)
    targets = torch.arange(r0 + offset, r1 + offset, device=device)
    return cols[None, :] < targets[:, None]


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Row cross-entropy of ``scale * a @ b.T`` with target column ``offset + i``, tile by tile.

    Forward: per row a running maximum ``m`` and ``sum exp(logit - m)``, the maximum over the columns
    before the target (for the accuracy) and the positive logit (read from the tile holding the target
    column, so the very same fp32 value enters the maximum and the positive: ``ce = (m - positive) +
    log(sum)`` keeps full relative precision even for a confident row, whose loss is tiny next to
    logits of ~100).
    Backward: each tile is recomputed; ``d ce_i / d logit_ij = p_ij - [j = target]`` with
    ``p = exp(logit - m) / sum``, the target entry evaluated as ``expm1((logit - m) - log(sum))`` (no
    cancellation), the whole tile formed in fp32 before any cast.
    """

    @staticmethod
    def forward(ctx, a, b, scale, offset, chunk):
        rows, cols, dev = a.shape[0], b.shape[0], a.device
        f32 = {"dtype": torch.float32, "device": dev}
        prods = _Products(a, b, scale, chunk)
        row_max = torch.full((rows,), _NEG_INF, **f32)
        row_sum = torch.zeros(rows, **f32)
        before = torch.full((rows,), _NEG_INF, **f32)
        positive = torch.empty(rows, **f32)
        buf, work = _scratch(chunk, rows, cols, dev)
        for r0, r1 in _spans(rows, chunk):
            prods.rows(r0, r1)
            for c0, c1 in _spans(cols, chunk):
                logits = prods.logits(c0, c1, buf)
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    positive[lo:hi] = logits[lo - r0 : hi - r0, cl : cl + hi - lo].diagonal()
                tile_max = logits.amax(dim=1)
                if c1 <= offset + r0:  # every column before every row's target
                    torch.maximum(before[r0:r1], tile_max, out=before[r0:r1])
                elif c0 < offset + r1 - 1:  # some columns before some targets
                    mask = _before_mask(r0, r1, c0, c1, offset, dev)
                    masked = torch.where(mask, logits, _NEG_INF).amax(dim=1)
                    torch.maximum(before[r0:r1], masked, out=before[r0:r1])
                w = work[: logits.numel()].view(logits.shape)
                _online_update(row_max[r0:r1], row_sum[r0:r1], logits, tile_max, 1, w)
        log_sum = row_sum.log_()
        ctx.save_for_backward(a, b, scale, row_max, log_sum)
        ctx.offset, ctx.chunk = offset, chunk
        correct = (before < positive) & (positive >= row_max)
        ctx.mark_non_differentiable(correct)
        return (row_max - positive) + log_sum, correct

    @staticmethod
    def backward(ctx, grad_ce, _grad_correct):
        with no_autocast(grad_ce.device):
            return _ChunkedCrossEntropy._backward(ctx, grad_ce)

    @staticmethod
    def _backward(ctx, grad_ce):
        a, b, scale, row_max, log_sum = ctx.saved_tensors
        offset, chunk = ctx.offset, ctx.chunk
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        rows, cols, dev = a.shape[0], b.shape[0], a.device
        prods = _Products(a, b, scale, chunk)
        g = grad_ce.float()
        weight = g * torch.exp(-log_sum)  # g_i / sum_i
        grad_a, acc_b = prods.buffers(need_a, need_b)
        buf, work = _scratch(chunk, rows, cols, dev)
        for r0, r1 in _spans(rows, chunk):
            prods.rows(r0, r1)
            acc = prods.row_accumulator(grad_a, need_s)
            for c0, c1 in _spans(cols, chunk):
                logits = prods.logits(c0, c1, buf)
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    band = (slice(lo - r0, hi - r0), slice(cl, cl + hi - lo))
                    target = logits[band].diagonal().clone()
                grad = torch.sub(logits, row_max[r0:r1, None], out=work[: logits.numel()].view(logits.shape))
                grad.exp_().mul_(weight[r0:r1, None])
                if lo < hi:  # p - 1 at the target, without cancellation
                    fix = torch.expm1(target.sub_(row_max[lo:hi]).sub_(log_sum[lo:hi])).mul_(g[lo:hi])
                    grad[band].diagonal().copy_(fix)
                prods.accumulate(grad, c0, c1, acc, acc_b, need_s)
            prods.finish_rows(acc, grad_a, need_s)
        grad_b, grad_s = prods.finish(acc_b, need_s)
        return grad_a, grad_b, grad_s, None, None


class _SymmetricChunkedCrossEntropy(torch.autograd.Function):
    """Both directions of the square block ``L = scale * a @ b.T`` (targets on the diagonal) from one
    product per tile: image-to-text cross-entropies are row-wise, text-to-image ones column-wise.

    Forward per tile: row and column maxima, online row and column ``sum exp``, positives from the
    diagonal tiles, maxima before the target (strictly lower / upper triangle) for the accuracies.
    Backward per tile: ``G = g_row * P_row + g_col * P_col`` minus the targets' ones (evaluated with
    ``expm1``), then ``grad_a += G b``, ``grad_b += G^T a``: one recompute and two products.
    """

    @staticmethod
    def forward(ctx, a, b, scale, chunk):
        n, dev = a.shape[0], a.device
        f32 = {"dtype": torch.float32, "device": dev}
        prods = _Products(a, b, scale, chunk)
        row_max, col_max = torch.full((n,), _NEG_INF, **f32), torch.full((n,), _NEG_INF, **f32)
        row_sum, col_sum = torch.zeros(n, **f32), torch.zeros(n, **f32)
        row_before, col_before = torch.full((n,), _NEG_INF, **f32), torch.full((n,), _NEG_INF, **f32)
        positive = torch.empty(n, **f32)
        buf, work = _scratch(chunk, n, n, dev)
        spans = _spans(n, chunk)
        edge = spans[0][1]
        # additive mask of a diagonal tile: 0 strictly below the diagonal (column before the row's
        # target), -inf elsewhere; its transpose selects the rows before each column's target
        below = torch.full((edge, edge), _NEG_INF, **f32).triu_()
        above = below.mT.contiguous()
        for r0, r1 in spans:
            prods.rows(r0, r1)
            for c0, c1 in spans:
                logits = prods.logits(c0, c1, buf)
                row_tmax, col_tmax = logits.amax(dim=1), logits.amax(dim=0)
                if c0 < r0:  # columns before these rows' targets: row "before" maxima
                    torch.maximum(row_before[r0:r1], row_tmax, out=row_before[r0:r1])
                elif c0 > r0:  # rows before these columns' targets
                    torch.maximum(col_before[c0:c1], col_tmax, out=col_before[c0:c1])
                else:  # a diagonal tile (square: the same spans on both sides)
                    positive[r0:r1] = logits.diagonal()
                    n_d = r1 - r0
                    masked = torch.add(logits, below[:n_d, :n_d], out=work[: logits.numel()].view(logits.shape))
                    torch.maximum(row_before[r0:r1], masked.amax(dim=1), out=row_before[r0:r1])
                    masked = torch.add(logits, above[:n_d, :n_d], out=masked)
                    torch.maximum(col_before[c0:c1], masked.amax(dim=0), out=col_before[c0:c1])
                w = work[: logits.numel()].view(logits.shape)
                _online_update(row_max[r0:r1], row_sum[r0:r1], logits, row_tmax, 1, w)
                _online_update(col_max[c0:c1], col_sum[c0:c1], logits, col_tmax, 0, logits)
        row_log, col_log = row_sum.log_(), col_sum.log_()
        ctx.save_for_backward(a, b, scale, row_max, row_log, col_max, col_log)
        ctx.chunk = chunk
        correct_row = (row_before < positive) & (positive >= row_max)
        correct_col = (col_before < positive) & (positive >= col_max)
        ctx.mark_non_differentiable(correct_row, correct_col)
        return (row_max - positive) + row_log, (col_max - positive) + col_log, correct_row, correct_col

    @staticmethod
    def backward(ctx, grad_row, grad_col, _grad_cr, _grad_cc):
        with no_autocast(grad_row.device):
            return _SymmetricChunkedCrossEntropy._backward(ctx, grad_row, grad_col)

    @staticmethod
    def _backward(ctx, grad_row, grad_col):
        a, b, scale, row_max, row_log, col_max, col_log = ctx.saved_tensors
        chunk = ctx.chunk
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        n, dev = a.shape[0], a.device
        prods = _Products(a, b, scale, chunk)
        g_row, g_col = grad_row.float(), grad_col.float()
        w_row, w_col = g_row * torch.exp(-row_log), g_col * torch.exp(-col_log)  # g / sum
        grad_a, acc_b = prods.buffers(need_a, need_b)
        buf, work = _scratch(chunk, n, n, dev)
        for r0, r1 in _spans(n, chunk):
            prods.rows(r0, r1)
            acc = prods.row_accumulator(grad_a, need_s)
            for c0, c1 in _spans(n, chunk):
                logits = prods.logits(c0, c1, buf)
                if r0 == c0:
                    target = logits.diagonal().clone()
                grad = torch.sub(logits, row_max[r0:r1, None], out=work[: logits.numel()].view(logits.shape))
                grad.exp_().mul_(w_row[r0:r1, None])
                p_col = logits.sub_(col_max[None, c0:c1]).exp_()
                grad.addcmul_(p_col, w_col[None, c0:c1])
                if r0 == c0:  # p - 1 at the targets of both directions, without cancellation
                    fix = torch.expm1((target - row_max[r0:r1]).sub_(row_log[r0:r1])).mul_(g_row[r0:r1])
                    fix.addcmul_(torch.expm1(target.sub_(col_max[c0:c1]).sub_(col_log[c0:c1])), g_col[c0:c1])
                    grad.diagonal().copy_(fix)
                prods.accumulate(grad, c0, c1, acc, acc_b, need_s)
            prods.finish_rows(acc, grad_a, need_s)
        grad_b, grad_s = prods.finish(acc_b, need_s)
        return grad_a, grad_b, grad_s, None


def chunked_cross_entropy(a: Tensor, b: Tensor, scale: Tensor, offset: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Row-wise cross-entropy of ``scale * a @ b.T`` (target of row ``i``: column ``offset + i``).

    The logits are formed in ``chunk_size x chunk_size`` fp32 tiles with an online (running-max)
    log-sum-exp and never materialised as a whole; the backward recomputes each tile. Memory is
    ``O(min(M, chunk_size) * chunk_size)`` for the tiles plus fp32 ``(M, D)`` and ``(K, D)`` gradient
    accumulators (and fp32 copies of the features where the products run in fp32). Differentiable in
    ``a``, ``b`` and ``scale``.

    Args:
        a: ``(M, D)`` rows.
        b: ``(K, D)`` columns, ``K >= offset + M``.
        scale: 0-d fp32 tensor multiplying the dot products.
        offset: Column of row 0's target.
        chunk_size: Tile edge.

    Returns:
        ``(ce, correct)``: fp32 ``(M,)`` cross-entropies and bool ``(M,)``, whether the row's first
        maximum is its target column (not differentiable).
    """
    if not 0 <= offset <= b.shape[0] - a.shape[0]:
        raise ValueError(f"targets offset {offset} + {a.shape[0]} rows exceed {b.shape[0]} columns")
    return _ChunkedCrossEntropy.apply(a, b, scale, offset, chunk_size)


def symmetric_chunked_cross_entropy(
    a: Tensor, b: Tensor, scale: Tensor, chunk_size: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both directions of the square block ``scale * a @ b.T`` (``a``, ``b``: ``(B, D)``, row ``i``
    of ``a`` pairs with row ``i`` of ``b``) from one product per tile.

    Returns ``(ce_a2b, ce_b2a, correct_a2b, correct_b2a)``: the fp32 ``(B,)`` cross-entropies of each
    row of ``a`` against all of ``b`` and of each row of ``b`` against all of ``a``, and whether each
    row's first maximum is its pair; the same values (to fp32 rounding) as two calls of
    :func:`chunked_cross_entropy` with offset 0, at half the matmul work. Memory as
    :func:`chunked_cross_entropy` plus four ``(B,)`` statistics.
    """
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"a square block needs as many rows as columns, got {a.shape[0]} and {b.shape[0]}")
    return _SymmetricChunkedCrossEntropy.apply(a, b, scale, chunk_size)


def chunked_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Both directions with the tiled kernels: one symmetric pass when this rank's block is the whole
    batch (world size 1), else :func:`chunked_cross_entropy` per direction (local rows against the
    gathered side)."""
    if batch.all_image is batch.image and batch.all_text is batch.text:
        ce_i2t, ce_t2i, ok_i2t, ok_t2i = symmetric_chunked_cross_entropy(batch.image, batch.text, scale, chunk_size)
    else:
        ce_i2t, ok_i2t = chunked_cross_entropy(batch.image, batch.all_text, scale, batch.offset, chunk_size)
        ce_t2i, ok_t2i = chunked_cross_entropy(batch.text, batch.all_image, scale, batch.offset, chunk_size)
    return with_bias(ModeOutput(ce_i2t, ce_t2i, ok_i2t, ok_t2i), bias)
