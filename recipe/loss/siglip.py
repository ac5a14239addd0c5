"""Sharded SigLIP (sigmoid) loss over gathered text embeddings, exact at every world size.

Definition, on the stacked global batch of ``B`` L2-normalised pairs ``(x_i, y_i)`` with logit
multiplier ``s`` (already exponentiated) and logit bias ``b``::

    l_ij = s * x_i . y_j + b,        z_ij = +1 if i == j else -1,
    L    = -(1 / B) * sum_i sum_j log sigmoid(z_ij * l_ij)

i.e. every image-text pair of the batch is an independent binary classification (the ``B`` positives
on the diagonal and the ``B (B - 1)`` negatives), normalised by the number of images, as in the
SigLIP paper and big_vision.

Sharding rule. With ``N`` data-parallel ranks holding ``M_r`` pairs each (``B = sum(M_r)``), rank
``r`` all-gathers the text embeddings (:func:`~recipe.loss.gather.all_gather_with_grad`: one
collective, reduce-scatter backward), computes only its own ``M_r x B`` block (its local images
against all texts; its positives sit in the columns ``offset .. offset + M_r`` with ``offset`` the
number of pairs held by lower ranks) and returns::

    loss_r = N / B * sum_{local i} sum_j -log sigmoid(z_ij * l_ij)

The blocks of all ranks tile the ``B x B`` matrix exactly once, so ``mean_r loss_r = L``. Gradients:
an image ``x_i`` enters only its own rank's block, so its rank's gradient is ``N * dL/dx_i``; a text
``y_j`` enters every rank's block and the reduce-scatter backward of the gather hands its owner
``sum_r d loss_r / d y_j = N * dL/dy_j``; ``s`` and ``b`` are not gathered, each rank holds
``d loss_r / d s`` (and ``/ d b``), whose mean over ranks is ``dL/ds``. The data-parallel mean of
the gradients (DeepSpeed, DDP: the ``1 / N``) is therefore the full-batch gradient of every
parameter. With equal local batches ``N / B = 1 / M``, the normalisation open_clip's
``SigLipLoss`` uses (it divides by the local batch size), so the rank losses agree with it.
Ranks of **different sizes** are handled as :class:`~recipe.loss.ClipLoss` does: the sizes are
exchanged in one small all-gather that also carries the feature dim/dtype and a non-finite flag (so
every rank raises the same ``ValueError``), read on the host only on the first call (and when every
rank's local batch shape changes) and checked on the device afterwards (no host synchronisation in
the steady state, :mod:`recipe.loss.inputs`), or passed as ``sizes=`` with ``validate=False`` to skip
that exchange. Only the texts are gathered (the images of other ranks
are never needed), half the traffic of gathering both sides; big_vision and open_clip pass the texts
around a ring instead, which gives the same sums.

Modes (:data:`SIGLIP_MODES`):

* ``"plain"``: materialises the ``M x B`` fp32 logit block and lets autograd differentiate
  ``-logsigmoid(z * l)``.
* ``"chunked"``: a custom :class:`torch.autograd.Function` walks the block in
  ``chunk_size x chunk_size`` tiles, keeping per-row loss sums and the statistics of the metrics;
  its backward recomputes each tile and accumulates the exact gradients of the features, ``s`` and
  ``b``. Extra memory is ``O(B * D + chunk_size**2)``: the block is never materialised.

Numerics: logits are fp32 whatever the feature dtype (:mod:`recipe.loss.matmul`, also inside an
autocast region); ``-log sigmoid(u)`` is evaluated as ``softplus(-u)`` by ``F.logsigmoid`` (no
overflow, no ``log(0)``); the logit gradient ``sigmoid(l) - [i == j]`` is formed as ``-sigmoid(-l)``
on the diagonal, without cancellation for confident positives. Feature gradients of bf16 features
use a bf16 gradient matrix with fp32 accumulation, like the CLIP loss.

Metrics (same keys as :class:`~recipe.loss.ClipLoss`): ``acc_i2t``, the fraction of images whose
positive logit is the largest of their row (over all ``B`` texts), and ``acc_t2i``, the fraction of
texts whose positive is the largest of their column (over all ``B`` images; ties count as correct
in both). The column maxima of the other ranks' blocks arrive by one ``B``-float all-reduce (max)
in the forward, no host synchronisation. Each rank returns its share (times ``N / B``) so that the
mean over ranks is the full-batch value.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from .clip import LossResult, ShardedLoss
from .gather import all_gather_with_grad
from .inputs import check_inputs, rank_sizes
from .matmul import MatmulF32, grad_matmul_dtype, mm_f32, no_autocast

__all__ = ["SIGLIP_MODES", "SigLipLoss", "SigmoidOutput", "chunked_sigmoid_loss"]


class SigmoidOutput(NamedTuple):
    """Per-row results of a SigLIP mode on one rank's ``M x B`` block.

    Attributes:
        loss: fp32 ``(M,)``, ``sum_j -log sigmoid(z_ij l_ij)`` of each local image (differentiable).
        positive: fp32 ``(M,)`` positive logit ``l_ii`` of each local pair (detached).
        row_max: fp32 ``(M,)`` largest logit of each local row (detached).
        col_max: fp32 ``(B,)`` largest logit of each column over this rank's rows (detached).
    """

    loss: Tensor
    positive: Tensor
    row_max: Tensor
    col_max: Tensor


#: A SigLIP mode: ``fn(image (M, D), all_text (B, D), scale, bias, offset, chunk_size)`` with ``scale``
#: and ``bias`` 0-d fp32 tensors.
SigLipModeFn = Callable[[Tensor, Tensor, Tensor, Tensor, int, int], SigmoidOutput]


def plain_sigmoid_loss(
    a: Tensor, b: Tensor, scale: Tensor, bias: Tensor, offset: int, chunk_size: int
) -> SigmoidOutput:
    """Materialises the ``M x B`` fp32 logit block; ``chunk_size`` is unused."""
    del chunk_size
    logits = MatmulF32.apply(a, b.mT) * scale + bias
    sign = torch.full(logits.shape, -1.0, dtype=logits.dtype, device=logits.device)
    sign.diagonal(offset).fill_(1.0)
    loss = -F.logsigmoid(logits * sign).sum(dim=1)
    stats = logits.detach()
    return SigmoidOutput(loss, stats.diagonal(offset).clone(), stats.amax(dim=1), stats.amax(dim=0))


def _diagonal_band(r0: int, r1: int, c0: int, c1: int, offset: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of tile rows ``[r0, r1)`` whose positive column ``offset + i`` is in ``[c0, c1)``."""
    return max(r0, c0 - offset), min(r1, c1 - offset)


