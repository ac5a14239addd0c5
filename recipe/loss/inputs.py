"""Checking a sharded loss's inputs and learning every rank's batch size (shared by every loss).

:func:`check_inputs` validates the local features and turns the logit scale and bias into fp32 scalars;
:func:`rank_sizes` returns every rank's number of pairs, so that a bad input raises the same error on
every rank instead of hanging the others.

Host synchronisation. A loss module keeps a :class:`SizeCache`; only the first call (and a call whose
local batch shape differs from the cached one) reads anything on the host. The protocol, identical on
every rank so that the ranks always issue the same collectives:

* World size 1: the first call of a shape checks the non-finite flag on the host (a ``ValueError``);
  later calls of that shape check it on the device (``torch._assert_async``: at once on the CPU, as a
  device-side assertion at the next synchronisation on CUDA).
* World size > 1, unless the caller passes ``sizes`` with ``validate=False`` (no collective at all):
  every call all-gathers a small ``(rows, dim, dtype, non-finite, steady)`` row per rank, an
  asynchronous collective. A rank whose local shape equals the cached one is *steady*: it takes the
  sizes from the cache, reads nothing, and asserts on the device that the gathered table equals the
  cached one (same sizes, dims and dtypes everywhere, every input finite). A rank whose shape changed
  (or the first call) reads the table on the host and raises the same ``ValueError`` as the others
  for bad inputs; it also raises when another rank is steady, because that rank's cached sizes are
  now wrong (it fails its device-side check in the same call).

So after the first call a rank's batch size may change only in a call where *every* rank's local
batch shape changes (e.g. the last, smaller batch of an epoch split evenly); otherwise the step fails
on every rank instead of computing with stale sizes (on CUDA the steady ranks fail by the device-side
assertion, which surfaces at their next synchronisation, at worst when the collective that the
failed rank no longer joins times out). A caller whose sizes vary otherwise passes
``sizes=`` (then the cache is keyed on the declared sizes and a change of them is a host-read call on
every rank alike), or builds the loss with ``cache_sizes=False`` (no cache: every call reads the
exchanged table on the host, one synchronisation per call, as before issue 17).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor

from .gather import all_gather_single, world_and_rank

__all__ = ["SizeCache", "as_scalar", "check_inputs", "rank_sizes"]

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


@dataclasses.dataclass
class SizeCache:
    """What a loss module remembers between calls (see the module docstring).

    Attributes:
        key: The local ``(rows, dim, dtype, device)`` and declared sizes the cache holds, or ``None``.
        sizes: Every rank's number of pairs for ``key``.
        expected: World size > 1: the ``(world, 5)`` int64 table a steady call must gather (on the
            features' device).
        mine: This rank's row of ``expected`` (what a steady call contributes).
        host_reads: Number of calls that read the exchanged table or the non-finite flag on the host
            (tests count them).
    """

    key: tuple | None = None
    sizes: list[int] | None = None
    expected: Tensor | None = None
    mine: Tensor | None = None
    host_reads: int = 0


def rank_sizes(
    image: Tensor,
    bad: Tensor | None,
    sizes: list[int] | None,
    group: dist.ProcessGroup | None,
    what: str,
    cache: SizeCache | None = None,
) -> tuple[list[int], int, int]:
    """``(sizes, world, rank)``: every rank's number of pairs in rank order.

    ``sizes`` given by the caller is checked against the local rows and, without validation (``bad``
    None), used as is with no collective. Otherwise the ranks exchange a small table each call; with a
    ``cache`` a call whose local shape (and declared ``sizes``) match the cached ones reads nothing on
    the host (module docstring); without one every call reads the table.

    Raises:
        ValueError: On every rank alike: ``sizes`` that do not fit, an empty batch, feature widths or
            dtypes that differ across ranks, non-finite inputs (``bad``) on any rank (named ``what``),
            a batch size that changed on some ranks only (with a ``cache``).
    """
    world, rank = world_and_rank(group)
    rows = image.shape[0]
    if sizes is not None and (len(sizes) != world or sizes[rank] != rows):
        raise ValueError(f"sizes {sizes} do not match world size {world} / local rows {rows}")
    key = (rows, image.shape[1], image.dtype, image.device, None if sizes is None else tuple(sizes))
    steady = cache is not None and cache.key == key
    if world == 1:
        if rows == 0:
            raise ValueError("empty local batch")
        if bad is not None:
            message = f"non-finite values in the {what} inputs"
            if steady:  # no host read: raises at once on the CPU, later (device assertion) on CUDA
                torch._assert_async(~bad, message)
            else:
                if cache is not None:
                    cache.host_reads += 1
                # host read (first call of this shape): the error must come before the loss is used
                if bool(bad):
                    raise ValueError(message)
        if cache is not None:
            cache.key, cache.sizes = key, [rows]
        return [rows], world, rank
    if sizes is not None and bad is None:
        if 0 in sizes:  # every rank holds the same sizes: all raise, none hangs
            raise ValueError(f"empty local batch on rank(s) {[r for r, m in enumerate(sizes) if m == 0]}")
        return list(sizes), world, rank
    table = _gather_meta(image, bad, cache.mine if steady else None, world, group)
    if steady:  # no host read: the table must be the cached one (checked on the device)
        torch._assert_async(
            (table == cache.expected).all(),
            f"{what}: the ranks' batch sizes, feature dims or dtypes changed on other ranks while this "
            "rank's did not (or an input is not finite); pass sizes= when local batch sizes vary",
        )
        return list(cache.sizes), world, rank
    if cache is not None:
        cache.host_reads += 1
    new_sizes = _check_table(table, what)
    if cache is not None:
        expected = table.clone()
        expected[:, 3:] = 0  # a steady call: all finite, every rank steady
        expected[:, 4] = 1
        cache.key, cache.sizes, cache.expected, cache.mine = key, new_sizes, expected, expected[rank].clone()
    return new_sizes, world, rank


def _gather_meta(image: Tensor, bad: Tensor | None, cached: Tensor | None, world: int, group) -> Tensor:
    """All-gathers ``(rows, dim, dtype code, non-finite flag, steady flag)`` of every rank (no host
    read). ``cached``: this rank's steady row, already on the device (a steady call copies nothing
    from the host)."""
    if cached is not None:
        mine = cached.clone()
    else:
        code = _DTYPES.index(image.dtype) if image.dtype in _DTYPES else len(_DTYPES)
        mine = torch.tensor([image.shape[0], image.shape[1], code, 0, 0], dtype=torch.int64, device=image.device)
    if bad is not None:
        mine[3] = bad.to(torch.int64)
    table = torch.empty(world, 5, dtype=torch.int64, device=image.device)
    all_gather_single(table, mine[None], group)
    return table


def _check_table(table: Tensor, what: str) -> list[int]:
    """Reads the gathered table on the host and raises the same error on every rank."""
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
    steady = [i for i, r in enumerate(rows) if r[4]]
    if steady:
        raise ValueError(
            f"{what}: the local batch size changed on some ranks only (rank(s) {steady} kept theirs and "
            "use cached sizes); pass sizes= when local batch sizes vary independently"
        )
    return [r[0] for r in rows]
