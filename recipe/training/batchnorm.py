"""BatchNorm running statistics made the same on every data-parallel rank (timm's ``distribute_bn``,
reduce mode).

In training mode a BatchNorm layer normalises with its micro-batch's statistics and moves its running
statistics towards them, so each rank's ``running_mean`` / ``running_var`` follow that rank's data and
drift apart while the weights stay identical. An evaluation would then mix models (each rank embeds its
share of the held-out data with its own statistics), and a checkpoint keeps rank 0's alone (DeepSpeed's
module state and ``model_weights.pt`` are rank 0's module). :func:`average_batchnorm_stats` replaces
every rank's statistics by their mean over the ranks; the training loop calls it before each
evaluation (:func:`recipe.train.run_eval`) and :func:`recipe.run.checkpoint.save` before each save (the
periodic ones, the save on SIGTERM/SIGUSR1 and the final one), so what is evaluated is the one model
the checkpoint holds: a 2-rank evaluation during training equals a 1-rank evaluation of the saved
checkpoint, and a resumed run continues with the statistics the uninterrupted one has.

What is averaged: ``running_mean`` and ``running_var`` of every layer that tracks running statistics
(``torch.nn.modules.batchnorm._NormBase`` with ``track_running_stats``: BatchNorm1d/2d/3d,
SyncBatchNorm, timm's ``BatchNormAct2d``, an InstanceNorm that tracks them), except a locked tower's
(``ImageTower.frozen_norms``, set by ``--lock-image``: kept in evaluation mode, never updated, the same
on every rank; left untouched). ``num_batches_tracked`` is left as it is: every rank runs the same
number of training forwards, so it is already the same on every rank. With ``--ema-decay`` the EMA's
copies of these buffers (taken from the model at every update, :mod:`recipe.training.ema`) are refreshed from
the averaged ones, so the EMA evaluation and ``ema_weights.pt`` hold the mean too.

Cost: one all-reduce of all the statistics together (flattened into one fp64 vector whatever their
dtypes: summed, divided by the world size and rounded once back to each buffer's dtype, so the result
is the correctly rounded mean for two ranks and the same bits on every rank), no host
synchronisation. Nothing at all (no collective) at world size 1 or for a model without such layers,
e.g. the default ViT towers. Under ZeRO-3 buffers are not partitioned: every rank holds them whole.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from .distributed import collective_device

__all__ = ["batchnorm_stats", "average_batchnorm_stats"]

_STATS = ("running_mean", "running_var")


def _locked_norms(module: nn.Module) -> set[int]:
    """Ids of the BatchNorm layers a locked tower keeps in evaluation mode (``frozen_norms`` of every
    :class:`recipe.model.image_tower.ImageTower` in ``module``)."""
    locked: set[int] = set()
    for m in module.modules():
        names = getattr(m, "frozen_norms", None)
        trunk = getattr(m, "trunk", None)
        if names and isinstance(trunk, nn.Module):
            found = dict(trunk.named_modules())
            locked.update(id(found[name]) for name in names if name in found)
    return locked


def batchnorm_stats(module: nn.Module) -> dict[str, torch.Tensor]:
    """The running statistics :func:`average_batchnorm_stats` averages, by their names in
    ``module.named_buffers()`` (in that order, the same on every rank): ``running_mean`` and
    ``running_var`` of each layer tracking running statistics outside a locked tower."""
    locked = _locked_norms(module)
    out: dict[str, torch.Tensor] = {}
    for prefix, m in module.named_modules():
        if not isinstance(m, nn.modules.batchnorm._NormBase) or not m.track_running_stats or id(m) in locked:
            continue
        for name in _STATS:
            buf = m._buffers.get(name)
            if buf is not None:
                out[f"{prefix}.{name}" if prefix else name] = buf
    return out


@torch.no_grad()
def average_batchnorm_stats(module: nn.Module, ema: Any | None = None, group: Any | None = None) -> int:
    """Replaces the running statistics of ``module``'s BatchNorm layers (:func:`batchnorm_stats`) by
    their mean over the ranks of ``group`` (default: the default process group); every rank calls it.

    Args:
        module: The model (under DeepSpeed ``engine.module``).
        ema: A :class:`recipe.training.ema.ModelEMA` of ``module``: its copies of the averaged buffers are
            set to the mean as well.
        group: The process group (``None``: the default one).

    Returns:
        The number of buffers averaged: 0, with no collective, without torch.distributed, at world
        size 1 or when ``module`` has no such layer.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return 0
    stats = batchnorm_stats(module)
    if not stats:
        return 0
    bufs = list(stats.values())
    device = collective_device()
    # one collective for every buffer: fp64 holds any fp32/half statistic and the sum of a few exactly
    flat = torch.cat([b.detach().reshape(-1).to(device=device, dtype=torch.float64) for b in bufs])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= dist.get_world_size(group)
    for buf, mean in zip(bufs, flat.split([b.numel() for b in bufs])):
        buf.copy_(mean.view_as(buf))  # rounded once to the buffer's dtype, on its device
    if ema is not None:  # the EMA copies buffers at each update: give it the mean now
        for name, buf in stats.items():
            copy = ema.buffers.get(name)
            if copy is not None:
                copy.copy_(buf)
    return len(bufs)