class _ChunkedSigmoidLoss(torch.autograd.Function):
    """Row sums of ``-log sigmoid(z * (scale * a @ b.T + bias))``, positives at column ``offset + i``.

    Forward: tile by tile, the logits (fp32), the positives negated in place (``u = -z * l``), and
    ``softplus(u) = -logsigmoid(-u)`` summed per row; row and column maxima and the positives for the
    metrics. Backward: each tile is recomputed and ``d loss_i / d l_ij = sigmoid(l_ij) - [positive]``
    (``-sigmoid(-l)`` at the positive) weighted by the incoming row gradient gives ``G``; then
    ``grad_a = s G b``, ``grad_b = s G^T a``, ``grad_s = sum G * (a . b)``, ``grad_bias = sum G``.
    """

    @staticmethod
    def forward(ctx, a, b, scale, bias, offset, chunk):
        rows, cols = a.shape[0], b.shape[0]
        f32 = {"dtype": torch.float32, "device": a.device}
        loss = torch.zeros(rows, **f32)
        positive = torch.empty(rows, **f32)
        row_max = torch.full((rows,), float("-inf"), **f32)
        col_max = torch.full((cols,), float("-inf"), **f32)
        for r0 in range(0, rows, chunk):
            r1 = min(rows, r0 + chunk)
            for c0 in range(0, cols, chunk):
                c1 = min(cols, c0 + chunk)
                logits = mm_f32(a[r0:r1], b[c0:c1].mT).mul_(scale).add_(bias)
                row_max[r0:r1] = torch.maximum(row_max[r0:r1], logits.amax(dim=1))
                col_max[c0:c1] = torch.maximum(col_max[c0:c1], logits.amax(dim=0))
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    diag = logits[lo - r0 : hi - r0, cl : cl + hi - lo].diagonal()
                    positive[lo:hi] = diag
                    diag.neg_()
                loss[r0:r1] -= F.logsigmoid(logits.neg_()).sum(dim=1)
        ctx.save_for_backward(a, b, scale, bias)
        ctx.offset, ctx.chunk = offset, chunk
        ctx.mark_non_differentiable(positive, row_max, col_max)
        return loss, positive, row_max, col_max

    @staticmethod
    def backward(ctx, grad_loss, *_grad_stats):
        with no_autocast(grad_loss.device):
            return _ChunkedSigmoidLoss._backward(ctx, grad_loss)

    @staticmethod
    def _backward(ctx, grad_loss):
        a, b, scale, bias = ctx.saved_tensors
        offset, chunk = ctx.offset, ctx.chunk
        need_a, need_b, need_s, need_bias = ctx.needs_input_grad[:4]
        rows, cols = a.shape[0], b.shape[0]
        gdtype = grad_matmul_dtype(a.dtype)
        g = grad_loss.float()
        grad_a = torch.zeros(a.shape, dtype=torch.float32, device=a.device) if need_a else None
        grad_b = torch.empty_like(b) if need_b else None
        grad_s = torch.zeros((), dtype=torch.float32, device=a.device)
        grad_bias = torch.zeros((), dtype=torch.float32, device=a.device)
        for c0 in range(0, cols, chunk):
            c1 = min(cols, c0 + chunk)
            b_c = b[c0:c1]
            acc_b = torch.zeros(b_c.shape, dtype=torch.float32, device=b.device) if need_b else None
            for r0 in range(0, rows, chunk):
                r1 = min(rows, r0 + chunk)
                a_r = a[r0:r1]
                dots = mm_f32(a_r, b_c.mT)
                gl = (dots * scale).add_(bias)
                lo, hi = _diagonal_band(r0, r1, c0, c1, offset)
                if lo < hi:
                    cl = offset + lo - c0
                    band = (slice(lo - r0, hi - r0), slice(cl, cl + hi - lo))
                    positive_logit = gl[band].diagonal().clone()
                gl.sigmoid_()  # d loss / d l of a negative
                if lo < hi:  # of a positive: sigmoid(l) - 1 = -sigmoid(-l), without cancellation
                    gl[band].diagonal().copy_(torch.sigmoid(positive_logit.neg_()).neg_())
                gl.mul_(g[r0:r1, None])
                if need_s:
                    grad_s += torch.dot(gl.view(-1), dots.view(-1))
                if need_bias:
                    grad_bias += gl.sum()
                del dots
                gl_m = gl.to(gdtype)
                if need_a:
                    grad_a[r0:r1] += mm_f32(gl_m, b_c)
                if need_b:
                    acc_b += mm_f32(gl_m.mT, a_r)
            if need_b:
                grad_b[c0:c1] = (acc_b * scale).to(b.dtype)
        if need_a:
            grad_a = (grad_a * scale).to(a.dtype)
        return (
            grad_a,
            grad_b,
            grad_s.reshape(scale.shape) if need_s else None,
            grad_bias.reshape(bias.shape) if need_bias else None,
            None,
            None,
        )


