"""The per-tensor metadata rows both multi-tensor kernels read, and the host code that fills them.

The fused GPU kernel (:mod:`optim.triton_kernel`, device code in :mod:`optim._sradamw_jit`) and the CPU
kernel (:mod:`optim._cpu_kernel`, C++ in ``optim/csrc/sradamw_cpu.cpp``) update many tensors per call.
Each tensor of a call has one *row* of int64 words: the :class:`Word` part (addresses, length, noise
index and key words), then the :class:`Slot` part (the float32 hyperparameters of
:func:`optim.functional.hyperparameters`, two per word). The layout is defined here once, by name;
the Triton kernel binds it as constexpr globals and the C++ kernel receives it as preprocessor
definitions generated from these enums, so neither spells a position.

Tensors share a call when they share a *specialisation* (:func:`specialisation`: storage dtypes,
master form, state scales, rounding modes, gradient multiplier, clamp), which both kernels compile
as constants. Imports torch only (no Triton).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any

import torch

from .functional import HYPERPARAMETERS, TensorStep, hyperparameters, key_pair
from .rounding import key_words_tensor

__all__ = [
    "Word", "Slot", "Kind", "Master", "INT_WORDS", "ROW_WORDS", "KIND", "check", "validate", "specialisation",
    "metadata", "call_arguments", "prepare", "copy_back",
]


class Word(IntEnum):
    """The int64 words of a metadata row."""

    # the words that stay from step to step (a step plan writes them once: optim._plan)
    P = 0  # address of the parameter
    M = 1  # address of exp_avg
    V = 2  # address of exp_avg_sq
    MASTER = 3  # address of the float32 master, or of the int16 low halves of a split one (0: none)
    M_SCALE_OLD = 4  # addresses of exp_avg's (old, new) 0-dim float32 state scales (0: none)
    M_SCALE_NEW = 5
    V_SCALE_OLD = 6  # the same for exp_avg_sq
    V_SCALE_NEW = 7
    NUMEL = 8  # number of elements
    NOISE_BASE = 9  # noise index of element 0
    # the words that change every step, adjacent to each other and to the float slots after them
    G = 10  # address of the gradient
    A_P = 11  # key words (optim.rounding.key_words) of the weight's noise key, in [0, 2**32)
    B_P = 12
    A_S = 13  # the same for the statistics' key (high half of its hash: exp_avg, low half: exp_avg_sq)
    B_S = 14


#: The float32 hyperparameters after the :class:`Word` part, by the names (and in the order) of
#: ``optim.functional.HYPERPARAMETERS``, rounded there.
Slot = IntEnum("Slot", {name.upper(): i for i, name in enumerate(HYPERPARAMETERS)})

INT_WORDS = len(Word)
ROW_WORDS = INT_WORDS + (len(Slot) + 1) // 2  # the float part padded to whole words


class Kind(IntEnum):
    """Storage dtype codes of the kernels' ``*_KIND`` constants."""

    F32 = 0
    BF16 = 1
    F16 = 2


class Master(IntEnum):
    """Codes of the kernels' ``MASTER`` constant."""

    NONE = 0
    F32 = 1  # a float32 master; the parameter gets its round-to-nearest-even copy
    SPLIT = 2  # bfloat16 parameter = high half, int16 state = low half (optim.master16)


KIND = {torch.float32: Kind.F32, torch.bfloat16: Kind.BF16, torch.float16: Kind.F16}
_ROUNDINGS = ("stochastic", "nearest")
_KEY_WORDS = [int(Word.A_P), int(Word.B_P), int(Word.A_S), int(Word.B_S)]  # weight (a, b), statistics (a, b)


