"""The optimizer of a run: SRAdamW over the CLIP paper's parameter groups, and the learning-rate
schedule (linear warmup, then cosine decay or constant)."""

from __future__ import annotations

import math

import torch

from optim import SRAdamW

from .config import TrainConfig
from .param_groups import param_groups
from .precision import Precision

__all__ = ["build_optimizer", "lr_at"]


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, prec: Precision) -> SRAdamW:
    """SRAdamW over the CLIP paper's parameter groups.

    The logit scale is clamped inside the optimizer (under ZeRO the optimizer owns the parameter's
    partition, so clamping the module would be lost). The optimizer keeps its gradient check: it is
    the one place that sees every route's gradients (ZeRO-3 partitions included, which DeepSpeed
    does not check in bf16); it folds the train step's ``found_inf`` into that check on the device,
    and the train step reads the outcome (:func:`recipe.step.train_step`).
    """
    m = cfg.model
    groups = param_groups(
        model,
        cfg.optim.weight_decay,
        text_master_weights=m.text_master_weights,
        image_master_weights=m.image_master_weights,
        text_state_dtype=torch.float32 if m.text_master_weights else prec.sr_state_dtype,
        image_state_dtype=torch.float32 if m.image_master_weights else prec.sr_state_dtype,
    )
    for g in groups:
        if g["name"] == "logit_scale":
            g["clamp"] = (0.0, model.max_log_logit_scale)
            g["state_dtype"] = torch.float32
    o = cfg.optim
    return SRAdamW(
        groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, seed=o.sr_seed
    )


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` (or constant)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))
