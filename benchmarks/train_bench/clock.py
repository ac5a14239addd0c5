"""Wall time per phase of a train step, from timers wrapped around the callables each phase runs.

The arms' own code runs unchanged; :meth:`PhaseClock.wrap` replaces an attribute (a method, a module
function, a class's method) by a timer around it. A timer counts only while its clock is stepping
(:meth:`PhaseClock.step`): timers of callables that several arms share stack, and each passes through
while another arm's clock runs. Each step records, per phase, its *inclusive* time (everything inside
the phase's calls) in :attr:`PhaseClock.inclusive`, its *exclusive* time (less the time of wrapped calls
nested in it; the step's own remainder is the phase ``step_own``) in :attr:`PhaseClock.exclusive`, and
the number of wrapped calls in :attr:`PhaseClock.calls`; ``total`` is the whole step in both. On CUDA
every timed call synchronises the device before and after: host syncs that exist only for this
diagnosis (without them a phase's time would be its kernel launches).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from .worker import sync

__all__ = ["PhaseClock"]


class PhaseClock:
    active: PhaseClock | None = None

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.inclusive: list[dict[str, float]] = []
        self.exclusive: list[dict[str, float]] = []
        self.calls: list[dict[str, int]] = []
        self._inc: dict[str, float] = {}
        self._exc: dict[str, float] = {}
        self._calls: dict[str, int] = {}
        self._stack: list[list[Any]] = []  # [phase, time spent in nested wrapped calls]

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        """Time ``owner.attr`` as ``phase`` (nothing when there is no such attribute)."""
        orig = getattr(owner, attr, None)
        if orig is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            if PhaseClock.active is not self:
                return orig(*args, **kwargs)
            sync(self.device)
            t0 = time.perf_counter()
            self._stack.append([phase, 0.0])
            try:
                return orig(*args, **kwargs)
            finally:
                sync(self.device)
                dt = time.perf_counter() - t0
                _, inner = self._stack.pop()
                self._inc[phase] = self._inc.get(phase, 0.0) + dt
                self._exc[phase] = self._exc.get(phase, 0.0) + dt - inner
                self._calls[phase] = self._calls.get(phase, 0) + 1
                self._stack[-1][1] += dt

        setattr(owner, attr, timed)

    def step(self, fn: Callable[[], Any]) -> None:
        """Run one step ``fn()`` with this clock's timers counting."""
        self._inc, self._exc, self._calls = {}, {}, {}
        self._stack = [["step_own", 0.0]]
        PhaseClock.active = self
        try:
            sync(self.device)
            t0 = time.perf_counter()
            fn()
            sync(self.device)
            total = time.perf_counter() - t0
        finally:
            PhaseClock.active = None
        self._exc["step_own"] = total - self._stack[0][1]
        self._inc["total"] = self._exc["total"] = total
        self.inclusive.append(self._inc)
        self.exclusive.append(self._exc)
        self.calls.append(self._calls)
