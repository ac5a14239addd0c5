"""AdamW step time, state bytes per parameter and achieved bandwidth, side by side in one run; and the
host time of one SRAdamW step with its kernel launches recorded instead of run (``--host``).

Compares on the same parameters and the same sequence of gradients:
  * torch AdamW, float32 weights and states (fused on CUDA, foreach on CPU);
  * torch AdamW on bf16 weights and states (round-to-nearest everywhere);
  * SRAdamW: bf16 weights + bf16 SR states; fp16 weights + scaled fp16 SR states; bf16 weights with
    an fp32 master and fp32 states; bf16 weights with the split master; each on the eager PyTorch
    path, (CPU) with the C++ kernel (the default there) and (CUDA) with the fused Triton kernel,
    and the fused kernel once more with ``check_finite=False`` (no separate inf/NaN pass over the
    gradients);
  * torchao ``_AdamW(bf16_stochastic_round=True)`` (bf16 weights, fp32 master-free SR) if installed;
  * optimi ``AdamW(kahan_sum=True)`` on bf16 weights if installed.

How a step is timed (as training runs it)
  * Fresh gradients every step: ``--grad-sets`` (default 3) gradient sets are drawn once per layout
    (bf16 values, a seeded generator on the benchmark's device, the same for every optimizer) and
    before every step, warm-up included, set ``k % K`` is written into the gradients. ``--grads new``
    (default) gives every parameter a new gradient tensor each step, as ``zero_grad(set_to_none=True)``
    or DeepSpeed's ``engine.zero_grad()`` followed by backward does, so nothing keyed by the gradient
    tensors (or their values) can be reused across steps; ``--grads copy`` copies the values into the
    same tensors (a persistent gradient buffer). The refresh is never inside the timed region.
  * On CUDA an L2-sized scratch buffer is written before the refresh (``--l2-flush-mib``, default
    twice the L2 size), so parameters and states are not cache-resident from the previous step and
    only the last-written gradients are (as after a backward pass).
  * Each step is timed on its own: refresh, ``torch.cuda.synchronize()`` (the queue drained), a CUDA
    event, ``step()``, a CUDA event, ``synchronize()``. The events span everything the step enqueues
    on the current stream, the deferred skip flag's pinned copy included, and any idle gap while the
    GPU waits for the host to launch the next kernel. ``ms`` is the median of ``--iters`` (default
    21) timed steps after ``--warmup`` steps, with min and max; GB/s is computed from the median.
    ``call ms`` is the host time until ``step()`` returns (perf_counter), ``wall_ms`` (JSON) the
    perf_counter time through the final synchronize. On CPU, perf_counter around ``step()`` only.
  * CUDA also reports ``back-to-back ms``: events around each step issued without a host sync between
    steps (gradients still refreshed between them, outside the events): the host work of a step then
    overlaps the GPU work of the previous one. This is what the old mean-of-20 measured.
  * CPU (default ``--interleave``): every optimizer prepared first, then one step of each in turn,
    so a load change on a shared machine hits every row alike; ``paired`` is the median over rounds of
    a row's time over torch bf16 AdamW's in the same round.

Why the old benchmark read 6.31 ms where an independent timing read 9.76 ms (issue 27: SRAdamW bf16
SR, 64 x 2**24, H200, finiteness check on). The old code ran ``sync; 20 x step(); sync`` and divided
by 20, with the same gradient tensors every step. Reading that code and ``optim/sradamw.py``:
  1. (the likely cause) The mean of back-to-back steps is a throughput, about max(host work, GPU
     work) per step, not what a step costs. SRAdamW's ``step()`` does its host work (per-tensor rows,
     keys, the table upload, ~20 small torch ops) and launches the update kernel at its end; with the
     deferred skip flag the host waits for the GPU only at the start of step k+1, for step k's flag
     copy, which is queued *before* step k's update. So back to back, step k+1's host work overlaps
     step k's update kernel and the mean hides up to min(host, GPU) per step. A step whose host work
     is exposed (timed alone after a sync, as an independent timing does, or a training step after a
     host read: a loss print, DeepSpeed's overflow check or gradient-norm read) costs the host work up
     to the update's launch plus the update kernel. The gap, 9.76 - 6.31 = 3.45 ms, is what the update
     kernel alone needs to move its 15.0 GB (read p, g, m, v; write p, m, v: 14 bytes per parameter)
     at 4.35 TB/s (~90 % of the H200's 4.8 TB/s): consistent with a back-to-back figure bounded by
     ~6.3 ms of host work per step, the step alone costing that plus the update. (Were the GPU the
     bound instead, update + gradient maxima = 6.3 ms, the step alone had ~4 ms of host work; either
     way the mean hid host work that the step pays.) This host path, at the commit the issue
     measured, takes ~1.4 ms for 64 tensors on CPU tensors on the project's CPU machine (``--host``);
     CUDA adds dispatch and launch costs per torch op, a pinned allocation, an event and the pinned
     upload, and the GPU machine's CPU is another CPU: one GPU run settles the split (``call ms`` is
     the host part, ``back-to-back ms`` the old figure, ``ms`` the step alone).
  2. Not causes here, made impossible anyway: reused gradients (nothing in SRAdamW cached by gradient
     value or tensor at that commit, but the host path is being rewritten to cache a step plan: with
     ``--grads new`` nothing keyed by the gradient tensors can hit where training would miss);
     L2-resident data (2 GiB of gradients cannot be, a small layout's whole state can: hence the
     flush); timing that ends before the GPU finished (the old final ``synchronize()`` covered all
     streams; the events here cover the skip flag's copy too); averaging that hides the first steps
     (warm-up excluded; median with min and max shown).
  An independent timing that refreshed the gradients inside its timed region (``randn`` and a scale
  of 1.07 B bf16 values: ~6 GB of traffic, ~1.5 ms) would read high too; here the refresh is outside.

Host time (``--host``): the wall-clock time of one steady-state ``SRAdamW.step()`` with the kernel
launches replaced by a recorder that only records their arguments, for the layouts ``tiny``,
``vit-b-32`` and ``gpu-1b`` by default, on CPU tensors:
  * route ``triton``: ``fused=True`` with ``TRITON_INTERPRET=1`` (set by this script when unset),
    ``optim.triton_kernel._launch`` replaced; the skip flag is forced onto the deferred path (as for
    CUDA tensors: ``SRAdamW._defers``, when it exists);
  * route ``cpu``: ``fused=None`` (the C++ kernel), ``optim._cpu_kernel._kernel`` replaced by a
    function returning a recording callable; the skip flag is read at once, as SRAdamW does on CPU.
  The recorder depends on nothing inside ``SRAdamW.step`` but these two launch points: as long as
  ``optim.triton_kernel._launch(blocks, device, *args, **kwargs)`` and ``optim._cpu_kernel._kernel(spec)``
  stay the places that launch, the measurement follows any rewrite of the host path. A route that
  records no launch (the launch moved, or the step fell back to the eager path) is an error row.
  Both launch points carry both of a plan step's launches: the gradient maxima (the Triton
  ``grad_amax_kernel`` through ``_launch(..., kernel=...)``; the C++ reduction as ``_kernel(AMAX)``)
  and the update, so a steady step records 2 (or one more per further specialisation or element width).
  Tensors have the layout's tensor *count* but ``--host-elements`` (default 1024) elements each (0:
  the layout's own shapes); host time should not depend on sizes. Not included: what only a GPU
  host pays (CUDA dispatch and launch per op, pinned allocations, events, the upload). One thread by
  default (``--threads``): on a GPU host the step's host work is single-threaded, and on a shared
  machine OpenMP's threads in the maxima call would measure contention. Reported: median, min, max
  host us/step over ``--iters`` (default 60) steps after ``--warmup`` (default 5), launches recorded
  per step, and the growth per extra tensor: the same route timed at N and 2N tensors (the layout's
  shapes twice), interleaved step by step, slope of the medians. Goals (issue 27): vit-b-32 <= 150
  us/step, growth <= 0.3 us per extra tensor; the table marks them.

Usage:
    python benchmarks/bench_optim.py                       # CPU: 8 tensors of 2**20
    python benchmarks/bench_optim.py --layout gpu-1b       # CUDA: 64 tensors of 2**24 (1.07 B)
    python benchmarks/bench_optim.py --layout vit-b-32     # the ViT-B-32 preset's tensor shapes
    python benchmarks/bench_optim.py --layout gpu-1b,vit-b-32   # both, one table each, one run
    python benchmarks/bench_optim.py --layout gpu-1b --exclude "PyTorch path" --json rows.json
    python benchmarks/bench_optim.py --host                # host us/step: tiny, vit-b-32, gpu-1b; both routes
    python benchmarks/bench_optim.py --host --host-config all --json host.json

``--json`` rows (written again after every row, so a run cut short keeps what it measured). Step rows
(``kind: "step"``): ``optimizer``, ``layout``, ``ms`` (median per step), ``ms_min``, ``ms_max``,
``times_ms``, ``steps``, ``state_bytes_per_param``, ``weight_bytes_per_param``, ``GB/s``, ``params``,
``tensors``, ``grads``; on CUDA also ``call_ms``, ``wall_ms``, ``back_to_back_ms``; interleaved:
``paired``; or ``error``. Host rows (``kind: "host"``): ``optimizer``, ``route``, ``layout``,
``tensors``, ``elements_per_tensor``, ``host_us`` (median), ``host_us_min``, ``host_us_max``,
``launches_per_step``, ``host_us_2x`` (at 2N tensors), ``us_per_extra_tensor`` (from the medians;
``us_per_extra_tensor_min`` from the minima), ``steps``, or ``error``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optim import SRAdamW  # noqa: E402

#: SRAdamW configurations: key -> (label, parameter dtype, keyword arguments).
SR_CONFIGS: dict[str, tuple[str, torch.dtype, dict[str, Any]]] = {
    "bf16": ("bf16 w + bf16 SR states", torch.bfloat16, {"state_dtype": torch.bfloat16}),
    "fp16": ("fp16 w + scaled fp16 SR states", torch.float16, {"state_dtype": torch.float16}),
    "fp32-master": ("bf16 w + fp32 master/states", torch.bfloat16,
                    {"master_weights": True, "master_format": "fp32", "state_dtype": torch.float32}),
    "split-master": ("bf16 w + split master (int16 low half)/fp32 states", torch.bfloat16,
                     {"master_weights": True, "state_dtype": torch.float32}),
}
HOST_ROUTES = {
    "triton": "Triton, launches recorded",
    "cpu": "C++ CPU kernel, calls recorded",
}
HOST_GOAL_US = 150.0  # issue 27: host time of one step, ViT-B-32's 350 tensors
HOST_GOAL_US_PER_TENSOR = 0.3  # issue 27: growth per extra tensor
HOST_GOAL_LAYOUT = "vit-b-32"


def layout(name: str, n_tensors: int, size: int) -> list[tuple[int, ...]]:
    if name == "uniform":
        return [(size,)] * n_tensors
    if name == "gpu-1b":
        return [(1 << 24,)] * 64
    if name.endswith("-flat"):  # the same elements as one tensor (what ZeRO-1/2 hand the optimizer at one rank)
        return [(sum(math.prod(s) for s in layout(name[: -len("-flat")], n_tensors, size)),)]
    if name in ("vit-b-32", "tiny"):  # a preset's parameter shapes (ZeRO-0: the module's own tensors)
        from recipe.model import create_model

        with torch.device("meta"):
            model = create_model("ViT-B-32" if name == "vit-b-32" else name)
        return [tuple(p.shape) for p in model.parameters()]
    raise ValueError(f"unknown layout {name!r}")


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out.append(v)
    return out


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


# ------------------------------------------------------------------------------------------------
# gradients: fresh every step
# ------------------------------------------------------------------------------------------------
class GradPool:
    """``sets`` gradient sets for ``shapes`` (bf16 values ~ N(0, 1e-3), drawn once with a seeded
    generator on ``device``), written into the parameters' gradients before every step (:meth:`write`).
    Every optimizer of a layout sees the same sequence (set ``k % sets`` at its step ``k``)."""

    def __init__(self, shapes: Sequence[tuple[int, ...]], device: str, sets: int = 3, seed: int = 1) -> None:
        if sets < 1:
            raise ValueError(f"need at least one gradient set, got {sets}")
        gen = torch.Generator(device=device).manual_seed(seed)
        self.sets = [[(torch.randn(s, generator=gen, device=device) * 1e-3).to(torch.bfloat16) for s in shapes]
                     for _ in range(sets)]

    def write(self, params: Sequence[torch.Tensor], k: int, mode: str = "new") -> None:
        """Gradient set ``k % sets`` into ``params``' gradients: ``"new"`` gives each parameter a new
        gradient tensor (the old one dropped first, as ``zero_grad(set_to_none=True)`` and backward do);
        ``"copy"`` copies the values into the existing gradients (allocated on first use)."""
        values = self.sets[k % len(self.sets)]
        if len(values) != len(params):
            raise ValueError(f"{len(params)} parameters, gradient sets of {len(values)} tensors")
        if mode == "new":
            for p in params:
                p.grad = None
            for p, g in zip(params, values):
                p.grad = torch.empty_like(p, memory_format=torch.contiguous_format).copy_(g)
        elif mode == "copy":
            for p, g in zip(params, values):
                if p.grad is None:
                    p.grad = torch.empty_like(p, memory_format=torch.contiguous_format)
                p.grad.copy_(g)
        else:
            raise ValueError(f"unknown gradient refresh mode {mode!r} (new | copy)")


def make_params(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype, device: str, seed: int = 0
                ) -> list[torch.nn.Parameter]:
    """Parameters ~ N(0, 0.02) in ``dtype``, drawn on ``device`` (2 x 1.07 B CPU draws per row take minutes)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(dtype)) for s in shapes]


