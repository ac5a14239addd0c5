"""Cost of the numerics telemetry (``--numerics-every``, :mod:`recipe.training.numerics`) per training step.

One engine built as :mod:`recipe.train` builds it (the demo's ``tiny`` preset and
``ds_configs/zero2_bf16_halfmaster.json`` by default, batch 64 = the demo's micro-batch), stepped by
the recipe's own :func:`recipe.training.step.train_step` through ``bench_train.RecipeRunner``. Blocks of
``--block`` steps alternate between telemetry on (hooks attached and armed, as the loop arms them,
only on the steps it reads: one in ``--every``; ``end_step`` every step, ``read`` every ``--every``
steps) and off (hooks detached), the order flipping every round,
so both arms see the same machine load. Reported: the median step time of each arm, their
difference, and the time spent inside the monitor's own calls (timed directly: on the CPU every
operation is synchronous, so that time is the telemetry's cost without the noise of two medians).

Usage::

    python benchmarks/bench_numerics.py                          # CPU demo configuration
    python benchmarks/bench_numerics.py --rounds 10 --block 5 --json benchmarks/results/bench_numerics_cpu.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from _common import ROOT, environment, make_inputs  # noqa: E402  (puts the repository on sys.path)
from bench_train import RecipeRunner  # noqa: E402


def _timed(fn, box: list[float]):
    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            box.append(time.perf_counter() - t)

    return wrapper


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--ds-config", default=str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--block", type=int, default=5, help="steps per arm per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--every", type=int, default=10, help="steps between reads (the default --log-every)")
    ap.add_argument("--sample-per-tensor", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the launcher sets OMP_NUM_THREADS=1)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    from recipe.training.numerics import NumericsMonitor

    runner = RecipeRunner(args.preset, "plain", False, args.ds_config, torch.device("cpu"), args.batch)
    inputs = make_inputs(args.batch, runner.image_size, runner.text, seed=0)
    mon = NumericsMonitor(runner.arm.optimizer, args.every, args.sample_per_tensor)
    inside: list[float] = []
    mon.before_step = _timed(mon.before_step, inside)
    mon.after_step = _timed(mon.after_step, inside)
    for _ in range(args.warmup):  # the first steps create the state and compile SRAdamW's CPU update
        runner.step(inputs)
    times: dict[str, list[float]] = {"off": [], "on": []}
    per_step_inside: list[float] = []
    reads: list[float] = []
    done = 0
    for r in range(args.rounds):
        for arm in (("on", "off") if r % 2 else ("off", "on")):
            if arm == "on":
                mon.attach()
            for _ in range(args.block):
                inside.clear()
                mon.active = (done + 1) % args.every == 0  # as recipe.train arms it: only the steps it reads
                t = time.perf_counter()
                runner.step(inputs)
                if arm == "on":
                    mon.end_step(skipped=False)
                    done += 1
                    if done % args.every == 0:
                        t_read = time.perf_counter()
                        mon.read()
                        reads.append(time.perf_counter() - t_read)
                times[arm].append(time.perf_counter() - t)
                if arm == "on":
                    per_step_inside.append(sum(inside))
            if arm == "on":
                mon.detach()
    mon.attach()
    mon.active = True
    metrics = {}
    for _ in range(3):
        runner.step(inputs)
        mon.end_step(skipped=False)
    t_read = time.perf_counter()
    metrics = mon.read()
    reads.append(time.perf_counter() - t_read)
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    hooks = statistics.fmean(per_step_inside)  # amortised: one sampled step in --every
    sampled = [x for x in per_step_inside if x > 0]
    hooks_sampled = statistics.median(sampled) if sampled else 0.0
    read = statistics.median(reads)
    result = {
        "environment": environment("cpu"),
        "settings": vars(args),
        "description": runner.description,
        "ms_per_step_off": off * 1e3,
        "ms_per_step_on": on * 1e3,
        "difference_percent": (on - off) / off * 100,
        "ms_inside_monitor_per_step": hooks * 1e3,
        "inside_percent": hooks / off * 100,
        "ms_inside_monitor_per_sampled_step": hooks_sampled * 1e3,
        "inside_percent_sampled_step": hooks_sampled / off * 100,
        "ms_per_read": read * 1e3,
        "read_percent_amortised": read / args.every / off * 100,
        "steps_per_arm": len(times["off"]),
        "metrics_of_last_window": metrics,
    }
    table = "\n".join([
        f"| {runner.description}, batch {args.batch}, 1 rank, {torch.get_num_threads()} thread(s) | ms/step |",
        "|---|---|",
        f"| telemetry off (median of {len(times['off'])} steps) | {off * 1e3:.1f} |",
        f"| telemetry on (median of {len(times['on'])} steps) | {on * 1e3:.1f} ({result['difference_percent']:+.2f} %) |",
        f"| inside the monitor's hooks, per step (mean: one sampled step in {args.every}) | {hooks * 1e3:.3f} "
        f"({result['inside_percent']:.2f} %) |",
        f"| inside the monitor's hooks, per sampled step (median) | {hooks_sampled * 1e3:.2f} "
        f"({result['inside_percent_sampled_step']:.2f} %) |",
        f"| one read (all-reduce + host read), every {args.every} steps | {read * 1e3:.2f} "
        f"({result['read_percent_amortised']:.3f} % amortised) |",
    ])
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({**result, "markdown": table}, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return result


if __name__ == "__main__":
    main()
