"""Functional AdamW step with stochastic rounding: the definition, and its PyTorch implementations.

A :class:`TensorStep` holds everything one tensor's update needs (its tensors, step, hyperparameters,
noise keys, float16 state scales). :func:`apply_update_` applies one on the PyTorch path (the
reference definition, chunked eager ops); ``optim._cpu_kernel`` applies the same function element for
element in one C++ loop on the CPU (the CPU fast path) and ``optim.triton_kernel.sradamw_fused_`` a list of them
with the fused GPU kernel. All three compute the same bits.

The update, in IEEE float32 arithmetic whatever the storage dtypes: every operation below is one
correctly rounded float32 operation (no fused multiply-add: a CPU compiler, the Triton kernel and the
eager ops all round each product and sum separately; the square root is correctly rounded):

    g  = g * grad_mul                                  (an inverse loss scale, when given)
    w  = w * decay                                     decay = 1 - lr * weight_decay
    m  = m * beta1 + g * (1 - beta1)
    v  = v * beta2 + (g * g) * (1 - beta2)
    w  = w + (m * neg_step) / (sqrt(v) + eps_hat)

with ``neg_step = -lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` and ``eps_hat = eps * sqrt(1 - beta2**t)``
(the bias corrections folded into the scalars, as in the Adam paper's efficient form): each
hyperparameter is computed in float64 on the host and rounded once to float32
(:func:`hyperparameters`). The result equals ``torch.optim.AdamW`` in float32 to a few ulps (torch
uses lerp, addcmul and two divisions; the definition here has one square root and one division, so
the fused kernel stays cheap). Then ``w``, ``m`` and ``v`` are written back to their storage dtypes: float32 exactly, half
precision with stochastic rounding (or round-to-nearest when asked). The noise: per element one
32-bit hash under the statistics key (high half rounds ``m``, low half ``v``) and one under the weight
key (:mod:`optim.rounding`). float16 Adam statistics are stored divided by a per-tensor power-of-two
scale so that tiny gradients do not underflow; the scale follows an upper bound of the statistic that
is updated from the gradient's absolute maximum alone, so the element-wise pass needs no second
reduction. With scales ``(old, new)`` the update works on the stored values with exact power-of-two
factors (``m = m * (beta1 * (old * (1 / new))) + g * ((1 - beta1) * (1 / new))``, the weight step
uses ``m * (neg_step * new)`` and ``sqrt(v * new_v)``): the same bits as scaling in and out around
the lines above wherever float32 stays in its normal range, with three products per element fewer.

Skipping on the device: ``found_inf`` may be a flag tensor that is never read on the host. Every
store is then masked (the stored tensors keep their bits where the flag is set), and the result is
bit-identical to the unmasked update where it is not.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

import torch

from .master16 import join_master, split_bits
from .rounding import (
    _GOLDEN,
    _M32,
    _as_i32,
    key_words_tensor,
    keyed_hash,
    round_with_bits,
)

__all__ = [
    "TensorStep",
    "apply_update_",
    "sradamw_update_",
    "masked_copy_",
    "state_scale",
    "hyperparameters",
    "update_block_",
    "HYPERPARAMETERS",
    "F16_STATE_TARGET_EXP",
    "STREAM_PARAM",
    "STREAM_STATE",
]

Rounding = Literal["stochastic", "nearest"]

#: float16 statistics are scaled so that their running bound maps to at most 2**14, leaving a factor
#: four of headroom below float16's largest finite value (65504).
F16_STATE_TARGET_EXP = 14

#: Elements per chunk of the eager PyTorch path. Chunks bound the temporaries whatever the tensor's
#: length; on the CPU a chunk that stays in cache is about twice as fast as one pass over a large
#: tensor. The noise is keyed by the global element index, so the chunk size never changes the result.
CPU_CHUNK = 1 << 18
DEVICE_CHUNK = 1 << 24

#: Noise streams: the weight, and the two statistics (one 32-bit hash: high half exp_avg, low half
#: exp_avg_sq).
STREAM_PARAM = 0
STREAM_STATE = 1

#: The float32 hyperparameters of one tensor's step, in this order (the fused kernel's row slots and
#: the compiled path's scalar vector use these names and this order).
HYPERPARAMETERS = (
    "decay", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps_hat", "neg_step", "grad_mul",
    "clamp_min", "clamp_max",
)


_HP = {name: i for i, name in enumerate(HYPERPARAMETERS)}  # position of each name in the ``hp`` vector


def _f32(x: float) -> float:
    """x rounded to float32 (round to nearest even)."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


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
        keys: Noise keys of the weight and the statistics streams, from ``derive_key`` (two ints, or an
            int64 tensor ``[2]``).
        master: Optional float32 master copy (contiguous); ``param`` then gets its nearest copy. Or,
            for a bfloat16 ``param``, the int16 low halves of an exact float32 master whose high
            half is ``param`` itself (:mod:`optim.master16`: 2 bytes instead of 4).
        exp_avg_scales: ``(old, new)`` float32 scales of a float16 ``exp_avg`` on its device (value =
            stored * scale): two 1-element tensors, or one ``[2]`` tensor.
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
    keys: tuple[int, int] | torch.Tensor
    master: torch.Tensor | None = None
    exp_avg_scales: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None
    exp_avg_sq_scales: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None
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


