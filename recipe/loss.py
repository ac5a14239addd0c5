"""Sharded gathered-embedding contrastive (CLIP) loss, exact at every world size.

With ``N`` data-parallel ranks holding ``M_r`` image-text pairs each (``B = sum(M_r)``), every rank
all-gathers the image and text embeddings, computes only its own ``M_r x B`` block in each direction
(local images against all texts, local texts against all images) with targets offset by the number
of rows held by lower ranks, and returns its share of the full ``B x B`` loss::

    loss_r = N / B * sum_{local rows i} (CE_i2t(i) + CE_t2i(i)) / 2

so that the data-parallel *mean* over ranks (what DeepSpeed and DDP do with gradients) is exactly the
full-batch loss ``mean_i (CE_i2t(i) + CE_t2i(i)) / 2``. With equal local batches ``N / B = 1 / M``,
i.e. each rank returns the mean over its local rows.

The all-gather carries a full backward: the gradient of the gathered tensor is reduce-scattered
(summed) to the rank that owns each row. The gradient a rank sees for its local features is therefore
``sum_s d loss_s / d x_r = N * d loss_full / d x_r``, and after the data-parallel mean of the parameter
gradients (the ``1 / N``) every parameter gradient equals the gradient of the full-batch loss. The
logit scale (and bias) are not gathered: their per-rank gradients are ``d loss_r / d s`` and their
data-parallel mean is ``d loss_full / d s``.

Ranks with **different local batch sizes are handled exactly** (not rejected): the local sizes are
exchanged with one small all-gather per call, the features are padded to the largest local size for
the collective and unpadded afterwards, targets are offset by the sizes of the lower ranks, and the
``N / B`` weight above keeps the data-parallel mean equal to the full-batch loss. The size exchange
is one tiny collective plus a host synchronisation per call; it also carries a flag for non-finite
inputs, so that every rank raises the same ``ValueError`` instead of one rank raising and the others
hanging in the next collective.

Three modes are provided (see :data:`LOSS_MODES`; a new mode is one more entry in that dict):

* ``"plain"``: materialises the two ``M x B`` logit blocks in fp32 and uses ``F.cross_entropy``.
* ``"chunked"``: a custom :class:`torch.autograd.Function` computes each row's log-sum-exp over the
  gathered side in tiles of ``chunk_size x chunk_size`` with an online (running max) log-sum-exp, and
  its backward recomputes each tile. Extra memory is ``O(min(M, chunk)·chunk + B·D)``: the ``M x B``
  block is never materialised.
* ``"fused"``: Triton kernels streaming tiles of the block with online row (and, at world size 1,
  column) log-sum-exp statistics and a tile-recomputing backward; see :mod:`recipe.loss_kernels`.

Numerics (both modes): logits, log-sum-exp, softmax and the logit-scale gradient are computed in
fp32 whatever the feature dtype (16-bit feature products are exact in fp32 and are accumulated in
fp32: ``torch.mm(..., out_dtype=torch.float32)`` on CUDA, an upcast elsewhere), so a logit scale of
100 with fp16 features neither overflows nor loses the logits' precision. In the backward, the
softmax-gradient matrix is cast to bf16 for the two feature-gradient matmuls when the features are
bf16 (tensor-core speed, fp32 accumulation, error of the order of the bf16 rounding of the returned
gradient itself); for fp16 features it stays fp32 (fp16 would underflow ``p_ij / B``), as it does
for fp32 features, where both modes are exact to fp32 rounding.

A scalar ``logit_bias`` (SigLIP style) is added to every logit in both modes. Softmax cross-entropy
is invariant to a constant added to all logits of a row, so the bias changes neither the loss nor the
feature gradients and its own gradient is zero (exactly zero in the chunked mode, fp32 rounding in the
plain mode); it is accepted so that models carrying a bias can share the loss call.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "ClipLoss",
    "GatheredBatch",
    "LOSS_MODES",
    "ModeOutput",
    "all_gather_with_grad",
    "chunked_cross_entropy",
]


# --------------------------------------------------------------------------------------------------
# Process-group helpers and the autograd all-gather
# --------------------------------------------------------------------------------------------------


def _world(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Returns ``(world_size, rank)`` of ``group``; ``(1, 0)`` when torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _all_gather_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _exchange_sizes(rows: int, device: torch.device, group: dist.ProcessGroup | None) -> list[int]:
    world, _ = _world(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    table = torch.empty(world, dtype=torch.int64, device=device)
    _all_gather_single(table, mine, group)
    return [int(v) for v in table.tolist()]


class _AllGatherRows(torch.autograd.Function):
    """All-gathers several tensors along dim 0 in one collective; backward is a reduce-scatter sum."""

    @staticmethod
    def forward(ctx, group, sizes, rank, *tensors):  # noqa: D102  (documented on the public wrapper)
        rows = tensors[0].shape[0]
        widths = [math.prod(t.shape[1:]) for t in tensors]
        packed = torch.cat([t.reshape(rows, w) for t, w in zip(tensors, widths)], dim=1)
        world, m_max = len(sizes), max(sizes)
        if rows < m_max:
            packed = torch.cat([packed, packed.new_zeros(m_max - rows, packed.shape[1])])
        gathered = packed.new_empty(world * m_max, packed.shape[1])
        _all_gather_single(gathered, packed.contiguous(), group)
        if min(sizes) != m_max:
            gathered = torch.cat([gathered[r * m_max : r * m_max + m] for r, m in enumerate(sizes)])
        ctx.group, ctx.sizes, ctx.rank, ctx.widths = group, sizes, rank, widths
        ctx.shapes = [t.shape[1:] for t in tensors]
        outs, col = [], 0
        for shape, width in zip(ctx.shapes, widths):
            outs.append(gathered[:, col : col + width].reshape(gathered.shape[0], *shape))
            col += width
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):  # noqa: D102
        total = sum(ctx.sizes)
        ref = next(g for g in grads if g is not None)
        packed = torch.cat(
            [
                (g if g is not None else ref.new_zeros(total, *shape)).reshape(total, w)
                for g, shape, w in zip(grads, ctx.shapes, ctx.widths)
            ],
            dim=1,
        )
        world, m_max = len(ctx.sizes), max(ctx.sizes)
        if min(ctx.sizes) != m_max:
            padded = packed.new_zeros(world * m_max, packed.shape[1])
            start = 0
            for r, m in enumerate(ctx.sizes):
                padded[r * m_max : r * m_max + m] = packed[start : start + m]
                start += m
            packed = padded
        local = packed.new_empty(m_max, packed.shape[1])
        _reduce_scatter_single(local, packed.contiguous(), ctx.group)
        local = local[: ctx.sizes[ctx.rank]]
        outs, col = [], 0
        for shape, width in zip(ctx.shapes, ctx.widths):
            outs.append(local[:, col : col + width].reshape(local.shape[0], *shape))
            col += width
        return (None, None, None, *outs)


def all_gather_with_grad(
    *tensors: Tensor,
    group: dist.ProcessGroup | None = None,
    sizes: list[int] | None = None,
) -> tuple[Tensor, ...]:
    """All-gathers tensors along dim 0 with a full backward (reduce-scatter sum).

    All tensors must have the same dtype, device and number of rows on this rank; they are packed
    into one buffer so the whole call is a single collective (and a single one in the backward).
    Ranks may hold different numbers of rows: rows are padded to the largest for the collective and
    removed afterwards. The gradient of each gathered output is summed over ranks and each rank
    receives the rows it contributed. At world size 1 (or without torch.distributed) the inputs are
    returned unchanged, so the operation is the identity there.

    Args:
        *tensors: Local tensors of shape ``(M_r, ...)``.
        group: Process group; ``None`` for the default group.
        sizes: Every rank's ``M_r`` in rank order, if already known; exchanged with an extra small
            all-gather otherwise.

    Returns:
        One gathered tensor of shape ``(sum(sizes), ...)`` per input, rows in rank order.
    """
    if not tensors:
        raise ValueError("all_gather_with_grad needs at least one tensor")
    first = tensors[0]
    for t in tensors[1:]:
        if t.shape[0] != first.shape[0] or t.dtype != first.dtype or t.device != first.device:
            raise ValueError("all_gather_with_grad tensors must share rows, dtype and device")
    world, rank = _world(group)
    if world == 1:
        return tuple(tensors)
    if sizes is None:
        sizes = _exchange_sizes(first.shape[0], first.device, group)
    if len(sizes) != world or sizes[rank] != first.shape[0]:
        raise ValueError(f"sizes {sizes} do not match world size {world} / local rows {first.shape[0]}")
    return _AllGatherRows.apply(group, list(sizes), rank, *tensors)


# --------------------------------------------------------------------------------------------------
# fp32-output matmuls
# --------------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _cuda_has_out_dtype_mm(dtype: torch.dtype) -> bool:
    try:  # probe with the layouts used here: a column slice of a wider buffer, transposed
        a = torch.ones(3, 8, dtype=dtype, device="cuda")[:, :4]
        out = torch.mm(a, a.mT, out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool((out == 4).all())
    except (RuntimeError, TypeError):
        return False


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with an fp32 result; 16-bit products are exact in fp32 and accumulated in fp32."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.dtype == b.dtype and a.is_cuda and _cuda_has_out_dtype_mm(a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _no_autocast(device: torch.device) -> torch.autocast:
    """Context disabling autocast: the loss chooses its own precisions."""
    return torch.autocast(device_type=device.type, enabled=False)


def _grad_matmul_dtype(feature_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax-gradient matrix in the feature-gradient matmuls (see module docstring)."""
    return torch.bfloat16 if feature_dtype == torch.bfloat16 else torch.float32


