"""From raw samples to batches: skip reasons, caption/label cleaning, image decoding, transforms.

:class:`SampleDecoder` turns a :class:`~recipe.data.formats.RawSample` into a :class:`Sample` or
names why it cannot be used (one of :data:`SKIP_REASONS`); :func:`collate` stacks decoded samples
into a batch and tokenises the captions. Labelled evaluation data without captions
(``with_captions=False``) makes batches of images and labels only.

Images go through an image pipeline (:class:`recipe.data.images.ImagePipeline`): ``decode(bytes)`` per
sample, in the worker, and ``collate(pixels)`` per batch. :class:`PILPipeline` applies a transform such as timm's
(:func:`build_transform`) to the fully decoded PIL image (evaluation; training where the fast path
cannot reproduce the transform); :func:`build_train_pipeline` picks the training loader's:
:class:`recipe.data.images.TrainImagePipeline` (crop box first, uint8 pixels, draft decoding of
large JPEGs) or, with ``decode_device="cuda"``, :class:`recipe.data.device_decode.DeviceTrainPipeline`
(the workers keep the JPEG bytes; the training process decodes them on the GPU).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch
from PIL import Image

from recipe.config import DECODE_DEVICES, DataConfig

from .device_decode import DeviceTrainPipeline, check_device_decoding
from .formats import RawSample, clean_label, read_image_bytes
from .images import CropSpec, ImagePipeline, TrainImagePipeline, stack_pixels

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


class PILPipeline(ImagePipeline):
    """``transform`` (e.g. timm's, :func:`build_transform`) of the fully decoded RGB PIL image; the
    batch is the stack of its outputs."""

    def __init__(self, transform: Callable):
        self.transform = transform

    def decode(self, data: bytes) -> torch.Tensor:
        with Image.open(io.BytesIO(data)) as img:
            img.load()
            rgb = img.convert("RGB")
        return self.transform(rgb)

    def collate(self, pixels: Sequence[torch.Tensor]) -> dict[str, Any]:
        return {"pixel_values": stack_pixels(pixels)}


#: ``image_pipeline`` values of :func:`build_train_pipeline` (None: the default of ``decode_device``).
TRAIN_PIPELINES = ("fast", "exact", "pil", "device")


def build_train_pipeline(image_data_config: Mapping[str, Any], cfg: DataConfig | None = None,
                         image_pipeline: str | None = None) -> ImagePipeline:
    """The training loader's image pipeline.

    ``image_pipeline``: None picks by ``cfg.decode_device``: ``cpu`` is ``fast``, ``cuda`` is
    ``device``. ``fast``: :class:`recipe.data.images.TrainImagePipeline` with draft decoding of large
    JPEGs; ``exact``: the same without draft; ``pil``: timm's transform on the fully decoded image
    (what ``fast`` reproduces, see :mod:`recipe.data.images`); ``device``:
    :class:`recipe.data.device_decode.DeviceTrainPipeline` finishing on ``cfg.decode_device``
    (``cpu`` there decodes in the training process, a way to test the path without a GPU).
    ``fast`` and ``exact`` fall back to ``pil`` where they cannot reproduce timm's transform
    (colour jitter, random interpolation).

    Raises:
        ValueError: An unknown ``image_pipeline`` or ``decode_device``, the GPU path for a
            transform it cannot reproduce, or ``decode_device="cuda"`` without a CUDA device or
            without torchvision's JPEG decoder.
    """
    cfg = cfg or DataConfig()
    device = cfg.decode_device
    if device not in DECODE_DEVICES:
        raise ValueError(f"--decode-device must be cpu or cuda, got {device!r}")
    if image_pipeline is None:
        image_pipeline = "device" if device == "cuda" else "fast"
    if image_pipeline not in TRAIN_PIPELINES:
        raise ValueError(f"image_pipeline must be one of {', '.join(TRAIN_PIPELINES)}, got {image_pipeline!r}")
    spec = CropSpec.from_config(image_data_config, cfg) if image_pipeline != "pil" else None
    if image_pipeline == "device":
        if spec is None:
            raise ValueError("--decode-device cuda does random resized crops, flips and normalisation only; it cannot "
                             "apply --color-jitter or a random/other interpolation: use --decode-device cpu")
        check_device_decoding(device)
        return DeviceTrainPipeline(spec, device)
    if spec is None:
        return PILPipeline(build_transform(image_data_config, True, cfg))
    return TrainImagePipeline(spec, draft=image_pipeline == "fast")


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
    a sample is not read and is None. ``transform``: an :class:`ImagePipeline`, or a transform of
    PIL images (wrapped in a :class:`PILPipeline`).
    """

    def __init__(self, transform: Callable | ImagePipeline, with_labels: bool, with_captions: bool = True):
        self.pipeline = transform if isinstance(transform, ImagePipeline) else PILPipeline(transform)
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
            pixels = self.pipeline.decode(data)
        except Exception as exc:  # PIL raises many types for bad data; all mean a corrupt image
            return None, "corrupt_image", f"{where}: {type(exc).__name__}: {exc}"
        return Sample(raw.key, pixels, caption, label), None, ""


def collate(
    samples: Sequence[Sample], tokenize: Tokenize | None, with_labels: bool, with_captions: bool = True,
    pipeline: ImagePipeline | None = None,
) -> dict[str, Any]:
    """Stack decoded samples into a batch and tokenise the captions.

    Returns:
        ``pixel_values`` (float ``[B, 3, H, W]``; the image entries of ``pipeline.collate`` when a
        pipeline is given), ``keys`` (list of str); with captions ``captions`` (list of str) and,
        when ``tokenize`` is given, ``input_ids``/``attention_mask`` (long ``[B, L]``); with labels
        ``labels`` (long ``[B]``).
    """
    pixels = [s.pixels for s in samples]
    images = pipeline.collate(pixels) if pipeline is not None else {"pixel_values": stack_pixels(pixels)}
    batch: dict[str, Any] = {**images, "keys": [s.key for s in samples]}
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
    "TRAIN_PIPELINES",
    "ImagePipeline",
    "PILPipeline",
    "Sample",
    "SampleDecoder",
    "Tokenize",
    "build_train_pipeline",
    "build_transform",
    "clean_caption",
    "collate",
    "stack_pixels",
]
