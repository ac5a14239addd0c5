"""The per-tensor host work of a step on a plan, chosen once: one C++ pass, or the same in Python.

Every step on a plan (:mod:`optim._plan`) walks the optimizer's parameters: it reads each ``.grad``,
checks that the parameters with gradients are exactly the plan's (the same objects in the same order,
their storage where it was) and that every gradient is dense and contiguous, and writes each
gradient's address into the plan's metadata table. :func:`gather` does that walk:

* ``optim/csrc/plan_host.cpp`` (a Python extension built against the installed torch, ~10 ns per
  tensor): built on first use with the system's C++ compiler (:mod:`optim._build`; 10-20 s once per
  machine and torch version, logged at INFO; cached, then loading takes milliseconds). Built in
  the calling thread, never in a background one: a training process forks DataLoader workers, and a
  fork while another Python thread starts or ends can leave the child waiting forever on the
  interpreter's thread lock (seen: a worker hung in ``PyOS_AfterFork_Child`` while the build thread
  ended);
* the Python walk (~0.35 us per tensor: C-level ``map`` over attribute reads and method calls), when
  the extension cannot be built here (no compiler or Python headers: said once in a
  ``RuntimeWarning``) or ``SRADAMW_PLAN_HOST=python``.

Both return the same codes and write the same words (tests/optim/test_host.py runs both).
"""

from __future__ import annotations

import array
import importlib.machinery
import importlib.util
import logging
import operator
import os
import sysconfig
import threading
import warnings
from itertools import repeat
from pathlib import Path
from typing import Any

import torch

from . import _build as builder

__all__ = ["OK", "OTHER_TENSORS", "MOVED", "NOT_CONTIGUOUS", "gather", "gather_python", "as_int64", "native", "wait",
           "unavailable_reason"]

SOURCE = Path(__file__).with_name("csrc") / "plan_host.cpp"
MODULE = "optim_plan_host"  # the extension's module name (PyInit_optim_plan_host)

#: :func:`gather`'s result codes (the C++ source's, by the same names)
OK, OTHER_TENSORS, MOVED, NOT_CONTIGUOUS, BAD_ARGUMENTS = range(5)

_GRAD = operator.attrgetter("grad")
_DATA_PTR = torch.Tensor.data_ptr
_CONTIGUOUS = torch.Tensor.is_contiguous

_STANDARDS = ("c++20", "c++17")
_LOCK = threading.Lock()
_native: Any = None  # the extension's gather, once loaded
_error: str | None = None  # why it cannot be built ("" when it was)


def gather_python(lists: list[list[torch.Tensor]], params: list[torch.Tensor], param_ptrs: torch.Tensor,
                  table: torch.Tensor, g_words: torch.Tensor, grad_ptrs: torch.Tensor) -> int:
    """The walk in Python (see the module docstring), with the arguments and codes of :func:`gather`."""
    flat = [p for group in lists for p in group]
    grads = list(map(_GRAD, flat))
    if any(map(operator.is_, grads, repeat(None))):
        flat = [p for p, g in zip(flat, grads) if g is not None]
        grads = [g for g in grads if g is not None]
    if len(flat) != len(params) or not all(map(operator.is_, flat, params)):
        return OTHER_TENSORS
    if not torch.equal(as_int64(list(map(_DATA_PTR, params))), param_ptrs):
        return MOVED
    try:
        if not all(map(_CONTIGUOUS, grads)):
            return NOT_CONTIGUOUS
    except RuntimeError:  # a sparse gradient has no is_contiguous
        return NOT_CONTIGUOUS
    if grads:
        grad_ptrs.copy_(as_int64(list(map(_DATA_PTR, grads))))
        rows = g_words >= 0
        table.view(-1)[g_words[rows]] = grad_ptrs[rows]
    return OK


