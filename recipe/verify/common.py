"""What every check shares: the resolved run (:class:`Run`), one result line (:class:`Row`), and the
small collective helpers the checks agree through.

Host synchronisation: this is a preflight, not a training step. Every check reads its results on the
host (``float(...)``, ``.tolist()``, ``torch.cuda.synchronize()`` around timings) and the ranks agree on
them with small collectives; none of this runs in a training loop, so no read below is marked
individually.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from recipe.plan import ModelSpec
from recipe.training.precision import Precision

__all__ = ["CHECKS", "STATUSES", "Row", "Run", "dtype_name", "local_world", "max_over_ranks", "per_rank", "ranks_with",
           "sum_over_ranks", "sync", "worst"]

#: The checks, in the order they run (``--skip`` takes these names).
CHECKS = ("memory", "comm", "loss", "optimizer")
#: Statuses from best to worst; a check's verdict is its worst row, the run's its worst check.
STATUSES = ("pass", "skip", "warn", "fail")


@dataclass
class Row:
    """One line of the report: ``check``, what was checked (``item``), the status and a short detail.

    ``values`` holds the numbers behind the detail (for ``--json``); ``rank`` names the rank whose
    result the row shows when the ranks differ (the worst one), ``None`` when they agree.
    """

    check: str
    item: str
    status: str
    detail: str
    values: dict[str, Any] = field(default_factory=dict)
    rank: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Run:
    """The run the preflight checks, resolved from the flags and the DeepSpeed JSON (same on every rank)."""

    spec: ModelSpec
    ds_config: str
    ds_json: dict[str, Any]
    precision: Precision
    world: int
    rank: int
    local_world: int
    micro_batch: int
    accumulation: int
    embed_dim: int
    loss: str
    loss_mode: str
    contrastive_batch: str
    chunk_size: int
    grad_checkpointing: bool
    device: torch.device

    @property
    def backend(self) -> str:
        return dist.get_backend() if dist.is_initialized() else "none"


def worst(statuses: list[str]) -> str:
    """The worst of ``statuses`` (``pass`` for none)."""
    return max(statuses, key=STATUSES.index, default="pass")


def sync(device: torch.device) -> None:
    """Waits for the device's queued work (a timing boundary; a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _reduce(values: list[float], op: Any, device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t, op=op)
    return t.tolist()


def max_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of ``values`` over ranks (NaN counts as the largest: a NaN error fails)."""
    nan_safe = [float("inf") if math.isnan(v) else v for v in values]
    return _reduce(nan_safe, dist.ReduceOp.MAX, device)


def sum_over_ranks(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over ranks."""
    return _reduce(values, dist.ReduceOp.SUM, device)


def per_rank(value: float, device: torch.device) -> list[float]:
    """``value`` of every rank, in rank order."""
    mine = torch.tensor([value], dtype=torch.float64, device=device)
    if not (dist.is_initialized() and dist.get_world_size() > 1):
        return mine.tolist()
    out = mine.new_empty(dist.get_world_size())
    dist.all_gather_into_tensor(out, mine)
    return out.tolist()


def ranks_with(values: list[float]) -> str:
    """``"rank(s) 1, 3"``: the ranks whose value is nonzero."""
    return "rank(s) " + ", ".join(str(r) for r, v in enumerate(values) if v)


def local_world() -> int:
    """Ranks on this node: ``LOCAL_WORLD_SIZE`` (torchrun) or ``LOCAL_SIZE`` (the deepspeed launcher)."""
    for key in ("LOCAL_WORLD_SIZE", "LOCAL_SIZE"):
        value = os.environ.get(key, "")
        if value.isdigit() and int(value) > 0:
            return int(value)
    return 1


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}[dtype]
