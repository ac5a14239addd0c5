"""Functional AdamW step with stochastic rounding, one tensor at a time (the PyTorch path).

:func:`sradamw_update_` is the reference definition of the update. The fused GPU kernel computes the
same thing in one pass; everything that kernel needs besides the tensors is a handful of host-side
scalars (learning rate, bias corrections, keys, state scales) prepared by :func:`state_scale`.

The update, in float32 arithmetic whatever the storage dtypes (same order of operations as
``torch.optim.AdamW`` so float32 parameters with float32 state match it):

    w  = w * (1 - lr * weight_decay)
    m  = lerp(m, g, 1 - beta1)
    v  = beta2 * v + (1 - beta2) * g * g
    w  = w - lr / (1 - beta1**t) * m / (sqrt(v) / sqrt(1 - beta2**t) + eps)

then ``w``, ``m`` and ``v`` are written back to their storage dtypes: float32 exactly, half precision
with stochastic rounding (or round-to-nearest when asked). float16 Adam statistics are stored divided
by a per-tensor power-of-two scale so that tiny gradients do not underflow; the scale follows an
upper bound of the statistic that is updated from the gradient's absolute maximum alone, so the
element-wise pass needs no second reduction.
"""

from __future__ import annotations

import math
from typing import Literal

import torch

from .rounding import random_bits, round_with_bits

__all__ = ["sradamw_update_", "state_scale", "F16_STATE_TARGET_EXP", "STREAM_PARAM", "STREAM_EXP_AVG", "STREAM_EXP_AVG_SQ"]

Rounding = Literal["stochastic", "nearest"]

#: float16 statistics are scaled so that their running bound maps to at most 2**14, leaving a factor
#: four of headroom below float16's largest finite value (65504).
F16_STATE_TARGET_EXP = 14

#: Elements per chunk of the PyTorch path. Chunks bound the temporaries whatever the tensor's length;
#: on the CPU a chunk that stays in cache is about twice as fast as one pass over a large tensor. The
#: noise is keyed by the global element index, so the chunk size never changes the result.
CPU_CHUNK = 1 << 18
DEVICE_CHUNK = 1 << 24

STREAM_PARAM = 0
STREAM_EXP_AVG = 1
STREAM_EXP_AVG_SQ = 2


def state_scale(bound: torch.Tensor) -> torch.Tensor:
    """Power-of-two scale for a float16 statistic whose absolute values are at most ``bound``.

    Args:
        bound: 0-dim float32 tensor, an upper bound of the statistic's magnitude.

    Returns:
        0-dim float32 tensor ``2**k`` with ``bound / 2**k <= 2**14`` (``2**-14`` for a zero bound),
        kept within float32's normal range.
    """
    exponent = torch.frexp(bound).exponent  # bound <= 2**exponent
    exponent = (exponent - F16_STATE_TARGET_EXP).clamp(-126, 127)
    return torch.ldexp(torch.ones_like(bound), exponent)


def _write(
    dst: torch.Tensor, src32: torch.Tensor, rounding: Rounding, key: int, offset: int
) -> None:
    """Stores float32 ``src32`` into ``dst`` (a slice), rounding stochastically when half."""
    if dst.dtype == torch.float32 or rounding == "nearest":
        dst.copy_(src32)
    else:
        bits = random_bits(key, offset, src32.numel(), device=src32.device)
        dst.copy_(round_with_bits(src32, dst.dtype, bits))


def sradamw_update_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    keys: tuple[int, int, int],
    master: torch.Tensor | None = None,
    exp_avg_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    exp_avg_sq_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    grad_mul: torch.Tensor | float | None = None,
    weight_rounding: Rounding = "stochastic",
    state_rounding: Rounding = "stochastic",
    clamp: tuple[float, float] | None = None,
    chunk_size: int | None = None,
) -> None:
    """One AdamW step on one tensor, in place, processed in chunks of ``chunk_size`` elements.

    Args:
        param: The parameter (float32, bfloat16 or float16), contiguous.
        grad: Its gradient (any floating dtype), same number of elements.
        exp_avg: First moment storage (float32, bfloat16 or float16).
        exp_avg_sq: Second moment storage.
        step: The step number ``t`` after this update (1 for the first step).
        lr: Learning rate.
        beta1: First moment decay.
        beta2: Second moment decay.
        eps: Denominator term.
        weight_decay: Decoupled weight decay coefficient (multiplied by ``lr``).
        keys: Noise keys for the (weight, exp_avg, exp_avg_sq) streams, from ``derive_key``.
        master: Optional float32 master copy of ``param``; when given it is updated and ``param``
            receives its round-to-nearest copy.
        exp_avg_scales: ``(old, new)`` scales of a float16 ``exp_avg`` (value = stored * scale).
        exp_avg_sq_scales: Same for ``exp_avg_sq``.
        grad_mul: Multiplies the gradient first (an inverse loss scale), scalar or 0-dim tensor.
        weight_rounding: How half-precision weights are written: ``"stochastic"`` or ``"nearest"``.
        state_rounding: How half-precision statistics are written.
        clamp: Optional ``(min, max)``: the updated float32 weight is projected into this range
            before it is written (e.g. CLIP's logit-scale clamp, applied to the master).
        chunk_size: Elements per chunk; default ``CPU_CHUNK`` on the CPU, ``DEVICE_CHUNK`` elsewhere.
    """
    if chunk_size is None:
        chunk_size = CPU_CHUNK if param.device.type == "cpu" else DEVICE_CHUNK
    n = param.numel()
    p_flat = param.view(-1)
    g_flat = grad.reshape(-1)
    m_flat = exp_avg.view(-1)
    v_flat = exp_avg_sq.view(-1)
    w_flat = master.view(-1) if master is not None else None
    bias_correction1 = 1 - beta1**step
    bias_correction2_sqrt = math.sqrt(1 - beta2**step)
    step_size = lr / bias_correction1
    decay = 1 - lr * weight_decay
    key_p, key_m, key_v = keys
    for start in range(0, n, chunk_size):
        end = min(start + chunk_size, n)
        g = g_flat[start:end].to(torch.float32)
        if grad_mul is not None:
            g = g * grad_mul
        if w_flat is not None:
            w = w_flat[start:end]  # updated in place
        elif param.dtype == torch.float32:
            w = p_flat[start:end]
        else:
            w = p_flat[start:end].to(torch.float32)
        m = m_flat[start:end].to(torch.float32)
        v = v_flat[start:end].to(torch.float32)
        if exp_avg_scales is not None:
            m.mul_(exp_avg_scales[0])
        if exp_avg_sq_scales is not None:
            v.mul_(exp_avg_sq_scales[0])

        w.mul_(decay)
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
        w.addcdiv_(m, denom, value=-step_size)
        if clamp is not None:
            w.clamp_(clamp[0], clamp[1])

        if exp_avg_scales is not None:
            m.div_(exp_avg_scales[1])
        if exp_avg_sq_scales is not None:
            v.div_(exp_avg_sq_scales[1])
        _write(m_flat[start:end], m, state_rounding, key_m, start)
        _write(v_flat[start:end], v, state_rounding, key_v, start)
        if w_flat is not None:
            p_flat[start:end].copy_(w)
        elif param.dtype != torch.float32:
            _write(p_flat[start:end], w, weight_rounding, key_p, start)