def call_arguments(
    grad_mul: torch.Tensor | float | None, found_inf: torch.Tensor | None,
    place: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[int, float, torch.Tensor | None, torch.Tensor | None]:
    """A kernel call's per-call arguments, checked: ``(gmul_mode, gmul_value, gmul_tensor, skip)``.
    ``gmul_mode`` 0: no multiplier, 1: the float ``gmul_value`` in the rows' ``grad_mul`` slot, 2: the
    1-element tensor ``gmul_tensor``; ``skip``: ``found_inf`` or None. ``place`` puts a 1-element tensor
    where the kernel reads it (float32 ``[1]``, never read on the host)."""
    gmul_mode, gmul_value, gmul_tensor = 0, 1.0, None
    if isinstance(grad_mul, torch.Tensor):
        if grad_mul.numel() != 1:
            raise ValueError("grad_mul must be a scalar or a 1-element tensor")
        gmul_mode, gmul_tensor = 2, place(grad_mul)
    elif grad_mul is not None:
        gmul_mode, gmul_value = 1, float(grad_mul)
    skip = None
    if found_inf is not None:
        if not isinstance(found_inf, torch.Tensor) or found_inf.numel() != 1:
            raise ValueError("found_inf must be a 1-element tensor")
        skip = place(found_inf)
    return gmul_mode, gmul_value, gmul_tensor, skip


def prepare(s: TensorStep, states_checked: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(param, grad)`` of one row, checked (:func:`check`) and contiguous (a non-contiguous parameter
    is updated through a copy: :func:`copy_back`)."""
    grad = s.grad.detach()
    check(s, grad, states_checked)
    param = s.param if s.param.is_contiguous() else s.param.contiguous()
    return param, grad if grad.is_contiguous() else grad.contiguous()


def copy_back(items: Sequence[tuple[TensorStep, torch.Tensor, torch.Tensor]]) -> None:
    """Writes the updated copies of non-contiguous parameters back (:func:`prepare`)."""
    for s, param, _ in items:
        if param is not s.param:
            s.param.copy_(param)


def check(s: TensorStep, grad: torch.Tensor, states_checked: bool) -> None:
    """The per-call check of one tensor: everything (:func:`validate`), or with ``states_checked``
    (SRAdamW checked its states, roundings and clamp once, when it created or loaded them) only what
    can change between steps: the gradient, and the sizes every address of the row depends on. Any
    doubt falls through to :func:`validate`, which names the problem."""
    if states_checked:
        p = s.param
        n = p.numel()
        if (grad.dtype in KIND and grad.numel() == n and grad.device == p.device and s.exp_avg.numel() == n
                and s.exp_avg_sq.numel() == n and (s.master is None or s.master.numel() == n)):
            return
    validate(s)


def validate(s: TensorStep) -> None:
    """Raises ``ValueError`` on dtypes, sizes, devices, layouts or options the kernels cannot take."""
    p = s.param
    n, device = p.numel(), p.device
    named = (("param", p), ("grad", s.grad), ("exp_avg", s.exp_avg), ("exp_avg_sq", s.exp_avg_sq), ("master", s.master))
    for name, t in named:
        if t is None:
            continue
        if name == "master" and not (t.dtype == torch.float32 or (t.dtype == torch.int16 and p.dtype == torch.bfloat16)):
            raise ValueError(f"master: dtype {t.dtype} is not supported (float32, or int16 low halves with a "
                             "bfloat16 param)")
        if name != "master" and t.dtype not in KIND:
            raise ValueError(f"{name}: dtype {t.dtype} is not supported (float32, bfloat16 or float16)")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, param on {device}")
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, param {n}")
        if name in ("exp_avg", "exp_avg_sq", "master") and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, sc in (("exp_avg_scales", s.exp_avg_scales), ("exp_avg_sq_scales", s.exp_avg_sq_scales)):
        if sc is None:
            continue
        if isinstance(sc, torch.Tensor):  # one [2] tensor (old, new), as SRAdamW hands them
            ok = sc.shape == (2,) and sc.dtype == torch.float32 and sc.device == device
        else:
            ok = len(sc) == 2 and all(isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.numel() == 1
                                      and x.device == device for x in sc)
        if not ok:
            raise ValueError(f"{name} must be two 1-element float32 tensors on the param's device")
    if s.weight_rounding not in _ROUNDINGS or s.state_rounding not in _ROUNDINGS:
        bad = "weight_rounding" if s.weight_rounding not in _ROUNDINGS else "state_rounding"
        raise ValueError(f"{bad} must be 'stochastic' or 'nearest', got {getattr(s, bad)!r}")
    if s.clamp is not None and not (len(s.clamp) == 2 and float(s.clamp[0]) <= float(s.clamp[1])):
        raise ValueError(f"clamp must be None or a (min, max) pair with min <= max, got {s.clamp!r}")
    if s.index_offset < 0 or s.index_offset + n > 1 << 63:
        raise ValueError(f"index_offset {s.index_offset} out of range")


def specialisation(s: TensorStep, grad: torch.Tensor, gmul_mode: int, **extra: Any) -> tuple[tuple[str, Any], ...]:
    """The kernels' compile-time constants for one tensor, as ``(name, value)`` pairs in a fixed order
    (tensors with equal ones share a call). ``gmul_mode``: 0 no gradient multiplier, 1 the row's
    ``grad_mul`` slot, 2 a float32 scalar in memory. ``extra``: kernel-specific constants (the Triton
    kernel's pointer alignment)."""
    master = s.master.dtype if s.master is not None else None
    return _specialisation(s.param.dtype, grad.dtype, s.exp_avg.dtype, s.exp_avg_sq.dtype, master,
                           s.exp_avg_scales is not None, s.exp_avg_sq_scales is not None, s.weight_rounding,
                           s.state_rounding, gmul_mode, s.clamp is not None, tuple(extra.items()))


@functools.lru_cache(maxsize=256)
def _specialisation(p_dt, g_dt, m_dt, v_dt, master_dt, scale_m, scale_v, weight_rounding, state_rounding, gmul_mode,
                    clamp, extra) -> tuple[tuple[str, Any], ...]:
    p_half = p_dt != torch.float32
    master_code = Master.NONE if master_dt is None else (Master.SPLIT if master_dt == torch.int16 else Master.F32)
    return tuple(
        dict(
            P_KIND=KIND[p_dt],
            G_KIND=KIND[g_dt],
            M_KIND=KIND[m_dt],
            V_KIND=KIND[v_dt],
            MASTER=int(master_code),
            SCALE_M=scale_m,
            SCALE_V=scale_v,
            SR_P=p_half and master_dt is None and weight_rounding == "stochastic",
            SR_M=m_dt != torch.float32 and state_rounding == "stochastic",
            SR_V=v_dt != torch.float32 and state_rounding == "stochastic",
            GMUL=gmul_mode,
            CLAMP=clamp,
            **dict(extra),
        ).items()
    )


_ADDRESS_WORDS = (int(Word.P), int(Word.G), int(Word.M), int(Word.V), int(Word.MASTER))
_M_OLD, _M_NEW = int(Word.M_SCALE_OLD), int(Word.M_SCALE_NEW)
_V_OLD, _V_NEW = int(Word.V_SCALE_OLD), int(Word.V_SCALE_NEW)
_NUMEL, _NOISE_BASE = int(Word.NUMEL), int(Word.NOISE_BASE)


def _int_words(s: TensorStep, param: torch.Tensor, grad: torch.Tensor) -> list[int]:
    """The :class:`Word` part of one row (the key words are filled for the whole table at once)."""
    row = [0] * INT_WORDS
    for word, t in zip(_ADDRESS_WORDS, (param, grad, s.exp_avg, s.exp_avg_sq, s.master)):
        if t is not None:
            row[word] = t.data_ptr()
    for (old, new), scales in (((_M_OLD, _M_NEW), s.exp_avg_scales), ((_V_OLD, _V_NEW), s.exp_avg_sq_scales)):
        if isinstance(scales, torch.Tensor) and scales.is_contiguous():  # float32 [2]: old, then new
            row[old] = scales.data_ptr()
            row[new] = row[old] + 4
        elif scales is not None:
            row[old], row[new] = scales[0].data_ptr(), scales[1].data_ptr()
    row[_NUMEL] = param.numel()
    row[_NOISE_BASE] = int(s.index_offset)
    return row


def _float_slots(s: TensorStep, grad_mul: float) -> list[float]:
    """The :class:`Slot` part of one row: :func:`optim.functional.hyperparameters`, padded to whole words."""
    hp = hyperparameters(s, grad_mul)
    return [hp[name] for name in HYPERPARAMETERS] + [0.0] * (len(Slot) % 2)


def metadata(items: Sequence[tuple[TensorStep, torch.Tensor, torch.Tensor]], grad_mul: float) -> torch.Tensor:
    """The host metadata table of one call: int64 ``[len(items), ROW_WORDS]`` (CPU). ``items``:
    ``(step, contiguous param, contiguous grad)``; ``grad_mul``: the value of the ``grad_mul`` slot."""
    ints: list[int] = []
    for s, param, grad in items:
        ints += _int_words(s, param, grad)
    ints_t = torch.tensor(ints, dtype=torch.int64).view(len(items), INT_WORDS)
    keys = torch.stack([s.keys if isinstance(s.keys, torch.Tensor) and s.keys.dtype == torch.int64
                        and s.keys.shape == (2,) else key_pair(s.keys) for s, _, _ in items])  # [tensors, 2]
    (a_p, b_p), (a_s, b_s) = key_words_tensor(keys[:, 0]), key_words_tensor(keys[:, 1])
    ints_t[:, _KEY_WORDS] = torch.stack([a_p, b_p, a_s, b_s], 1)  # weight (a, b), statistics (a, b)
    # the float slots: one row per distinct set of hyperparameters (a group's tensors share one)
    rows: dict[tuple, int] = {}
    unique: list[list[float]] = []
    which = []
    for s, _, _ in items:
        key = (s.lr, s.weight_decay, s.beta1, s.beta2, s.eps, s.step, tuple(s.clamp) if s.clamp is not None else None)
        i = rows.get(key)
        if i is None:
            i = rows[key] = len(unique)
            unique.append(_float_slots(s, grad_mul))
        which.append(i)
    floats = torch.tensor(unique, dtype=torch.float32)
    floats = floats.expand(len(items), -1) if len(unique) == 1 else floats[torch.tensor(which)]
    return torch.cat([ints_t, floats.view(torch.int64)], dim=1).contiguous()
