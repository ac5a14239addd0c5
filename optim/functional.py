"""Functional AdamW step with stochastic rounding, one tensor at a time (the PyTorch path).

A :class:`TensorStep` holds everything one tensor's update needs (its tensors, step, hyperparameters,
noise keys, float16 state scales); :func:`apply_update_` applies one on the PyTorch path and
``optim.triton_kernel.sradamw_fused_`` applies a list of them with the fused kernel, which computes
the same thing in one pass. :func:`sradamw_update_` is the same update with the tensors and options
as arguments (the reference definition the tests call).

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

Skipping on the device: ``found_inf`` may be a flag tensor that is never read on the host. Every
store is then masked (the stored tensors keep their bits where the flag is set), and the result is
bit-identical to the unmasked update where it is not.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

from .rounding import random_bits, round_with_bits

__all__ = [
    "TensorStep",
    "apply_update_",
    "sradamw_update_",
    "masked_copy_",
    "state_scale",
    "F16_STATE_TARGET_EXP",
    "STREAM_PARAM",
    "STREAM_EXP_AVG",
    "STREAM_EXP_AVG_SQ",
]

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



@dataclass
class TensorStep:
    """Everything one tensor's update needs; the fields mirror :func:`sradamw_update_`'s arguments.

    Built once per tensor and step by ``SRAdamW.step`` and applied by :func:`apply_update_` (PyTorch
    path) or ``optim.triton_kernel.sradamw_fused_`` (fused kernel, many at once).

    Attributes:
        param: Parameter (float32, bfloat16 or float16); a non-contiguous one is updated through a
            contiguous copy.
        grad: Its gradient (float32, bfloat16 or float16), same number of elements.
        exp_avg: First moment storage, contiguous.
        exp_avg_sq: Second moment storage, contiguous.
        step: Step number after this update (1 for the first step).
        lr: Learning rate.
        beta1: First moment decay.
        beta2: Second moment decay.
        eps: Denominator term.
        weight_decay: Decoupled weight decay coefficient (multiplied by ``lr``).
        keys: Noise keys of the (weight, exp_avg, exp_avg_sq) streams, from ``derive_key``.
        master: Optional float32 master copy (contiguous); ``param`` then gets its nearest copy.
        exp_avg_scales: ``(old, new)`` 0-dim float32 scales of a float16 ``exp_avg`` on its device
            (value = stored * scale).
        exp_avg_sq_scales: Same for ``exp_avg_sq``.
        weight_rounding: ``"stochastic"`` or ``"nearest"`` for half weights without master.
        state_rounding: ``"stochastic"`` or ``"nearest"`` for half statistics.
        clamp: Optional ``(min, max)`` projection of the updated float32 weight (before rounding).
        index_offset: Noise index of element 0 (``SRAdamW`` uses 0; a ZeRO partition may pass its
            offset in the flat buffer so that the noise follows the global element index).
    """

    param: torch.Tensor
    grad: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    keys: tuple[int, int, int]
    master: torch.Tensor | None = None
    exp_avg_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    exp_avg_sq_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    weight_rounding: Rounding = "stochastic"
    state_rounding: Rounding = "stochastic"
    clamp: tuple[float, float] | None = None
    index_offset: int = 0


def _skip_mask(found_inf: torch.Tensor | None) -> torch.Tensor | None:
    """A 1-element flag (nonzero: skip) as the 0-dim bool tensor :func:`masked_copy_` takes; not read."""
    if found_inf is None:
        return None
    if found_inf.numel() != 1:
        raise ValueError("found_inf must be a 1-element tensor")
    return found_inf.detach().reshape(()) != 0


def masked_copy_(dst: torch.Tensor, src: torch.Tensor, skip: torch.Tensor | None) -> None:
    """``dst.copy_(src)``; with a ``skip`` mask (0-dim bool tensor) ``dst`` keeps its bits where it is set.

    ``src`` is cast to ``dst.dtype`` as ``copy_`` casts it, so the unmasked result is bit-identical.
    """
    if skip is None:
        dst.copy_(src)
    else:
        dst.copy_(torch.where(skip, dst, src.to(dst.dtype)))


def _write(
    dst: torch.Tensor, src32: torch.Tensor, rounding: Rounding, key: int, offset: int, skip: torch.Tensor | None
) -> None:
    """Stores float32 ``src32`` into ``dst`` (a slice), rounding stochastically when half."""
    if dst.dtype != torch.float32 and rounding == "stochastic":
        bits = random_bits(key, offset, src32.numel(), device=src32.device)
        src32 = round_with_bits(src32, dst.dtype, bits)
    masked_copy_(dst, src32, skip)


def apply_update_(
    s: TensorStep,
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> None:
    """One AdamW step on one tensor, in place, on the PyTorch path (chunks of ``chunk_size`` elements).

    Args:
        s: The tensor, its state and hyperparameters.
        grad_mul: Multiplies the gradient first (an inverse loss scale), scalar or 0-dim tensor.
        found_inf: Optional 1-element flag tensor, never read on the host: where nonzero every
            store is masked and nothing changes.
        chunk_size: Elements per chunk; default ``CPU_CHUNK`` on the CPU, ``DEVICE_CHUNK`` elsewhere.
    """
    param = s.param if s.param.is_contiguous() else s.param.contiguous()
    skip = _skip_mask(found_inf)
    if chunk_size is None:
        chunk_size = CPU_CHUNK if param.device.type == "cpu" else DEVICE_CHUNK
    n = param.numel()
    p_flat = param.view(-1)
    g_flat = s.grad.reshape(-1)
    m_flat = s.exp_avg.view(-1)
    v_flat = s.exp_avg_sq.view(-1)
    w_flat = s.master.view(-1) if s.master is not None else None
    bias_correction1 = 1 - s.beta1**s.step
    bias_correction2_sqrt = math.sqrt(1 - s.beta2**s.step)
    step_size = s.lr / bias_correction1
    decay = 1 - s.lr * s.weight_decay
    key_p, key_m, key_v = s.keys
    # Unmasked, float32 storage (master, float32 param or state) is updated in place; masked, every
    # value is computed aside and written through masked_copy_.
    aside = skip is not None
    for start in range(0, n, chunk_size):
        chunk = slice(start, min(start + chunk_size, n))
        at = s.index_offset + start  # noise index of the chunk's first element
        g = g_flat[chunk].to(torch.float32)
        if grad_mul is not None:
            g = g * grad_mul
        w = (w_flat if w_flat is not None else p_flat)[chunk].to(torch.float32, copy=aside)
        m = m_flat[chunk].to(torch.float32, copy=aside)
        v = v_flat[chunk].to(torch.float32, copy=aside)
        if s.exp_avg_scales is not None:
            m.mul_(s.exp_avg_scales[0])
        if s.exp_avg_sq_scales is not None:
            v.mul_(s.exp_avg_sq_scales[0])

        w.mul_(decay)
        m.lerp_(g, 1 - s.beta1)
        v.mul_(s.beta2).addcmul_(g, g, value=1 - s.beta2)
        denom = (v.sqrt() / bias_correction2_sqrt).add_(s.eps)
        w.addcdiv_(m, denom, value=-step_size)
        if s.clamp is not None:
            w.clamp_(s.clamp[0], s.clamp[1])

        if s.exp_avg_scales is not None:
            m.div_(s.exp_avg_scales[1])
        if s.exp_avg_sq_scales is not None:
            v.div_(s.exp_avg_sq_scales[1])
        _write(m_flat[chunk], m, s.state_rounding, key_m, at, skip)
        _write(v_flat[chunk], v, s.state_rounding, key_v, at, skip)
        if w_flat is not None:
            if aside:
                masked_copy_(w_flat[chunk], w, skip)
            masked_copy_(p_flat[chunk], w, skip)  # the nearest copy of the master
        elif param.dtype != torch.float32 or aside:
            _write(p_flat[chunk], w, s.weight_rounding, key_p, at, skip)
    if param is not s.param:
        s.param.copy_(param)


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
    found_inf: torch.Tensor | None = None,
    index_offset: int = 0,
) -> None:
    """One AdamW step on one tensor, in place, processed in chunks of ``chunk_size`` elements.

    The reference definition of the update: :func:`apply_update_` on the :class:`TensorStep` of these
    arguments (see its attributes: every argument of that name means the same here).

    Args:
        grad_mul: Multiplies the gradient first (an inverse loss scale), scalar or 0-dim tensor.
        chunk_size: Elements per chunk; default ``CPU_CHUNK`` on the CPU, ``DEVICE_CHUNK`` elsewhere.
        found_inf: Optional 1-element flag tensor (not read on the host): nonzero masks every store.
        index_offset: Noise index of element 0 (default 0).
    """
    spec = TensorStep(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, keys=keys, master=master, exp_avg_scales=exp_avg_scales,
        exp_avg_sq_scales=exp_avg_sq_scales, weight_rounding=weight_rounding, state_rounding=state_rounding,
        clamp=clamp, index_offset=index_offset,
    )
    apply_update_(spec, grad_mul=grad_mul, found_inf=found_inf, chunk_size=chunk_size)