@dataclass
class Runner:
    """One optimizer under test: its parameters, the gradient sequence and its step counter."""

    label: str
    opt: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    pool: GradPool
    device: str
    grads: str = "new"
    scratch: torch.Tensor | None = None  # written before each refresh: evicts the L2 (CUDA)
    k: int = 0  # steps taken (warm-up included): the next gradient set
    times: list[float] = field(default_factory=list)
    calls: list[float] = field(default_factory=list)
    walls: list[float] = field(default_factory=list)

    def refresh(self) -> None:
        """Outside every timed region: the L2 flush, then the step's gradients."""
        if self.scratch is not None:
            self.scratch.zero_()
        self.pool.write(self.params, self.k, self.grads)
        self.k += 1

    def step(self) -> None:
        """One untimed step with fresh gradients (warm-up)."""
        self.refresh()
        self.opt.step()

    def timed_step(self) -> float:
        """One step timed on its own (see the module docstring); records and returns its seconds."""
        self.refresh()
        if self.device == "cuda":
            torch.cuda.synchronize()  # the refresh done, the queue drained: the step starts on an idle GPU
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            t0 = time.perf_counter()
            self.opt.step()
            call = time.perf_counter() - t0
            end.record()  # after everything step() enqueued on this stream (the skip flag's copy too)
            torch.cuda.synchronize()  # every stream, not only the event's
            wall = time.perf_counter() - t0
            dt = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            self.opt.step()
            dt = call = wall = time.perf_counter() - t0
        self.times.append(dt)
        self.calls.append(call)
        self.walls.append(wall)
        return dt

    def back_to_back(self, n: int) -> list[float]:
        """CUDA: ``n`` steps issued without a host sync between them, events around each step only
        (the refresh between them is outside the events); seconds per step."""
        torch.cuda.synchronize()
        events = []
        for _ in range(n):
            self.refresh()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            self.opt.step()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return [s.elapsed_time(e) / 1e3 for s, e in events]


