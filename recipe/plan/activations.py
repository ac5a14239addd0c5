"""Activation and loss memory, counted from the tensors autograd keeps for backward.

Nothing here is a formula for a particular architecture: a forward pass of the real model (built on
the ``meta`` device, so ViT-B-32 or larger costs no memory and milliseconds) runs under
:func:`torch.autograd.graph.saved_tensors_hooks`, and every tensor autograd saves is counted once
(views are counted by their base tensor; parameters are model state and left out). Two batch sizes
give the bytes per sample (the slope) and a batch-independent part.

Gradient checkpointing (``set_grad_checkpointing``) changes what is saved: torch's non-reentrant
checkpoint replaces the saved tensors of a segment by its own recomputation hooks (so the outer
hooks no longer see them) and keeps the segment's *inputs* alive through its recompute closure,
which no saved-tensor hook sees. :func:`count_saved` therefore also wraps torch's checkpoint
implementation for the duration of the count: it adds each segment's tensor inputs, and it measures
the segment's own saved bytes once (its recomputation in backward materialises them again: the
largest segment is a transient peak that adds to the checkpointed total).

What the hooks do not see, and the plan's headroom covers: allocator rounding and fragmentation,
transient tensors of a single operation (e.g. attention scratch, a backward kernel's workspace),
gradients of activations while backward runs through a layer, communication buffers of
collectives, and the CUDA context itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

__all__ = ["ActivationBytes", "SavedCounter", "count_saved", "measure_activations", "measure_loss"]


class SavedCounter:
    """Bytes of distinct tensors kept for backward (see the module docstring)."""

    def __init__(self, exclude: list[torch.Tensor] = ()) -> None:
        self.exclude = {id(t) for t in exclude}
        self.held: dict[int, torch.Tensor] = {}  # the tensors themselves: ids stay unique while counted
        self.segment_peak = 0  # largest checkpointed segment's own saved bytes (recomputed in backward)
        self.segments = 0

    def add(self, t: torch.Tensor) -> None:
        base = t._base if t._base is not None else t
        if id(base) in self.exclude or isinstance(base, torch.nn.Parameter) or id(base) in self.held:
            return
        self.held[id(base)] = base

    @property
    def bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self.held.values())

    @contextlib.contextmanager
    def hooks(self) -> Iterator[SavedCounter]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            self.add(t)
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self


@contextlib.contextmanager
def count_saved(exclude: list[torch.Tensor] = ()) -> Iterator[SavedCounter]:
    """Counts what a forward pass keeps for backward, checkpointed segments included."""
    counter = SavedCounter(exclude)
    original = torch_checkpoint._checkpoint_impl  # what torch.utils.checkpoint.checkpoint calls

    def wrapped(function: Any, args: tuple, kwargs: dict, **options: Any) -> Any:
        for a in list(args) + list(kwargs.values()):
            if isinstance(a, torch.Tensor):
                counter.add(a)  # alive until backward, through the recompute closure
        inner = SavedCounter()
        inner.exclude = counter.exclude
        with torch.enable_grad(), inner.hooks():  # the segment's own saved bytes: recomputed in backward
            function(*args, **kwargs)
        counter.segment_peak = max(counter.segment_peak, inner.bytes)
        counter.segments += 1
        return original(function, args, kwargs, **options)

    torch_checkpoint._checkpoint_impl = wrapped
    try:
        with counter.hooks():
            yield counter
    finally:
        torch_checkpoint._checkpoint_impl = original


class _FusedAttentionSaves(torch.autograd.Function):
    """What a fused (flash) attention kernel keeps for backward: q, k, v, the output and the fp32
    log-sum-exp per query. On ``meta``, torch would count its math decomposition instead (fp32
    T x T probabilities), which no GPU run with bf16/fp16 attention keeps; a CPU run keeps exactly
    these (``ScaledDotProductFlashAttentionForCpuBackward``), so meta and CPU counts agree."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _fused_attention_on_meta() -> Iterator[None]:
    real = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if q.device.type != "meta":
            return real(q, k, v, *args, **kwargs)
        return _FusedAttentionSaves.apply(q, k, v)

    torch.nn.functional.scaled_dot_product_attention = sdpa  # modules look it up at call time
    try:
        yield
    finally:
        torch.nn.functional.scaled_dot_product_attention = real


