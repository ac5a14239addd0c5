"""Compiles the Triton kernels a GPU test is about to need ahead of it, in parallel processes.

A GPU test that steps the optimizer over many dtype groups and step options compiles one kernel per
specialisation, one after the other (~0.3-0.6 s each on a CPU core; 105 in
tests/optim/test_triton_kernel.py's bit-exact GPU test, about as many in tests/optim/test_sradamw.py's
skip-flag test; the fused loss's GPU tests in tests/recipe/loss/test_fused.py need ~40). Triton
cannot compile in parallel threads (its passes hold the GIL), but it keeps every compiled kernel in its
on-disk cache, keyed by the kernel's source, specialisation, options, target and environment. So:

1. :func:`precompile` runs ``dry_run`` (the test's own steps, on tensors of their own) with
   ``JITFunction._do_compile`` -- where a launch that misses the in-memory cache compiles -- replaced by a
   recorder: the compile's exact inputs are kept and the launch is skipped (a launch of a kernel already
   compiled runs as usual);
2. forked processes compile the recorded kernels, ``triton.compile`` with those very inputs as
   ``_do_compile`` would call it, so they land in the on-disk cache under the key the real run looks up;
3. the test then runs as it always does: each compile is a cache hit.

Correctness never depends on it: the dry run's results are not looked at, and whatever is not in the
cache by then (a timeout, a failure, a key that differs) is compiled by the real run as before. The
children only compile (no CUDA call: a forked child of a process that uses CUDA must not).
"""

from __future__ import annotations

import multiprocessing
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

_JOBS: list[tuple] = []  # what forked workers compile (inherited, not pickled)


def _compile(i: int) -> int:
    fn, signature, constexprs, options, attrs, target = _JOBS[i]
    fn.compile(fn.ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)
    return i


def record_compiles(dry_run: Callable[[], Any]) -> list[tuple]:
    """``(fn, signature, constexprs, options, attrs, target)`` of every distinct compile ``dry_run``
    would do (the launches that need one are skipped). Errors of ``dry_run`` are swallowed: what was
    recorded until then is returned."""
    from triton.runtime.jit import JITFunction

    seen: set[tuple[int, str]] = set()
    jobs: list[tuple] = []

    def record(self: Any, key: Any, signature: Any, device: Any, constexprs: Any, options: Any, attrs: Any,
               warmup: Any) -> None:
        ident = (id(self), repr(key))
        if ident not in seen:
            seen.add(ident)
            jobs.append((self, signature, constexprs, options, attrs, self.device_caches[device][2]))
        return None  # JITFunction.run returns without launching

    real = JITFunction._do_compile
    JITFunction._do_compile = record
    try:
        dry_run()
    except Exception:  # noqa: BLE001  (a dry run may trip over the outputs of the launches it skipped)
        pass
    finally:
        JITFunction._do_compile = real
    return jobs


def _cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def precompile(dry_run: Callable[[], Any], processes: int | None = None, timeout_s: float = 45.0) -> dict[str, Any]:
    """Puts the kernels ``dry_run`` needs into Triton's on-disk cache, compiled in up to ``processes``
    forked processes (default: the CPUs this process may use, at most 32). Returns ``{"kernels",
    "processes", "seconds", "error"}`` (``error``: why nothing or not everything was compiled ahead; the
    test then compiles as before)."""
    global _JOBS
    t0 = time.perf_counter()
    out: dict[str, Any] = {"kernels": 0, "processes": 0, "seconds": 0.0, "error": ""}
    if "fork" not in multiprocessing.get_all_start_methods():
        out["error"] = "no fork on this platform"
        return out
    try:
        jobs = record_compiles(dry_run)
    except Exception as err:  # noqa: BLE001  (e.g. a Triton whose JIT internals differ)
        out["error"] = f"recording failed: {type(err).__name__}: {err}"
        return out
    n = min(len(jobs), processes or _cpus(), 32)
    out.update(kernels=len(jobs), processes=n)
    if n < 2:  # nothing to gain: the test compiles them itself
        out["seconds"] = time.perf_counter() - t0
        return out
    _JOBS = jobs
    pool = None
    try:
        with warnings.catch_warnings():  # "multi-threaded, use of fork() may lead to deadlocks": the timeout guards
            warnings.simplefilter("ignore", DeprecationWarning)
            pool = multiprocessing.get_context("fork").Pool(n)
        pool.map_async(_compile, range(len(jobs)), chunksize=1).get(timeout_s)
    except Exception as err:  # noqa: BLE001  (a timeout or a compile error: the real run compiles)
        out["error"] = f"{type(err).__name__}: {err}"
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        _JOBS = []
    out["seconds"] = time.perf_counter() - t0
    return out