def hyperparameters(s: TensorStep, grad_mul: float = 1.0) -> dict[str, float]:
    """The step's float32 scalars by name (:data:`HYPERPARAMETERS`): computed in float64, rounded once.

    The one place where the hyperparameters are rounded; the eager path, the CPU kernel and the
    fused kernel's metadata rows all take them from here. Cached: the tensors of a group share them.
    """
    clamp = (float(s.clamp[0]), float(s.clamp[1])) if s.clamp is not None else None
    return _hyperparameters(float(s.lr), float(s.weight_decay), float(s.beta1), float(s.beta2), float(s.eps),
                            int(s.step), clamp, float(grad_mul))


@functools.lru_cache(maxsize=1024)
def _hyperparameters(lr: float, weight_decay: float, beta1: float, beta2: float, eps: float, step: int,
                     clamp: tuple[float, float] | None, grad_mul: float) -> dict[str, float]:
    values = {
        "decay": 1 - lr * weight_decay,
        "beta1": beta1,
        "one_minus_beta1": 1 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1 - beta2,
        "eps_hat": eps * math.sqrt(1 - beta2**step),
        "neg_step": -(lr * math.sqrt(1 - beta2**step) / (1 - beta1**step)),
        "grad_mul": grad_mul,
        "clamp_min": clamp[0] if clamp is not None else 0.0,
        "clamp_max": clamp[1] if clamp is not None else 0.0,
    }
    return MappingProxyType({k: _f32(values[k]) for k in HYPERPARAMETERS})


def key_pair(keys: tuple[int, int] | torch.Tensor) -> torch.Tensor:
    """A step's two noise keys (weight, statistics) as an int64 CPU tensor ``[2]``; ``SRAdamW`` passes
    them as such a tensor (derived for all tensors at once, never read back on the host)."""
    if isinstance(keys, torch.Tensor):
        return keys.reshape(2).to(torch.int64)
    return torch.tensor([int(k) & _M32 for k in keys], dtype=torch.int64)


def _sqrt_ieee(x: torch.Tensor) -> torch.Tensor:
    """Correctly rounded float32 square root on any build: via float64 (53 >= 2 * 24 + 2 bits, so the
    double rounding is exact). Eager float32 ``sqrt`` on some CPU builds is not correctly rounded."""
    return x.double().sqrt_().float()


def _scaled(beta: torch.Tensor, one_minus_beta: torch.Tensor, scales: torch.Tensor | None):
    """A statistic's ``(decay, gain, out)`` factors: ``stat = stat * decay + x * gain``, its value
    ``stat * out``. Unscaled: ``(beta, 1 - beta, None)``. Stored in float16 as value / scale with
    scales ``(old, new)``: ``(beta * (old * (1 / new)), (1 - beta) * (1 / new), new)``, so the update
    works on the stored (scaled) values directly. The scales are powers of two, so each factor is
    exact and the scaled update equals the unscaled one divided by ``new``, bit for bit, wherever no
    float32 intermediate leaves the normal range (the kernel computes the factors the same way)."""
    if scales is None:
        return beta, one_minus_beta, None
    inv_new = 1.0 / scales[1]
    return beta * (scales[0] * inv_new), one_minus_beta * inv_new, scales[1]


