"""The run directory: its lock and the files that describe the run.

Layout of ``<run>``: ``config.json`` (the resolved :class:`recipe.config.TrainConfig`),
``ds_config.json`` (what DeepSpeed was given), ``git_revision.txt``, ``model_config.json``,
``tokenizer/``, ``metrics.jsonl`` and ``tensorboard/`` (:mod:`recipe.metrics`), ``checkpoints/``
(:mod:`recipe.checkpoint`), ``final_metrics.json``, and while a run is alive ``run.lock``.

One run at a time: rank 0 takes ``run.lock`` (host, pid, process start time and the start date
inside) before anything is written. A second run into the same directory refuses with a message
naming the holder; a lock left by a process that no longer exists on this host (killed, crashed
machine rebooted) is taken over with a warning. A lock held from another host is never taken over:
remove it by hand when that run is gone.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .checkpoint import atomic_write_bytes

__all__ = ["RunLockError", "RunLock", "prepare_run_dir", "git_revision", "LOCK_FILE"]

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"


class RunLockError(RuntimeError):
    """The run directory is in use by another run."""


def _start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _alive(pid: int, ticks: int | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_ticks(pid)
    return ticks is None or now is None or now == ticks


class RunLock:
    """The lock of one run directory, held by this process (rank 0) while the run is alive.

    Raises:
        RunLockError: On :meth:`acquire`, when another live run holds the directory.
    """

    def __init__(self, run_dir: str | os.PathLike) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.held = False

    def _mine(self) -> dict[str, Any]:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start_ticks": _start_ticks(pid),
                "started": time.strftime("%Y-%m-%dT%H:%M:%S")}

    def acquire(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = json.dumps(self._mine()).encode()
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self._holder()
                if holder is None:  # vanished or unreadable (a half-written lock of a dead run): retry
                    self.path.unlink(missing_ok=True)
                    continue
                if holder.get("host") != socket.gethostname() or _alive(int(holder["pid"]), holder.get("start_ticks")):
                    raise RunLockError(
                        f"run directory {self.path.parent} is in use by pid {holder.get('pid')} on host "
                        f"{holder.get('host')} since {holder.get('started')} (lock file {self.path}); give another "
                        "--output-dir, or stop that run (remove the lock file only if that run is gone)"
                    )
                logger.warning("taking over the stale lock %s of pid %s (no longer running)", self.path, holder["pid"])
                atomic_write_bytes(self.path, mine)
                self.held = True
                return
            with os.fdopen(fd, "wb") as f:
                f.write(mine)
            self.held = True
            return
        raise RunLockError(f"cannot take the lock {self.path}")

    def _holder(self) -> dict[str, Any] | None:
        try:
            holder = json.loads(self.path.read_text())
            return holder if isinstance(holder, dict) and "pid" in holder else None
        except (OSError, ValueError):
            return None

    def release(self) -> None:
        """Removes the lock if this process holds it (idempotent)."""
        if self.held:
            holder = self._holder()
            if holder is not None and holder.get("pid") == os.getpid():
                self.path.unlink(missing_ok=True)
            self.held = False


def git_revision() -> str:
    """The recipe's git revision (with ``(dirty)`` when the tree has changes)."""
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + (" (dirty)" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def prepare_run_dir(run_dir: Path, config: dict[str, Any], ds_config: dict[str, Any]) -> None:
    """Writes the resolved config, the DeepSpeed JSON and the git revision (rank 0, lock held)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(run_dir / "config.json", json.dumps(config, indent=2).encode())
    atomic_write_bytes(run_dir / "ds_config.json", json.dumps(ds_config, indent=2).encode())
    atomic_write_bytes(run_dir / "git_revision.txt", (git_revision() + "\n").encode())
