"""Run a function on N local torch.distributed ranks (real processes) and collect each rank's result.

Typical use in a test::

    def _worker(rank: int, world_size: int, scale: float) -> dict:   # module level: picklable
        t = torch.full((2,), float(rank) * scale)
        torch.distributed.all_reduce(t)
        return {"sum": t}

    results = run_distributed(_worker, 4, 2.0)        # list of 4 dicts, index = rank

Each rank is a fresh process started with ``torch.multiprocessing`` (``spawn``), with the usual
launcher environment (``MASTER_ADDR``, ``MASTER_PORT`` on a free local port, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``) so that code which initialises itself from the
environment, e.g. ``deepspeed.init_distributed()``, works unchanged; pass
``init_process_group=False`` to leave the initialisation to ``fn``. By default the helper initialises
the default process group (gloo, CPU) before calling ``fn`` and destroys it afterwards.

The function must be importable by the children (defined at module level of an importable module)
and its arguments and return value picklable; results travel back through ``torch.save`` files, so
tensors are fine. If any rank raises, the others are terminated and the parent raises
``RuntimeError`` carrying the traceback of the rank that failed first; if the ranks do not finish
within ``timeout_s`` they are terminated and ``TimeoutError`` is raised. Spawn each world size
once per test module and run several checks inside the worker: starting processes costs seconds.
"""

from __future__ import annotations

import datetime
import os
import socket
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["find_free_port", "run_distributed"]


def find_free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _rank_entry(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    args: tuple,
    out_dir: str,
    port: int,
    backend: str,
    init_process_group: bool,
    threads_per_rank: int,
    env: dict[str, str],
    timeout_s: float,
) -> None:
    os.environ.update(env)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(threads_per_rank)
    if init_process_group:
        dist.init_process_group(
            backend,
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        if dist.is_initialized():
            dist.barrier()
    except BaseException:
        # time-stamped, so that the parent can report the rank that failed first rather than a
        # peer's "connection closed" error
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(f"{time.time()!r}\n{traceback.format_exc()}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _first_failure(out_dir: str, world_size: int, name: str) -> str:
    failures = []
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.err")
        if os.path.exists(path):
            with open(path) as f:
                stamp, _, trace = f.read().partition("\n")
            failures.append((float(stamp), rank, trace))
    if not failures:
        return f"a rank of {name} died without a Python exception (see the chained exception)"
    failures.sort()
    _, rank, trace = failures[0]
    others = [r for _, r, _ in failures[1:]]
    return f"rank {rank} of {name} failed first (later failures on ranks {others}):\n{trace}"


def run_distributed(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str = "gloo",
    timeout_s: float = 300.0,
    init_process_group: bool = True,
    threads_per_rank: int | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` spawned ranks and returns their results.

    Args:
        fn: Module-level (picklable) function; its return value must be ``torch.save``-able.
        world_size: Number of ranks (processes).
        *args: Extra picklable arguments passed to every rank.
        backend: torch.distributed backend for the default group (``"gloo"`` runs on CPU).
        timeout_s: Wall-clock limit for the whole run, also the process group's collective timeout.
        init_process_group: Initialise (and afterwards destroy) the default process group before
            calling ``fn``; set ``False`` when ``fn`` initialises it itself (e.g. DeepSpeed).
        threads_per_rank: ``torch.set_num_threads`` in each rank; default: CPU count split evenly.
        env: Extra environment variables set in each rank before anything else.

    Returns:
        The results, indexed by rank.

    Raises:
        RuntimeError: A rank raised or died; the message holds the traceback of the rank that
            failed first (the others typically fail on the broken connection), the chained
            exception the multiprocessing error.
        TimeoutError: The ranks did not finish within ``timeout_s``.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be positive, got {world_size}")
    if threads_per_rank is None:
        threads_per_rank = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as out_dir:
        ctx = mp.start_processes(
            _rank_entry,
            args=(
                fn,
                world_size,
                tuple(args),
                out_dir,
                find_free_port(),
                backend,
                init_process_group,
                threads_per_rank,
                dict(env or {}),
                timeout_s,
            ),
            nprocs=world_size,
            join=False,
            start_method="spawn",
        )
        deadline = time.monotonic() + timeout_s
        try:
            while not ctx.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size} ranks of {fn.__name__} did not finish in {timeout_s} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            raise RuntimeError(_first_failure(out_dir, world_size, fn.__name__)) from err
        finally:
            for proc in ctx.processes:
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5)
        return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