class _MatmulF32(torch.autograd.Function):
    """``a @ b`` with an fp32 result, and a backward that follows :func:`_grad_matmul_dtype`."""

    @staticmethod
    def forward(ctx, a, b):  # noqa: D102
        ctx.save_for_backward(a, b)
        return _mm_f32(a, b)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        a, b = ctx.saved_tensors
        with _no_autocast(a.device):
            g = grad.to(_grad_matmul_dtype(a.dtype))
            grad_a = _mm_f32(g, b.mT).to(a.dtype) if ctx.needs_input_grad[0] else None
            grad_b = _mm_f32(a.mT, g).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


# --------------------------------------------------------------------------------------------------
# Chunked cross-entropy
# --------------------------------------------------------------------------------------------------


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
                logits = _mm_f32(a[r0:r1], b[c0:c1].mT).mul_(scale)
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
        with _no_autocast(grad_ce.device):
            return _ChunkedCrossEntropy._backward(ctx, grad_ce)

    @staticmethod
    def _backward(ctx, grad_ce):
        a, b, scale, row_max, log_sum = ctx.saved_tensors
        offset, chunk = ctx.offset, ctx.chunk
        need_a, need_b, need_s = ctx.needs_input_grad[:3]
        rows, cols = a.shape[0], b.shape[0]
        gdtype = _grad_matmul_dtype(a.dtype)
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
                dots = _mm_f32(a_r, b_c.mT)
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
                    grad_a[r0:r1] += _mm_f32(gp_m, b_c)
                if need_b:
                    acc_b += _mm_f32(gp_m.mT, a_r)
            if need_b:
                grad_b[c0:c1] = (acc_b * scale).to(b.dtype)
        if need_a:
            grad_a = (grad_a * scale).to(a.dtype)
        return grad_a, grad_b, (grad_s.reshape(scale.shape) if need_s else None), None, None


