"""CLIP training recipe: sharded contrastive loss, encoders, data and the DeepSpeed train loop.

``recipe.load(run_dir)`` gives a trained run's model, tokenizer and image preprocessing
(:func:`recipe.loading.load`); it is imported on first use, so ``import recipe`` stays light.
"""

from __future__ import annotations

from typing import Any

__all__ = ["load", "Loaded"]


def __getattr__(name: str) -> Any:  # PEP 562: recipe.load / recipe.Loaded without importing torch up front
    if name in __all__:
        from . import loading

        return getattr(loading, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