def update_block_(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    master: torch.Tensor | None,
    hp: torch.Tensor,
    words: torch.Tensor,
    lo0: torch.Tensor,
    m_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    grad_mul: torch.Tensor | None,
    skip: torch.Tensor | None,
    sr_p: bool,
    sr_m: bool,
    sr_v: bool,
    clamp: bool,
) -> None:
    """The update of one block of elements, in place: the definition, as tensor operations.

    Runs eagerly on chunks (:func:`apply_update_`; the square root through float64, correctly rounded
    on any build: :func:`_sqrt_ieee`); the CPU kernel (``optim/csrc/sradamw_cpu.cpp``) and the Triton kernel
    (``optim._sradamw_jit``) compute it element for element. Every argument that changes per step is a
    tensor.

    Args:
        p, g, m, v: 1-D views of the weight, gradient and statistics (storage dtypes).
        master: 1-D float32 master (``p`` then gets its round-to-nearest copy), or 1-D int16 low halves
            of one whose high half is the bfloat16 ``p`` (:mod:`optim.master16`), or None.
        hp: float32 ``[len(HYPERPARAMETERS)]`` from :func:`hyperparameters`.
        words: int32 ``[4]``: the weight and statistics key words, the ``a`` words already combined
            with the high half of the block's element index (:func:`optim.rounding._segment_word`).
        lo0: int32 0-dim: the low 32 bits of the noise index of element 0 (the block never crosses a
            multiple of 2**32).
        m_scales, v_scales: float32 ``[2]`` (old, new) power-of-two scales of float16 statistics.
        grad_mul: float32 0-dim gradient multiplier or None.
        skip: 0-dim bool (True: store nothing) or None.
        sr_p, sr_m, sr_v: stochastic rounding of the weight and the two statistics.
        clamp: project the weight into ``[clamp_min, clamp_max]``.
    """
    f32 = torch.float32
    gf = g.to(f32)
    if grad_mul is not None:
        gf = gf * grad_mul
    split = master is not None and master.dtype == torch.int16  # the exact master in 2 bytes (optim.master16)
    if split:
        w = join_master(p, master)
    else:
        w = (master if master is not None else p).to(f32)
    mf, vf = m.to(f32), v.to(f32)
    m_decay, m_in, m_out = _scaled(hp[_HP["beta1"]], hp[_HP["one_minus_beta1"]], m_scales)
    v_decay, v_in, v_out = _scaled(hp[_HP["beta2"]], hp[_HP["one_minus_beta2"]], v_scales)
    w = w * hp[_HP["decay"]]
    mf = mf * m_decay + gf * m_in
    vf = vf * v_decay + (gf * gf) * v_in
    v_true = vf if v_out is None else vf * v_out
    w = w + (mf * (hp[_HP["neg_step"]] if m_out is None else hp[_HP["neg_step"]] * m_out)) / (
        _sqrt_ieee(v_true) + hp[_HP["eps_hat"]])
    if clamp:  # NaN stays NaN
        lo, hi = hp[_HP["clamp_min"]], hp[_HP["clamp_max"]]
        w = torch.where(w < lo, lo, torch.where(w > hi, hi, w))

    lo = None
    if sr_p or sr_m or sr_v:
        lo = torch.arange(g.numel(), dtype=torch.int32, device=g.device) + lo0  # wraps modulo 2**32
    if sr_m or sr_v:
        h = keyed_hash(lo, words[2], words[3])
        if sr_m:
            mf = round_with_bits(mf, m.dtype, h)  # the high 16 bits
        if sr_v:
            vf = round_with_bits(vf, v.dtype, h << 16)  # the low 16 bits
    masked_copy_(m, mf, skip)
    masked_copy_(v, vf, skip)
    if split:
        hi, low = split_bits(w)
        masked_copy_(master, low, skip)  # exact: low is in int16's range
        masked_copy_(p, hi, skip)  # nearest, ties away from zero: the high half
    elif master is not None:
        masked_copy_(master, w, skip)
        masked_copy_(p, w, skip)  # round to nearest
    else:
        if sr_p:
            w = round_with_bits(w, p.dtype, keyed_hash(lo, words[0], words[1]))
        masked_copy_(p, w, skip)


