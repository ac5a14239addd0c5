"""Stopping a run cleanly on a signal.

SIGTERM is what SLURM, Kubernetes and most schedulers send before they kill a job: every rank notes
it, the ranks agree on it within the next optimizer step (the flag rides on the step's one
all-reduce, :func:`recipe.step.train_step`), save a checkpoint at that step boundary and exit with
code 143; ``--resume latest`` continues from there. SIGINT (Ctrl-C) stops at once with
``KeyboardInterrupt`` on every rank (the run directory's lock is released; nothing is saved).
``launch.sh`` forwards both signals from the launcher to the ranks.
"""

from __future__ import annotations

import signal
from typing import Any

__all__ = ["StopRequest", "PREEMPTED_EXIT_CODE"]

PREEMPTED_EXIT_CODE = 128 + signal.SIGTERM


class StopRequest:
    """Installs the signal handlers for one run; :attr:`requested` turns true on SIGTERM."""

    def __init__(self) -> None:
        self.requested = False
        self._previous: dict[int, Any] = {}

    def install(self) -> "StopRequest":
        self._previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
        signal.signal(signal.SIGTERM, self._on_term)
        # a process started in the background of a non-interactive shell (launch.sh) inherits SIGINT
        # ignored: make Ctrl-C forwarded by launch.sh stop the rank again
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return self

    def _on_term(self, signum: int, frame: Any) -> None:
        self.requested = True

    def restore(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}
