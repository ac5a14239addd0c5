"""Training throughput and memory: this recipe under DeepSpeed next to OpenCLIP, in one run.

Arms (each trains on the same random pixels and tokens, generated from one seed):

* ``recipe-<loss mode>``: :func:`recipe.model.create_model` (``ViT-B-32`` preset on CUDA, ``tiny``
  on CPU) under DeepSpeed with ``ds_configs/zero0_bf16_sr.json`` (bf16 at ZeRO-0, the default route), SRAdamW
  over the CLIP paper's groups as :mod:`recipe.train` builds them (text tower: SR bf16 weights and
  bf16 states, no master; image tower and logit scale: fp32 master), :class:`recipe.loss.ClipLoss`
  in each requested mode that exists (``plain``; ``fused`` once :data:`recipe.loss.LOSS_MODES` has
  it). One process, world size 1: the script sets the launcher's environment itself.
* ``openclip``: ``open_clip.create_model("ViT-B-32")`` on CUDA (on CPU the same factory with the
  ``tiny`` preset's sizes: 32 px images, patch 8, 2 layers of width 64 per tower, 4,096 tokens,
  context 32, embedding 64), fp32 weights under ``torch.autocast(bfloat16)``, ``torch.optim.AdamW``
  (``fused=True`` on CUDA) with OpenCLIP's decay / no-decay split, and ``open_clip.loss.ClipLoss``.
  Without ``open_clip`` installed the arm is ``torch-amp``: the recipe's own model in fp32 under
  the same autocast + AdamW, with the recipe's plain loss (the table says so).

Gradient accumulation (``--accumulation 1 4``): each recipe arm also runs with the same per-rank batch
split into k micro-batches under DeepSpeed's ``gradient_accumulation_steps`` = k, with
``--contrastive-batch`` ``global`` (default: one loss over all k micro-batches through the embedding
cache of :mod:`recipe.training.passes`, the cost of which this measures) or ``micro``. The largest-batch
search runs at accumulation 1 only.

Per arm, with and without gradient checkpointing: samples/s over ``--steps`` timed steps after
``--warmup`` steps (one step = forward, loss, backward, optimizer step), peak memory during the
timed steps, and the largest batch that fits.

Memory: on CUDA ``torch.cuda.max_memory_allocated()`` (weights, gradients, optimizer state and
activations; the peak is reset after the warm-up steps); on CPU the peak resident set size during
the timed steps minus the resident size before the model was built (Linux ``VmHWM``, reset after
the warm-up), where "before" already holds the libraries' code: the worker first builds the arm
small, trains one step on it and drops it, since much of that code loads on first use. "Fits"
means: on CUDA, two training steps without running out of memory; on CPU, a peak within
``--cpu-budget-mib`` (a stand-in for device memory, so the search can be exercised). The search
doubles the batch from ``--batch`` up to ``--max-batch``, then bisects between the last batch that
fitted and the first that did not, to ``--fit-tolerance`` (relative) or ``--fit-granularity``. Every arm and setting runs in its own process (clean peak memory; a CUDA
out-of-memory error never poisons a later measurement), and a probe after a failure starts a
fresh process.

Usage::

    python benchmarks/bench_train.py                      # CUDA if present: ViT-B-32, batch 512
    python benchmarks/bench_train.py --device cpu         # tiny presets, batch 32
    python benchmarks/bench_train.py --fit none --ckpt off --steps 5   # quick look
    python benchmarks/bench_train.py --device cpu --fit none --accumulation 1 4   # embedding cache cost
    python benchmarks/bench_train.py --device cpu --fit none --ckpt off --no-baseline --compile   # torch.compile
    python benchmarks/bench_train.py --device cpu --ckpt off --breakdown --steps 30   # per-phase times vs OpenCLIP

``--compile`` compiles the recipe arms' towers (:func:`recipe.training.engine.compile_towers`, ZeRO 0-2 configs)
after the engine is built; the compilation falls in the warm-up steps, whose time each row reports as
``warmup_seconds``.

``--breakdown`` instead times the phases of one step (data, forward, loss, backward, DeepSpeed's
hooks, reduction, overflow check, norm, clipping, weight copies, the optimizer, the train step's own
work) by wrapping timers around the callables that run them, the first recipe arm and the baseline
alternating step by step in this one process, so that both see the same load; it reports medians.

``--routes JSON [JSON ...]`` instead compares precision / ZeRO routes: the recipe's own train step under
each DeepSpeed JSON (a path or a name in ``ds_configs/``), the routes alternating step by step in one
process, each route's median step and its ratio to the first route's (``train_bench/routes.py``); with
``--breakdown``, per-phase times of each route (hooks, bucket flattening, collectives, norm, clipping,
the optimizer, DeepSpeed's weight copies...). Under a launcher it runs on every rank::

    python benchmarks/bench_train.py --device cpu --routes zero0_bf16_sr zero2_bf16_halfmaster --steps 30
    python benchmarks/bench_train.py --device cpu --routes zero0_bf16_sr zero1_bf16_halfmaster \
        zero2_bf16_halfmaster --breakdown --steps 20
    DS_ACCELERATOR=cpu torchrun --nproc_per_node 2 benchmarks/bench_train.py --device cpu \
        --routes zero0_bf16_sr zero2_bf16_halfmaster --breakdown   # 2 ranks

Output: a markdown table (device, versions, date) on stdout and a JSON file
(``benchmarks/results/bench_train_<device>.json`` by default).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import torch

from _common import (  # noqa: E402, F401  (the benchmarks' shared module; puts the repository on sys.path)
    RESULTS,
    TextSpec,
    input_checksum,
    make_inputs,
    write_result,
)
from train_bench.breakdown import BREAKDOWN_ROWS, run_breakdown  # noqa: E402, F401
from train_bench.openclip_arm import OPENCLIP_TINY, OpenClipRunner  # noqa: E402, F401
from train_bench.recipe_arm import RecipeRunner  # noqa: E402
from train_bench.report import breakdown_table, markdown_table  # noqa: E402
from train_bench.routes import ROUTE_PHASES, routes_table, run_routes  # noqa: E402, F401
from train_bench.settings import (  # noqa: E402, F401
    DEFAULT_DS_CONFIG,
    BenchSettings,
    _baseline_grad_clip,
    available_arms,
)
from train_bench.sweep import largest_fitting, run_benchmark  # noqa: E402
from train_bench.worker import RESULT_TAG, measure_worker  # noqa: E402

# This file is the command line; the measurement lives in the ``train_bench`` package next to it
# (its ``__init__`` lists the parts). The names below, and TextSpec, OPENCLIP_TINY, BREAKDOWN_ROWS and
# _baseline_grad_clip (the tests use them), are re-exported for the scripts and tests that import this one.
__all__ = [
    "BenchSettings",
    "available_arms",
    "make_inputs",
    "input_checksum",
    "RecipeRunner",
    "OpenClipRunner",
    "largest_fitting",
    "run_benchmark",
    "markdown_table",
    "run_breakdown",
    "breakdown_table",
    "main",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="recipe preset (default ViT-B-32 on CUDA, tiny on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="batch of the timed steps (default 512 on CUDA, 32 on CPU)")
    ap.add_argument("--warmup", type=int, default=BenchSettings.warmup)
    ap.add_argument("--steps", type=int, default=BenchSettings.steps)
    ap.add_argument(
        "--ckpt", choices=("both", "off", "on"), default="both", help="gradient checkpointing settings to run"
    )
    ap.add_argument(
        "--loss-modes", nargs="+", default=["plain", "fused"], help="recipe ClipLoss modes (missing ones are reported)"
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the OpenCLIP arm")
    ap.add_argument(
        "--accumulation", type=int, nargs="+", default=[1],
        help="recipe arms: run each with the batch split into K micro-batches per optimizer step (e.g. 1 4)",
    )
    ap.add_argument(
        "--contrastive-batch", choices=("global", "micro"), default="global",
        help="recipe arms with accumulation: one loss over the whole step (global) or per micro-batch",
    )
    ap.add_argument("--compile", action="store_true", help="recipe arms: torch.compile the towers (ZeRO 0-2 configs)")
    ap.add_argument(
        "--fit",
        choices=("all", "off", "none"),
        default="all",
        help="largest-batch search: every setting, checkpointing off only, or none",
    )
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--fit-tolerance", type=float, default=BenchSettings.fit_tolerance)
    ap.add_argument("--fit-granularity", type=int, default=None)
    ap.add_argument("--cpu-budget-mib", type=float, default=BenchSettings.cpu_budget_mib)
    ap.add_argument("--ds-config", default=DEFAULT_DS_CONFIG)
    ap.add_argument("--baseline-grad-clip", type=float, default=None,
                    help="OpenCLIP arm: clip_grad_norm_ threshold (default: the DeepSpeed config's gradient_clipping, "
                    "so both arms clip; 0: OpenCLIP's default, no clipping)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default 1 on CPU)")
    ap.add_argument("--worker-timeout", type=float, default=BenchSettings.timeout_s, help="seconds per worker process")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/bench_train_<device>.json)")
    ap.add_argument(
        "--breakdown", action="store_true",
        help="instead: per-phase time of one step, the first recipe arm and the baseline alternating in one "
        "process (--steps rounds; first --ckpt setting and --accumulation; writes bench_train_breakdown_<device>.json)",
    )
    ap.add_argument(
        "--routes", nargs="+", default=None, metavar="JSON",
        help="instead: the recipe's train step under each DeepSpeed JSON (path or ds_configs/ name), alternating "
        "step by step in one process; each route's median step and its ratio to the first's (--steps rounds; "
        "with --breakdown per-phase times; first --ckpt setting, loss mode and --accumulation; writes "
        "bench_train_routes_<device>.json)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    if args.worker:
        measure_worker(json.loads(args.worker), lambda r: print(RESULT_TAG + json.dumps(r), flush=True))
        return None
    s = BenchSettings(
        device=args.device,
        preset=args.preset,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        ckpt={"both": [False, True], "off": [False], "on": [True]}[args.ckpt],
        loss_modes=args.loss_modes,
        accumulation=args.accumulation,
        contrastive_batch=args.contrastive_batch,
        compile=args.compile,
        baseline=not args.no_baseline,
        fit=args.fit,
        max_batch=args.max_batch,
        fit_tolerance=args.fit_tolerance,
        fit_granularity=args.fit_granularity,
        cpu_budget_mib=args.cpu_budget_mib,
        ds_config=args.ds_config,
        baseline_grad_clip=args.baseline_grad_clip,
        seed=args.seed,
        threads=args.threads,
        timeout_s=args.worker_timeout,
    )
    kind = "cuda" if s.device.startswith("cuda") else "cpu"

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    try:
        if args.routes:
            result = run_routes(s, args.routes, phases=args.breakdown, log=log)
            if result["rank"] == 0:
                write_result(args.json or RESULTS / f"bench_train_routes_{kind}.json", result, routes_table(result))
            return result
        if args.breakdown:
            result = run_breakdown(s, log=log)
            write_result(args.json or RESULTS / f"bench_train_breakdown_{kind}.json", result, breakdown_table(result))
            return result
        result = run_benchmark(s, log=log)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    write_result(args.json or RESULTS / f"bench_train_{kind}.json", result, markdown_table(result))
    return result


if __name__ == "__main__":
    main()
