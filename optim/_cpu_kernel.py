"""The CPU fast path of SRAdamW: a C++ kernel that updates every tensor of a specialisation in one call.

The eager PyTorch path (:func:`optim.functional.apply_update_`, the reference definition) runs the
update as ~60 element-wise passes over memory. ``optim/csrc/sradamw_cpu.cpp`` computes the same
function element for element in one vectorised loop, for many tensors per call, exactly as the fused
Triton kernel does on the GPU: it reads the same metadata rows (:mod:`optim._rows`), so the host work
per step is one row per tensor and one call per specialisation, not a dispatch per tensor. Threads
(OpenMP, ``torch.get_num_threads()`` of them) take blocks of elements across all tensors of the call.

Bit-exactness: compiled without floating-point contraction or fast-math (every product and sum is one
correctly rounded float32 operation, the square root and the division are the IEEE ones); the
results equal the eager path's bit for bit (tests/optim/test_cpu_kernel.py).

Building: one shared library per specialisation, compiled on first use with the system's C++ compiler
(``$CXX``, else ``c++``/``g++``/``clang++``; ~0.4 s each) and cached under
``$SRADAMW_CPU_CACHE`` (default ``~/.cache/clip-sr-recipe/sradamw_cpu``), keyed by the source, the
flags, the compiler's version and the CPU's features (the code is built for the host CPU; a compiler
that refuses OpenMP or ``-march=native`` gets a build without them: one thread, the same bits). A library
is written under a temporary name and renamed into place, so ranks that build at the same time never
load a half-written file. :func:`available` says whether building works here and
:func:`unavailable_reason` why not; ``SRAdamW`` then falls back to the eager path.
"""

from __future__ import annotations

import ctypes
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import _build as builder
from ._rows import INT_WORDS, ROW_WORDS, Slot, Word, call_arguments, copy_back, metadata, prepare, specialisation
from .functional import TensorStep

__all__ = ["cpu_updates_", "grad_amax", "GradAmax", "AMAX", "plan_calls", "run", "available",
           "unavailable_reason", "library_path"]

SOURCE = Path(__file__).with_name("csrc") / "sradamw_cpu.cpp"
AMAX_SOURCE = SOURCE.with_name("grad_amax_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fno-trapping-math", "-fopenmp",
         "-std=c++20", "-shared", "-fPIC")
#: What is tried when a compiler refuses FLAGS (no OpenMP: one thread; no -march=native: the compiler's
#: default target). The results are the same bits: none of these flags changes a rounding.
FALLBACK_FLAGS = (
    tuple(f for f in FLAGS if f != "-fopenmp"),
    tuple(f for f in FLAGS if f not in ("-fopenmp", "-march=native")),
)

_FNS: dict[tuple, Any] = {}
_LOCK = threading.Lock()
_ERROR: str | None = None


def _defines(spec: tuple[tuple[str, Any], ...]) -> list[str]:
    """The -D definitions of one specialisation: the row layout by name, then the constants."""
    layout = [f"-DW_{w.name}={int(w)}" for w in Word] + [f"-DS_{s.name}={int(s)}" for s in Slot]
    layout += [f"-DINT_WORDS={INT_WORDS}", f"-DROW_WORDS={ROW_WORDS}"]
    return layout + [f"-D{name}={int(value)}" for name, value in spec]


def library_path(spec: tuple[tuple[str, Any], ...] | None, source: Path = SOURCE, flags: tuple[str, ...] = FLAGS
                 ) -> Path:
    """Where the library of one specialisation of ``source`` built with ``flags`` is cached (built or
    not); ``spec`` None: a source without specialisations."""
    return builder.library_path(source, [*flags, *(_defines(spec) if spec is not None else [])])


def _build(spec: tuple[tuple[str, Any], ...] | None, source: Path = SOURCE) -> Path:
    """The cached library, or a new one: FLAGS first, then each of FALLBACK_FLAGS (a compiler without
    OpenMP or ``-march=native``); the first failure's message when none builds."""
    choices = (FLAGS, *FALLBACK_FLAGS)
    for flags in choices:
        path = library_path(spec, source, flags)
        if path.exists():
            return path
    first_error = None
    for flags in choices:
        try:
            return _compile(spec, source, flags)
        except RuntimeError as exc:
            first_error = first_error or exc
    raise first_error


def _compile(spec: tuple[tuple[str, Any], ...] | None, source: Path, flags: tuple[str, ...]) -> Path:
    args = [*flags, *(_defines(spec) if spec is not None else [])]
    return builder.compile_library(source, args, what="the SRAdamW CPU kernel")


def _load(key: Any, build, symbol: str, argtypes: list) -> Any:
    """A function of a library, built, cached and loaded once per process under ``key``."""
    fn = _FNS.get(key)
    if fn is None:
        with _LOCK:
            fn = _FNS.get(key)
            if fn is None:
                fn = getattr(ctypes.CDLL(str(build())), symbol)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
                _FNS[key] = fn
    return fn


#: :func:`_kernel`'s name for the gradient maxima's function (``optim/csrc/grad_amax_cpu.cpp``)
AMAX = "grad_amax"


def _kernel(spec: tuple[tuple[str, Any], ...] | str) -> Any:
    """The update kernel of one specialisation, or (``AMAX``) the gradient maxima's function: the one
    place that hands out the compiled functions (a host-time benchmark records here)."""
    if spec == AMAX:
        return _load("amax", lambda: _build(None, AMAX_SOURCE), "grad_amax_cpu",
                     [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p,
                      ctypes.c_int])
    return _load(spec, lambda: _build(spec), "sradamw_cpu_step",
                 [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int])


