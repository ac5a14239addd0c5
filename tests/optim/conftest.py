"""Fixtures of the optim tests."""

from __future__ import annotations

import pytest

from optim import _compiled


@pytest.fixture(autouse=True)
def eager_cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs ``SRAdamW(fused=None)`` on CPU tensors through the eager path (the definition) in every optim
    test but tests/optim/test_compiled.py, which proves the compiled CPU path bit-identical to it for
    every route: compiling each route the semantic tests touch would add minutes to the suite."""
    if request.module.__name__.rsplit(".", 1)[-1] != "test_compiled":
        monkeypatch.setattr(_compiled, "available", lambda: False)
