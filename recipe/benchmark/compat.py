"""Where the recipe calls CLIP_benchmark (``clip-benchmark`` 1.6.2, its newest release) and that release
breaks on today's numpy.

``clip_benchmark.metrics.zeroshot_classification.accuracy`` ends with ``float()`` of a one-element numpy
array, which numpy >= 2.4 refuses (``TypeError: only 0-dimensional arrays can be converted to Python
scalars``). :func:`accuracy` is a compatible replacement (the same top-k hits, counted as a Python int),
used by the recipe's own benchmark evaluation and put in place of the original by :func:`patch_accuracy`
for CLIP_benchmark's own command line (``python -m recipe.benchmark``): numpy stays unpinned for everyone.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["accuracy", "patch_accuracy", "original_accuracy_works"]


def accuracy(logits: torch.Tensor, target: torch.Tensor, topk: Sequence[int] = (1,)) -> list[float]:
    """Top-k accuracies of ``logits`` ``[N, C]`` against class ids ``target`` ``[N]``, one per ``k``, as
    ``clip_benchmark.metrics.zeroshot_classification.accuracy`` returns them (an image counts when its
    class is among the ``k`` largest logits, ties broken by ``torch.topk``), without the numpy scalar
    conversion that numpy >= 2.4 refuses."""
    n = len(target)
    if n == 0:
        return [float("nan") for _ in topk]
    ranked = logits.topk(max(topk), dim=1, largest=True, sorted=True).indices
    hit = ranked == target.view(-1, 1).to(ranked.device)
    return [int(hit[:, :k].sum().item()) / n for k in topk]


#: CLIP_benchmark's own ``accuracy``, kept when :func:`patch_accuracy` replaces it.
_ORIGINAL: dict[str, Any] = {}


def _original() -> Any:
    from clip_benchmark.metrics import zeroshot_classification

    return _ORIGINAL.get("accuracy", zeroshot_classification.accuracy)


def original_accuracy_works() -> bool:
    """Whether CLIP_benchmark's own ``accuracy`` runs with the installed numpy (False on numpy >= 2.4)."""
    try:
        _original()(torch.eye(2), torch.arange(2), topk=(1,))
    except TypeError:
        return False
    return True


def patch_accuracy() -> None:
    """Puts :func:`accuracy` in place of ``clip_benchmark.metrics.zeroshot_classification.accuracy`` (its
    ``evaluate`` looks the name up when it runs), for CLIP_benchmark's own command line. Idempotent."""
    from clip_benchmark.metrics import zeroshot_classification

    if zeroshot_classification.accuracy is not accuracy:
        _ORIGINAL.setdefault("accuracy", zeroshot_classification.accuracy)
        zeroshot_classification.accuracy = accuracy
