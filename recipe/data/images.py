"""The training images' fast path: crop box first, uint8 pixels, one normalising write per sample.

timm's training transform (:func:`recipe.data.decode.build_transform`) decodes the whole JPEG into a
PIL image, crops and resizes it with PIL, converts it to a float tensor and normalises it, one
allocation per step, and the batch is stacked afterwards. This module does the same augmentation in
fewer, cheaper steps:

1. :func:`sample_crop` draws the random resized crop box (and the flip) from the image size in the
   JPEG header alone, with exactly timm's draws (``RandomResizedCropAndInterpolation.get_params``
   from Python's ``random``, then torchvision's ``RandomHorizontalFlip`` from torch's generator), so
   the same per-sample seed gives the same box as timm's transform -- and as the GPU path
   (:mod:`recipe.data.device_decode`), which calls the same function in the workers.
2. :func:`decode_crop` decodes the JPEG (optionally in draft mode, see below) straight to a uint8
   ``[H, W, 3]`` tensor over PIL's bytes, crops it as a view and resizes the crop with
   ``torchvision.transforms.v2.functional.resize`` on uint8 (antialiased, bicubic or bilinear as the
   model's data config says: torch's vectorised uint8 kernels, ~4x faster than PIL's here).
3. :class:`Normalizer` writes ``(x / 255 - mean) / std`` of each sample straight into the batch
   tensor -- which :func:`batch_buffer` allocates in shared memory inside a DataLoader worker, so
   that handing the batch to the training process copies nothing -- with the very float32 operations
   of ``ToTensor`` + ``Normalize`` (bit for bit their result), per sample so that its three passes
   stay in the cache.

How the result compares with timm's path (``recipe-pil`` in ``benchmarks/bench_data.py``): crop box,
flip, conversion and normalisation are identical; the only difference is the resampling kernel:
torch's antialiased uint8 bicubic and PIL's use the same filter (a = -0.5, support scaled by the
reduction) but differ in fixed-point precision and in the rounding between their two separable
passes, so some pixels differ by one level of 255 (:func:`resize_agreement`; on the benchmark's
images: ~96 % identical, ~4 % one level apart, a few in 10^5 up to 6 levels; PSNR > 50 dB).
:data:`RESIZE_BOUND` states the bound the tests hold it to.

Draft decoding (``draft=True``, the training loader's default): libjpeg can decode at 1/2, 1/4 or
1/8 scale in its inverse DCT, which skips part of the decoding work of large images.
:func:`draft_scale` picks the largest reduction at which the crop box still covers
:data:`DRAFT_MARGIN` (2) times the output size in both dimensions; the box is then rounded to whole
pixels of the reduced image, which moves its edges by at most 1/4 output pixel. So images whose crop
is less than twice the output size (for a 224-px model: shorter sides below ~470 px after the crop,
e.g. img2dataset's 256- or 384-px shards) are never drafted and come out exactly as with
``draft=False``. Drafted images differ from the full decode -- the DCT-domain reduction is another
low-pass filter than the antialiased bicubic, plus the rounding -- by the lossy shortcut's stated
bound: PSNR >= :data:`DRAFT_PSNR_BOUND_DB` (35 dB) against the full decode of the same crop
(:func:`draft_psnr`). Measured on the benchmark's natural-image-like JPEGs (quality 90; 16 images
each): minimum / median 40.2 / 44.8 dB at 1024 px (reduction 2), 40.6 / 46.9 dB at 1536 px (2),
40.5 / 46.4 dB at 2048 px (4), for 1.5x / 1.6x / 2.1x faster decode + resize. With a margin of 1
(reduce as far as the crop stays >= the output) 512-px images would be drafted too, at 32-37 dB and
no faster here (the entropy decoding that draft cannot skip dominates), so the margin is 2.
``build_train_loader(..., image_pipeline="exact")`` turns it off.
"""

from __future__ import annotations

