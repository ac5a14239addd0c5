"""The ``"chunked"`` loss mode: tiled online log-sum-exp cross-entropy that never materialises the
``M x B`` logit block (the backward recomputes each tile)."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import GatheredBatch, ModeOutput, with_bias
from .matmul import grad_matmul_dtype, mm_f32, no_autocast

__all__ = ["chunked_cross_entropy", "chunked_mode"]


def _diagonal_band(r0: int, r1: int, c0: int, c1: int, offset: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of tile rows ``[r0, r1)`` whose target column ``offset + i`` is in ``[c0, c1)``."""
    return max(r0, c0 - offset), min(r1, c1 - offset)


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Row cross-entropy of ``scale * a @ b.T`` with target column ``offset + i``, tile by tile.

    Forward: per row a running maximum ``m``, running ``sum exp(logit - m)``, running arg-max and the
    positive logit (read from the tile holding the target column, so the very same fp32 value enters
    the maximum and the positive: ``ce = (m - positive) + log(sum)`` keeps full relative precision
    even for a confident row, whose loss is tiny next to logits of ~100).
    Backward: each tile is recomputed; ``d ce_i / d logit_ij = p_ij - [j = target]``, the target
    entry evaluated as ``expm1(logit - m - log(sum))`` (no cancellation) and the whole matrix formed
    in fp32 before any cast.
    """

    @staticmethod
    def forward(ctx, a, b, scale, offset, chunk):  # noqa: D102
        rows, cols = a.shape[0], b.shape[0]
        f32 = dict(dtype=torch.float32, device=a.device)
        row_max = torch.empty(rows, **f32)
        log_sum = torch.empty(rows, **f32)
        positive = torch.empty(rows, **f32)
        arg = torch.empty(rows, dtype=torch.int64, device=a.device)
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            run_max = torch.full((r1 - r0,), float("-inf"), **f32)
            run_sum = torch.zeros(r1 - r0, **f32)
            run_arg = torch.zeros(r1 - r0, dtype=torch.int64, device=a.device)
            for c0 in range(0, cols, chunk):
                c1 = min(cols, c0 + chunk)
                logits = mm_f32(a[r0:r1], b[c0:c1].mT).mul_(scale)
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    positive[lo:hi] = logits[lo - r0 : hi - r0, cl : cl + hi - lo].diagonal()
                tile_max, tile_arg = logits.max(dim=1)
                # strict '>' keeps the first maximum, as torch.argmax over the whole row would
                run_arg = torch.where(tile_max > run_max, tile_arg + c0, run_arg)
                new_max = torch.maximum(run_max, tile_max)
                run_sum.mul_(torch.exp(run_max - new_max))
                run_sum.add_(logits.sub_(new_max[:, None]).exp_().sum(dim=1))
                run_max = new_max
            row_max[r0:r1] = run_max
            log_sum[r0:r1] = run_sum.log()
            arg[r0:r1] = run_arg
        ctx.save_for_backward(a, b, scale, row_max, log_sum)
        ctx.offset, ctx.chunk = offset, chunk
        ctx.mark_non_differentiable(arg)
        return (row_max - positive) + log_sum, arg

    @staticmethod
    def backward(ctx, grad_ce, _grad_arg):  # noqa: D102
        with no_autocast(grad_ce.device):
            return _ChunkedCrossEntropy._backward(ctx, grad_ce)

    @staticmethod
    def _backward(ctx, grad_ce):
        a, b, scale, row_max, log_sum = ctx.saved_tensors
        offset, chunk = ctx.offset, ctx.chunk
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        rows, cols = a.shape[0], b.shape[0]
        gdtype = grad_matmul_dtype(a.dtype)
        g = grad_ce.float()
        grad_a = torch.zeros(a.shape, dtype=torch.float32, device=a.device) if need_a else None
        grad_b = torch.empty_like(b) if need_b else None
        grad_s = torch.zeros((), dtype=torch.float32, device=a.device)
        for c0 in range(0, cols, chunk):
            c1 = min(cols, c0 + chunk)
            b_c = b[c0:c1]
            acc_b = torch.zeros(b_c.shape, dtype=torch.float32, device=b.device) if need_b else None
            for r0 in range(0, rows, chunk):
                r1 = min(rows, r0 + chunk)
                a_r = a[r0:r1]
                dots = mm_f32(a_r, b_c.mT)
                # shifted = logit - m - log(sum) = log p
                shifted = (dots * scale).sub_(row_max[r0:r1, None]).sub_(log_sum[r0:r1, None])
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    target_log_p = shifted[lo - r0 : hi - r0, cl : cl + hi - lo].diagonal().clone()
                gp = shifted.exp_()
                if lo < hi:  # p - 1 at the target, without cancellation
                    gp[lo - r0 : hi - r0, cl : cl + hi - lo].diagonal().copy_(torch.expm1(target_log_p))
                gp.mul_(g[r0:r1, None])
                if need_s:  # d ce_i / d scale = sum_j (p_ij - [j = target]) * dots_ij
                    grad_s += torch.dot(gp.view(-1), dots.view(-1))
                del dots
                gp_m = gp.to(gdtype)
                if need_a:
                    grad_a[r0:r1] += mm_f32(gp_m, b_c)
                if need_b:
                    acc_b += mm_f32(gp_m.mT, a_r)
            if need_b:
                grad_b[c0:c1] = (acc_b * scale).to(b.dtype)
        if need_a:
            grad_a = (grad_a * scale).to(a.dtype)
        return grad_a, grad_b, (grad_s.reshape(scale.shape) if need_s else None), None, None


def chunked_cross_entropy(a: Tensor, b: Tensor, scale: Tensor, offset: int, chunk_size: int) -> tuple[Tensor, Tensor]:
    """Row-wise cross-entropy of ``scale * a @ b.T`` (target of row ``i``: column ``offset + i``).

    The logits are formed in ``chunk_size x chunk_size`` fp32 tiles with an online (running-max)
    log-sum-exp and never materialised as a whole; the backward recomputes each tile. Memory is
    ``O(min(M, chunk_size) * chunk_size)`` for the tiles plus fp32 ``(M, D)`` and ``(chunk_size, D)``
    gradient accumulators. Differentiable in ``a``, ``b`` and ``scale``.

    Args:
        a: ``(M, D)`` rows.
        b: ``(K, D)`` columns, ``K >= offset + M``.
        scale: 0-d fp32 tensor multiplying the dot products.
        offset: Column of row 0's target.
        chunk_size: Tile edge.

    Returns:
        ``(ce, argmax)``: fp32 ``(M,)`` cross-entropies and the int64 ``(M,)`` column of each row's
        first maximum (not differentiable).
    """
    if not 0 <= offset <= b.shape[0] - a.shape[0]:
        raise ValueError(f"targets offset {offset} + {a.shape[0]} rows exceed {b.shape[0]} columns")
    return _ChunkedCrossEntropy.apply(a, b, scale, offset, chunk_size)


def chunked_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Both directions with :func:`chunked_cross_entropy` (local rows against the gathered side)."""
    targets = batch.targets()
    ce_i2t, arg_i2t = chunked_cross_entropy(batch.image, batch.all_text, scale, batch.offset, chunk_size)
    ce_t2i, arg_t2i = chunked_cross_entropy(batch.text, batch.all_image, scale, batch.offset, chunk_size)
    return with_bias(ModeOutput(ce_i2t, ce_t2i, arg_i2t == targets, arg_t2i == targets), bias)
