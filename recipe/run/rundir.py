"""The run directory: its lock and the files that describe the run.

Layout of ``<run>``: ``config.json`` (the resolved :class:`recipe.config.TrainConfig`),
``ds_config.json`` (what DeepSpeed was given), ``git_revision.txt``, ``model_config.json``,
``tokenizer/``, ``metrics.jsonl`` and ``tensorboard/`` (:mod:`recipe.run.metrics`), ``checkpoints/``
(:mod:`recipe.run.checkpoint`), ``final_metrics.json``, and while a run is alive ``run.lock``.

A directory is a run once it holds any of :data:`RUN_FILES`. A new run (no ``--resume``) goes only
into a missing or empty directory, or one holding other files (a scheduler's log, say) but no run:
:func:`claim_run_dir` refuses a run directory before anything is written, and ``--resume latest``
refuses a directory that does not exist. A start that fails before its first training step takes
back what it wrote (:meth:`Claim.undo`): the directory is as it was, or gone if the start made it.

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
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from .checkpoint import atomic_write_bytes
from .outcome import process_running, start_ticks

__all__ = ["RunLockError", "RunDirError", "RunLock", "Claim", "claim_run_dir", "run_files", "prepare_run_dir",
           "git_revision", "LOCK_FILE", "RUN_FILES", "ERROR_LOG"]

logger = logging.getLogger(__name__)

LOCK_FILE = "run.lock"
#: Where the ranks append the tracebacks of a failure (kept when a failed start is taken back).
ERROR_LOG = "error.log"
#: What makes a directory a run: any of these (what a start writes first, what training adds).
RUN_FILES = ("config.json", "checkpoints", "metrics.jsonl", "final_metrics.json", "model_config.json", "tokenizer")
#: What a resumed start rewrites, restored when that start fails.
_REWRITTEN = ("config.json", "ds_config.json", "git_revision.txt")


class RunLockError(RuntimeError):
    """The run directory is in use by another run."""


class RunDirError(ValueError):
    """The run directory cannot take this start (it holds another run, or there is no run to resume)."""


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
        return {"host": socket.gethostname(), "pid": pid, "start_ticks": start_ticks(pid),
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
                elsewhere = holder.get("host") != socket.gethostname()
                if elsewhere or process_running(int(holder["pid"]), holder.get("start_ticks")):
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


def run_files(run_dir: Path) -> list[str]:
    """Which of :data:`RUN_FILES` ``run_dir`` holds (directories with a trailing ``/``)."""
    found = []
    for name in RUN_FILES:
        p = run_dir / name
        if p.exists():
            found.append(name + ("/" if p.is_dir() else ""))
    return found


def check_run_dir(run_dir: Path, resume: str | None) -> None:
    """Refuses a start that would mix two runs or resume nothing, before anything is written.

    Raises:
        RunDirError: No ``resume`` and ``run_dir`` holds a run; or ``resume="latest"`` and ``run_dir``
            does not exist or holds no run.
    """
    found = run_files(run_dir) if run_dir.is_dir() else []
    if resume is None and found:
        raise RunDirError(
            f"--output-dir {run_dir} already holds a run ({', '.join(found)}): give --resume latest to continue "
            "it, or another --output-dir for a new run"
        )
    if resume == "latest" and not run_dir.is_dir():
        raise RunDirError(f"--resume latest: {run_dir} does not exist, so there is no run to continue "
                          "(leave out --resume to start a new run there)")
    if resume == "latest" and "config.json" not in found:
        raise RunDirError(f"--resume latest: {run_dir} holds no run (no config.json): nothing to continue "
                          "(leave out --resume to start a new run there)")


class Claim:
    """Rank 0's hold on a run directory for one start: the lock, and what to take back if the start fails.

    Attributes:
        existed: Whether the directory was there before this start.
    """

    def __init__(self, run_dir: Path, lock: RunLock, existed: bool, before: set[str], saved: dict[str, bytes]) -> None:
        self.run_dir, self.lock, self.existed = run_dir, lock, existed
        self._before, self._saved = before, saved

    def undo(self) -> list[str]:
        """Takes back what this start wrote: the entries it added (all of a directory it made, which is
        then removed when empty) but ``error.log``, where the ranks leave the tracebacks of why it
        failed; the files a resumed start rewrote get their earlier contents. Returns what it removed."""
        self.lock.release()
        removed = []
        for name in sorted(set(os.listdir(self.run_dir)) - self._before - {ERROR_LOG}):
            p = self.run_dir / name
            shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
            removed.append(name)
        for name, data in self._saved.items():
            atomic_write_bytes(self.run_dir / name, data)
        if not self.existed:
            try:
                self.run_dir.rmdir()
            except OSError:  # it holds error.log
                pass
        return removed

    def release(self) -> None:
        self.lock.release()


def claim_run_dir(run_dir: Path, resume: str | None) -> Claim:
    """Checks ``run_dir`` for this start (:func:`check_run_dir`), takes its lock and notes what is there.

    Raises:
        RunDirError: See :func:`check_run_dir` (nothing written).
        RunLockError: Another live run holds the directory.
    """
    check_run_dir(run_dir, resume)  # before the lock: a refusal writes nothing
    existed = run_dir.is_dir()
    before = set(os.listdir(run_dir)) if existed else set()
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        check_run_dir(run_dir, resume)  # again under the lock: another start may have come in between
    except RunDirError:
        lock.release()
        if not existed:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    saved = {n: (run_dir / n).read_bytes() for n in _REWRITTEN if (run_dir / n).is_file()} if resume else {}
    return Claim(run_dir, lock, existed, before - {LOCK_FILE}, saved)