import io
import math
import random
import warnings
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
from PIL import Image
from torch.utils.data import get_worker_info

#: The resampling difference to timm's PIL path that the tests allow (see the module docstring):
#: the largest difference in levels of 255, and the least share of values that are identical or
#: one level apart.
RESIZE_BOUND = {"max_levels": 8, "within_one_level": 0.999}
#: PSNR (dB) of a drafted decode against the full decode of the same crop below which draft
#: decoding is not a safe default (the lossy shortcut's stated bound).
DRAFT_PSNR_BOUND_DB = 35.0
#: Draft decoding reduces an image only as far as its crop box stays this many times the output size.
DRAFT_MARGIN = 2.0
#: Interpolation modes of a timm data config the fast path can resample with.
_INTERPOLATIONS = {"bicubic": "BICUBIC", "bilinear": "BILINEAR"}

# ``torch.frombuffer`` over PIL's bytes is read only; the pipeline never writes into it.
warnings.filterwarnings("ignore", message="The given buffer is not writable", category=UserWarning)


class ImagePipeline:
    """How a sample's image becomes batch entries: :meth:`decode` runs per sample (in a DataLoader
    worker, right after the producer seeded the augmentation) and raises on a corrupt image;
    :meth:`collate` turns the decoded values of a batch into its image entries (``pixel_values``).
    A pipeline with a ``finish(batch) -> (batch, stats)`` method completes each batch in the
    training process (:class:`recipe.data.loader.ClipLoader` calls it). The pipelines:
    :class:`TrainImagePipeline` (here), :class:`recipe.data.decode.PILPipeline` (timm's transform) and
    :class:`recipe.data.device_decode.DeviceTrainPipeline` (the GPU path)."""

    def decode(self, data: bytes) -> Any:
        raise NotImplementedError

    def collate(self, pixels: Sequence[Any]) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class CropSpec:
    """What the training transform does: a random resized crop to ``size`` (height, width) with area
    fraction ``scale`` and aspect ratio ``ratio``, a horizontal flip with probability ``hflip``,
    ``interpolation`` (``bicubic``/``bilinear``), then normalisation by ``mean``/``std``."""

    size: tuple[int, int]
    scale: tuple[float, float]
    ratio: tuple[float, float]
    hflip: float
    interpolation: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]

    @classmethod
    def from_config(cls, image_data_config: Mapping[str, Any], cfg: Any) -> "CropSpec | None":
        """The spec of timm's training transform for ``image_data_config`` and the augmentation fields
        of a :class:`recipe.config.DataConfig`; None where this path cannot reproduce it (colour
        jitter, random interpolation, not 3 channels), which then keeps timm's transform."""
        size = image_data_config.get("input_size", (3, 224, 224))
        interpolation = image_data_config.get("interpolation", "bilinear")
        mean, std = tuple(image_data_config.get("mean", ())), tuple(image_data_config.get("std", ()))
        if (len(size) != 3 or size[0] != 3 or interpolation not in _INTERPOLATIONS or cfg.color_jitter is not None
                or len(mean) != 3 or len(std) != 3):
            return None
        ratio = tuple(cfg.train_ratio) if cfg.train_ratio is not None else (3.0 / 4.0, 4.0 / 3.0)
        return cls((int(size[1]), int(size[2])), tuple(map(float, cfg.train_scale)), tuple(map(float, ratio)),
                   float(cfg.hflip), interpolation, tuple(map(float, mean)), tuple(map(float, std)))


@dataclass(frozen=True)
class CropBox:
    """A crop of an image: rows ``top:top+height``, columns ``left:left+width``, then a flip or not."""

    top: int
    left: int
    height: int
    width: int
    flip: bool


