"""One CLIP_benchmark dataset evaluated with CLIP_benchmark's own functions, the data sharded over ranks.

Classification: the classifier is ``clip_benchmark.metrics.zeroshot_classification.zero_shot_classifier``
(its prompt ensembling of the dataset's class names and templates), each rank embedding a block of the
classes; each rank embeds its share of the images (:func:`recipe.benchmark.datasets.share`) into logits
``100 * normalize(image) @ classifier`` as CLIP_benchmark's ``run_classification`` does; the ranks' logits
and labels are gathered and scored as its ``evaluate`` scores them: top-1 / top-5 accuracy
(:func:`recipe.benchmark.compat.accuracy`, its numpy-safe ``accuracy``; top-5 is NaN under 5 classes),
``mean_per_class_recall`` (scikit-learn's balanced accuracy), or ``mean_average_precision``
(``average_precision_per_class``) for a multi-label set.

Retrieval: each rank embeds its images and all their captions; gathered, the text-image scores are ranked
by CLIP_benchmark's ``recall_at_k`` (through its ``batchify``), giving ``image_retrieval_recall@k`` and
``text_retrieval_recall@k`` for k = 1, 5, 10 (a k beyond the number of candidates counts them all).

Every rank returns the same metrics. The ranks' shares are put back in the order one process reads the
dataset (tar order for a webdataset, index order otherwise), which decides exact ties (``torch.topk``'s
choice among equal scores: identical captions are common), so any number of ranks and workers gives one
process's result.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..training.distributed import rank_world
from .adapter import BenchmarkModel, BenchmarkTokenizer, check_prompts
from .compat import accuracy
from .datasets import CLASSIFICATION, BenchmarkSpec, make_loader, share

__all__ = ["RECALL_K", "BenchmarkResult", "evaluate_dataset"]

#: The recall@k of retrieval.
RECALL_K = (1, 5, 10)


@dataclass
class BenchmarkResult:
    """One dataset's result: CLIP_benchmark's ``metrics`` dict, and how many images (and captions) it had."""

    spec: BenchmarkSpec
    metrics: dict[str, float]
    samples: int
    texts: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


def _gather(obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (a collective; ``[obj]`` without a process group)."""
    rank, world = rank_world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj)
    return out


@contextlib.contextmanager
def _progress(enabled: bool) -> Iterator[None]:
    """CLIP_benchmark's classifier shows a tqdm bar per call; quiet unless ``enabled``."""
    from clip_benchmark.metrics import zeroshot_classification as zc

    saved = zc.tqdm
    if not enabled:
        zc.tqdm = lambda items, *a, **k: items
    try:
        yield
    finally:
        zc.tqdm = saved


def _bar(items: Any, enabled: bool, desc: str) -> Any:
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc, file=sys.stderr, dynamic_ncols=True)


def _in_order(parts: list[tuple[Any, ...]]) -> list[int]:
    """The permutation that sorts the gathered rows by their position keys (last field of each part)."""
    keys = [k for p in parts for k in p[-1]]
    return sorted(range(len(keys)), key=keys.__getitem__)


@torch.no_grad()
def _classification(model: BenchmarkModel, tok: BenchmarkTokenizer, dataset: Any, loader: Any, device: torch.device,
                    progress: bool, name: str) -> tuple[dict[str, float], int]:
    from clip_benchmark.metrics.zeroshot_classification import average_precision_per_class, zero_shot_classifier
    from sklearn.metrics import balanced_accuracy_score

    classnames, templates = list(dataset.classes), dataset.templates
    rank, world = rank_world()
    lo, hi = len(classnames) * rank // world, len(classnames) * (rank + 1) // world
    part = None
    if hi > lo:
        with _progress(progress):
            part = zero_shot_classifier(model, tok, classnames[lo:hi], templates, device.type, amp=False).cpu()
    classifier = torch.cat([p for p in _gather(part) if p is not None], dim=1).to(device)
    logits, targets, keys = [], [], []
    for images, target, key in _bar(loader, progress, "images"):
        features = F.normalize(model.encode_image(images), dim=-1)
        logits.append((100.0 * features @ classifier).float().cpu())
        targets.append(target.cpu())
        keys += key
    parts = [p for p in _gather((logits, targets, keys)) if p[-1]]
    if not parts:
        raise ValueError(f"benchmark {name!r}: no images")
    order = torch.tensor(_in_order(parts))
    logit = torch.cat([x for p in parts for x in p[0]])[order]
    target = torch.cat([x for p in parts for x in p[1]])[order]
    if target.ndim == 2:  # multi-label (voc2007_multilabel, wds dataset_type multilabel)
        return {"mean_average_precision": average_precision_per_class(logit, target).mean().item()}, len(target)
    if len(classnames) >= 5:
        acc1, acc5 = accuracy(logit, target, topk=(1, 5))
    else:
        (acc1,), acc5 = accuracy(logit, target, topk=(1,)), float("nan")
    recall = float(balanced_accuracy_score(target.numpy(), logit.argmax(dim=1).numpy()))
    return {"acc1": acc1, "acc5": acc5, "mean_per_class_recall": recall}, len(target)