def chunked_sigmoid_loss(
    a: Tensor, b: Tensor, scale: Tensor, bias: Tensor, offset: int, chunk_size: int
) -> SigmoidOutput:
    """Per-row SigLIP loss of the block ``scale * a @ b.T + bias`` (row ``i``'s positive: column
    ``offset + i``), in ``chunk_size x chunk_size`` fp32 tiles that are recomputed in the backward.

    Memory is ``O(chunk_size**2)`` for a tile plus fp32 ``(M, D)`` and ``(chunk_size, D)`` gradient
    accumulators and ``(B,)`` column maxima. Differentiable in ``a``, ``b``, ``scale`` and ``bias``.

    Args:
        a: ``(M, D)`` local image features.
        b: ``(K, D)`` gathered text features, ``K >= offset + M``.
        scale: 0-d fp32 multiplier of the dot products.
        bias: 0-d fp32 bias added to every logit.
        offset: Column of row 0's positive.
        chunk_size: Tile edge.
    """
    if not 0 <= offset <= b.shape[0] - a.shape[0]:
        raise ValueError(f"positives offset {offset} + {a.shape[0]} rows exceed {b.shape[0]} columns")
    return SigmoidOutput(*_ChunkedSigmoidLoss.apply(a, b, scale, bias, offset, chunk_size))


