"""``--routes``: the recipe's own train step under several DeepSpeed JSONs (precision and ZeRO routes),
interleaved step by step in one process (one process per rank under a launcher), so that every route
sees the same load: the median step of each route, its time relative to the first route (the
reference), and with ``--breakdown`` where each route's step goes, phase by phase.

Whole-step timing adds nothing to the step: the train step's own host read (its outcome) ends each
step, and on CUDA one ``synchronize`` after it. The phase breakdown instead wraps timers around the
callables that run each phase (as ``--breakdown`` does for the OpenCLIP comparison), with a device
synchronisation around each on CUDA: its totals are slower than the whole-step timing, and it is
meant for where the time goes, not for the ratio.

Under a launcher (``torchrun``, ``deepspeed``; e.g. ``torchrun --nproc_per_node 2 benchmarks/bench_train.py
--routes ...``) every rank steps the same routes in the same order; a step's time is the slowest
rank's, the phases are rank 0's (a rank's wait for the others shows up in ``comm``).
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

import torch

from _common import ROOT, environment, make_inputs  # noqa: E402  (puts the repository on sys.path)

from .recipe_arm import RecipeRunner
from .settings import BenchSettings, resolve_settings
from .clock import PhaseClock
from .worker import sync, worker_env

__all__ = ["ROUTE_PHASES", "resolve_route", "run_routes", "routes_table"]

#: Rows of the per-route breakdown: (key, label). Exclusive times: a phase nested in another (a
#: collective inside the gradient reduction) counts in the inner one only, and the rows of a step add
#: up to its total.
ROUTE_PHASES = [
    ("data", "data (inputs to the model's dtype)"),
    ("forward", "forward (model, and DeepSpeed's forward wrapper)"),
    ("loss", "loss"),
    ("backward", "backward (autograd)"),
    ("hooks", "DeepSpeed: per-gradient hooks (bucket bookkeeping, bucket copies)"),
    ("reduce", "gradient reduction after backward, without its flatten and collectives (copies back, casts)"),
    ("flatten", "DeepSpeed: gradient flattening (reduce bucket, the flat gradient partition)"),
    ("comm", "collectives (gradient all-reduce, norm, flags, weight all-gather; waits for other ranks)"),
    ("overflow", "DeepSpeed: overflow check"),
    ("norm", "gradient norm for clipping (DeepSpeed: per gradient; recipe: grad_multiplier)"),
    ("clip", "DeepSpeed: unscale and clip (a pass over the flat gradient partition)"),
    ("optimizer", "optimizer step (SRAdamW)"),
    ("allgather", "DeepSpeed: weight all-gather, without its collectives"),
    ("ds_step", "DeepSpeed: rest of engine.step (partition -> weights copy, gradient release, bookkeeping)"),
    ("outcome", "train step: outcome read (its one host sync per step)"),
    ("step_own", "train step's own work (finite flags, passes bookkeeping)"),
    ("total", "total (median step)"),
]

_COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                "reduce_scatter", "broadcast", "barrier")


def resolve_route(name: str) -> str:
    """A DeepSpeed JSON for ``--routes``: a path, or a name in ``ds_configs/`` (``.json`` optional)."""
    for p in (Path(name), ROOT / "ds_configs" / name, ROOT / "ds_configs" / f"{name}.json"):
        if p.is_file():
            return str(p)
    raise ValueError(f"--routes: no DeepSpeed JSON {name!r} (a path, or a name in ds_configs/)")


def _clock(runner: RecipeRunner) -> PhaseClock:
    """A clock around every phase of this arm's train step (see :data:`ROUTE_PHASES`)."""
    import deepspeed.comm
    import torch.distributed

    import recipe.training.overlap
    import recipe.training.passes
    import recipe.training.step
    from optim import SRAdamW

    clock, engine = PhaseClock(runner.device), runner.arm.engine
    clock.wrap(recipe.training.passes, "_inputs", "data")
    clock.wrap(engine, "forward", "forward")
    clock.wrap(runner, "loss_fn", "loss")
    clock.wrap(engine, "backward", "backward")
    clock.wrap(engine, "allreduce_gradients", "reduce")  # DeepSpeed's, at the end of backward
    # the recipe-managed routes' (two ranks or more): what the overlapped all-reduce leaves after backward
    clock.wrap(recipe.training.overlap.OverlappedAllReduce, "finish", "reduce")
    clock.wrap(recipe.training.step, "grad_multiplier", "norm")
    clock.wrap(recipe.training.step, "read_outcome", "outcome")
    clock.wrap(engine, "step", "ds_step")
    clock.wrap(SRAdamW, "step", "optimizer")  # the class: the train step binds type(opt).step per step
    zero = engine.optimizer
    if zero is not runner.arm.optimizer:  # a ZeRO optimizer around SRAdamW
        for attr, phase in (("process_gradients", "hooks"), ("check_overflow", "overflow"),
                            ("scaled_global_norm", "norm"), ("unscale_and_clip_grads", "clip"),
                            ("flatten", "flatten"), ("flatten_dense_tensors_aligned", "flatten")):
            clock.wrap(zero, attr, phase)
        stage12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
        clock.wrap(stage12, "all_gather_dp_groups", "allgather")
    for module in (deepspeed.comm, torch.distributed):
        for name in _COLLECTIVES:
            clock.wrap(module, name, "comm")
    return clock


