"""Rank helpers shared by the training loop, checkpoints and evaluation (no-ops without
torch.distributed, so every helper also works in a single plain process)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["rank_world", "barrier", "mean_over_ranks", "max_over_ranks_", "collective_device", "broadcast_from_rank0"]


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank_world() -> tuple[int, int]:
    """``(rank, world_size)``; ``(0, 1)`` without torch.distributed."""
    return (dist.get_rank(), dist.get_world_size()) if initialized() else (0, 1)


def barrier() -> None:
    if initialized():
        dist.barrier()


def collective_device() -> torch.device:
    """Where a tensor must live for the process group's collectives (NCCL: this rank's GPU)."""
    if initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def broadcast_from_rank0(obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (a collective; ``obj`` itself without torch.distributed)."""
    if initialized() and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def max_over_ranks_(flag: torch.Tensor) -> torch.Tensor:
    """All-reduces ``flag`` in place with MAX (on its device: no host synchronisation)."""
    if initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return flag


def mean_over_ranks(x: torch.Tensor) -> float:
    """The mean of ``x`` over ranks, as a Python float (a collective and a host read: log time only)."""
    x = x.detach().float().clone()
    if initialized():
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x)