def as_int64(values: list[int]) -> torch.Tensor:
    """An int64 CPU tensor of Python ints (through a C array: ~10x faster than ``torch.tensor(list)``)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64) if values else torch.empty(0, dtype=torch.int64)


def gather(lists: list[list[torch.Tensor]], params: list[torch.Tensor], param_ptrs: torch.Tensor,
           table: torch.Tensor, g_words: torch.Tensor, grad_ptrs: torch.Tensor) -> int:
    """One step's walk over the parameters: ``OK`` when the parameters with gradients (in the order of
    ``lists``, the groups' parameter lists) are ``params``, each at the address ``param_ptrs`` (int64
    ``[len(params)]``) holds, with a dense contiguous gradient; the gradients' addresses are then in
    ``grad_ptrs`` (int64 ``[len(params)]``) and in ``table`` at the flat word indices ``g_words``
    (int64 ``[len(params)]``, -1 for a parameter without a row). Else ``OTHER_TENSORS``, ``MOVED`` or
    ``NOT_CONTIGUOUS`` (the table may then hold some new addresses: the plan is not used)."""
    fn = _native if _native is not None else _load_once()
    if fn is not None:
        code = fn(lists, params, param_ptrs, table, g_words, grad_ptrs)
        if code == BAD_ARGUMENTS:
            raise RuntimeError("optim._host.gather: arguments of the wrong type or size (a bug in optim._plan)")
        return code
    return gather_python(lists, params, param_ptrs, table, g_words, grad_ptrs)


def native() -> bool:
    """Whether the C++ walk is loaded (it is built on first use)."""
    return _native is not None


def wait() -> bool:
    """Builds (or loads) the C++ walk now, if not done yet; whether it is loaded."""
    _load_once()
    return _native is not None


def unavailable_reason() -> str:
    """Why the C++ walk is not used ("" when it is, or before the first use)."""
    return _error or ""


# ------------------------------------------------------------------------------------------------
def _load_once() -> Any:
    """The extension's gather, built or loaded on the first call (None when it cannot be)."""
    global _error
    if _native is not None or _error is not None:
        return _native
    with _LOCK:
        if _native is None and _error is None:
            if os.environ.get("SRADAMW_PLAN_HOST", "").lower() == "python":
                _error = "SRADAMW_PLAN_HOST=python"
            else:
                _load()
    return _native


def _arguments(std: str) -> tuple[list[str], list[str], str]:
    """Compile arguments (``std``: the C++ standard), link arguments and the cache key's extra part for
    this torch and Python."""
    torch_dir = Path(torch.__file__).parent
    include = sysconfig.get_paths()["include"]
    if not (Path(include) / "Python.h").exists():
        raise RuntimeError(f"Python's headers are not installed ({include}/Python.h missing)")
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", 1))
    args = ["-O2", f"-std={std}", "-shared", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", "-w",
            f"-I{torch_dir / 'include'}", f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
            f"-I{include}"]
    lib = torch_dir / "lib"
    link = [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python", f"-Wl,-rpath,{lib}"]
    return args, link, f"torch {torch.__version__} python {sysconfig.get_python_version()}"


def _load() -> None:
    global _native, _error
    try:
        path = None
        for std in _STANDARDS:  # torch's headers need C++20 from 2.10 on, C++17 before
            args, link, key = _arguments(std)
            cached = builder.library_path(SOURCE, args, key)
            if cached.exists():
                path = cached
                break
        first_error = None
        if path is None:
            logging.getLogger(__name__).info("building %s once for torch %s (cached in %s)", SOURCE.name,
                                             torch.__version__, builder.cache_dir())
        for std in _STANDARDS if path is None else ():
            args, link, key = _arguments(std)
            try:
                path = builder.compile_library(SOURCE, args, what="optim's plan host helper", link=link, key_extra=key)
                break
            except RuntimeError as exc:
                first_error = first_error or exc
        if path is None:
            raise first_error
        loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
        spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        _native = module.gather
        _error = ""
    except Exception as exc:  # noqa: BLE001 - no compiler, no headers, unwritable cache...
        _error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        warnings.warn(f"SRAdamW's plan host helper cannot be built here ({_error}); steps walk their tensors in "
                      "Python (the same results, ~0.35 us more per tensor and step).", RuntimeWarning, stacklevel=2)
