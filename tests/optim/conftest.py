"""Fixtures of the optim tests."""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest

from optim import _cpu_kernel


@pytest.fixture(autouse=True)
def eager_cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs ``SRAdamW(fused=None)`` on CPU tensors through the eager path (the definition) in every optim
    test but tests/optim/test_cpu_kernel.py, which proves the CPU kernel bit-identical to it for every
    route, and tests/optim/test_plan.py and test_host.py, which prove the step plans (a kernel route) invisible: the
    semantic tests then check the definition itself."""
    if request.module.__name__.rsplit(".", 1)[-1] not in ("test_cpu_kernel", "test_plan", "test_host"):
        monkeypatch.setattr(_cpu_kernel, "available", lambda: False)


@pytest.fixture
def no_compiler(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[ModuleType], contextlib.AbstractContextManager]:
    """``with no_compiler(module) as fresh:`` ``module`` reloaded with a build cache of its own
    (``tmp_path / "cache"``) and ``CXX`` naming a compiler that does not exist; reloaded as it was after."""

    @contextlib.contextmanager
    def reloaded(module: ModuleType) -> Iterator[ModuleType]:
        monkeypatch.setenv("SRADAMW_CPU_CACHE", str(tmp_path / "cache"))
        monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
        try:
            yield importlib.reload(module)
        finally:
            monkeypatch.undo()
            importlib.reload(module)

    return reloaded
