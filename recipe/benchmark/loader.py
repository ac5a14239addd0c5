"""CLIP_benchmark's own command line on a recipe run: ``--model_type recipe``.

``python -m recipe.benchmark`` is ``clip_benchmark``'s command line (its ``eval`` and ``build``
subcommands, every option as it documents them) with two additions: the model type ``recipe``, whose
``--model`` is a recipe run directory (its newest complete checkpoint, or ``RUN/checkpoints/stepN``) and
``--pretrained`` the weights (``master``: the optimizer's fp32 masters where kept, as ``python -m
recipe.export`` writes them, also for ``''``; ``module``: the module weights as the run evaluated with;
``ema``), and CLIP_benchmark's ``accuracy`` replaced by its numpy >= 2.4-safe equal
(:mod:`recipe.benchmark.compat`)::

    python -m recipe.benchmark eval --model_type recipe --model runs/demo --pretrained module \\
        --dataset wds/cifar10 --dataset_root /data/clip_benchmark/wds_cifar10 --recall_k 1 5 10

The model is loaded in fp32 (CLIP_benchmark's ``--no_amp`` keeps it there; by default it autocasts) with
the run's tokenizer and evaluation transform (:mod:`recipe.benchmark.adapter`). In Python,
:func:`register` adds the same to an imported ``clip_benchmark``.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

__all__ = ["MODEL_TYPE", "WEIGHTS", "load_recipe", "register", "main"]

#: The ``--model_type`` this module adds.
MODEL_TYPE = "recipe"
#: ``--pretrained`` values of ``--model_type recipe`` ('' is ``master``).
WEIGHTS = ("master", "module", "ema")


def load_recipe(model_name: str, pretrained: str = "", cache_dir: str | None = None,
                device: str | torch.device = "cpu") -> tuple[Any, Any, Any]:
    """CLIP_benchmark's loader signature: ``(model, transform, tokenizer)`` of the recipe run
    ``model_name`` with the weights ``pretrained`` names (module docstring); ``cache_dir`` is unused."""
    from ..export.run import load_run
    from .adapter import BenchmarkModel, BenchmarkTokenizer, image_transform

    weights = pretrained or "master"
    if weights not in WEIGHTS:
        raise ValueError(f"--pretrained for --model_type {MODEL_TYPE} is one of {', '.join(WEIGHTS)} (or ''), "
                         f"got {pretrained!r}: --model names the run directory")
    ema = weights == "ema"
    loaded = load_run(model_name, torch.float32, ema=ema, weights="module" if ema else weights)
    model = BenchmarkModel(loaded.model).to(device).eval()
    return model, image_transform(loaded.model.image_data_config()), BenchmarkTokenizer(loaded.tokenizer)


def register() -> None:
    """Adds ``--model_type recipe`` to CLIP_benchmark (its ``clip_benchmark.models`` table, which its
    command line's choices are) and puts the numpy-safe ``accuracy`` in place. Idempotent."""
    from clip_benchmark import models

    from .compat import patch_accuracy

    models.TYPE2FUNC[MODEL_TYPE] = load_recipe
    if MODEL_TYPE not in models.MODEL_TYPES:
        models.MODEL_TYPES.append(MODEL_TYPE)
    patch_accuracy()


def main(argv: list[str] | None = None) -> int:
    """Runs CLIP_benchmark's command line (``argv``: its arguments, default ``sys.argv[1:]``) after
    :func:`register`."""
    from .datasets import require_clip_benchmark

    require_clip_benchmark()
    register()
    from clip_benchmark import cli

    saved = sys.argv
    sys.argv = ["clip_benchmark", *(sys.argv[1:] if argv is None else argv)]
    try:
        return int(cli.main() or 0)
    finally:
        sys.argv = saved
