"""One optimizer step of the recipe, and the one owner of "finite or not, skip or stop".

:func:`train_step` runs the forward and backward passes of one optimizer step's micro-batches
through the DeepSpeed engine (:mod:`recipe.training.passes`: one contrastive loss over the global batch, or one
per micro-batch), the precision route's unscale and clip (fp16), the optimizer step, and
then decides: a step whose loss or gradients are not finite is skipped and counted, on the fp16 route
an overflow shrinks the loss scale, and too many non-finite steps in a row stop the run. The
training loop (:mod:`recipe.train`) and the benchmarks (``benchmarks/``) call this same function.

Host synchronisations: none before the optimizer step is queued (the non-finite flag of the losses
and, on the fp16 route, the gradient multiplier are device tensors handed to SRAdamW, which folds in
its own gradient check on the device); one per optimizer step afterwards, where the outcome is read
(:func:`read_outcome`), because skipping changes host state (counters, the loss scale of the next
step, the stop decision). DeepSpeed's ZeRO step synchronises on its own (the clipping norm; its bf16
overflow check, a second owner of the finite check, is off: :func:`recipe.training.engine.engine_config`).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import torch

from optim import SRAdamW

from .distributed import max_over_ranks_, rank_world
from ..loss import ClipLoss, SigLipLoss
from .passes import run_passes
from .overlap import reducer_for
from .precision import Precision

__all__ = ["TrainState", "StepResult", "train_step", "record_skip", "step_kwargs", "grad_multiplier"]


@dataclass
class TrainState:
    """Counters that travel in the checkpoint."""

    step: int = 0
    samples: int = 0
    nonfinite_steps: int = 0  # skipped: non-finite loss (or non-finite gradients outside fp16)
    nonfinite_in_row: int = 0
    overflow_steps: int = 0  # fp16: skipped by dynamic loss scaling


@dataclass
class StepResult:
    """What one optimizer step returns.

    Attributes:
        loss: This rank's loss, mean over the step's micro-batches (detached device scalar).
        metrics: The loss's metrics (accuracies), mean over the micro-batches (device scalars).
        skipped: The optimizer step was skipped (non-finite loss or gradients, or fp16 overflow).
        loss_nonfinite: The loss of some micro-batch was not finite on some rank.
        samples: Pairs this step trained on, all ranks.
        contrastive_batch: Pairs each loss of the step contrasted (:class:`recipe.training.passes.Passes`).
        stop: Some rank asked to stop (``stop_requested``, e.g. on SIGTERM): every rank sees the same
            value, so all of them stop at this step boundary.
        grad_norm: The unscaled global gradient norm the recipe clipped by (device scalar) on the
            recipe-managed routes with clipping; None where DeepSpeed clips (its engine reports it).
            ``inf`` on an fp16 overflow step (the scaled gradients overflowed: the norm is unknown).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]
    skipped: bool
    loss_nonfinite: bool
    samples: int
    contrastive_batch: int
    stop: bool = False
    grad_norm: torch.Tensor | None = None


@contextlib.contextmanager
def step_kwargs(opt: SRAdamW, **kwargs: Any) -> Iterator[None]:
    """Makes DeepSpeed's argument-less ``optimizer.step()`` pass ``kwargs`` (found_inf, inverse scale)."""
    opt.step = functools.partial(type(opt).step, opt, **kwargs)
    try:
        yield
    finally:
        del opt.step


