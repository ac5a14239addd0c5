"""Stopping a run cleanly on a signal.

SIGTERM is what SLURM, Kubernetes, ``timeout`` and most schedulers send before they kill a job, and
SIGUSR1 what SLURM sends ahead of the time limit with ``--signal=USR1@SECONDS``: every rank notes
either, the ranks agree on it within the next optimizer step (the flag rides on the step's one
all-reduce, :func:`recipe.training.step.train_step`), save a checkpoint at that step boundary and exit with
code 143 (:data:`PREEMPTED_EXIT_CODE`); ``--resume latest`` continues from there. A stop whose
checkpoint could not be saved exits with :data:`STOP_UNSAVED_EXIT_CODE` instead, naming the step
that was lost. SIGINT (Ctrl-C) stops at once with ``KeyboardInterrupt`` on every rank (the run
directory's lock is released; nothing is saved).

Schedulers often signal every process of the job, not only the launcher: the DataLoader workers too.
A worker that died of it would take its rank down before the save, so the workers are made deaf to
SIGTERM and SIGUSR1 from birth (:func:`forking_workers` blocks both while the rank forks them,
:func:`protect_worker` takes over in the worker): a worker still ends when its rank ends it (a
SIGTERM sent by its parent) or when its rank is gone (the DataLoader's own watchdog).
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

__all__ = ["StopRequest", "StopNotSaved", "PREEMPTED_EXIT_CODE", "STOP_UNSAVED_EXIT_CODE", "STOP_SIGNALS",
           "forking_workers", "protect_worker"]

#: Exit code of a rank (and of ``launch.sh``) that stopped on a signal with its checkpoint saved.
PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM
#: Exit code of a rank that was asked to stop but could not save its checkpoint (the step is lost).
STOP_UNSAVED_EXIT_CODE = 3
#: The signals that mean "save and stop".
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopRequest:
    """Installs the signal handlers for one run; :attr:`requested` turns true on SIGTERM or SIGUSR1,
    :attr:`signal_name` says which came first."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        self._previous = {s: signal.getsignal(s) for s in (*STOP_SIGNALS, signal.SIGINT)}
        for s in STOP_SIGNALS:
            signal.signal(s, self._on_stop)
        # a process started in the background of a non-interactive shell (launch.sh) inherits SIGINT
        # ignored: make Ctrl-C forwarded by launch.sh stop the rank again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return self

    def _on_stop(self, signum: int, frame: Any) -> None:
        if not self.requested:
            self.signal_name = signal.Signals(signum).name
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}


class StopNotSaved(RuntimeError):
    """A stop was requested, but the run failed before its checkpoint was saved.

    Attributes:
        signal_name: What asked for the stop.
        step: The last step the run completed.
        last_saved: The newest complete checkpoint (``None``: none; the run restarts from step 0).
    """

    def __init__(self, signal_name: str, step: int, cause: BaseException, complete: Sequence[Path]) -> None:
        self.signal_name, self.step = signal_name, step
        self.last_saved = Path(complete[-1]) if complete else None
        since = (f"the last complete checkpoint is {self.last_saved}" if self.last_saved is not None
                 else "there is no complete checkpoint: the run restarts from step 0")
        cause_line = (str(cause).strip().splitlines() or [""])[0]
        super().__init__(f"stopped by {signal_name} after step {step}, but its checkpoint was not saved "
                         f"({type(cause).__name__}: {cause_line}); {since}")


@contextlib.contextmanager
def forking_workers() -> Iterator[None]:
    """Blocks SIGTERM and SIGUSR1 in this thread while DataLoader workers are forked: a child starts
    with them blocked (so a job-wide signal cannot kill it before :func:`protect_worker` runs), and
    this process receives what arrived meanwhile when the block is lifted."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def protect_worker(worker_id: int | None = None, *, rank_pid: int | None = None) -> None:
    """Run first in a DataLoader worker (its ``worker_init_fn``, with ``rank_pid`` the pid of the rank
    that made the DataLoader; default: the parent): SIGTERM and SIGUSR1 stay blocked and a thread
    takes them, so that a job-wide signal leaves the worker to its rank; a SIGTERM from the rank (the
    DataLoader or ``multiprocessing`` ending a worker) still ends it."""
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)  # already blocked when forked by forking_workers
    parent = rank_pid if rank_pid is not None else os.getppid()

    def take() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)  # ended by its rank: as the DataLoader's own handler does

    threading.Thread(target=take, name="stop-signals", daemon=True).start()
