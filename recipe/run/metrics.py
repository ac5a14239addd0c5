"""Run logging on rank 0: a tqdm progress bar, ``metrics.jsonl`` and TensorBoard scalars."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch

from .checkpoint import atomic_write_bytes

__all__ = ["MetricsLogger", "peak_memory_bytes", "truncate_metrics"]


def peak_memory_bytes() -> int:
    """Peak accelerator memory allocated by this process (CUDA), else the peak resident set size."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.max_memory_allocated())
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB
    except (ImportError, OSError):
        return 0


def truncate_metrics(path: Path, last_step: int) -> int:
    """Drops the rows of ``metrics.jsonl`` after ``last_step`` (a resumed run replays those steps),
    atomically, so that no step and kind appears twice; returns how many rows were dropped."""
    if not path.exists():
        return 0
    lines = path.read_text(encoding="utf-8").splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= last_step:
                keep.append(line)
        except ValueError:  # a line cut by a crash mid-write
            continue
    if len(keep) != len(lines):
        atomic_write_bytes(path, "".join(k + "\n" for k in keep).encode())
    return len(lines) - len(keep)


def _clean(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        v = v.item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


class MetricsLogger:
    """Writes metrics of rank 0; every method is a no-op on other ranks.

    Args:
        run_dir: The run directory (``metrics.jsonl`` and ``tensorboard/`` go there).
        total_steps: Length of the progress bar.
        enabled: True on rank 0.
        start_step: First step of the bar (after a resume).
    """

    def __init__(self, run_dir: str | Path, total_steps: int, enabled: bool, start_step: int = 0) -> None:
        self.enabled = enabled
        self._bar = None
        self._tb = None
        self._jsonl = None
        if not enabled:
            return
        run_dir = Path(run_dir)
        truncate_metrics(run_dir / "metrics.jsonl", start_step)  # a resumed run replays later steps
        self._jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        try:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=start_step + 1 if start_step else None)
        except ImportError:  # tensorboard is an install requirement; tolerate its absence
            print("tensorboard is not installed: no TensorBoard logs", file=sys.stderr)
        from tqdm import tqdm

        self._bar = tqdm(total=total_steps, initial=start_step, desc="train", dynamic_ncols=True, file=sys.stderr)

    def log(self, step: int, metrics: dict[str, Any], kind: str = "train") -> None:
        """Records ``metrics`` at ``step`` under ``kind`` (``train`` / ``eval``)."""
        if not self.enabled:
            return
        row = {"kind": kind, "step": step, **{k: _clean(v) for k, v in metrics.items()}}
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for k, v in row.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{kind}/{k}", v, step)
        if kind == "train" and "loss" in row:
            self._bar.set_postfix(loss=f"{row['loss']:.4f}" if isinstance(row["loss"], float) else row["loss"])

    def advance(self, n: int = 1) -> None:
        if self.enabled:
            self._bar.update(n)

    def write(self, text: str) -> None:
        """Prints a line without breaking the progress bar."""
        if self.enabled:
            self._bar.write(text, file=sys.stderr)

    def close(self) -> None:
        if not self.enabled:
            return
        self._bar.close()
        if self._tb is not None:
            self._tb.close()
        self._jsonl.close()