def _memory(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def run_routes(s: BenchSettings, routes: list[str], phases: bool = False,
               log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per-step medians of the recipe's train step under each DeepSpeed JSON of ``routes`` (the first is
    the reference), the arms alternating step by step in this process (see the module docstring)."""
    s = resolve_settings(s)
    for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM"):  # what the workers get (before DeepSpeed loads)
        if key in (env := worker_env(s.device)):
            os.environ.setdefault(key, env[key])
    if s.threads:
        torch.set_num_threads(s.threads)
    if len(routes) < 1:
        raise ValueError("--routes needs at least one DeepSpeed JSON")
    paths = [resolve_route(r) for r in routes]
    device = torch.device(s.device)
    if device.type == "cuda" and "LOCAL_RANK" in os.environ:  # one GPU per rank under a launcher
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    mode, k = s.loss_modes[0], s.accumulation[0]
    runners, persistent, inputs = [], [], None
    for path in paths:
        before = _memory(device)
        r = RecipeRunner(s.preset, mode, s.ckpt[0], path, device, s.batch, s.seed, k, s.contrastive_batch, s.compile)
        if inputs is None:
            x = make_inputs(s.batch, r.image_size, r.text, s.seed)
            m0 = _memory(device)
            inputs = {n: v.to(device) for n, v in x.items()}
            before += _memory(device) - m0  # the shared inputs are no route's own
        for _ in range(s.warmup):
            r.step(inputs)
        sync(device)
        persistent.append(_memory(device) - before)
        runners.append(r)
    import torch.distributed as dist

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    clocks = [_clock(r) for r in runners] if phases else None
    n = len(runners)
    times: list[list[float]] = [[] for _ in runners]
    transient: list[list[int]] = [[] for _ in runners]
    for i in range(s.steps):
        for j in [(i + o) % n for o in range(n)]:  # the first arm of a round rotates (no order bias)
            r = runners[j]
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            base = _memory(device)
            if clocks:
                clocks[j].step(lambda r=r: r.step(inputs))
                times[j].append(clocks[j].exclusive[-1]["total"])
            else:
                sync(device)
                t0 = time.perf_counter()
                r.step(inputs)  # ends with the train step's host read of its outcome
                sync(device)
                times[j].append(time.perf_counter() - t0)
            if device.type == "cuda":
                transient[j].append(int(torch.cuda.max_memory_allocated(device)) - base)
        if rank == 0:
            log(f"  round {i + 1}: " + ", ".join(f"{Path(p).stem} {times[j][-1] * 1e3:.1f} ms"
                                                for j, p in enumerate(paths)))
    if world > 1:  # a step takes as long as its slowest rank
        every: list[Any] = [None] * world
        dist.all_gather_object(every, times)
        times = [[max(t[j][i] for t in every) for i in range(s.steps)] for j in range(n)]
    ref = times[0]
    rows = {}
    for j, (path, r) in enumerate(zip(paths, runners)):
        med = statistics.median(times[j])
        row: dict[str, Any] = {
            "ds_config": str(Path(path).relative_to(ROOT)) if Path(path).is_relative_to(ROOT) else path,
            "route": r.arm.precision.label,
            "description": r.description,
            "step_s": med,
            "samples_per_s": s.batch * world / med,
            "ratio_to_first": med / statistics.median(ref),
            "paired_ratio_to_first": statistics.median(a / b for a, b in zip(times[j], ref)),
            "steps_s": times[j],
        }
        if device.type == "cuda":
            row["persistent_bytes"] = persistent[j]
            row["step_transient_bytes"] = max(transient[j])
            row["peak_bytes"] = persistent[j] + max(transient[j])
        if clocks:
            per_step = [{k: t.get(k, 0.0) for k, _ in ROUTE_PHASES} for t in clocks[j].exclusive]
            row["phases"] = {key: statistics.median(st[key] for st in per_step) for key, _ in ROUTE_PHASES}
            row["phase_steps"] = per_step
            row["phase_calls"] = clocks[j].calls[-1]  # wrapped calls per phase in the last step
        rows[Path(path).stem] = row
    return {"settings": asdict(s), "environment": environment(s.device), "world_size": world, "rank": rank,
            "phases": phases, "routes": list(rows), "rows": rows}


def routes_table(result: dict[str, Any]) -> str:
    """The comparison as markdown (ms per step, medians over the rounds)."""
    s, env, names, rows = result["settings"], result["environment"], result["routes"], result["rows"]
    v = env["versions"]
    how = ("phases timed by wrappers with a device sync around each on CUDA, calls per step in parentheses; "
           "per-phase medians need not add up to the median total" if result["phases"] else
           "whole steps, nothing added to them")
    lines = [
        f"**{env['device']}**, {env['date']}; torch {v['torch']}, deepspeed {v['deepspeed']}, {s['threads']} "
        f"thread(s). Preset {s['preset']}, batch {s['batch']} per rank"
        + (f" in {s['accumulation'][0]} micro-batches" if s["accumulation"][0] > 1 else "")
        + f", {result['world_size']} rank(s), loss {s['loss_modes'][0]}, checkpointing "
        f"{'on' if s['ckpt'][0] else 'off'}; {s['steps']} rounds after {s['warmup']} warm-up steps, routes "
        f"alternating step by step in one process per rank ({how}).",
        "",
        "| | " + " | ".join(f"`{rows[n]['ds_config']}`" for n in names) + " |",
        "|---|" + "---:|" * len(names),
        "| route | " + " | ".join(rows[n]["route"] for n in names) + " |",
    ]
    if result["phases"]:
        for key, label in ROUTE_PHASES:
            cells = []
            for n in names:
                calls = rows[n]["phase_calls"].get(key, 0)
                cells.append(f"{rows[n]['phases'][key] * 1e3:.1f}" + (f" ({calls})" if calls > 1 else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **median step (ms)** | " + " | ".join(f"**{rows[n]['step_s'] * 1e3:.1f}**" for n in names) + " |")
    lines.append("| samples/s (all ranks) | " + " | ".join(f"{rows[n]['samples_per_s']:.0f}" for n in names) + " |")
    lines.append(f"| **step time / `{names[0]}`** (median of per-round ratios) | "
                 + " | ".join(f"**{rows[n]['ratio_to_first']:.3f}** ({rows[n]['paired_ratio_to_first']:.3f})"
                              for n in names) + " |")
    if "peak_bytes" in rows[names[0]]:
        lines.append("| peak memory (GiB: own persistent + largest step transient) | "
                     + " | ".join(f"{rows[n]['peak_bytes'] / 2**30:.2f}" for n in names) + " |")
    return "\n".join(lines) + "\n"
