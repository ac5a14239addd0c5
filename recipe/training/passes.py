"""The forward and backward passes of one optimizer step: per micro-batch, or over the global batch.

With gradient accumulation k, one optimizer step trains on k micro-batches of m pairs on each of N
ranks. Which pairs a pair is contrasted with is the *contrastive batch* (``--contrastive-batch``):

``micro``
    Each micro-batch has its own loss over its m × N pairs (gathered across ranks); DeepSpeed
    averages the k gradients. A pair meets m·N − 1 negatives: with k = 4 the contrastive batch is
    4× smaller than the batch the DeepSpeed JSON configures.

``global`` (the default; the CLIP paper's setting)
    One loss over all m × k × N pairs, exactly as if they were one batch, computed with the memory
    of one micro-batch's activations plus an embedding cache (GradCache, Gao et al. 2021):

    1. forward every micro-batch without a graph and keep only its embeddings, and the random-number
       state it started from;
    2. the sharded loss over all cached embeddings (gathered across ranks as usual, any loss mode)
       and, by one backward pass through the loss alone, its gradient with respect to every cached
       embedding and to the logit scale (and SigLIP's logit bias), times the fp16 route's loss scale, so
       that small embedding gradients do not underflow;
    3. forward each micro-batch again from the same random-number state, so that dropout,
       stochastic depth and patch dropout draw the same masks, and back-propagate its slice of the
       embedding gradients through ``engine.backward``; DeepSpeed's accumulation boundary comes
       with the last one, and the optimizer steps once.

    The second forward is the cost: about one extra forward pass of both towers per step. BatchNorm
    normalises with the micro-batch's statistics in both forwards (so the two forwards agree) and
    its running statistics are updated by the first only: once per sample. Gradient checkpointing
    works unchanged (pass 3 recomputes as usual). With k = 1 both modes are the same single pass.

Memory of ``global`` beyond one micro-batch's activations: the cache, 2 towers × m·k × D values in
the towers' dtype, its gradient (the same again), and the loss's own memory for m·k local rows
against m·k·N gathered columns (see :mod:`recipe.loss`; the chunked and fused modes keep it small).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..config import CONTRASTIVE_BATCH_NAMES
from ..loss import ClipLoss, SigLipLoss
from .precision import Precision

__all__ = ["CONTRASTIVE_BATCHES", "Passes", "run_passes", "micro_passes", "global_passes", "batchnorm_stats_frozen"]

#: Values of ``--contrastive-batch``.
CONTRASTIVE_BATCHES = CONTRASTIVE_BATCH_NAMES


@dataclass
class Passes:
    """What the passes of one optimizer step return.

    Attributes:
        losses: This rank's loss of each loss evaluation (detached): k for ``micro``, one for ``global``.
        metrics: The loss's metrics of each evaluation (device scalars).
        samples: Pairs trained on, all ranks.
        contrastive_batch: Pairs each loss contrasted (m·N for ``micro``, m·k·N for ``global``).
    """

    losses: list[torch.Tensor]
    metrics: list[dict[str, torch.Tensor]]
    samples: int
    contrastive_batch: int


def run_passes(
    mode: str,
    engine: Any,
    loss_fn: ClipLoss | SigLipLoss,
    prec: Precision,
    batches: Sequence[dict[str, Any]],
    world: int,
    last_backward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Passes:
    """The passes of one optimizer step over ``batches`` in contrastive-batch ``mode``; the optimizer
    step itself (after the last backward) is the caller's. The step's last backward pass runs inside
    ``last_backward()`` (the overlapped gradient all-reduce sends from there:
    :mod:`recipe.training.overlap`).

    Raises:
        ValueError: An unknown ``mode``.
    """
    if mode not in CONTRASTIVE_BATCHES:
        raise ValueError(f"contrastive_batch must be one of {', '.join(CONTRASTIVE_BATCHES)}, got {mode!r}")
    if mode == "global" and len(batches) > 1:
        return global_passes(engine, loss_fn, prec, batches, world, last_backward)
    return micro_passes(engine, loss_fn, prec, batches, world, last_backward)


def _inputs(batch: dict[str, Any], device: torch.device, prec: Precision) -> tuple[torch.Tensor, ...]:
    pixels = batch["pixel_values"].to(device, prec.param_dtype)
    return pixels, batch["input_ids"].to(device), batch["attention_mask"].to(device)


def micro_passes(
    engine: Any, loss_fn: ClipLoss | SigLipLoss, prec: Precision, batches: Sequence[dict[str, Any]], world: int,
    last_backward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Passes:
    """Forward, loss and backward of each micro-batch in turn (DeepSpeed divides each loss by k)."""
    device = next(engine.module.parameters()).device
    losses, metrics, samples = [], [], 0
    for i, batch in enumerate(batches):
        image, text, *logit = engine(*_inputs(batch, device, prec))  # logit: scale (and SigLIP's bias)
        loss, m = loss_fn(image, text, *logit, sizes=[image.shape[0]] * world)
        with last_backward() if i == len(batches) - 1 else contextlib.nullcontext():
            engine.backward(loss * prec.loss_scaler.scale if prec.loss_scaler else loss)
        losses.append(loss.detach())
        metrics.append(m)
        samples += image.shape[0] * world
        del image, text, logit, loss
        if i < len(batches) - 1:
            engine.step()  # DeepSpeed counts micro-steps: the update happens at the accumulation boundary
    return Passes(losses, metrics, samples, samples // len(batches))


def global_passes(
    engine: Any, loss_fn: ClipLoss | SigLipLoss, prec: Precision, batches: Sequence[dict[str, Any]], world: int,
    last_backward: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
) -> Passes:
    """One loss over all micro-batches of all ranks, through an embedding cache (see the module)."""
    module = engine.module
    device = next(module.parameters()).device
    # 1. embeddings of every micro-batch, without a graph, and the RNG state each forward started from
    starts, images, texts = [], [], []
    with torch.no_grad():
        for batch in batches:
            starts.append(_rng_state(device))
            image, text, *logit = engine(*_inputs(batch, device, prec))  # logit: scale (and SigLIP's bias)
            images.append(image)
            texts.append(text)
    end = _rng_state(device)
    sizes = [t.shape[0] for t in images]
    image = torch.cat(images).requires_grad_()
    text = torch.cat(texts).requires_grad_()
    logit = [t.detach().requires_grad_() for t in logit]  # the same in every micro-batch's forward
    del images, texts
    # 2. the loss over the whole cache and its gradient with respect to the cache and the logit parameters
    loss, metrics = loss_fn(image, text, *logit, sizes=[image.shape[0]] * world)
    (loss * prec.loss_scaler.scale if prec.loss_scaler else loss).backward()
    grads = (image.grad.split(sizes), text.grad.split(sizes), [t.grad for t in logit])
    loss = loss.detach()
    del image, text, logit
    # 3. the same forwards again, each back-propagating its slice of the cache's gradient
    try:
        with batchnorm_stats_frozen(module):
            for i, batch in enumerate(batches):
                _set_rng_state(starts[i], device)
                image, text, *logit = engine(*_inputs(batch, device, prec))
                # a scalar whose gradient with respect to the embeddings is the cached gradient (DeepSpeed's
                # backward takes a scalar); the logit parameters' gradients enter once, with the first slice
                surrogate = (image.float() * grads[0][i].float()).sum() + (text.float() * grads[1][i].float()).sum()
                if i == 0:
                    for t, g in zip(logit, grads[2]):
                        surrogate = surrogate + (t.float() * g.float()).sum()
                with last_backward() if i == len(batches) - 1 else contextlib.nullcontext():
                    engine.backward(surrogate, scale_wrt_gas=False)  # the gradients are already the step's total
                del image, text, logit, surrogate
                if i < len(batches) - 1:
                    engine.step()  # DeepSpeed counts micro-steps: the update happens at the accumulation boundary
    finally:
        _set_rng_state(end, device)  # what follows sees the RNG as after one forward of each micro-batch
    samples = sum(sizes) * world
    return Passes([loss], [metrics], samples, samples)


@contextlib.contextmanager
def batchnorm_stats_frozen(module: nn.Module) -> Iterator[None]:
    """BatchNorm layers in training mode keep normalising with the batch's statistics, but their running
    statistics (and batch counters) are restored afterwards: the second forward of a sample leaves no trace.

    A snapshot rather than ``momentum = 0``: ``0 × NaN`` statistics would still corrupt the buffers.
    """
    saved = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training and m.track_running_stats:
            bufs = {n: b.clone() for n in ("running_mean", "running_var", "num_batches_tracked")
                    if (b := getattr(m, n, None)) is not None}
            saved.append((m, bufs))
    try:
        yield
    finally:
        with torch.no_grad():
            for m, bufs in saved:
                for n, b in bufs.items():
                    getattr(m, n).copy_(b)


def _rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The CPU generator's state and, on a GPU, the device generator's (dropout draws from the latter)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def _set_rng_state(state: tuple[torch.Tensor, torch.Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)