def chunked_cross_entropy(
    a: Tensor, b: Tensor, scale: Tensor, offset: int, chunk_size: int
) -> tuple[Tensor, Tensor]:
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


# --------------------------------------------------------------------------------------------------
# Loss modes
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GatheredBatch:
    """What a loss mode sees on one rank.

    Attributes:
        image: Local image features ``(M, D)``.
        text: Local text features ``(M, D)``.
        all_image: Gathered image features ``(B, D)`` (rows in rank order, grads reduce-scattered).
        all_text: Gathered text features ``(B, D)``.
        offset: Row of ``all_image`` / ``all_text`` holding local pair 0 (the target offset).
    """

    image: Tensor
    text: Tensor
    all_image: Tensor
    all_text: Tensor
    offset: int

    def targets(self) -> Tensor:
        """Column index of each local row's positive in the ``M x B`` blocks."""
        return torch.arange(self.image.shape[0], device=self.image.device) + self.offset


class ModeOutput(NamedTuple):
    """Per-local-row results of a loss mode.

    Attributes:
        ce_i2t: fp32 ``(M,)`` cross-entropy of each local image against all texts.
        ce_t2i: fp32 ``(M,)`` cross-entropy of each local text against all images.
        correct_i2t: bool ``(M,)``, the row's arg-max is its positive (not differentiable).
        correct_t2i: bool ``(M,)``, same for text to image.
    """

    ce_i2t: Tensor
    ce_t2i: Tensor
    correct_i2t: Tensor
    correct_t2i: Tensor


