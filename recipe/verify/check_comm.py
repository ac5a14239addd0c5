"""All-gather, reduce-scatter and all-reduce: correct contents, and bandwidth in NCCL-tests' conventions.

The all-reduce is the default route's one collective per step (bf16 at ZeRO-0 averages the gradients
with it); ZeRO-1/2/3 gather weights and reduce-scatter gradients.

For each size (bytes *per rank*: what one rank sends to an all-gather, receives from a
reduce-scatter, holds in an all-reduce) every rank fills its buffer with a pattern of small integers
known to every rank,
runs one warm-up and ``iters`` timed collectives, and checks the result exactly (integers below 2**24
survive fp32 sums over up to 4096 ranks exactly): the gathered rows of every rank, the element-wise
sum over ranks of its own shard, or the element-wise sum over ranks of the whole buffer. Timing is the slowest rank's (all-reduce MAX of the mean time).

Bandwidth as nccl-tests reports it (``doc/PERFORMANCE.md`` there): with ``S`` the total bytes of the
collective (``N x`` per-rank bytes: the gathered output, the scattered input) and ``t`` the time,
``algbw = S / t`` and ``busbw = algbw x (N - 1) / N`` for both; for the all-reduce ``S`` is the
buffer's bytes and ``busbw = algbw x 2 (N - 1) / N`` (a ring moves each byte twice); busbw is comparable
with the link's bandwidth whatever N. At one rank nothing moves: busbw 0, no bandwidth warning.

Verdict: an error, a timeout (``--timeout`` per collective) or a wrong result fails; a busbw at the
largest size below ``--min-busbw`` (GB/s, 10**9 bytes; default 5 on GPUs -- far below NVLink or
InfiniBand and below PCIe, i.e. traffic falling back to TCP sockets or a wrong interface --, 0.05 on
CPUs, where gloo over loopback is ~1 GB/s) warns.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from .common import Row, Run, max_over_ranks, per_rank, ranks_with, sync

__all__ = ["DEFAULT_MIN_BUSBW", "DEFAULT_SIZES_MIB", "check_comm", "pattern"]

#: Per-rank sizes in MiB by device type.
DEFAULT_SIZES_MIB = {"cuda": (1.0, 4.0, 16.0, 64.0), "cpu": (0.25, 1.0, 4.0)}
#: Warning threshold of busbw (GB/s) at the largest size, by device type.
DEFAULT_MIN_BUSBW = {"cuda": 5.0, "cpu": 0.05}
_MOD = 4093  # pattern values are below this: sums over <= 4096 ranks stay below 2**24 (exact in fp32)


def pattern(rank: int, numel: int, device: torch.device, offset: int = 0) -> torch.Tensor:
    """fp32 small integers ``(rank * 7919 + offset + i) mod 4093`` for ``i < numel`` (exact in fp32)."""
    idx = torch.arange(offset, offset + numel, dtype=torch.int64, device=device)
    return ((idx + rank * 7919) % _MOD).to(torch.float32)


def _run(op: str, out: torch.Tensor, inp: torch.Tensor, timeout: datetime.timedelta) -> None:
    if op == "all_gather":
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
    elif op == "all_reduce":
        out.copy_(inp)
        work = dist.all_reduce(out, op=dist.ReduceOp.SUM, async_op=True)
    else:
        work = dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.SUM, async_op=True)
    work.wait(timeout=timeout)  # raises on an error or when the timeout passes


def _one(op: str, numel: int, run: Run, iters: int, timeout: datetime.timedelta) -> tuple[float, int]:
    """``(mean seconds on this rank, wrong elements on this rank)`` of one collective at one size."""
    world, rank, dev = run.world, run.rank, run.device
    if op == "all_gather":
        inp = pattern(rank, numel, dev)
        out = torch.empty(world * numel, dtype=torch.float32, device=dev)
        expected = torch.cat([pattern(r, numel, dev) for r in range(world)])
    elif op == "all_reduce":
        inp = pattern(rank, numel, dev)
        out = torch.empty(numel, dtype=torch.float32, device=dev)
        expected = sum(pattern(r, numel, dev) for r in range(world))
    else:
        inp = pattern(rank, world * numel, dev)
        out = torch.empty(numel, dtype=torch.float32, device=dev)
        expected = sum(pattern(r, numel, dev, offset=rank * numel) for r in range(world))
    _run(op, out, inp, timeout)  # warm-up (connections, NCCL channels)
    wrong = int((out != expected).sum())
    out.fill_(-1.0)
    sync(dev)
    dist.barrier()  # start the timed loop together
    start = time.perf_counter()
    for _ in range(iters):
        _run(op, out, inp, timeout)
    sync(dev)
    seconds = (time.perf_counter() - start) / iters
    wrong += int((out != expected).sum())
    return seconds, wrong


def check_comm(run: Run, sizes_mib: tuple[float, ...], iters: int, timeout_s: float, min_busbw: float) -> list[Row]:
    """One row per collective: correctness at every size, and the bandwidth at each size."""
    if not dist.is_initialized():
        return [Row("comm", "collectives", "skip", "torch.distributed is not initialised")]
    timeout = datetime.timedelta(seconds=timeout_s)
    world = run.world
    rows = []
    for op in ("all_gather", "reduce_scatter", "all_reduce"):
        parts, wrong_by_rank, status, values = [], [0.0] * world, "pass", {}
        for mib in sizes_mib:
            numel = max(1, int(mib * 2**20) // 4)
            seconds, wrong = _one(op, numel, run, iters, timeout)
            slowest = max_over_ranks([seconds], run.device)[0]
            wrong_by_rank = [a + b for a, b in zip(wrong_by_rank, per_rank(float(wrong), run.device))]
            total = numel * 4 if op == "all_reduce" else world * numel * 4
            algbw = total / slowest / 1e9
            busbw = algbw * (2 if op == "all_reduce" else 1) * (world - 1) / world
            values[f"{mib:g}MiB"] = {"bytes_per_rank": numel * 4, "seconds": slowest, "algbw_GBps": algbw,
                                     "busbw_GBps": busbw}
            parts.append(f"{mib:g}M {algbw:.2f}/{busbw:.2f}")
        wrong_total = int(sum(wrong_by_rank))
        values["wrong_elements"] = wrong_total
        detail = "GB/s algbw/busbw, slowest rank, per-rank MiB: " + ", ".join(parts)
        last_busbw = values[f"{sizes_mib[-1]:g}MiB"]["busbw_GBps"]
        if wrong_total:
            status, detail = "fail", f"{wrong_total} wrong elements on {ranks_with(wrong_by_rank)}; " + detail
        elif world > 1 and last_busbw < min_busbw:
            status, detail = "warn", detail + f" -- busbw below {min_busbw:g} GB/s"
        rows.append(Row("comm", op.replace("_", "-"), status, detail, values))
    return rows