def sample_crop(spec: CropSpec, width: int, height: int) -> CropBox:
    """Draw the random resized crop (and flip) of a ``width`` x ``height`` image.

    The draws are timm's ``RandomResizedCropAndInterpolation`` (up to ten tries of an area fraction
    and a log-uniform aspect ratio from Python's ``random``, a position when the box fits, else the
    centre crop clipped to the ratio range) followed by torchvision's ``RandomHorizontalFlip`` (one
    ``torch.rand(1)`` when ``hflip > 0``): seeded alike, both give the same box. The CPU path
    (:func:`decode_crop`) and the GPU path (:mod:`recipe.data.device_decode`) both call this.
    """
    area = width * height
    log_ratio = (math.log(spec.ratio[0]), math.log(spec.ratio[1]))
    box = None
    for _ in range(10):
        target_area = random.uniform(*spec.scale) * area
        aspect = math.exp(random.uniform(*log_ratio))
        w = int(round(math.sqrt(target_area * aspect)))
        h = int(round(math.sqrt(target_area / aspect)))
        if w <= width and h <= height:
            top = random.randint(0, height - h)
            left = random.randint(0, width - w)
            box = (top, left, h, w)
            break
    if box is None:  # the centre, as much of it as the ratio range allows
        in_ratio = width / height
        if in_ratio < min(spec.ratio):
            w, h = width, int(round(width / min(spec.ratio)))
        elif in_ratio > max(spec.ratio):
            w, h = int(round(height * max(spec.ratio))), height
        else:
            w, h = width, height
        box = ((height - h) // 2, (width - w) // 2, h, w)
    flip = bool(torch.rand(1) < spec.hflip) if spec.hflip > 0 else False
    return CropBox(*box, flip)


def draft_scale(box: CropBox, size: tuple[int, int], margin: float | None = None) -> int:
    """The largest JPEG decoding reduction (8, 4, 2 or 1) at which ``box`` still covers at least
    ``margin`` x ``size`` (height, width) pixels (default :data:`DRAFT_MARGIN`): the resize after it
    always shrinks, and rounding the box to whole reduced pixels moves its edges by at most
    ``0.5 / margin`` output pixels."""
    margin = DRAFT_MARGIN if margin is None else margin
    for s in (8, 4, 2):
        if box.height / s >= margin * size[0] and box.width / s >= margin * size[1]:
            return s
    return 1


def open_image(data: bytes) -> Image.Image:
    """The image in ``data``, opened (its header read), not decoded."""
    return Image.open(io.BytesIO(data))


def uint8_hwc(img: Image.Image) -> torch.Tensor:
    """A decoded image as a uint8 ``[H, W, 3]`` tensor over one copy of its pixels."""
    if img.mode != "RGB":
        img = img.convert("RGB")
    w, h = img.size
    return torch.frombuffer(img.tobytes(), dtype=torch.uint8).view(h, w, 3)


def decode_crop(data: bytes, spec: CropSpec, draft: bool = False, box: CropBox | None = None) -> torch.Tensor:
    """Decode ``data``, draw its crop box (:func:`sample_crop`, unless ``box`` is given), crop,
    resize and flip: a uint8 ``[3, H, W]`` tensor of ``spec.size``.

    ``draft``: let a JPEG decode at the reduction :func:`draft_scale` allows (lossy, see the module);
    the crop box is then rounded to whole pixels of the reduced image.

    Raises:
        Whatever PIL raises for corrupt or unsupported data (the decoder counts it as corrupt).
    """
    with open_image(data) as img:
        width, height = img.size
        if box is None:
            box = sample_crop(spec, width, height)
        s = draft_scale(box, spec.size) if draft and img.format in ("JPEG", "MPO") else 1
        drafted = img.draft("RGB", (width // s, height // s)) if s > 1 else None
        img.load()
        pixels = uint8_hwc(img)
    if drafted is not None and drafted[1][2] < width:
        box = reduce_box(box, width / drafted[1][2])
    return resize_crop(pixels, box, spec)


def reduce_box(box: CropBox, s: float) -> CropBox:
    """``box`` in an image decoded at 1/``s`` scale, its edges rounded to the nearest pixel."""
    top, left = round(box.top / s), round(box.left / s)
    bottom, right = round((box.top + box.height) / s), round((box.left + box.width) / s)
    return CropBox(top, left, bottom - top, right - left, box.flip)


def resize_crop(pixels: torch.Tensor, box: CropBox, spec: CropSpec) -> torch.Tensor:
    """Crop a uint8 ``[H, W, 3]`` image (a view), resize it to ``spec.size`` (antialiased) and flip
    it as ``box`` says: a uint8 ``[3, h, w]`` tensor (channels-last in memory)."""
    from torchvision.transforms.v2 import InterpolationMode
    from torchvision.transforms.v2.functional import resize

    crop = pixels[box.top : box.top + box.height, box.left : box.left + box.width].permute(2, 0, 1)
    if tuple(crop.shape[1:]) != spec.size:
        crop = resize(crop, list(spec.size), interpolation=getattr(InterpolationMode, _INTERPOLATIONS[spec.interpolation]),
                      antialias=True)
    if box.flip:
        crop = crop.flip(-1)
    return crop


def batch_buffer(shape: Sequence[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised tensor for a batch; in shared memory inside a DataLoader worker (as
    torch's ``default_collate`` does), so that sending it to the training process copies nothing."""
    if get_worker_info() is not None:
        nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
        storage = torch.UntypedStorage._new_shared(nbytes, device="cpu")
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape))
    return torch.empty(tuple(shape), dtype=dtype)


def stack_pixels(pixels: Sequence[torch.Tensor]) -> torch.Tensor:
    """``torch.stack`` into a :func:`batch_buffer` (shared memory in a worker)."""
    return torch.stack(list(pixels), out=batch_buffer((len(pixels), *pixels[0].shape), pixels[0].dtype))


class Normalizer:
    """``(x / 255 - mean) / std`` of uint8 pixels, with exactly the float32 operations of
    ``ToTensor`` (``x.float().div(255)``) and ``Normalize`` (``sub_(mean).div_(std)``): bit for bit
    their result."""

    def __init__(self, mean: Sequence[float], std: Sequence[float]):
        self.mean = torch.as_tensor(mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32).view(-1, 1, 1)

    def into(self, out: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
        """Write the normalised uint8 ``pixels`` (``[C, H, W]``, any strides) into float32 ``out``."""
        torch.div(pixels, 255, out=out)
        return out.sub_(self.mean).div_(self.std)

    def batch(self, samples: Sequence[torch.Tensor]) -> torch.Tensor:
        """The normalised float32 ``[B, C, H, W]`` batch of uint8 ``[C, H, W]`` samples, each written
        once into a :func:`batch_buffer` (its three passes run per sample, in the cache)."""
        out = batch_buffer((len(samples), *samples[0].shape))
        for i, px in enumerate(samples):
            self.into(out[i], px)
        return out


class TrainImagePipeline(ImagePipeline):
    """The training loader's image path: bytes -> uint8 crop (:func:`decode_crop`) in
    :meth:`decode`, uint8 crops -> normalised batch (:class:`Normalizer`) in :meth:`collate`.

    Draws from Python's ``random`` and torch's CPU generator, as timm's transform does, so the
    producer's per-sample seeding applies unchanged.
    """

    def __init__(self, spec: CropSpec, draft: bool = False):
        self.spec = spec
        self.draft = draft
        self.normalizer = Normalizer(spec.mean, spec.std)

    def decode(self, data: bytes) -> torch.Tensor:
        return decode_crop(data, self.spec, self.draft)

    def collate(self, pixels: Sequence[torch.Tensor]) -> dict[str, Any]:
        return {"pixel_values": self.normalizer.batch(pixels)}


def resize_agreement(images: Sequence[bytes], image_data_config: Mapping[str, Any], cfg: Any = None,
                     seed: int = 0) -> dict[str, Any]:
    """How :func:`resize_crop` (torch, uint8) agrees with PIL's crop + resize (timm's path) on the
    same crop boxes of ``images`` (one box per image from ``seed``): ``max_levels``, the shares of
    values ``identical`` and ``within_one`` level, and ``psnr_min_db``."""
    from recipe.config import DataConfig

    spec = CropSpec.from_config(image_data_config, cfg or DataConfig())
    if spec is None:
        raise ValueError("the data config needs timm's transform (colour jitter or an unsupported interpolation)")
    resample = getattr(Image.Resampling, _INTERPOLATIONS[spec.interpolation])
    counts = torch.zeros(256, dtype=torch.int64)
    worst = float("inf")
    for k, data in enumerate(images):
        random.seed(seed + k)
        torch.manual_seed(seed + k)
        with open_image(data) as img:
            rgb = img.convert("RGB")
        box = sample_crop(spec, *rgb.size)
        crop = rgb.crop((box.left, box.top, box.left + box.width, box.top + box.height))
        ref = uint8_hwc(crop.resize((spec.size[1], spec.size[0]), resample)).permute(2, 0, 1)
        ref = ref.flip(-1) if box.flip else ref
        got = decode_crop(data, spec, False, box)
        counts += torch.bincount((got.int() - ref.int()).abs().flatten(), minlength=256)
        worst = min(worst, psnr(got, ref))
    total = int(counts.sum())
    return {
        "images": len(images),
        "max_levels": int(torch.nonzero(counts).max()),
        "identical": round(int(counts[0]) / total, 6),
        "within_one": round(int(counts[:2].sum()) / total, 6),
        "psnr_min_db": round(worst, 2),
    }


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """PSNR in dB of two uint8 images (inf when equal)."""
    mse = (a.double() - b.double()).pow(2).mean().item()
    return float("inf") if mse == 0 else 10 * math.log10(255.0**2 / mse)


def draft_psnr(images: Sequence[bytes], image_data_config: Mapping[str, Any], cfg: Any = None,
               seed: int = 0) -> dict[str, Any]:
    """Draft decoding's PSNR against the full decode of the same crop box, per image (one box drawn
    per image from ``seed``): ``images``, ``drafted`` (how many got a reduction), ``psnr_min_db``,
    ``psnr_median_db`` (over the drafted ones; None when none was), ``scales`` (reduction -> count)."""
    from recipe.config import DataConfig

    spec = CropSpec.from_config(image_data_config, cfg or DataConfig())
    if spec is None:
        raise ValueError("the data config needs timm's transform (colour jitter or an unsupported interpolation)")
    values, scales = [], {}
    for k, data in enumerate(images):
        random.seed(seed + k)
        torch.manual_seed(seed + k)
        with open_image(data) as img:
            box = sample_crop(spec, *img.size)
        s = draft_scale(box, spec.size)
        scales[s] = scales.get(s, 0) + 1
        if s > 1:
            values.append(psnr(decode_crop(data, spec, True, box), decode_crop(data, spec, False, box)))
    values.sort()
    return {
        "images": len(images),
        "drafted": len(values),
        "scales": {str(k): v for k, v in sorted(scales.items())},
        "psnr_min_db": round(values[0], 2) if values else None,
        "psnr_median_db": round(values[len(values) // 2], 2) if values else None,
        "bound_db": DRAFT_PSNR_BOUND_DB,
    }


__all__ = [
    "DRAFT_MARGIN",
    "DRAFT_PSNR_BOUND_DB",
    "RESIZE_BOUND",
    "CropBox",
    "CropSpec",
    "ImagePipeline",
    "Normalizer",
    "TrainImagePipeline",
    "batch_buffer",
    "decode_crop",
    "draft_psnr",
    "draft_scale",
    "open_image",
    "psnr",
    "reduce_box",
    "resize_agreement",
    "resize_crop",
    "sample_crop",
    "stack_pixels",
    "uint8_hwc",
]
