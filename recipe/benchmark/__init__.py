"""CLIP_benchmark (LAION's ``clip-benchmark``) inside the recipe: its datasets, class names, templates and
metrics on a run, from the command line, in training, and its own command line on a run directory.

* ``python -m recipe.evaluate --checkpoint RUN --benchmark NAME[,NAME...] --benchmark-root DIR``
  (:mod:`.cli`): CLIP_benchmark's datasets as its builder makes them from local files
  (:mod:`.datasets`), zero-shot classification and retrieval with its functions (:mod:`.evaluation`), the
  data sharded over ranks; its result JSON per dataset plus a summary table and CSV (:mod:`.results`).
* Training: ``--eval-benchmark NAME[,...] --benchmark-root DIR`` adds ``benchmark_<dataset>_<metric>`` to
  every evaluation (:func:`.training.benchmark_metrics`).
* ``python -m recipe.benchmark eval --model_type recipe --model RUN ...`` (:mod:`.loader`): CLIP_benchmark's
  own command line, taking a run directory.
* :mod:`.compat`: CLIP_benchmark 1.6.2's ``accuracy`` fails on numpy >= 2.4; a compatible replacement is
  used where the recipe calls it.
* :mod:`.synthetic`: the demo's shapes as two small CLIP_benchmark sets, written by its converter.

Needs the ``eval`` extra: ``pip install -e ".[eval]"``.
"""

from .datasets import BenchmarkError, MissingBenchmarkData, UnknownBenchmark

__all__ = ["BenchmarkError", "MissingBenchmarkData", "UnknownBenchmark"]
