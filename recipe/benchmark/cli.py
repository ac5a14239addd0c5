"""``python -m recipe.evaluate --checkpoint RUN --benchmark NAME[,NAME...] --benchmark-root DIR``.

Resolves every name first (an unknown name, or files missing under the root, stop before the model is
read), loads the run's checkpoint (:func:`recipe.export.run.load_run`; ``--weights`` as for the rest of
``recipe.evaluate``: ``master`` in fp32 by default, ``module`` in the run's precision, the default with
``--ema``; ``--dtype`` to choose another), builds each dataset with CLIP_benchmark's
builder and the run's evaluation transform, evaluates it (:func:`recipe.benchmark.evaluation.evaluate_dataset`)
and writes ``RUN/clip_benchmark/step<N>_<weights>/``: one CLIP_benchmark result JSON per dataset and
``summary.csv``; the summary table goes to stderr, one JSON line of the metrics to stdout.

Several ranks: started by a launcher that sets ``WORLD_SIZE``/``RANK``/``LOCAL_RANK`` (``torchrun``,
``deepspeed``), every rank evaluates its share of each dataset on its own GPU (NCCL; gloo on CPUs); rank
0 writes and prints.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..training.distributed import rank_world
from .adapter import check_tokenizer, image_transform
from .datasets import build, resolve_all
from .evaluation import BenchmarkResult, evaluate_dataset
from .results import flat_metrics, format_table, summary_rows, write_results

__all__ = ["run", "setup_distributed", "evaluate_benchmarks"]


def setup_distributed() -> tuple[bool, torch.device]:
    """Starts the default process group from a launcher's environment when ``WORLD_SIZE`` > 1 and none is
    running (NCCL with this rank's GPU, gloo without GPUs); returns whether it started one, and the device."""
    started = False
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    if world > 1 and not (dist.is_available() and dist.is_initialized()):
        dist.init_process_group("nccl" if cuda else "gloo")
        started = True
    return started, torch.device("cuda", local) if cuda else torch.device("cpu")


def evaluate_benchmarks(model: torch.nn.Module, tokenizer: Any, names: Any, root: str | None, batch_size: int = 64,
                        workers: int = 0, progress: bool = False, split: str = "test") -> list[BenchmarkResult]:
    """Every dataset of ``names`` (``NAME[,NAME...]`` under ``root``, or resolved
    :class:`~recipe.benchmark.datasets.BenchmarkSpec` s), evaluated on ``model`` (in evaluation mode, on its
    device; every rank calls this). Raises on an unknown name, missing files, or templates longer than the
    tokenizer's context (:mod:`recipe.benchmark.datasets`, :mod:`recipe.benchmark.adapter`)."""
    specs = resolve_all(names, root, split)
    transform = image_transform(model.image_data_config())
    return [evaluate_dataset(model, tokenizer, spec, build(spec, transform), batch_size, workers, progress)
            for spec in specs]


def run(args: Any) -> dict[str, Any]:
    """The ``--benchmark`` path of ``python -m recipe.evaluate`` (``args``: its parsed arguments)."""
    from ..export.run import find_checkpoint, load_run, parse_dtype
    from ..model.tokenizer import load_tokenizer

    # names, files and the tokenizer's context checked before the model is read
    specs = resolve_all(args.benchmark, args.benchmark_root)
    check_tokenizer(specs, None, load_tokenizer(find_checkpoint(args.checkpoint)[1] / "tokenizer"))
    started, device = setup_distributed()
    try:
        rank, _ = rank_world()
        # --weights as the rest of recipe.evaluate: master (fp32) by default, module with --ema
        weights = getattr(args, "weights", None) or ("module" if args.ema else "master")
        dtype = parse_dtype(args.dtype) if getattr(args, "dtype", None) else None
        loaded = load_run(args.checkpoint, dtype or torch.float32, ema=args.ema, weights=weights)
        model = loaded.model
        if dtype is None and weights == "module":  # the module weights in the precision the run trained in
            model.to(loaded.saved_dtype)
        model.to(device).eval()
        workers = args.workers if args.workers is not None else 0
        results = evaluate_benchmarks(model, loaded.tokenizer, specs, None, args.batch_size, workers,
                                      progress=not args.no_progress)
        source = loaded.provenance()["source"]
        metrics: dict[str, Any] = {**flat_metrics(results), "step": loaded.step}
        if rank == 0:
            out_dir = loaded.run_dir / "clip_benchmark" / f"step{loaded.step:08d}_{source}"
            extra = {"step": loaded.step, "weights": source,
                     "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
            written = write_results(results, out_dir, str(Path(loaded.run_dir).resolve()), source, extra)
            table = format_table(summary_rows(results))
            print(f"CLIP_benchmark datasets, {loaded.tag_dir.name} ({source} weights, {extra['dtype']}):\n{table}\n"
                  f"written to {out_dir} ({', '.join(p.name for p in written)})", file=sys.stderr, flush=True)
            print(json.dumps({k: (round(v, 6) if isinstance(v, float) else v) for k, v in metrics.items()}),
                  flush=True)
        return metrics
    finally:
        if started:
            dist.destroy_process_group()