#: SigLIP loss modes by name (the CLIP loss's Triton ``"fused"`` mode has no sigmoid counterpart).
SIGLIP_MODES: dict[str, SigLipModeFn] = {"plain": plain_sigmoid_loss, "chunked": chunked_sigmoid_loss}


class SigLipLoss(ShardedLoss):
    """SigLIP's pairwise sigmoid loss over the text embeddings gathered from all ranks.

    Call ``loss, metrics = loss_fn(image_features, text_features, logit_scale, logit_bias)`` on every
    rank of the group with that rank's features; ``loss`` is this rank's share of the full-batch loss
    (the mean over ranks is the full-batch loss, the data-parallel mean of the gradients the
    full-batch gradient; see the module docstring), ``metrics`` the accuracies ``acc_i2t`` and
    ``acc_t2i`` in the same convention (:class:`~recipe.loss.LossResult`). Ranks may hold different
    numbers of pairs.

    Args:
        mode: A key of :data:`SIGLIP_MODES`: ``"plain"`` or ``"chunked"``.
        chunk_size: Tile edge of the chunked mode.
        group, validate, cache_sizes: As :class:`~recipe.loss.clip.ShardedLoss`.
    """

    MODES = SIGLIP_MODES

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None,
        sizes: list[int] | None = None,
    ) -> LossResult:
        """Computes this rank's share of the loss and of the accuracies.

        Args:
            image_features: Local, L2-normalised image embeddings ``(M, D)``.
            text_features: Local, L2-normalised text embeddings ``(M, D)``, pair ``i`` matching image
                ``i``; same dtype and device.
            logit_scale: The multiplier ``s`` (already exponentiated), a single value (``(1,)`` or 0-d).
            logit_bias: The bias ``b``, a single value; ``None`` means ``b = 0``.
            sizes: Every rank's number of pairs in rank order, when the caller knows them; with
                ``validate=False`` this skips the size exchange (no collective).

        Returns:
            ``(loss, metrics)``, a :class:`~recipe.loss.LossResult`.

        Raises:
            ValueError: Malformed inputs, non-finite inputs (``validate``), an empty local batch or
                mismatched feature dimensions/dtypes across ranks (raised on every rank).
        """
        image, text = image_features, text_features
        scale, bias, bad = check_inputs(image, text, logit_scale, logit_bias, self.validate)
        bias = torch.zeros((), device=image.device) if bias is None else bias
        sizes, world, rank = rank_sizes(image, bad, sizes, self.group, "SigLIP loss", self._size_cache)
        if world == 1:
            all_text = text
        else:
            (all_text,) = all_gather_with_grad(text, group=self.group, sizes=sizes)

        offset = sum(sizes[:rank])
        with no_autocast(image.device):  # keep the fp32 logits even inside an autocast region
            out = SIGLIP_MODES[self.mode](image, all_text, scale, bias, offset, self.chunk_size)
            col_max = out.col_max
            if world > 1:  # the other ranks' rows of each column: one small all-reduce, no host sync
                col_max = col_max.clone()
                dist.all_reduce(col_max, op=dist.ReduceOp.MAX, group=self.group)
        weight = world / sum(sizes)
        loss = out.loss.sum() * weight
        metrics = {
            "acc_i2t": (out.positive >= out.row_max).sum().float() * weight,
            "acc_t2i": (out.positive >= col_max[offset : offset + image.shape[0]]).sum().float() * weight,
        }
        return LossResult(loss, metrics)
