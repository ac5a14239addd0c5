"""CLIP_benchmark datasets in training: ``--eval-benchmark NAME[,...] --benchmark-root DIR`` evaluates them
at every ``--eval-every`` and at the end, next to the validation metrics (``metrics.jsonl`` rows of kind
``eval``, TensorBoard ``eval/benchmark_<dataset>_<metric>``, ``final_metrics.json``).

:func:`check_config` runs with the configuration's validation (names and files, before anything is
written); :func:`check_tokenizer` once the run's tokenizer exists (its context must hold every
classification prompt), so that neither problem surfaces only at the first evaluation.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["check_config", "check_tokenizer", "benchmark_metrics"]


def check_config(names: str | None, root: str | None) -> None:
    """Raises :class:`recipe.benchmark.BenchmarkError` for names that are unknown or whose files are not
    under ``root`` (and when ``root`` is missing); nothing to check without names."""
    if not names:
        return
    from .datasets import resolve_all

    resolve_all(names, root)


def check_tokenizer(names: Any, root: str | None, tokenizer: Any) -> None:
    """Raises :class:`recipe.benchmark.adapter.PromptsTooLong` when the tokenizer's context cannot hold a
    classification prompt of the datasets (``NAME[,...]`` under ``root``, or resolved specs; read with their
    class names and templates, no images)."""
    if not names:
        return
    from .adapter import check_prompts
    from .datasets import CLASSIFICATION, build, resolve_all

    for spec in resolve_all(names, root):
        if spec.task == CLASSIFICATION:
            ds = build(spec)
            check_prompts(tokenizer, ds.classes, ds.templates, spec.name)


def benchmark_metrics(model: torch.nn.Module, tokenizer: Any, names: str, root: str, batch_size: int,
                      workers: int = 0) -> dict[str, float]:
    """``benchmark_<dataset>_<metric>`` of every dataset (every rank calls it; the model in evaluation mode)."""
    from .cli import evaluate_benchmarks
    from .results import flat_metrics

    was_training = model.training
    model.eval()
    try:
        return flat_metrics(evaluate_benchmarks(model, tokenizer, names, root, batch_size, workers))
    finally:
        model.train(was_training)
