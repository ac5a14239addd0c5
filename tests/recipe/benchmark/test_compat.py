"""CLIP_benchmark 1.6.2's ``accuracy`` and numpy >= 2.4: the replacement used where the recipe calls it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipe.benchmark.compat import accuracy, original_accuracy_works, patch_accuracy


def reference_accuracy(logits: torch.Tensor, target: torch.Tensor, topk: tuple[int, ...]) -> list[float]:
    """CLIP_benchmark's computation, with the count read by ``.item()``."""
    pred = logits.topk(max(topk), 1, True, True)[1].t()
    correct = pred.eq(target.view(1, -1).expand_as(pred))
    return [correct[:k].reshape(-1).float().sum().item() / len(target) for k in topk]


def test_the_replacement_gives_clip_benchmarks_accuracies() -> None:
    g = torch.Generator().manual_seed(0)
    for n, c in ((1, 5), (37, 12), (200, 1000)):
        logits = torch.randn(n, c, generator=g)
        logits[: n // 3, 0] = logits[: n // 3].max(1).values  # ties with the top logit
        target = torch.randint(0, c, (n,), generator=g)
        assert accuracy(logits, target, (1, 5)) == reference_accuracy(logits, target, (1, 5))
        assert accuracy(logits, target, (1,)) == reference_accuracy(logits, target, (1,))


def test_the_original_fails_only_on_numpy_2_4_and_the_patch_replaces_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from clip_benchmark.metrics import zeroshot_classification as zc

    new_numpy = tuple(int(p) for p in np.__version__.split(".")[:2]) >= (2, 4)
    assert original_accuracy_works() is not new_numpy  # CLIP_benchmark's own, also once replaced
    monkeypatch.setattr(zc, "accuracy", zc.accuracy)  # restored after the test
    patch_accuracy()
    assert zc.accuracy is accuracy
    logits, target = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.3, 0.7]]), torch.tensor([1, 1, 1])
    assert zc.accuracy(logits, target, topk=(1, 2)) == [2 / 3, 1.0]
