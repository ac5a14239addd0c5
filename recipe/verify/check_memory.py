"""Free memory per rank against the planner's predicted peak (:func:`recipe.plan.predict_memory`).

Free memory: ``torch.cuda.mem_get_info`` on a GPU (read first, before any other check allocates, so
that it is what the run will find: this process's CUDA context is taken, as the run's will be); on
the CPU the kernel's ``MemAvailable`` (``/proc/meminfo``) divided by the ranks of this node, which
share it. ``--gpu-memory`` replaces the measurement (what-if, or a device that reports wrongly).

Verdict: the prediction above free memory fails; above free memory less the planner's headroom
(``--headroom``, the planner's default 10 %: allocator fragmentation, transient peaks, NCCL
buffers, which the prediction does not see) warns; otherwise passes.
"""

from __future__ import annotations

from pathlib import Path

import torch

from recipe.plan import predict_memory
from recipe.plan.search import format_bytes

from .common import Row, Run, max_over_ranks

__all__ = ["check_memory", "free_bytes"]


def free_bytes(device: torch.device, local_ranks: int, meminfo: str = "/proc/meminfo") -> int:
    """Free memory one rank can count on: the GPU's free bytes, or available RAM / ranks on the node."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    for line in Path(meminfo).read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024 // max(1, local_ranks)
    raise RuntimeError(f"{meminfo} has no MemAvailable line")


def check_memory(run: Run, free: int, headroom: float, override: int | None) -> list[Row]:
    """One row: predicted peak per rank against the smallest free memory of any rank."""
    p = predict_memory(run.spec, run.ds_json, run.world, run.micro_batch, run.grad_checkpointing,
                       run.accumulation, run.loss_mode, run.contrastive_batch, run.chunk_size)
    mine = override if override is not None else free
    # the fullest rank decides: the smallest free memory over ranks
    lowest = -max_over_ranks([-float(mine)], run.device)[0]
    usable = lowest * (1 - headroom)
    where = "--gpu-memory" if override is not None else (
        "free GPU memory" if run.device.type == "cuda" else f"available RAM / {run.local_world} local rank(s)")
    detail = (f"predicted {format_bytes(p.total_bytes)} (m {run.micro_batch} x k {run.accumulation}, "
              f"ZeRO-{p.zero_stage}, {run.loss_mode}) of {format_bytes(lowest)} {where}, smallest rank")
    if p.total_bytes > lowest:
        status, detail = "fail", detail + ": does not fit"
    elif p.total_bytes > usable:
        status, detail = "warn", detail + f": within the {headroom:.0%} headroom"
    else:
        status, detail = "pass", detail + f": {p.total_bytes / lowest:.0%}"
    values = {"predicted_bytes": p.total_bytes, "free_bytes_min": int(lowest), "headroom": headroom,
              "usable_bytes": int(usable), "activation_bytes": p.activation_bytes,
              "model_state_bytes": p.model_state_bytes, "loss_bytes": p.loss_bytes}
    return [Row("memory", "peak vs free", status, detail, values)]
