"""The CPU fast path: :func:`optim.functional.update_block_` compiled by ``torch.compile`` into one loop.

The eager PyTorch path runs the update as ~60 element-wise passes over memory (the noise hash and the
rounding are integer operations); Inductor fuses the same function into one vectorised C++ loop per
dtype route. The function is the definition itself, so the results are the eager path's bit for bit
(tests/optim/test_compiled.py): every per-step value (hyperparameters, key words, noise index,
scales, skip flag) is a tensor argument, so one compilation per route serves every tensor and step
(the tensor length is dynamic); Inductor on the CPU rounds every float32 product and sum separately,
as the definition does, and its vector square root is the IEEE one.

``torch.compile`` needs a C++ compiler; :func:`available` says whether compiling works here (tried
once, on a tiny tensor) and :func:`unavailable_reason` why not. ``SRAdamW`` then falls back to the
eager path.
"""

from __future__ import annotations

import threading
import types
from collections.abc import Sequence
from typing import Any

import torch

from .functional import (
    _M32,
    HYPERPARAMETERS,
    TensorStep,
    _skip_mask,
    apply_update_,
    lo_tensor,
    rounding_flags,
    segment_words,
    segments,
    step_tensors,
    update_block_,
    words_table,
)

__all__ = ["compiled_updates_", "available", "unavailable_reason"]

#: One call handles up to this many elements (the noise index's low half must not wrap inside it).
MAX_BLOCK = 1 << 31
#: Elements per call for a split master (its int32 widening is a temporary of 4 bytes per element).
SPLIT_BLOCK = 1 << 22
#: Elements of the dummy tensors a route is first compiled on (see :func:`_prime`).
_PRIME = 1 << 20

_FNS: dict[tuple, Any] = {}
_ERROR: str | None = None
_LOCK = threading.Lock()


def _compiled(route: tuple) -> Any:
    """The compiled update of one route (dtypes and flags). Each route gets its own copy of the
    function's code object, so Dynamo's per-code recompilation limit counts routes separately (one
    shared code object would hit it after eight routes) and no global Dynamo setting is changed."""
    fn = _FNS.get(route)
    if fn is None:
        with _LOCK:
            fn = _FNS.get(route)
            if fn is None:
                code = update_block_.__code__.replace(co_name=f"update_block_{len(_FNS)}")
                copy = types.FunctionType(code, update_block_.__globals__, code.co_name,
                                          update_block_.__defaults__, update_block_.__closure__)
                copy.__kwdefaults__ = update_block_.__kwdefaults__
                fn = torch.compile(copy, dynamic=True, fullgraph=True)
                _prime(fn, route)
                _FNS[route] = fn
    return fn


def _prime(fn: Any, route: tuple) -> None:
    """Compiles ``fn`` for ``route`` on dummy tensors of :data:`_PRIME` elements (the skip flag set:
    nothing is stored). Inductor decides whether a loop runs on several threads from the size of the
    first example it sees; a route first met on a 5-element bias would otherwise stay single-threaded
    for every tensor after it (the length is dynamic, so the same code serves all sizes)."""
    p_dt, g_dt, m_dt, v_dt, w_dt, no_ms, no_vs, no_gmul, no_skip, sr_p, sr_m, sr_v, clamp = route
    zeros = [torch.zeros(_PRIME, dtype=dt) if dt is not None else None for dt in (p_dt, g_dt, m_dt, v_dt, w_dt)]
    # a fresh tensor per argument: Dynamo guards on which arguments are the same object, and the real
    # calls never pass one tensor twice (a shared dummy recompiled the route at its first real call,
    # on a small tensor, and that entry stayed single-threaded)
    fn(*zeros, torch.zeros(len(HYPERPARAMETERS)), torch.zeros(4, dtype=torch.int32),
       torch.zeros((), dtype=torch.int32), None if no_ms else torch.ones(2), None if no_vs else torch.ones(2),
       None if no_gmul else torch.ones(()), None if no_skip else torch.ones((), dtype=torch.bool),
       sr_p, sr_m, sr_v, clamp)


def available() -> bool:
    """Whether ``torch.compile`` builds the update on this machine (checked once, on the bf16 route)."""
    global _ERROR
    if _ERROR is None:
        try:
            p = torch.zeros(16, dtype=torch.bfloat16)
            s = TensorStep(p, torch.ones_like(p), torch.zeros_like(p), torch.zeros_like(p), step=1, lr=1e-3,
                           beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, keys=(1, 2))
            compiled_updates_([s])
            _ERROR = ""
        except Exception as exc:  # noqa: BLE001 - no compiler, unsupported platform...
            _ERROR = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
    return _ERROR == ""


def unavailable_reason() -> str:
    """Why the compiled path cannot run here ("" when it can)."""
    available()
    return _ERROR or ""


def compiled_updates_(
    specs: Sequence[TensorStep],
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
) -> None:
    """Applies one step to each tensor with the compiled update (CPU tensors)."""
    skip = _skip_mask(found_inf)
    table = words_table(specs) if specs else None  # the key words of all tensors at once (index high half 0)
    for i, s in enumerate(specs):
        if s.param.numel() <= 1:
            # Dynamo specialises lengths 0 and 1: a 1-element tensor (CLIP's logit scale) would compile
            # the route a second time (~10 s); the eager definition computes the same bits
            apply_update_(s, grad_mul=grad_mul, found_inf=found_inf)
            continue
        param = s.param if s.param.is_contiguous() else s.param.contiguous()
        device = param.device
        hp, m_scales, v_scales, gmul = step_tensors(s, grad_mul, device)
        sr_p, sr_m, sr_v = rounding_flags(s)
        # detached 1-D views (the same storage): every call then looks alike to Dynamo's guards
        flat = [t.detach().reshape(-1) if t is s.grad else (t.detach().view(-1) if t is not None else None)
                for t in (param, s.grad, s.exp_avg, s.exp_avg_sq, s.master)]
        route = (*(t.dtype if t is not None else None for t in flat), m_scales is None, v_scales is None,
                 gmul is None, skip is None, sr_p, sr_m, sr_v, s.clamp is not None)
        split = flat[4] is not None and flat[4].dtype == torch.int16
        if split:  # int16 master halves enter the loop widened to int32 (Inductor keeps int16 scalar)
            route = (*route[:4], torch.int32, *route[5:])
        fn = _compiled(route)
        for start, length in segments(s.index_offset, param.numel(), SPLIT_BLOCK if split else MAX_BLOCK):
            at = s.index_offset + start
            words = table[i] if at >> 32 == 0 else segment_words(s.keys, at >> 32)
            lo0 = lo_tensor(at & _M32, device)
            whole = start == 0 and length == param.numel()
            block = flat if whole else [t[start:start + length] if t is not None else None for t in flat]
            if split:
                low = block[4]
                block = [*block[:4], low.to(torch.int32)]
            fn(*block, hp, words, lo0, m_scales, v_scales, gmul, skip, sr_p, sr_m, sr_v, s.clamp is not None)
            if split:
                low.copy_(block[4])  # exact: the values are in int16's range
        if param is not s.param:
            s.param.copy_(param)
