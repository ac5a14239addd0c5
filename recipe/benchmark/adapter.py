"""A recipe model and tokenizer in CLIP_benchmark's terms, so that its own functions run on them.

CLIP_benchmark calls ``tokenizer(texts).to(device)``, ``model.encode_text(tokens)`` and
``model.encode_image(images)`` and normalises the features itself. The recipe's text tower also takes an
attention mask, so :class:`BenchmarkTokenizer` hands it the run's token ids and mask stacked in one tensor
(``[B, 2, L]``) that :class:`BenchmarkModel` splits again: the ids are the run's own tokenizer's, truncation
included (the end-of-text token kept). Features come back unnormalised in fp32, whatever the model's dtype.

:func:`check_prompts` says when the run's context is too short for a dataset's templates (the class name
would be cut off), :func:`check_tokenizer` the same for every classification dataset of a list, and
:func:`image_transform` is the run's evaluation transform (timm's, from the image tower's data config; grey
or RGBA images converted to RGB first, as open_clip's transform does).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from .datasets import BenchmarkError

__all__ = ["BenchmarkModel", "BenchmarkTokenizer", "PromptsTooLong", "prompts_of", "check_prompts", "check_tokenizer",
           "image_transform"]


class PromptsTooLong(BenchmarkError):
    """The run's tokenizer cannot encode a dataset's prompts within its context length."""


class BenchmarkTokenizer:
    """``tokenizer(texts) -> LongTensor[B, 2, L]``: the run's ``input_ids`` and ``attention_mask``."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def __call__(self, texts: str | Sequence[str]) -> torch.Tensor:
        out = self.tokenizer([texts] if isinstance(texts, str) else list(texts))
        return torch.stack([out["input_ids"], out["attention_mask"]], dim=1)


class BenchmarkModel(nn.Module):
    """A :class:`recipe.model.CLIP` with CLIP_benchmark's ``encode_image(images)`` and
    ``encode_text(tokens)`` (tokens from :class:`BenchmarkTokenizer`): unnormalised fp32 features."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def _where(self) -> tuple[torch.device, torch.dtype]:
        p = next(self.model.parameters())
        return p.device, p.dtype

    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        device, dtype = self._where()
        return self.model.encode_image(images.to(device=device, dtype=dtype), normalize=False).float()

    def encode_text(self, tokens: torch.Tensor) -> torch.Tensor:
        device, _ = self._where()
        tokens = tokens.to(device)
        return self.model.encode_text(tokens[:, 0], tokens[:, 1], normalize=False).float()


def prompts_of(classnames: Sequence[str], templates: Sequence[str] | dict[str, Sequence[str]]) -> list[str]:
    """Every prompt CLIP_benchmark's ``zero_shot_classifier`` embeds: ``template.format(c=name)`` for a
    list of templates, ``templates[name]`` for per-class prompts (CuPL)."""
    if isinstance(templates, dict):
        return [p for c in classnames for p in templates[c]]
    return [t.format(c=c) for c in classnames for t in templates]


def check_prompts(tokenizer: Any, classnames: Sequence[str], templates: Sequence[str] | dict[str, Sequence[str]],
                  name: str, chunk: int = 4096) -> None:
    """Raises :class:`PromptsTooLong` when a prompt of ``name`` takes more tokens (start and end tokens
    included) than the tokenizer's context length: truncated, it would lose the class name.

    Raises:
        PromptsTooLong: Naming the longest prompt, its length and the context length.
    """
    prompts = prompts_of(classnames, templates)
    context = int(tokenizer.context_length)
    longest, longest_len, over = "", 0, 0
    for start in range(0, len(prompts), chunk):
        part = prompts[start:start + chunk]
        lengths = tokenizer(part, context_length=1 << 20, padding="longest")["attention_mask"].sum(1)
        over += int((lengths > context).sum())
        i = int(lengths.argmax())
        if int(lengths[i]) > longest_len:
            longest, longest_len = part[i], int(lengths[i])
    if over:
        raise PromptsTooLong(
            f"benchmark {name!r}: the run's tokenizer cannot encode its templates within the text tower's context of "
            f"{context} tokens: {over} of its {len(prompts)} prompts are longer (the longest, {longest!r}, takes "
            f"{longest_len} tokens with the start and end tokens) and would lose their class names to truncation. "
            f"Evaluate a run trained with --context-length {longest_len} or more")


def check_tokenizer(names: Any, root: str | None, tokenizer: Any) -> None:
    """Raises :class:`PromptsTooLong` when the tokenizer's context cannot hold a classification prompt of the
    datasets (``NAME[,...]`` under ``root``, or resolved specs; read with their class names and templates, no
    images). Used by :mod:`recipe.benchmark.cli` and, as :func:`recipe.benchmark.training.check_tokenizer`,
    by training."""
    if not names:
        return
    from .datasets import CLASSIFICATION, build, resolve_all

    for spec in resolve_all(names, root):
        if spec.task == CLASSIFICATION:
            ds = build(spec)
            check_prompts(tokenizer, ds.classes, ds.templates, spec.name)


class _RGB:
    def __init__(self, transform: Any) -> None:
        self.transform = transform

    def __call__(self, image: Any) -> Any:
        if getattr(image, "mode", "RGB") != "RGB":
            image = image.convert("RGB")
        return self.transform(image)


def image_transform(image_data_config: dict[str, Any]) -> Any:
    """The run's evaluation transform of a PIL image (resize, centre crop by ``crop_pct``, normalise)."""
    from ..data.decode import build_transform

    return _RGB(build_transform(image_data_config, train=False))