def grad_multiplier(params: torch.nn.Module | list[torch.Tensor], prec: Precision
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Recipe-managed routes: ``(multiplier, norm)``, the inverse loss scale (fp16; 1 for bf16) times
    the clipping factor of the unscaled global gradient norm, and that norm (None without clipping),
    as device scalars (no host read; a non-finite norm makes the optimizer's gradient check skip).
    ``params``: the module, or its parameters as a list."""
    inv = 1.0 / prec.loss_scaler.scale if prec.loss_scaler is not None else 1.0
    if isinstance(params, torch.nn.Module):
        params = list(params.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    device = grads[0].device if grads else torch.device("cpu")
    if prec.recipe_clip <= 0 or not grads:
        return torch.tensor(inv, dtype=torch.float32, device=device), None
    # per-gradient norms accumulated in fp32 (scaled fp16 gradients cannot overflow there), summed in fp64
    norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
    norm = torch.linalg.vector_norm(torch.stack(norms).double()) * inv
    factor = (prec.recipe_clip / (norm + 1e-6)).clamp(max=1.0)
    return (inv * factor).float(), norm.float()


def record_skip(state: TrainState, prec: Precision, skipped: bool, loss_nonfinite: bool, limit: int) -> bool:
    """Counts a skipped step and updates the loss scale; stops after ``limit`` non-finite steps in a row.
    Returns whether the step was an fp16 overflow.

    On the fp16 route a step skipped with a finite loss is the loss scaler's overflow (counted in
    ``overflow_steps``), not a bad loss.

    Raises:
        FloatingPointError: ``limit`` non-finite steps in a row.
    """
    overflow = skipped and prec.loss_scaler is not None and not loss_nonfinite
    nonfinite = skipped and not overflow
    if prec.loss_scaler is not None:
        prec.loss_scaler.update(skipped)
    state.overflow_steps += int(overflow)
    state.nonfinite_steps += int(nonfinite)
    state.nonfinite_in_row = state.nonfinite_in_row + 1 if nonfinite else 0
    if state.nonfinite_in_row >= limit:
        raise FloatingPointError(
            f"{state.nonfinite_in_row} non-finite steps in a row at step {state.step}: stopping "
            "(loss or gradients are inf/NaN; lower the learning rate or check the data)"
        )
    return overflow


def train_step(
    engine: Any,
    opt: torch.optim.Optimizer,
    loss_fn: ClipLoss | SigLipLoss,
    prec: Precision,
    batches: Iterable[dict[str, Any]],
    state: TrainState,
    max_nonfinite_in_row: int,
    after_backward: Callable[[list[torch.Tensor]], None] | None = None,
    stop_requested: bool = False,
    contrastive_batch: str = "global",
) -> StepResult:
    """One optimizer step over ``batches`` (the step's micro-batches, ``gradient_accumulation_steps``
    of them), then the skip/stop decision recorded in ``state`` (:func:`record_skip`).

    ``contrastive_batch`` (``global`` or ``micro``) picks the passes (:mod:`recipe.training.passes`): one loss
    over all micro-batches of all ranks, or one loss per micro-batch.

    Every rank's batches must hold the same number of pairs (the recipe's loaders guarantee it), so
    the loss needs no size exchange. ``after_backward(live)`` runs after the last backward pass and
    before the optimizer step, with the tensors the step itself still holds (losses, metrics); the
    memory benchmark measures there. An optimizer other than SRAdamW (a benchmark's comparison arm)
    is stepped without the recipe's flags; DeepSpeed's overflow check still guards it.
    ``stop_requested`` (this rank's wish to stop, e.g. on SIGTERM) travels in the same all-reduce as
    the non-finite flag, so that every rank learns of any rank's wish at the same step.

    Raises:
        FloatingPointError: Too many non-finite steps in a row.
    """
    world = rank_world()[1]
    # the recipe-managed routes average the gradients themselves, sent during the last backward pass
    reducer = reducer_for(engine, prec.reduce_dtype) if prec.recipe_managed else None
    passes = run_passes(contrastive_batch, engine, loss_fn, prec, list(batches), world,
                        reducer.last_backward if reducer is not None else contextlib.nullcontext)
    if reducer is not None:
        reducer.finish()  # waits for the buckets sent during backward, sends and waits for the rest
    losses, metrics = passes.losses, passes.metrics
    if after_backward is not None:
        after_backward([*losses, *(v for m in metrics for v in m.values())])
    nonfinite = (~torch.isfinite(torch.stack(losses))).any().float()
    flags = max_over_ranks_(torch.stack([nonfinite, torch.tensor(float(stop_requested), device=nonfinite.device)]))
    kwargs: dict[str, Any] = {"found_inf": flags[:1]}  # [loss non-finite, stop], on any rank
    grad_norm = None
    if prec.recipe_managed:
        params = list(engine.module.parameters())
        if prec.loss_scaler is not None or prec.recipe_clip > 0:
            kwargs["inv_grad_scale"], grad_norm = grad_multiplier(params, prec)
    ours = isinstance(opt, SRAdamW)
    skipped_before = opt.skipped_steps if ours else 0
    with step_kwargs(opt, **kwargs) if ours else contextlib.nullcontext():
        engine.step()
    loss_nonfinite, skipped, stop = read_outcome(engine, opt, flags, skipped_before)
    overflow = record_skip(state, prec, skipped, loss_nonfinite, max_nonfinite_in_row)
    if grad_norm is not None and overflow:
        # the scaled gradients left fp16's range (inf, or NaN where infinities met), so the unscaled norm
        # is unknown; reported as inf whichever the sum gave
        grad_norm = torch.full_like(grad_norm, float("inf"))
    state.step += 1
    state.samples += passes.samples
    mean = {k: torch.stack([m[k] for m in metrics]).mean() for k in metrics[0]}
    return StepResult(torch.stack(losses).mean(), mean, skipped, loss_nonfinite, passes.samples,
                      passes.contrastive_batch, stop, grad_norm)


def read_outcome(
    engine: Any, opt: torch.optim.Optimizer, flags: torch.Tensor, skipped_before: int
) -> tuple[bool, bool, bool]:
    """``(loss_nonfinite, skipped, stop)`` of the step just queued: skipped by SRAdamW (non-finite loss
    or gradients) or by DeepSpeed's ZeRO overflow check before it (DeepSpeed then never calls SRAdamW)."""
    # host sync, once per step: the skip changes host state (counters, next loss scale, stop)
    loss_nonfinite, stop = (bool(v) for v in flags.tolist())
    # reading skipped_steps settles SRAdamW's device-side skip of this step (same synchronisation)
    by_optimizer = getattr(opt, "skipped_steps", 0) > skipped_before
    skipped = loss_nonfinite or by_optimizer or bool(getattr(engine.optimizer, "overflow", False))
    return loss_nonfinite, skipped, stop
