"""The all-gather of the sharded contrastive losses: one collective forward, a reduce-scatter backward.

With ``N`` data-parallel ranks holding ``M_r`` rows each, :func:`all_gather_with_grad` returns the
``sum(M_r)`` rows of all ranks in rank order. Its backward sums the gradient of the gathered tensor
over ranks and hands each rank the rows it contributed (a reduce-scatter), so that a loss computed
from the gathered tensor on every rank back-propagates exactly into the local features. Ranks may
hold different numbers of rows: they are padded to the largest for the collective and unpadded
afterwards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["all_gather_with_grad", "all_gather_single", "world_and_rank"]


def world_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """Returns ``(world_size, rank)`` of ``group``; ``(1, 0)`` when torch.distributed is not set up."""
    if not (dist.is_available() and dist.is_initialized()):
        if group is not None:
            raise RuntimeError("a process group was given but torch.distributed is not initialised")
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    """All-gathers ``inp`` of every rank into the rows of ``out`` (one collective)."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


def _reduce_scatter_single(out: Tensor, inp: Tensor, group: dist.ProcessGroup | None) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _exchange_sizes(rows: int, device: torch.device, group: dist.ProcessGroup | None) -> list[int]:
    world, _ = world_and_rank(group)
    mine = torch.tensor([rows], dtype=torch.int64, device=device)
    table = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_single(table, mine, group)
    # host sync: the sizes shape the gathered tensor (callers that know them pass ``sizes``)
    return [int(v) for v in table.tolist()]


def _unpack(packed: Tensor, shapes: list[torch.Size], widths: list[int]) -> tuple[Tensor, ...]:
    """Splits the columns of a packed ``(rows, sum(widths))`` buffer back into tensors of ``shapes``."""
    outs, col = [], 0
    for shape, width in zip(shapes, widths):
        outs.append(packed[:, col : col + width].reshape(packed.shape[0], *shape))
        col += width
    return tuple(outs)


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
        all_gather_single(gathered, packed.contiguous(), group)
        if min(sizes) != m_max:
            gathered = torch.cat([gathered[r * m_max : r * m_max + m] for r, m in enumerate(sizes)])
        ctx.group, ctx.sizes, ctx.rank, ctx.widths = group, sizes, rank, widths
        ctx.shapes = [t.shape[1:] for t in tensors]
        return _unpack(gathered, ctx.shapes, widths)

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
        return (None, None, None, *_unpack(local, ctx.shapes, ctx.widths))


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
    world, rank = world_and_rank(group)
    if world == 1:
        return tuple(tensors)
    if sizes is None:
        sizes = _exchange_sizes(first.shape[0], first.device, group)
    if len(sizes) != world or sizes[rank] != first.shape[0]:
        raise ValueError(f"sizes {sizes} do not match world size {world} / local rows {first.shape[0]}")
    return _AllGatherRows.apply(group, list(sizes), rank, *tensors)
