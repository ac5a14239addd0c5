"""The two-tower CLIP model with its towers and tokenizer: ``clip`` (:class:`CLIP`, its config dataclasses,
presets and :func:`create_model`), ``encoders`` (transformers text towers, poolers; the image tower re-exported),
``image_tower`` (timm image towers) and ``tokenizer`` (offline BPE and local tokenizers).

``from recipe.model import create_model`` (and the other names of ``clip``) keeps working: they are read from
:mod:`recipe.model.clip` on first use, so importing ``recipe.model.tokenizer`` alone loads no model code.
"""

from __future__ import annotations

from typing import Any

#: What ``from recipe.model import ...`` gives: :mod:`recipe.model.clip`'s ``__all__`` and the OpenAI normalisation.
__all__ = ["ImageTowerConfig", "TextTowerConfig", "CLIPConfig", "CLIP", "PRESETS", "create_model",
           "keep_batchnorm_fp32", "check_tokenizer_fits", "OPENAI_CLIP_MEAN", "OPENAI_CLIP_STD"]


def __getattr__(name: str) -> Any:  # PEP 562: the names of recipe.model.clip without importing torch up front
    if name in __all__:
        from . import clip

        return getattr(clip, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
