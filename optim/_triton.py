"""The one place Triton is imported, and the one policy for running Triton kernels.

Used by the optimizer kernel (:mod:`optim.triton_kernel`) and by the recipe's fused loss kernels
(``recipe.loss.fused``), so that both answer "can the kernels run, and how" the same way:

* Triton is imported on first use (``import optim`` never imports it).
* ``TRITON_INTERPRET=1`` makes Triton decorate kernels as interpreted functions that run on CPU
  tensors (numpy); it is read when a kernel is decorated, i.e. when the module defining it is
  imported. On a machine without a CUDA device compiled kernels cannot run at all, so when the
  variable is unset there it is set to ``1`` before the first import (the interpreter is the only
  way the kernels can run; it is slow and meant for tests). An explicit value is always respected
  (``TRITON_INTERPRET=0`` compiles, e.g. to inspect sm_90 code on a machine without a GPU).
* A broken or missing Triton makes :func:`load` return ``(None, None)`` and
  :func:`unavailable_reason` say why; callers raise their own error naming the feature.
"""

from __future__ import annotations

import os
from typing import Any

import torch

__all__ = ["load", "is_available", "unavailable_reason", "interpreting"]

_LOADED: tuple[Any, Any] | None = None
_ERROR: Exception | None = None


def load() -> tuple[Any, Any]:
    """``(triton, triton.language)``, or ``(None, None)`` when Triton cannot be imported."""
    global _LOADED, _ERROR
    if _LOADED is None:
        if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"  # see the module docstring
        try:
            import triton
            import triton.language as tl

            _LOADED = (triton, tl)
        except Exception as exc:  # ImportError, or a broken install
            _LOADED, _ERROR = (None, None), exc
    return _LOADED


def is_available() -> bool:
    """Whether Triton imports (kernels can be built)."""
    return load()[0] is not None


def unavailable_reason() -> str:
    """Why Triton is not usable ("" when it is)."""
    load()
    return "" if _ERROR is None else f"{type(_ERROR).__name__}: {_ERROR}"


def interpreting(kernel: Any) -> bool:
    """Whether ``kernel`` (a ``@triton.jit`` function) was decorated under ``TRITON_INTERPRET=1``
    and therefore runs on CPU tensors; False when Triton is unavailable."""
    if kernel is None or not is_available():
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(kernel, InterpretedFunction)