@torch.no_grad()
def _retrieval(model: BenchmarkModel, tok: BenchmarkTokenizer, loader: Any, device: torch.device, batch_size: int,
               progress: bool, name: str) -> tuple[dict[str, float], int, int]:
    from clip_benchmark.metrics.zeroshot_retrieval import batchify, recall_at_k

    images_emb, texts_emb, counts, keys = [], [], [], []
    for images, captions, key in _bar(loader, progress, "images"):
        images_emb.append(F.normalize(model.encode_image(images), dim=-1).cpu())
        texts_emb.append(F.normalize(model.encode_text(tok([t for c in captions for t in c])), dim=-1).cpu())
        counts += [len(c) for c in captions]
        keys += key
    parts = [p for p in _gather((images_emb, texts_emb, counts, keys)) if p[-1]]
    if not parts:
        raise ValueError(f"benchmark {name!r}: no images")
    order = _in_order(parts)
    per_image = [n for p in parts for n in p[2]]
    first = [0]
    for n in per_image:
        first.append(first[-1] + n)
    images_all = torch.cat([e for p in parts for e in p[0]])[torch.tensor(order)]
    text_rows = torch.tensor([t for i in order for t in range(first[i], first[i + 1])], dtype=torch.long)
    texts_all = torch.cat([e for p in parts for e in p[1]])[text_rows]
    image_of_text = torch.repeat_interleave(torch.arange(len(order)), torch.tensor([per_image[i] for i in order]))
    scores = texts_all @ images_all.t()
    positive = torch.zeros_like(scores, dtype=torch.bool)
    positive[torch.arange(len(scores)), image_of_text] = True
    metrics = {}
    n_texts, n_images = scores.shape
    for k in RECALL_K:
        image_r = batchify(recall_at_k, scores, positive, batch_size, device, k=min(k, n_images))
        text_r = batchify(recall_at_k, scores.T, positive.T, batch_size, device, k=min(k, n_texts))
        metrics[f"image_retrieval_recall@{k}"] = (image_r > 0).float().mean().item()
        metrics[f"text_retrieval_recall@{k}"] = (text_r > 0).float().mean().item()
    return metrics, n_images, n_texts


def evaluate_dataset(model: torch.nn.Module, tokenizer: Any, spec: BenchmarkSpec, dataset: Any, batch_size: int = 64,
                     workers: int = 0, progress: bool = False) -> BenchmarkResult:
    """CLIP_benchmark's metrics of ``model`` (a :class:`recipe.model.CLIP`, in evaluation mode) on ``dataset``
    (:func:`recipe.benchmark.datasets.build` of ``spec``, images transformed); every rank calls it and
    embeds its share (module docstring). Classification first checks that the run's context holds every
    prompt (:func:`recipe.benchmark.adapter.check_prompts`).

    Raises:
        recipe.benchmark.adapter.PromptsTooLong: A prompt longer than the tokenizer's context.
    """
    rank, world = rank_world()
    wrapped, tok = BenchmarkModel(model), BenchmarkTokenizer(tokenizer)
    device = next(model.parameters()).device
    loader = make_loader(share(dataset, rank, world), spec.task, batch_size, workers)
    show = progress and rank == 0
    if spec.task == CLASSIFICATION:
        check_prompts(tokenizer, dataset.classes, dataset.templates, spec.name)
        metrics, n = _classification(wrapped, tok, dataset, loader, device, show, spec.name)
        return BenchmarkResult(spec, metrics, n)
    metrics, n, texts = _retrieval(wrapped, tok, loader, device, batch_size, show, spec.name)
    return BenchmarkResult(spec, metrics, n, texts)
