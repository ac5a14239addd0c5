"""From raw samples to batches: skip reasons, caption/label cleaning, image decoding, transforms.

:class:`SampleDecoder` turns a :class:`~recipe.data.formats.RawSample` into a :class:`Sample` or
names why it cannot be used (one of :data:`SKIP_REASONS`); :func:`collate` stacks decoded samples
into a batch and tokenises the captions. Labelled evaluation data without captions
(``with_captions=False``) makes batches of images and labels only.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from PIL import Image

from recipe.config import DataConfig

from .formats import RawSample, read_image_bytes

#: Reasons a sample is skipped, in the order they are checked.
SKIP_REASONS = (
    "unreadable_shard",
    "empty_caption",
    "bad_caption",
    "bad_label",
    "missing_image",
    "unreadable_image",
    "corrupt_image",
)
#: Count of good samples served a second time in one epoch (top-ups, short shares).
REPEATED = "repeated"

#: ``tokenize(list[str]) -> {"input_ids": [B, L], "attention_mask": [B, L]}``.
Tokenize = Callable[[list[str]], Mapping[str, Any]]


def build_transform(image_data_config: Mapping[str, Any], train: bool, cfg: DataConfig | None = None) -> Callable:
    """Image transform from a timm data config (``timm.data.resolve_model_data_config``).

    Training: random resized crop (``cfg.train_scale``/``train_ratio``), optional flip and colour
    jitter; evaluation: resize and centre crop by ``crop_pct``. Both normalise with the config's
    mean and std.

    Args:
        image_data_config: Keys accepted by ``timm.data.create_transform``: ``input_size``,
            ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``.
        train: Training or evaluation transform.
        cfg: Augmentation settings (defaults of :class:`recipe.config.DataConfig` when None).
    """
    from timm.data import create_transform

    cfg = cfg or DataConfig()
    kwargs = dict(image_data_config)
    if train:
        kwargs.update(scale=tuple(cfg.train_scale), hflip=cfg.hflip, color_jitter=cfg.color_jitter)
        if cfg.train_ratio is not None:
            kwargs["ratio"] = tuple(cfg.train_ratio)
    return create_transform(**kwargs, is_training=train)


def clean_caption(value: Any) -> tuple[str | None, str | None]:
    """Return ``(caption, None)`` for a usable caption, else ``(None, reason)``.

    ``None``, NaN and blank strings are ``empty_caption``; bytes are decoded as UTF-8; anything
    else that is not a string (numbers, lists, undecodable bytes) is ``bad_caption``.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, "empty_caption"
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None, "bad_caption"
    if not isinstance(value, str):
        return None, "bad_caption"
    value = value.strip()
    if not value:
        return None, "empty_caption"
    return value, None


def clean_label(value: Any) -> int | None:
    """Parse a class label (int, numpy integer, or digits as str/bytes); None if unusable."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


@dataclass
class Sample:
    """One decoded sample."""

    key: str
    pixels: torch.Tensor
    caption: str | None
    label: int | None = None


class SampleDecoder:
    """Turn a :class:`RawSample` into a :class:`Sample`, or name why it cannot be used.

    ``with_captions=False``: the source has no captions (labelled evaluation data); the caption of
    a sample is not read and is None.
    """

    def __init__(self, transform: Callable, with_labels: bool, with_captions: bool = True):
        self.transform = transform
        self.with_labels = with_labels
        self.with_captions = with_captions

    def __call__(self, raw: RawSample) -> tuple[Sample | None, str | None, str]:
        """Decode one sample.

        Returns:
            ``(sample, None, "")`` or ``(None, reason, detail)`` with a reason of
            :data:`SKIP_REASONS`.
        """
        if raw.error is not None:
            return None, "unreadable_shard", raw.error
        caption = None
        if self.with_captions:
            caption, reason = clean_caption(raw.caption)
            if reason is not None:
                return None, reason, f"caption {raw.caption!r:.80}"
        label = None
        if self.with_labels:
            label = clean_label(raw.label)
            if label is None:
                return None, "bad_label", f"label {raw.label!r:.80}"
        try:
            data, where = read_image_bytes(raw.image, raw.base_dir)
        except FileNotFoundError as exc:
            return None, "missing_image", str(exc)
        except (OSError, TypeError) as exc:
            return None, "unreadable_image", f"{type(exc).__name__}: {exc}"
        if data is None:
            return None, "missing_image", "no image in sample"
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                rgb = img.convert("RGB")
            pixels = self.transform(rgb)
        except Exception as exc:  # PIL raises many types for bad data; all mean a corrupt image
            return None, "corrupt_image", f"{where}: {type(exc).__name__}: {exc}"
        return Sample(raw.key, pixels, caption, label), None, ""


def collate(
    samples: Sequence[Sample], tokenize: Tokenize | None, with_labels: bool, with_captions: bool = True
) -> dict[str, Any]:
    """Stack decoded samples into a batch and tokenise the captions.

    Returns:
        ``pixel_values`` (float ``[B, 3, H, W]``), ``keys`` (list of str); with captions
        ``captions`` (list of str) and, when ``tokenize`` is given, ``input_ids``/``attention_mask``
        (long ``[B, L]``); with labels ``labels`` (long ``[B]``).
    """
    batch: dict[str, Any] = {"pixel_values": torch.stack([s.pixels for s in samples]), "keys": [s.key for s in samples]}
    captions = [s.caption for s in samples]
    if with_captions:
        batch["captions"] = captions
    if tokenize is not None and with_captions:
        tokens = tokenize(captions)
        for name in ("input_ids", "attention_mask"):
            if name not in tokens:
                raise ValueError(f"tokenize() must return {name!r}; got keys {list(tokens)}")
            value = torch.as_tensor(tokens[name], dtype=torch.long)
            if value.dim() != 2 or value.shape[0] != len(captions):
                raise ValueError(
                    f"tokenize() returned {name} of shape {tuple(value.shape)} for {len(captions)} captions"
                )
            batch[name] = value
    if with_labels:
        batch["labels"] = torch.tensor([s.label for s in samples], dtype=torch.long)
    return batch


__all__ = [
    "REPEATED",
    "SKIP_REASONS",
    "Sample",
    "SampleDecoder",
    "Tokenize",
    "build_transform",
    "clean_caption",
    "clean_label",
    "collate",
]
