"""CLIP_benchmark datasets in training: ``--eval-benchmark NAME[,...] --benchmark-root DIR`` evaluates them
at every ``--eval-every`` and at the end, next to the validation metrics (``metrics.jsonl`` rows of kind
``eval``, TensorBoard ``eval/benchmark_<dataset>_<metric>``, ``final_metrics.json``).

:func:`check_config` is the check the configuration's validation runs (names and files, before anything
is written: :meth:`recipe.config.TrainConfig.validate` calls :func:`recipe.benchmark.datasets.resolve_all`
itself); :func:`check_tokenizer` (:func:`recipe.benchmark.adapter.check_tokenizer`) runs once the run's
tokenizer exists (its context must hold every classification prompt), so that neither problem surfaces only
at the first evaluation.
"""

from __future__ import annotations

from typing import Any

import torch

from .adapter import check_tokenizer

__all__ = ["check_config", "check_tokenizer", "benchmark_metrics"]


def check_config(names: str | None, root: str | None) -> None:
    """Raises :class:`recipe.benchmark.BenchmarkError` for names that are unknown or whose files are not
    under ``root`` (and when ``root`` is missing); nothing to check without names."""
    if not names:
        return
    from .datasets import resolve_all

    resolve_all(names, root)


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