def prepare(label: str, make: Callable[[list[torch.Tensor]], torch.optim.Optimizer], shapes: Sequence[tuple[int, ...]],
            dtype: torch.dtype, device: str, pool: GradPool, warmup: int, grads: str = "new",
            scratch: torch.Tensor | None = None) -> Runner:
    """Parameters, the optimizer and ``warmup`` steps with fresh gradients (compilation happens there)."""
    params = make_params(shapes, dtype, device)
    pool.write(params, 0, grads)  # optimizers that look at gradients when built see them
    runner = Runner(label, make(params), params, pool, device, grads, scratch)
    for _ in range(warmup):
        runner.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return runner


def result_row(runner: Runner) -> dict:
    params, opt = runner.params, runner.opt
    n = sum(p.numel() for p in params)
    states = state_tensors(opt)
    moved = 2 * nbytes(params) + nbytes([p.grad for p in params]) + 2 * nbytes(states)
    dt = statistics.median(runner.times)
    row = {
        "kind": "step",
        "optimizer": runner.label,
        "ms": dt * 1e3,
        "ms_min": min(runner.times) * 1e3,
        "ms_max": max(runner.times) * 1e3,
        "steps": len(runner.times),
        "times_ms": [round(t * 1e3, 4) for t in runner.times],
        "state_bytes_per_param": nbytes(states) / n,
        "weight_bytes_per_param": nbytes(params) / n,
        "GB/s": moved / dt / 1e9,
        "params": n,
        "tensors": len(params),
        "grads": runner.grads,
    }
    if runner.device == "cuda":
        row["call_ms"] = statistics.median(runner.calls) * 1e3
        row["wall_ms"] = statistics.median(runner.walls) * 1e3
    return row