def step_tensors(
    s: TensorStep, grad_mul: torch.Tensor | float | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """``(hp, m_scales, v_scales, grad_mul)`` of :func:`update_block_` for one tensor's step."""
    gm = grad_mul if isinstance(grad_mul, (int, float)) else 1.0
    hp = _hp_tensor(tuple(hyperparameters(s, gm).values()), torch.device(device))
    gmul = None
    if isinstance(grad_mul, torch.Tensor):
        gmul = grad_mul.detach().reshape(()).to(device=device, dtype=torch.float32)
    elif grad_mul is not None:
        gmul = hp[_HP["grad_mul"]]
    return hp, _scale_pair(s.exp_avg_scales), _scale_pair(s.exp_avg_sq_scales), gmul


def _scale_pair(scales: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None) -> torch.Tensor | None:
    """float32 ``[2]`` (old, new) from either form :class:`TensorStep` accepts (no copy for a contiguous
    ``[2]`` tensor: ``SRAdamW`` hands the scales of all tensors as rows of one)."""
    if scales is None:
        return None
    if isinstance(scales, torch.Tensor) and scales.shape == (2,) and scales.is_contiguous():
        return scales
    return torch.stack([x.reshape(()) for x in scales])


#: Small read-only tensors the update reuses across calls (hyperparameter vectors, index scalars), by
#: key; bounded (the oldest entry goes first). :func:`cached_tensors` lists them (memory census).
_TENSOR_CACHE: dict[tuple, torch.Tensor] = {}
_TENSOR_CACHE_SIZE = 256


def _cached(key: tuple, make) -> torch.Tensor:
    t = _TENSOR_CACHE.get(key)
    if t is None:
        if len(_TENSOR_CACHE) >= _TENSOR_CACHE_SIZE:
            _TENSOR_CACHE.pop(next(iter(_TENSOR_CACHE)))
        t = _TENSOR_CACHE[key] = make()
    return t


def cached_tensors() -> list[torch.Tensor]:
    """The small tensors the update keeps between calls (a few bytes each; for memory accounting)."""
    return list(_TENSOR_CACHE.values())


def _hp_tensor(values: tuple[float, ...], device: torch.device) -> torch.Tensor:
    """The float32 ``hp`` vector of these hyperparameter values (cached: the tensors of a group share
    one per step; read only)."""
    return _cached(("hp", values, device), lambda: torch.tensor(values, dtype=torch.float32, device=device))


def lo_tensor(at: int, device: torch.device) -> torch.Tensor:
    """int32 0-dim: the low 32 bits of noise index ``at`` (the ``lo0`` of :func:`update_block_`;
    cached, read only)."""
    return _cached(("lo", at, device), lambda: torch.tensor(_as_i32(at & _M32), dtype=torch.int32, device=device))


def rounding_flags(s: TensorStep) -> tuple[bool, bool, bool]:
    """Whether the weight, ``exp_avg`` and ``exp_avg_sq`` are written with stochastic rounding."""
    sr_p = s.param.dtype != torch.float32 and s.master is None and s.weight_rounding == "stochastic"
    sr_m = s.exp_avg.dtype != torch.float32 and s.state_rounding == "stochastic"
    sr_v = s.exp_avg_sq.dtype != torch.float32 and s.state_rounding == "stochastic"
    return sr_p, sr_m, sr_v


def segment_words(keys: tuple[int, int] | torch.Tensor, hi: int) -> torch.Tensor:
    """int32 ``[4]`` (CPU) of :func:`update_block_`'s ``words`` for the elements whose noise index has
    high half ``hi``: ``[a_weight ^ hi * golden, b_weight, a_state ^ hi * golden, b_state]``; for
    keys ``[T, 2]`` (int64) the rows ``[T, 4]`` of all of them."""
    pairs = keys if isinstance(keys, torch.Tensor) and keys.dim() == 2 else key_pair(keys).reshape(1, 2)
    a, b = key_words_tensor(pairs)
    a = a ^ ((hi * _GOLDEN) & _M32)
    words = torch.stack([a[:, 0], b[:, 0], a[:, 1], b[:, 1]], 1)
    words = (((words + (1 << 31)) & _M32) - (1 << 31)).to(torch.int32)  # uint32 patterns as int32
    return words if pairs is keys else words[0]


def segments(offset: int, n: int, limit: int) -> list[tuple[int, int]]:
    """``(start, length)`` pieces of ``[0, n)`` of at most ``limit`` elements that never cross a
    multiple of 2**32 in the noise index ``offset + start``."""
    out, pos = [], 0
    while pos < n:
        lo = (offset + pos) & _M32
        length = min(n - pos, limit, (1 << 32) - lo)
        out.append((pos, length))
        pos += length
    return out


def apply_update_(
    s: TensorStep,
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    chunk_size: int | None = None,
) -> None:
    """One AdamW step on one tensor, in place, on the eager PyTorch path (the reference definition).

    Args:
        s: The tensor, its state and hyperparameters.
        grad_mul: Multiplies the gradient first (an inverse loss scale), scalar or 0-dim tensor.
        found_inf: Optional 1-element flag tensor, never read on the host: where nonzero every
            store is masked and nothing changes.
        chunk_size: Elements per chunk; default ``CPU_CHUNK`` on the CPU, ``DEVICE_CHUNK`` elsewhere.
    """
    param = s.param if s.param.is_contiguous() else s.param.contiguous()
    device = param.device
    skip = _skip_mask(found_inf)
    if chunk_size is None:
        chunk_size = CPU_CHUNK if device.type == "cpu" else DEVICE_CHUNK
    hp, m_scales, v_scales, gmul = step_tensors(s, grad_mul, device)
    sr_p, sr_m, sr_v = rounding_flags(s)
    flat = [t.reshape(-1) if t is s.grad else (t.view(-1) if t is not None else None)
            for t in (param, s.grad, s.exp_avg, s.exp_avg_sq, s.master)]
    for start, length in segments(s.index_offset, param.numel(), chunk_size):
        at = s.index_offset + start
        words = segment_words(s.keys, at >> 32).to(device)
        lo0 = lo_tensor(at & _M32, torch.device(device))
        chunk = [t[start:start + length] if t is not None else None for t in flat]
        update_block_(*chunk, hp, words, lo0, m_scales, v_scales, gmul, skip, sr_p, sr_m, sr_v,
                      s.clamp is not None)
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
    keys: tuple[int, int],
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
