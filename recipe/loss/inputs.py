"""Checking a sharded loss's inputs and learning every rank's batch size (shared by every loss).

:func:`check_inputs` validates the local features and turns the logit scale and bias into fp32 scalars;
:func:`rank_sizes` returns every rank's number of pairs, exchanging them (with the feature width, dtype
and a non-finite flag) unless the caller knows them, so that a bad input raises the same error on
every rank instead of hanging the others.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .gather import all_gather_single, world_and_rank

__all__ = ["as_scalar", "check_inputs", "rank_sizes"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def as_scalar(value: Tensor | float, name: str, device: torch.device) -> Tensor:
    """``value`` as a 0-d fp32 tensor on ``device`` (autograd kept).

    Raises:
        ValueError: More than one value.
    """
    t = torch.as_tensor(value, device=device)
    if t.numel() != 1:
        raise ValueError(f"{name} must hold a single value, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        t = t.double()
    return t.float().reshape(())


def check_inputs(
    image: Tensor, text: Tensor, logit_scale: Tensor | float, logit_bias: Tensor | float | None, validate: bool
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """``(scale, bias, bad)``: the logit scale and bias as fp32 scalars (``bias`` None when not given) and,
    with ``validate``, a device flag that some input is not finite (no host read here).

    Raises:
        ValueError: Features that are not both ``(M, D)`` of one floating dtype and device.
    """
    if image.dim() != 2 or image.shape != text.shape:
        raise ValueError(
            f"image and text features must both be (M, D); got {tuple(image.shape)} and {tuple(text.shape)}"
        )
    if image.dtype != text.dtype or image.device != text.device or not image.is_floating_point():
        raise ValueError(
            f"image and text features must share a floating dtype and device; got "
            f"{image.dtype}/{image.device} and {text.dtype}/{text.device}"
        )
    scale = as_scalar(logit_scale, "logit_scale", image.device)
    bias = None if logit_bias is None else as_scalar(logit_bias, "logit_bias", image.device)
    bad = None
    if validate:
        finite = torch.isfinite(image).all() & torch.isfinite(text).all() & torch.isfinite(scale)
        if bias is not None:
            finite = finite & torch.isfinite(bias)
        bad = ~finite
    return scale, bias, bad


def rank_sizes(
    image: Tensor, bad: Tensor | None, sizes: list[int] | None, group: dist.ProcessGroup | None, what: str
) -> tuple[list[int], int, int]:
    """``(sizes, world, rank)``: every rank's number of pairs in rank order. ``sizes`` given by the caller
    is checked and, without validation (``bad`` None), used as is; otherwise the ranks exchange them.

    Raises:
        ValueError: On every rank alike: ``sizes`` that do not fit, an empty batch, feature widths or
            dtypes that differ across ranks, non-finite inputs (``bad``) on any rank (named ``what``).
    """
    world, rank = world_and_rank(group)
    if sizes is not None and (len(sizes) != world or sizes[rank] != image.shape[0]):
        raise ValueError(f"sizes {sizes} do not match world size {world} / local rows {image.shape[0]}")
    if world == 1:
        if image.shape[0] == 0:
            raise ValueError("empty local batch")
        # host sync only when asked to validate: the error must come before the loss is used
        if bad is not None and bool(bad):
            raise ValueError(f"non-finite values in the {what} inputs")
        return [image.shape[0]], world, rank
    if sizes is None or bad is not None:
        return _exchange_meta(image, bad, world, group, what), world, rank
    if 0 in sizes:  # every rank holds the same sizes: all raise, none hangs
        raise ValueError(f"empty local batch on rank(s) {[r for r, m in enumerate(sizes) if m == 0]}")
    return list(sizes), world, rank


def _exchange_meta(
    image: Tensor, bad: Tensor | None, world: int, group: dist.ProcessGroup | None, what: str
) -> list[int]:
    """All-gathers (rows, dim, dtype, non-finite flag) and raises the same error on every rank."""
    code = _DTYPES.index(image.dtype) if image.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor([image.shape[0], image.shape[1], code, 0], dtype=torch.int64, device=image.device)
    if bad is not None:
        mine[3] = bad.to(torch.int64)
    table = torch.empty(world, 4, dtype=torch.int64, device=image.device)
    all_gather_single(table, mine[None], group)
    # host sync: sizes shape the gathered tensors, and every rank must raise the same error
    rows = table.tolist()
    if len({r[1] for r in rows}) > 1 or len({r[2] for r in rows}) > 1:
        per_rank = [r[1:3] for r in rows]
        raise ValueError(f"feature dim/dtype differ across ranks: (dim, dtype code) per rank = {per_rank}")
    empty = [i for i, r in enumerate(rows) if r[0] == 0]
    if empty:
        raise ValueError(f"empty local batch on rank(s) {empty}")
    nonfinite = [i for i, r in enumerate(rows) if r[3]]
    if nonfinite:
        raise ValueError(f"non-finite values in the {what} inputs on rank(s) {nonfinite}")
    return [r[0] for r in rows]