def _error_row(label: str, e: Exception, **extra: Any) -> dict:
    return {"optimizer": label, "error": f"{type(e).__name__}: {e}"[:160], **extra}


def bench_layout(cands: list[tuple[str, torch.dtype, Callable]], shapes: Sequence[tuple[int, ...]], device: str,
                 warmup: int, iters: int, *, interleave: bool, grads: str = "new", grad_sets: int = 3,
                 flush_bytes: int = 0, on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Rows for one layout. ``interleave``: every optimizer prepared first, then one timed step of
    each in turn, ``iters`` rounds (each row also gets ``paired``: the median over rounds of its step
    time over torch bf16 AdamW's in the same round); else one optimizer at a time."""
    pool = GradPool(shapes, device, grad_sets)
    scratch = torch.empty(flush_bytes, dtype=torch.uint8, device=device) if flush_bytes > 0 else None
    rows: dict[str, dict] = {}

    def finish(runner: Runner) -> None:
        rows[runner.label] = result_row(runner)
        if device == "cuda":
            b2b = runner.back_to_back(iters)
            rows[runner.label]["back_to_back_ms"] = statistics.median(b2b) * 1e3

    def report() -> None:
        if on_row is not None:
            on_row([rows[label] for label, _, _ in cands if label in rows])

    if interleave:
        ready = []
        for label, dtype, make in cands:
            try:
                ready.append(prepare(label, make, shapes, dtype, device, pool, warmup, grads, scratch))
            except Exception as e:  # a comparison optimizer that cannot run here is reported, not hidden
                rows[label] = _error_row(label, e)
        for _ in range(iters):
            for runner in ready:
                runner.timed_step()
        base = next((r for r in ready if r.label.startswith("torch AdamW bf16")), None)
        for runner in ready:
            finish(runner)
            if base is not None:
                rows[runner.label]["paired"] = statistics.median(t / b for t, b in zip(runner.times, base.times))
        report()
    else:
        for label, dtype, make in cands:
            runner = None
            try:
                runner = prepare(label, make, shapes, dtype, device, pool, warmup, grads, scratch)
                for _ in range(iters):
                    runner.timed_step()
                finish(runner)
            except Exception as e:  # a comparison optimizer that cannot run here is reported, not hidden
                rows[label] = _error_row(label, e)
            del runner
            if device == "cuda":
                torch.cuda.empty_cache()
            report()
    return [rows[label] for label, _, _ in cands if label in rows]


def candidates(device: str) -> list[tuple[str, torch.dtype, Callable]]:
    cuda = device == "cuda"
    torch_kw = {"fused": True} if cuda else {"foreach": True}
    c: list[tuple[str, torch.dtype, Callable]] = [
        ("torch AdamW fp32" + (" fused" if cuda else " foreach"), torch.float32,
         lambda ps: torch.optim.AdamW(ps, lr=1e-3, **torch_kw)),
        ("torch AdamW bf16 (RTN)", torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3, **torch_kw)),
    ]
    sr_configs = list(SR_CONFIGS.values())
    for label, dtype, kw in sr_configs:
        c.append((f"SRAdamW {label} (PyTorch path)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=False, **kw)))
    if cuda:  # the fused kernel runs compiled on CUDA tensors only
        for label, dtype, kw in sr_configs:
            c.append((f"SRAdamW {label} (fused)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=True, **kw)))
        for label, dtype, kw in sr_configs[:2]:
            c.append(
                (f"SRAdamW {label} (fused, check_finite=False)", dtype,
                 lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=True, check_finite=False, **kw))
            )
    else:
        print("# SRAdamW fused rows need CUDA: skipped", file=sys.stderr)
        for label, dtype, kw in sr_configs:  # the default on CPU tensors: the C++ kernel
            c.append((f"SRAdamW {label} (CPU kernel)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, **kw)))
    try:
        from torchao.optim import _AdamW

        c.append(("torchao _AdamW bf16 SR", torch.bfloat16, lambda ps: _AdamW(ps, lr=1e-3, bf16_stochastic_round=True)))
    except ImportError:
        print("# torchao not installed: skipped", file=sys.stderr)
    try:
        from optimi import AdamW as OptimiAdamW

        c.append(("optimi AdamW bf16 Kahan", torch.bfloat16, lambda ps: OptimiAdamW(ps, lr=1e-3, kahan_sum=True)))
    except ImportError:
        print("# torch-optimi not installed: skipped", file=sys.stderr)
    return c


def print_step_table(rows: list[dict], cuda: bool) -> None:
    base = next((r["ms"] for r in rows if r["optimizer"].startswith("torch AdamW bf16") and "ms" in r), None)
    extra = " call ms | back-to-back ms |" if cuda else ""
    print(f"| optimizer | ms/step (median) | min | max | × torch bf16 | × torch bf16, paired |{extra} "
          "weight B/param | state B/param | GB/s |")
    print("|---|---:|---:|---:|---:|---:|" + ("---:|---:|" if cuda else "") + "---:|---:|---:|")
    for r in rows:
        if "error" in r:
            print(f"| {r['optimizer']} | error: {r['error']} | | | | |" + (" | |" if cuda else "") + " | | |")
            continue
        ratio = f"{r['ms'] / base:.2f}" if base else "-"
        paired = f"{r['paired']:.2f}" if "paired" in r else "-"
        more = f" {r['call_ms']:.2f} | {r['back_to_back_ms']:.2f} |" if cuda and "back_to_back_ms" in r else (
            " - | - |" if cuda else "")
        print(f"| {r['optimizer']} | {r['ms']:.2f} | {r['ms_min']:.2f} | {r['ms_max']:.2f} | {ratio} | {paired} |"
              f"{more} {r['weight_bytes_per_param']:.0f} | {r['state_bytes_per_param']:.2f} | {r['GB/s']:.1f} |")


# ------------------------------------------------------------------------------------------------
# host time: the kernel launches recorded instead of run
# ------------------------------------------------------------------------------------------------
class LaunchRecorder:
    """Stands in for the kernels' launch points and only records the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def launch(self, blocks: torch.Tensor, device: torch.device, *args: Any, **kwargs: Any) -> None:
        """In place of ``optim.triton_kernel._launch(blocks, device, *args, **kwargs)``."""
        self.calls.append(("launch", blocks, device, args, kwargs))

    def kernel(self, spec: Any) -> Callable[..., int]:
        """In place of ``optim._cpu_kernel._kernel(spec)``: the callable it returns records its call."""
        return functools.partial(self._call, spec)

    def _call(self, spec: Any, *args: Any) -> int:
        self.calls.append(("kernel", spec, args))
        return 0  # the C++ kernel's status: success


def _host_module(route: str) -> tuple[Any, str]:
    """The module whose launch point ``route`` records, and the attribute's name; raises when the route
    cannot run here."""
    if route == "triton":
        from optim import _triton

        if not _triton.is_available():
            raise RuntimeError(f"Triton unavailable: {_triton.unavailable_reason()}")
        import optim.triton_kernel as module

        if not module.interpreting():
            raise RuntimeError("optim.triton_kernel was imported compiled: set TRITON_INTERPRET=1 before it is "
                               "imported (this script does when run with --host and the variable unset)")
        return module, "_launch"
    if route == "cpu":
        from optim import _cpu_kernel as module

        if not module.available():  # built for real once, before the launch point is replaced
            raise RuntimeError(f"C++ CPU kernel unavailable: {module.unavailable_reason()}")
        return module, "_kernel"
    raise ValueError(f"unknown host route {route!r} ({' | '.join(HOST_ROUTES)})")


@contextlib.contextmanager
def recording(route: str, recorder: LaunchRecorder) -> Iterator[None]:
    """Replaces ``route``'s launch point by ``recorder`` for the duration (restored after)."""
    module, name = _host_module(route)
    if not hasattr(module, name):
        raise RuntimeError(f"{module.__name__}.{name} does not exist: the launch point moved; update "
                           "bench_optim's recorder")
    real = getattr(module, name)
    setattr(module, name, recorder.launch if route == "triton" else recorder.kernel)
    try:
        yield
    finally:
        setattr(module, name, real)


def host_time(shapes: Sequence[tuple[int, ...]], route: str, config: str = "bf16", *, steps: int = 60,
              warmup: int = 5, elements: int | None = 1024, grads: str = "new", grad_sets: int = 3) -> dict:
    """Host seconds of one ``SRAdamW.step()`` (config :data:`SR_CONFIGS` ``[config]``) on CPU tensors with
    the kernel launches of ``route`` recorded, at N = ``len(shapes)`` tensors and at 2N (the shapes
    twice), stepped alternately. ``elements``: each tensor gets ``min(its size, elements)`` elements
    (None or 0: the shapes as given). Returns the host row (module docstring); raises when the route
    cannot run here or records no launch."""
    label, dtype, kw = SR_CONFIGS[config]
    sizes = [(min(math.prod(s), elements),) if elements else tuple(s) for s in shapes]
    recorder = LaunchRecorder()
    with recording(route, recorder):
        runners = []
        for copies in (1, 2):
            layout_n = sizes * copies
            pool = GradPool(layout_n, "cpu", grad_sets)
            params = make_params(layout_n, dtype, "cpu")
            pool.write(params, 0, grads)
            opt = SRAdamW(params, lr=1e-3, fused=True if route == "triton" else None, **kw)
            deferred = route == "triton" and hasattr(opt, "_defers")
            if deferred:  # the skip flag as a device flag, as for CUDA tensors (masked update, settled later)
                opt._defers = lambda flag: True
            runners.append(Runner(label, opt, params, pool, "cpu", grads))
        for runner in runners:
            for _ in range(warmup):
                runner.step()
        gc.collect()
        times: list[list[float]] = [[], []]
        launches: list[list[int]] = [[], []]
        for _ in range(steps):
            for i, runner in enumerate(runners):
                runner.refresh()
                recorder.calls.clear()
                t0 = time.perf_counter()
                runner.opt.step()
                times[i].append(time.perf_counter() - t0)
                launches[i].append(len(recorder.calls))
        recorder.calls.clear()
    if min(launches[0] + launches[1]) < 1:
        raise RuntimeError(f"a step recorded no launch at {route}'s launch point (it moved, or the step took "
                           "another path): nothing was measured")
    n = len(shapes)
    t1, t2 = statistics.median(times[0]), statistics.median(times[1])
    return {
        "kind": "host",
        "optimizer": f"SRAdamW {label}",
        "route": route,
        "tensors": n,
        "elements_per_tensor": elements or None,
        "params": sum(math.prod(s) for s in sizes),
        "host_us": t1 * 1e6,
        "host_us_min": min(times[0]) * 1e6,
        "host_us_max": max(times[0]) * 1e6,
        "host_us_2x": t2 * 1e6,
        "host_us_2x_min": min(times[1]) * 1e6,
        "us_per_extra_tensor": (t2 - t1) / n * 1e6,
        "us_per_extra_tensor_min": (min(times[1]) - min(times[0])) / n * 1e6,  # from the fastest steps
        "launches_per_step": statistics.median(launches[0]),
        "launches_per_step_2x": statistics.median(launches[1]),
        "steps": steps,
        "deferred_skip": deferred,
        "plan_walk": _walk(),
        "threads": torch.get_num_threads(),
    }


def print_host_table(rows: list[dict]) -> None:
    print("| layout | route | optimizer | tensors | host µs/step (median) | min | max | launches/step "
          "| µs/step at 2× tensors | µs per extra tensor |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        head = f"| {r['layout']} | {HOST_ROUTES.get(r['route'], r['route'])} | {r['optimizer']} |"
        if "error" in r:
            print(f"{head} | error: {r['error']} | | | | | |")
            continue
        print(f"{head} {r['tensors']} | {r['host_us']:.0f} | {r['host_us_min']:.0f} | {r['host_us_max']:.0f} "
              f"| {r['launches_per_step']:g} | {r['host_us_2x']:.0f} | {r['us_per_extra_tensor']:.2f} |")
    goals = [r for r in rows if r.get("layout") == HOST_GOAL_LAYOUT and "error" not in r]
    if goals:
        print(f"# goals (issue 27): {HOST_GOAL_LAYOUT} host time <= {HOST_GOAL_US:g} µs/step, growth <= "
              f"{HOST_GOAL_US_PER_TENSOR:g} µs per extra tensor")
    for r in goals:
        what = f"{r['optimizer']}, {HOST_ROUTES.get(r['route'], r['route'])}, {r['tensors']} tensors"
        print(f"#   {'PASS' if r['host_us'] <= HOST_GOAL_US else 'FAIL'} host time {r['host_us']:.0f} µs "
              f"(goal <= {HOST_GOAL_US:g}): {what}")
        print(f"#   {'PASS' if r['us_per_extra_tensor'] <= HOST_GOAL_US_PER_TENSOR else 'FAIL'} growth "
              f"{r['us_per_extra_tensor']:.2f} µs/tensor (goal <= {HOST_GOAL_US_PER_TENSOR:g}): {what}")


# ------------------------------------------------------------------------------------------------
def main(argv: Sequence[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layout", default=None, help="uniform | gpu-1b | vit-b-32 | tiny, X-flat (the same elements "
                    "as one tensor), or several separated by commas "
                    "(default: gpu-1b on CUDA, uniform on CPU; with --host: tiny,vit-b-32,gpu-1b)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 5; CPU 2)")
    ap.add_argument("--iters", type=int, default=None, help="timed steps per row (default 21; --host: 60)")
    ap.add_argument("--only", default=None, help="substring filter on optimizer names")
    ap.add_argument("--exclude", action="append", default=[],
                    help="skip optimizers whose name contains this substring (repeatable)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="prepare every optimizer, then step them in turn and report medians (default on CPU, "
                    "where the machine may be shared; needs memory for all optimizers at once)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (CPU); 1 avoids OpenMP oversubscription on a shared machine "
                    "(--host: default 1)")
    ap.add_argument("--grads", choices=("new", "copy"), default="new",
                    help="fresh gradients before every step: new tensors (default, as zero_grad(set_to_none) + "
                    "backward) or the values copied into the same tensors (a persistent gradient buffer)")
    ap.add_argument("--grad-sets", type=int, default=3, help="gradient sets drawn per layout, used in turn")
    ap.add_argument("--l2-flush-mib", type=float, default=None,
                    help="MiB written before each step's gradient refresh (default: CUDA twice the L2 size, CPU 0)")
    ap.add_argument("--host", action="store_true",
                    help="host time of one SRAdamW step with the kernel launches recorded instead of run")
    ap.add_argument("--routes", default="triton,cpu", help="--host: triton, cpu or both (comma separated)")
    ap.add_argument("--host-config", default="bf16", choices=[*SR_CONFIGS, "all"],
                    help="--host: the SRAdamW configuration(s) (default bf16: bf16 weights + bf16 SR states)")
    ap.add_argument("--host-elements", type=int, default=1024,
                    help="--host: elements per tensor (the layout's tensor count, each at most this size; "
                    "0: the layout's own shapes)")
    args = ap.parse_args(argv)
    if args.host and "TRITON_INTERPRET" not in os.environ and "optim.triton_kernel" not in sys.modules:
        os.environ["TRITON_INTERPRET"] = "1"  # read when optim.triton_kernel is imported: CPU tensors
    threads_before = torch.get_num_threads()
    threads = args.threads or (1 if args.host else None)
    if threads:
        torch.set_num_threads(threads)
    from optim import _host

    _host.wait()  # the plans' C++ walk built (or found unbuildable) before anything is timed
    try:
        return _run(args)
    finally:
        torch.set_num_threads(threads_before)


def _environment(device: str) -> str:
    cuda = device == "cuda"
    dev_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    triton_version = "n/a"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        pass
    return (f"device: {dev_name}; torch {torch.__version__}; triton {triton_version}; {torch.get_num_threads()} "
            f"threads; load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")


def _run(args: argparse.Namespace) -> list[dict]:
    all_rows: list[dict] = []

    def save(rows: list[dict]) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(all_rows + rows, indent=2))

    if args.host:
        return _run_host(args, save)
    cuda = args.device == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    iters = args.iters if args.iters is not None else 21
    flush_mib = args.l2_flush_mib
    if flush_mib is None:
        l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0) if cuda else 0
        flush_mib = 2 * l2 / 2**20 if l2 else (256.0 if cuda else 0.0)
    for name in (args.layout or ("gpu-1b" if cuda else "uniform")).split(","):
        shapes = layout(name, args.tensors, args.size)
        print(f"# {_environment(args.device)}; layout {name}: {len(shapes)} tensors, "
              f"{sum(math.prod(s) for s in shapes):,} params")
        cands = [(label, dtype, make) for label, dtype, make in candidates(args.device)
                 if not (args.only and args.only not in label) and not any(x in label for x in args.exclude)]
        interleave = args.interleave if args.interleave is not None else not cuda

        def tagged(rows: list[dict]) -> list[dict]:
            for r in rows:
                r["layout"] = name
            return rows

        rows = tagged(bench_layout(cands, shapes, args.device, warmup, iters, interleave=interleave, grads=args.grads,
                                   grad_sets=args.grad_sets, flush_bytes=int(flush_mib * 2**20),
                                   on_row=lambda rows: save(tagged(rows))))
        print(f"# {'interleaved, ' if interleave else ''}median (min, max) of {iters} steps, each timed alone after "
              f"{warmup} warm-up steps; fresh gradients every step ({args.grads} tensors, {args.grad_sets} sets), "
              f"refreshed outside the timed region" + (f"; {flush_mib:.0f} MiB written before each refresh (L2 flush)"
                                                       if flush_mib else "")
              + ("; call ms: host time until step() returns; back-to-back ms: steps issued without a sync "
                 "between them (host work overlapping the previous step, the old benchmark's figure)" if cuda else ""))
        print_step_table(rows, cuda)
        all_rows += rows
        save([])
    return all_rows


def _walk() -> str:
    """Which walk over the parameters the step plans take (optim._host)."""
    from optim import _host

    return "C++" if _host.native() else f"Python ({_host.unavailable_reason() or 'C++ not built yet'})"


def _run_host(args: argparse.Namespace, save: Callable[[list[dict]], None]) -> list[dict]:
    warmup = args.warmup if args.warmup is not None else 5
    steps = args.iters if args.iters is not None else 60
    routes = [r.strip() for r in args.routes.split(",") if r.strip()]
    for r in routes:
        if r not in HOST_ROUTES:
            raise SystemExit(f"bench_optim: unknown route {r!r} (routes: {', '.join(HOST_ROUTES)})")
    configs = list(SR_CONFIGS) if args.host_config == "all" else [args.host_config]
    rows: list[dict] = []
    names = (args.layout or "tiny,vit-b-32,gpu-1b").split(",")
    print(f"# {_environment('cpu')}; host time of one SRAdamW.step(), kernel launches recorded instead of run, "
          f"CPU tensors of at most {args.host_elements or 'all their'} elements (each layout's tensor count); "
          f"median (min, max) of {steps} steps after {warmup} warm-up; fresh gradients every step ({args.grads} "
          "tensors); growth: the same route at 2x the tensors, interleaved; TRITON_INTERPRET="
          f"{os.environ.get('TRITON_INTERPRET', 'unset')}; plan walk: {_walk()}")
    for name in names:
        shapes = layout(name, args.tensors, args.size)
        for route in routes:
            for config in configs:
                try:
                    row = host_time(shapes, route, config, steps=steps, warmup=warmup, elements=args.host_elements,
                                    grads=args.grads, grad_sets=args.grad_sets)
                except Exception as e:  # a route that cannot run here is reported, not hidden
                    row = _error_row(f"SRAdamW {SR_CONFIGS[config][0]}", e, kind="host", route=route)
                row["layout"] = name
                rows.append(row)
                save(rows)
    print_host_table(rows)
    return rows


if __name__ == "__main__":
    main()
