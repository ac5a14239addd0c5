"""Test-session hooks shared by the whole suite.

Order of a GPU-only selection (``pytest -m gpu``, also ``benchmarks/gpu_check.sh``'s ``tests`` step): the
kernel tests run first, so that a run cut short by a time limit has checked the kernels -- the fused
SRAdamW kernel (tests/optim/test_triton_kernel.py, then the rest of tests/optim), then the fused CLIP
loss (tests/recipe/loss), then everything else, the benchmark scripts' smoke tests (tests/benchmarks:
the slowest, and what gpu_check.sh's benchmark steps run anyway) last. Within each rank the collection
order is kept (a stable sort: a module's tests stay together, so its module-scoped fixtures are set up
once). A selection that holds any test without the ``gpu`` marker (the default CPU run, CI) keeps
pytest's own order.
"""

from __future__ import annotations

import pytest

#: (node id prefix relative to the repository root, rank): the first prefix that matches wins; lower runs
#: first. test_interpreter_variant_in_subprocess waits for a CPU-only subprocess that started with its
#: module's first test: it runs after the rest of tests/optim, which the subprocess runs beside.
GPU_ORDER: tuple[tuple[str, int], ...] = (
    ("tests/optim/test_triton_kernel.py::test_interpreter_variant_in_subprocess", 2),
    ("tests/optim/test_triton_kernel.py", 0),
    ("tests/optim/", 1),
    ("tests/recipe/loss/", 3),
    ("tests/benchmarks/", 5),
)
LAST = 4  # any other test


def gpu_rank(nodeid: str) -> int:
    """Rank of a test by its node id (``tests/optim/test_x.py::test_y[p]``)."""
    nodeid = nodeid.replace("\\", "/")
    for prefix, rank in GPU_ORDER:
        if nodeid.startswith(prefix):
            return rank
    return LAST


@pytest.hookimpl(trylast=True)  # after ``-m`` has deselected: the items are what will run
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    if items and all(item.get_closest_marker("gpu") is not None for item in items):
        items[:] = sorted(items, key=lambda item: gpu_rank(item.nodeid))
