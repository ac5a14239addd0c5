"""The optimizer of a run: SRAdamW over the CLIP paper's parameter groups, and the learning-rate
schedule (linear warmup, then cosine decay or constant).

Per-tower rates and layer-wise decay (``--image-lr``, ``--text-lr``, ``--layer-decay``) are each group's
``lr_scale`` (:mod:`recipe.training.param_groups`): the training loop sets ``lr = lr_at(step) * lr_scale``, so
every group follows the one schedule, scaled (warmup, cosine and its floor ``--min-lr`` alike).
:func:`describe_groups` names the groups and their scales for the run's log.
"""

from __future__ import annotations

import math

import torch

from optim import SRAdamW

from ..config import TrainConfig
from .param_groups import param_groups
from .precision import Precision

__all__ = ["build_optimizer", "lr_at", "tower_lr_scales", "describe_groups", "warmup_note"]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, prec: Precision) -> SRAdamW:
    """SRAdamW over the CLIP paper's parameter groups, each with its ``lr_scale`` (``--image-lr`` and
    ``--text-lr`` over ``--lr``, ``--layer-decay``; see :mod:`recipe.training.param_groups`), which the training
    loop multiplies the schedule by. Frozen parameters (``--lock-image``, ``--lock-text``) are in no group.

    The logit scale is clamped inside the optimizer (under ZeRO the optimizer owns the parameter's
    partition, so clamping the module would be lost). The optimizer keeps its gradient check: it is
    the one place that sees every route's gradients (ZeRO-3 partitions included, which DeepSpeed
    does not check in bf16); it folds the train step's ``found_inf`` into that check on the device,
    and the train step reads the outcome (:func:`recipe.training.step.train_step`).
    """
    m = cfg.model
    image_scale, text_scale = tower_lr_scales(cfg)
    groups = param_groups(
        model,
        cfg.optim.weight_decay,
        text_master_weights=m.text_master_weights,
        image_master_weights=m.image_master_weights,
        text_state_dtype=torch.float32 if m.text_master_weights else prec.sr_state_dtype,
        image_state_dtype=torch.float32 if m.image_master_weights else prec.sr_state_dtype,
        image_lr_scale=image_scale,
        text_lr_scale=text_scale,
        layer_decay=cfg.optim.layer_decay,
    )
    for g in groups:
        if g["name"] == "logit_scale":
            g["clamp"] = (0.0, model.max_log_logit_scale)
            g["state_dtype"] = torch.float32
    o = cfg.optim
    # ZeRO-0 (the fp16 route) replicates the weights: every rank updates the same tensors and must draw
    # the same rounding noise (the noise rank 0), or the replicas drift apart. ZeRO-1/2/3 partitions are
    # disjoint: each rank draws its own (the default, from torch.distributed).
    rank = 0 if prec.zero_stage == 0 else None
    return SRAdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, seed=o.sr_seed,
        rank=rank,
    )


def tower_lr_scales(cfg: TrainConfig) -> tuple[float, float]:
    """``(image, text)`` multipliers of the schedule: ``--image-lr`` and ``--text-lr`` over ``--lr`` (1
    when unset).

    Raises:
        ValueError: a nonzero tower rate with ``--lr 0`` (no schedule to scale).
    """
    o = cfg.optim
    scales = []
    for flag, value in (("--image-lr", o.image_lr), ("--text-lr", o.text_lr)):
        if value is None or value == o.lr:
            scales.append(1.0)
        elif o.lr == 0:
            raise ValueError(f"{flag} {value} needs a nonzero --lr: tower rates scale the --lr schedule")
        else:
            scales.append(value / o.lr)
    return scales[0], scales[1]


def describe_groups(optimizer: torch.optim.Optimizer, counts: dict[str, int] | None = None) -> str:
    """One line naming each optimizer group with its parameter count, lr scale and weight decay, e.g.
    ``optimizer groups (...): image.layer0.decay 1,234 x0.25 wd 0.2, ...``.

    ``counts`` (group name -> model parameters, as :func:`recipe.training.engine.build_engine` returns them) replaces
    counting the groups' tensors, which ZeRO has replaced by flat partitions (ZeRO-3 empties them).
    """
    parts = []
    for g in optimizer.param_groups:
        n = counts[g["name"]] if counts is not None else sum(p.numel() for p in g["params"])
        parts.append(f"{g['name']} {n:,} x{g.get('lr_scale', 1.0):.4g} wd {g['weight_decay']:g}")
    return "optimizer groups (name, parameters, lr scale, weight decay): " + ", ".join(parts)


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` (or constant)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def warmup_note(cfg: TrainConfig, total_steps: int) -> str | None:
    """A line for a run that is warm-up from start to end (``--warmup-steps`` >= the run's steps, e.g.
    the demo's 30 with ``--steps 30``): its learning rate never reaches ``--lr``. None otherwise."""
    o = cfg.optim
    if total_steps <= 0 or o.warmup_steps < total_steps:
        return None
    return (f"note: --warmup-steps {o.warmup_steps} covers all {total_steps} steps of this run: the learning rate "
            f"rises to {lr_at(total_steps - 1, cfg, total_steps):.3g} and never reaches --lr {o.lr:g} "
            f"(give --warmup-steps below --steps, e.g. --warmup-steps {max(1, total_steps // 10)})")

