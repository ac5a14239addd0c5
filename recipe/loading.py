"""A trained run's model for use in Python: ``recipe.load(run_dir)``.

Usage::

    import torch, recipe
    from PIL import Image

    model, tokenizer, preprocess = recipe.load("runs/demo")      # the newest complete checkpoint
    with torch.no_grad():
        image = model.encode_image(preprocess(Image.open("cat.png")).unsqueeze(0))   # [1, D], L2-normalised
        text = model.encode_text(**tokenizer(["a red circle", "a blue square"]))      # [2, D], L2-normalised
        probs = (model.logit_scale.exp() * image @ text.T).softmax(dim=-1)

What it loads is what ``python -m recipe.export`` writes (:func:`recipe.export.run.load_run`): with
``weights="master"`` (the default) the optimizer's fp32 masters where it keeps them (the image tower and the
logit scale by default), the module weights (whose fp32 upcast is exact) elsewhere; ``weights="module"``
the checkpoint's module weights as the run trained and evaluated with; ``ema=True`` its EMA weights. The
model is the recipe's own :class:`recipe.model.CLIP` in evaluation mode, on any tower pair (open_clip and
Hugging Face take only some): with ``weights="module"`` its embeddings are the run's evaluation's, and an
export made with the same ``--weights`` gives its embeddings on the same inputs (tested). ``preprocess`` is the run's evaluation transform (timm's:
resize the shorter side to ``floor(size / crop_pct)``, centre crop, normalise) for one PIL image;
``tokenizer`` pads and truncates to the run's context length and keeps the end-of-text token.
"""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import torch

from .model.clip import CLIP
from .model.tokenizer import Tokenizer

__all__ = ["Loaded", "load"]


class Loaded(NamedTuple):
    """What :func:`load` returns; unpacks as ``model, tokenizer, preprocess`` (open_clip's order).

    Attributes:
        model: The :class:`recipe.model.CLIP` in evaluation mode, on the CPU:
            ``encode_image(pixels [B, 3, H, W])`` and ``encode_text(input_ids, attention_mask)`` give
            L2-normalised ``[B, embed_dim]`` embeddings (``normalize=False`` for the projections);
            ``logit_scale.exp()`` is the trained temperature.
        tokenizer: The run's :class:`recipe.model.tokenizer.Tokenizer`: ``tokenizer(texts)`` gives
            ``{"input_ids", "attention_mask"}`` tensors ``[B, context_length]`` for ``model.encode_text(**...)``.
        preprocess: The run's evaluation pipeline: a PIL image (any size and mode; converted to RGB as the
            evaluation does) to a normalised ``[3, H, W]`` float tensor.
    """

    model: CLIP
    tokenizer: Tokenizer
    preprocess: Callable[[Any], torch.Tensor]


def load(
    run_dir: str | os.PathLike,
    weights: str | None = "master",
    *,
    ema: bool = False,
    dtype: torch.dtype | str = torch.float32,
) -> Loaded:
    """Loads a recipe run's model, tokenizer and image preprocessing for inference.

    Args:
        run_dir: A run directory (its ``latest`` complete checkpoint), its ``checkpoints/`` directory, or
            one checkpoint directory (``RUN/checkpoints/step00000400``).
        weights: ``"master"``: the optimizer's fp32 masters where it keeps them, the module weights
            elsewhere (what ``python -m recipe.export`` writes by default; reading them needs ``deepspeed``
            importable, no process group); ``"module"``: the checkpoint's module weights alone (what the run
            evaluated with); None: ``"master"``, or ``"module"`` with ``ema``.
        ema: The checkpoint's EMA weights (runs trained with ``--ema-decay``); they have no master, so
            ``weights`` must be ``"module"`` or None.
        dtype: The model's dtype: a ``torch.dtype`` or ``"fp32"``, ``"bf16"``, ``"fp16"`` (masters are
            rounded to nearest in a half dtype). ``preprocess`` gives fp32 pixels: cast them to match.

    Returns:
        ``Loaded(model, tokenizer, preprocess)``.

    Raises:
        FileNotFoundError: The directory, its ``model_config.json`` or its tokenizer is missing.
        ValueError: Unknown ``weights`` or ``dtype``, or ``weights="master"`` with ``ema``.
        recipe.run.checkpoint.CheckpointError: No complete checkpoint there, or an unreadable one.
    """
    from .data.decode import build_transform
    from .export.run import load_run, parse_dtype

    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    run = load_run(run_dir, dtype=dtype, ema=ema, weights=weights or ("module" if ema else "master"))
    model = run.model.eval()
    return Loaded(model, run.tokenizer, _Preprocess(build_transform(model.image_data_config(), train=False)))


class _Preprocess:
    """A PIL image -> RGB -> ``transform`` (what :class:`recipe.data.decode.PILPipeline` does to an evaluation
    image)."""

    def __init__(self, transform: Callable[[Any], torch.Tensor]) -> None:
        self.transform = transform

    def __call__(self, image: Any) -> torch.Tensor:
        return self.transform(image.convert("RGB"))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(convert('RGB'), {self.transform!r})"