#: A loss mode: ``fn(batch, scale, bias, chunk_size) -> ModeOutput`` with ``scale`` a 0-d fp32
#: tensor and ``bias`` a 0-d fp32 tensor or ``None``.
ModeFn = Callable[[GatheredBatch, Tensor, "Tensor | None", int], ModeOutput]


def _plain_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Materialises both ``M x B`` fp32 logit blocks; ``chunk_size`` is unused."""
    del chunk_size
    targets = batch.targets()
    out = []
    for local, other in ((batch.image, batch.all_text), (batch.text, batch.all_image)):
        logits = _MatmulF32.apply(local, other.mT) * scale
        if bias is not None:
            logits = logits + bias
        ce = F.cross_entropy(logits, targets, reduction="none")
        out.append((ce, logits.detach().argmax(dim=1) == targets))
    return ModeOutput(out[0][0], out[1][0], out[0][1], out[1][1])


def _chunked_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Tiled online log-sum-exp cross-entropy (:func:`chunked_cross_entropy`)."""
    targets = batch.targets()
    ce_i2t, arg_i2t = chunked_cross_entropy(batch.image, batch.all_text, scale, batch.offset, chunk_size)
    ce_t2i, arg_t2i = chunked_cross_entropy(batch.text, batch.all_image, scale, batch.offset, chunk_size)
    if bias is not None:
        # The bias shifts every logit of a row alike and cancels in the cross-entropy; keep it in the
        # graph so that it gets its (exactly zero) gradient like any parameter the loss uses.
        zero = bias - bias
        ce_i2t, ce_t2i = ce_i2t + zero, ce_t2i + zero
    return ModeOutput(ce_i2t, ce_t2i, arg_i2t == targets, arg_t2i == targets)