_AMAX_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class GradAmax:
    """float32 ``[n]``: the largest magnitude of each of ``n`` contiguous CPU tensors (float32, bfloat16
    or float16; NaN when one holds a NaN), all in one call (``optim/csrc/grad_amax_cpu.cpp``), given
    their addresses; their dtypes and lengths are fixed when it is made (a step plan's gradients keep
    theirs: autograd's ``.grad`` setter keeps a parameter's dtype and size)."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        for g in tensors:
            if g.device.type != "cpu" or g.dtype not in _AMAX_KIND:
                raise ValueError(f"grad_amax takes float32/bfloat16/float16 CPU tensors, got {g.dtype} on {g.device}")
        self.n = len(tensors)
        self.meta = torch.tensor([0] * self.n + [g.numel() for g in tensors], dtype=torch.int64)  # addresses, numels
        self.kinds = torch.tensor([_AMAX_KIND[g.dtype] for g in tensors], dtype=torch.int32)
        self.out = torch.zeros(self.n, dtype=torch.float32)

    def __call__(self, addresses: torch.Tensor) -> torch.Tensor:
        """The maxima of the tensors at ``addresses`` (int64 ``[n]``; the caller keeps them alive), in a
        buffer of this object's (overwritten by the next call)."""
        self.meta[:self.n] = addresses
        base = self.meta.data_ptr()
        _kernel(AMAX)(base, base + 8 * self.n, self.kinds.data_ptr(), self.n, self.out.data_ptr(),
                      torch.get_num_threads())
        return self.out

    def tensors(self) -> list[torch.Tensor]:
        return [self.meta, self.kinds, self.out]


def grad_amax(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """float32 ``[len(grads)]``: the largest magnitude of each CPU tensor (float32, bfloat16 or float16;
    NaN when it holds one), all in one call (:class:`GradAmax`)."""
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    return GradAmax(grads)(torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)).clone()


def available() -> bool:
    """Whether the kernel builds and runs on this machine (checked once, on the bf16 route). When it
    does not, a ``RuntimeWarning`` says why once (SRAdamW then runs the eager path, ~20x slower)."""
    global _ERROR
    if _ERROR is None:
        try:
            p = torch.zeros(16, dtype=torch.bfloat16)
            s = TensorStep(p, torch.ones_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-3,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, keys=(1, 2))
            cpu_updates_([s])
            grad_amax([s.grad])
            _ERROR = ""
        except Exception as exc:  # noqa: BLE001 - no compiler, unsupported platform, unwritable cache...
            _ERROR = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            warnings.warn(f"SRAdamW's CPU kernel cannot be built here ({_ERROR}); CPU tensors take the eager "
                          f"path (the same results, ~20x slower). Set CXX to a C++ compiler, or "
                          f"SRADAMW_CPU_CACHE to a writable directory (now {builder.cache_dir()}).", RuntimeWarning,
                          stacklevel=2)
    return _ERROR == ""


def unavailable_reason() -> str:
    """Why the CPU kernel cannot run here ("" when it can)."""
    available()
    return _ERROR or ""


def _cpu_float(x: torch.Tensor) -> torch.Tensor:
    return x.detach().reshape(1).to(device="cpu", dtype=torch.float32).contiguous()


def cpu_updates_(
    specs: Sequence[TensorStep],
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    states_checked: bool = False,
) -> int:
    """Applies one step to each tensor (CPU tensors), one kernel call per specialisation.

    Args:
        specs: The tensors and their per-tensor hyperparameters.
        grad_mul: Multiplies every gradient first (an inverse loss scale): a float or a 1-element tensor.
        found_inf: Optional 1-element flag; nonzero: nothing changes.
        states_checked: The caller checked the states and options once (``SRAdamW``); each call then
            checks the gradients and sizes only (:func:`optim._rows.check`).

    Returns:
        The number of kernel calls.
    """
    steps = [s for s in specs if s.param.numel() > 0]
    if not steps:
        return 0
    gmul_mode, gmul_value, gmul_tensor, skip = call_arguments(grad_mul, found_inf, _cpu_float)

    groups: dict[tuple, list[tuple[TensorStep, torch.Tensor, torch.Tensor]]] = {}  # specialisation -> rows
    for s in steps:
        if s.param.device.type != "cpu":
            raise ValueError(f"the SRAdamW CPU kernel takes CPU tensors, got one on {s.param.device}")
        param, grad = prepare(s, states_checked)
        groups.setdefault(specialisation(s, grad, gmul_mode), []).append((s, param, grad))
    items = [item for rows in groups.values() for item in rows]  # rows contiguous per specialisation
    table = metadata(items, gmul_value)  # every row at once; items keeps the addressed tensors alive
    run(table, plan_calls([(spec, len(rows)) for spec, rows in groups.items()]), skip, gmul_tensor)
    copy_back(items)
    return len(groups)


def plan_calls(groups: Sequence[tuple[tuple, int]]) -> list[tuple[tuple, int, int]]:
    """``(specialisation, first row, rows)`` per kernel call, for groups given as ``(specialisation,
    rows)`` whose rows follow each other in the table in that order."""
    out, start = [], 0
    for spec, count in groups:
        out.append((spec, start, count))
        start += count
    return out


def run(table: torch.Tensor, calls: Sequence[tuple[tuple, int, int]], skip: torch.Tensor | None,
        gmul_tensor: torch.Tensor | None) -> None:
    """One kernel call per group of :func:`plan_calls` over the contiguous int64 metadata ``table``
    (the one place that calls the kernel; a host-time benchmark records here)."""
    threads = torch.get_num_threads()
    base = table.data_ptr()
    for spec, start, count in calls:
        _kernel(spec)(base + start * ROW_WORDS * 8, count, skip.data_ptr() if skip is not None else None,
                      gmul_tensor.data_ptr() if gmul_tensor is not None else None, threads)