@dataclass(frozen=True)
class ActivationBytes:
    """Saved-for-backward bytes of one forward of both towers (the embeddings included).

    Attributes:
        per_sample: Bytes per sample (slope between two batch sizes).
        fixed: Batch-independent part (e.g. casts of weights kept for backward).
        recompute_per_sample: With checkpointing, the largest segment's own saved bytes per sample:
            materialised again while backward recomputes it (0 without checkpointing).
    """

    per_sample: float
    fixed: float
    recompute_per_sample: float = 0.0

    def at(self, batch: int) -> float:
        """Peak activation bytes of a micro-batch (saved tensors plus one recomputed segment)."""
        return self.fixed + batch * (self.per_sample + self.recompute_per_sample)


def _inputs(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, ...]:
    _, h, w = (int(v) for v in model.image_data_config()["input_size"])
    pixels = torch.zeros(batch, 3, h, w, dtype=dtype, device=device)
    length = model.context_length
    ids = torch.ones(batch, length, dtype=torch.long, device=device)
    return pixels, ids, torch.ones_like(ids)


def _saved_bytes(model: torch.nn.Module, batch: int, dtype: torch.dtype, device: torch.device) -> tuple[int, int]:
    pixels, ids, _ = _inputs(model, batch, dtype, device)
    # No attention mask: an all-ones mask is what a full-length batch has, and transformers reads a
    # mask's values on the host (``.item()``), which a meta tensor cannot give. The mask itself is
    # B x L integers, nothing against the activations.
    model.text.default_attention_mask = lambda input_ids: None  # instance attribute, removed below
    try:
        with _fused_attention_on_meta(), count_saved() as counter:
            out = model(pixels, ids, None)
        del out
    finally:
        del model.text.default_attention_mask
    return counter.bytes, counter.segment_peak


def measure_activations(
    model: torch.nn.Module, dtype: torch.dtype, checkpointing: bool, batches: tuple[int, int] = (2, 4)
) -> ActivationBytes:
    """Saved-for-backward bytes of ``model`` (training mode, cast to ``dtype``) per sample.

    ``model`` may live on ``meta`` (free) or on a real device (the same count, checked in the tests).
    The model is changed in place (dtype, training mode, checkpointing).
    """
    device = next(model.parameters()).device
    model.to(dtype).train()
    model.set_grad_checkpointing(checkpointing)
    (b1, b2) = batches
    s1, p1 = _saved_bytes(model, b1, dtype, device)
    s2, p2 = _saved_bytes(model, b2, dtype, device)
    slope = (s2 - s1) / (b2 - b1)
    return ActivationBytes(slope, s1 - b1 * slope, (p2 - p1) / (b2 - b1) if checkpointing else 0.0)


def measure_loss(mode: str, rows: int, world: int, dim: int, dtype: torch.dtype, chunk_size: int) -> float:
    """Bytes the contrastive loss keeps for backward on one rank (``rows`` local pairs against
    ``rows x world`` gathered ones), plus its largest saved tensor once more: the gradient of that
    tensor exists while backward passes through it. Counted on ``meta``.

    The fused (Triton) mode cannot run on ``meta``; it keeps tiles like the chunked mode and is
    counted as such.
    """
    from recipe.loss.base import GatheredBatch
    from recipe.loss.clip import LOSS_MODES

    fn = LOSS_MODES["chunked" if mode == "fused" else mode]
    meta = torch.device("meta")
    image = torch.zeros(rows, dim, dtype=dtype, device=meta, requires_grad=True)
    text = torch.zeros(rows, dim, dtype=dtype, device=meta, requires_grad=True)
    if world > 1:
        all_image = torch.zeros(rows * world, dim, dtype=dtype, device=meta, requires_grad=True)
        all_text = torch.zeros(rows * world, dim, dtype=dtype, device=meta, requires_grad=True)
    else:
        all_image, all_text = image, text
    scale = torch.ones((), device=meta, requires_grad=True)
    # the embeddings themselves are counted by the caller (cache, gathered copies)
    with count_saved(exclude=[image, text, all_image, all_text, scale]) as counter:
        out = fn(GatheredBatch(image, text, all_image, all_text, 0), scale, None, chunk_size)
        loss = out.ce_i2t.sum() + out.ce_t2i.sum()
    del loss
    largest = max((t.untyped_storage().nbytes() for t in counter.held.values()), default=0)
    return float(counter.bytes + largest)