def _fused_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Fused tiled Triton kernels (:mod:`recipe.loss_kernels`, imported here: it imports Triton)."""
    from .loss_kernels import fused_mode

    return fused_mode(batch, scale, bias, chunk_size)


#: Loss modes by name. A new implementation (e.g. a fused kernel) is one more entry.
LOSS_MODES: dict[str, ModeFn] = {"plain": _plain_mode, "chunked": _chunked_mode, "fused": _fused_mode}


# --------------------------------------------------------------------------------------------------
# The module
# --------------------------------------------------------------------------------------------------


def _as_scalar(value: Tensor | float, name: str, device: torch.device) -> Tensor:
    t = torch.as_tensor(value, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold a single value, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.double()
    return t.float().reshape(())


class ClipLoss(nn.Module):
    """CLIP's symmetric contrastive loss over the embeddings gathered from all ranks.

    Call ``loss_fn(image_features, text_features, logit_scale, logit_bias=None)`` on every rank of
    the group with that rank's features; it returns this rank's share of the full-batch loss (a
    scalar fp32 tensor) such that the mean over ranks is the full-batch loss and the data-parallel
    mean of the gradients is the full-batch gradient (see the module docstring). Ranks may hold
    different numbers of pairs.

    Accuracies for logging: after each call ``loss_fn.last_metrics`` holds detached fp32 scalars
    ``"acc_i2t"`` (fraction of images whose most similar text is their own) and ``"acc_t2i"``, in the
    loss's convention: this rank's share, whose mean over ranks is the full-batch accuracy (with
    equal local batches: the local accuracy). ``return_metrics=True`` also returns them.

    Args:
        mode: A key of :data:`LOSS_MODES` (``"plain"``, ``"chunked"`` or ``"fused"``: Triton kernels
            on CUDA tensors, see :mod:`recipe.loss_kernels`).
        chunk_size: Tile edge of the chunked mode; caps the tile edge of the fused mode.
        group: Process group; ``None`` for the default group (or no torch.distributed at all).
        validate: Check that inputs are finite; costs one host synchronisation at world size 1 (at
            larger sizes the check rides on the size exchange). A non-finite input raises
            ``ValueError`` on every rank.
    """

    def __init__(
        self,
        mode: str = "plain",
        chunk_size: int = 4096,
        group: dist.ProcessGroup | None = None,
        validate: bool = True,
    ) -> None:
        super().__init__()
        if mode not in LOSS_MODES:
            raise ValueError(f"unknown ClipLoss mode {mode!r}; available: {sorted(LOSS_MODES)}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.mode = mode
        self.chunk_size = int(chunk_size)
        self.group = group
        self.validate = validate
        self.last_metrics: dict[str, Tensor] = {}

    def extra_repr(self) -> str:  # noqa: D102
        return f"mode={self.mode!r}, chunk_size={self.chunk_size}"

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        return_metrics: bool = False,
    ) -> Tensor | tuple[Tensor, dict[str, Tensor]]:
        """Computes this rank's share of the loss.

        Args:
            image_features: Local, L2-normalised image embeddings ``(M, D)``.
            text_features: Local, L2-normalised text embeddings ``(M, D)``, pair ``i`` matching image
                ``i``; same dtype and device.
            logit_scale: The multiplier (already exponentiated), a single value.
            logit_bias: Optional single value added to every logit.
            return_metrics: Also return the accuracy dict (also kept in ``last_metrics``).

        Returns:
            The scalar fp32 loss, or ``(loss, metrics)`` with ``return_metrics=True``.

        Raises:
            ValueError: Malformed inputs, non-finite inputs (``validate``), an empty local batch or
                mismatched feature dimensions/dtypes across ranks (raised on every rank).
        """
        image, text = image_features, text_features
        if image.dim() != 2 or image.shape != text.shape:
            raise ValueError(
                "image and text features must both be (M, D); got "
                f"{tuple(image.shape)} and {tuple(text.shape)}"
            )
        if image.dtype != text.dtype or image.device != text.device or not image.is_floating_point():
            raise ValueError(
                f"image and text features must share a floating dtype and device; got "
                f"{image.dtype}/{image.device} and {text.dtype}/{text.device}"
            )
        scale = _as_scalar(logit_scale, "logit_scale", image.device)
        bias = None if logit_bias is None else _as_scalar(logit_bias, "logit_bias", image.device)

        world, rank = _world(self.group)
        bad = None
        if self.validate:
            finite = torch.isfinite(image).all() & torch.isfinite(text).all() & torch.isfinite(scale)
            if bias is not None:
                finite = finite & torch.isfinite(bias)
            bad = ~finite
        if world == 1:
            sizes = [image.shape[0]]
            if image.shape[0] == 0:
                raise ValueError("empty local batch")
            if bad is not None and bool(bad):
                raise ValueError("non-finite values in the contrastive loss inputs")
            all_image, all_text, offset = image, text, 0
        else:
            sizes = self._exchange_meta(image, bad, world)
            all_image, all_text = all_gather_with_grad(image, text, group=self.group, sizes=sizes)
            offset = sum(sizes[:rank])

        batch = GatheredBatch(image, text, all_image, all_text, offset)
        with _no_autocast(image.device):  # keep the fp32 logits even inside an autocast region
            out = LOSS_MODES[self.mode](batch, scale, bias, self.chunk_size)
        weight = world / sum(sizes)
        loss = (out.ce_i2t.sum() + out.ce_t2i.sum()) * (weight / 2)
        metrics = {
            "acc_i2t": out.correct_i2t.sum().float() * weight,
            "acc_t2i": out.correct_t2i.sum().float() * weight,
        }
        self.last_metrics = metrics
        return (loss, metrics) if return_metrics else loss

    def _exchange_meta(self, image: Tensor, bad: Tensor | None, world: int) -> list[int]:
        """All-gathers (rows, dim, dtype, non-finite flag) and raises the same error on every rank."""
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        code = dtypes.index(image.dtype) if image.dtype in dtypes else len(dtypes)
        mine = torch.tensor([image.shape[0], image.shape[1], code, 0], dtype=torch.int64, device=image.device)
        if bad is not None:
            mine[3] = bad.to(torch.int64)
        table = torch.empty(world, 4, dtype=torch.int64, device=image.device)
        _all_gather_single(table, mine[None], self.group)
        rows = table.tolist()
        if len({r[1] for r in rows}) > 1 or len({r[2] for r in rows}) > 1:
            per_rank = [r[1:3] for r in rows]
            raise ValueError(f"feature dim/dtype differ across ranks: (dim, dtype code) per rank = {per_rank}")
        empty = [i for i, r in enumerate(rows) if r[0] == 0]
        if empty:
            raise ValueError(f"empty local batch on rank(s) {empty}")
        nonfinite = [i for i, r in enumerate(rows) if r[3]]
        if nonfinite:
            raise ValueError(f"non-finite values in the contrastive loss inputs on rank(s) {nonfinite}")
        return [r[0] for r in rows]
