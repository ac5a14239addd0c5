"""Training images decoded on the GPU (``--decode-device cuda``): the workers only read bytes.

In a DataLoader worker, :meth:`DeviceTrainPipeline.decode` reads an image's header, draws its crop
box and flip with :func:`recipe.data.images.sample_crop` -- the CPU path's own function, under the
same per-sample seed, so both paths crop every sample alike -- and keeps the JPEG bytes;
:meth:`DeviceTrainPipeline.collate` packs a batch's bytes into one shared-memory uint8 tensor with
offsets and boxes. In the training process, :meth:`DeviceTrainPipeline.finish` (called by
:class:`recipe.data.loader.ClipLoader` for every batch) decodes them in one batched
``torchvision.io.decode_jpeg(..., device=...)`` call (nvJPEG on CUDA), then crops, resizes
(antialiased, the model's interpolation), flips and normalises each image on the device into one
float32 ``pixel_values`` tensor there. The workers' CPU time per sample is then header parsing and
tokenisation.

What stays on the CPU, in the worker, through the CPU path with the same box
(:func:`recipe.data.images.decode_crop`): images that are not baseline/progressive 3-channel JPEGs
(PNG, WebP, grayscale or CMYK JPEG) and JPEGs that do not end in an end-of-image marker (a truncated
file there raises, and is counted as ``corrupt_image`` as on the CPU path). A JPEG that passes those
checks but fails to decode on the device is decoded on the CPU in the training process; one that
fails there too is counted as ``corrupt_image`` and its slot in the batch is filled with a copy of
another sample of the batch, image, caption, tokens and key alike, counted as ``repeated`` (the batch
keeps its size, so ranks stay in lock-step).

How the pixels compare with the CPU path: same box and flip; the decoders (nvJPEG vs libjpeg-turbo)
round their inverse DCT and chroma upsampling differently, and the resize runs in float without the
CPU path's rounding to uint8, so values differ by a few levels of 255 (the tests bound the CPU
variant of this path, torchvision's libjpeg decoder, against the CPU path).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .images import (
    CropBox, CropSpec, ImagePipeline, Normalizer, batch_buffer, decode_crop, open_image, sample_crop, uint8_hwc,
)

#: JPEG end-of-image marker; a file without one near its end is treated as possibly truncated.
_EOI = b"\xff\xd9"
_EOI_TAIL = 64


@dataclass
class EncodedCrop:
    """A JPEG left for the device: its bytes and the crop box drawn for it."""

    data: bytes
    box: CropBox


def check_device_decoding(device: str | torch.device) -> None:
    """Raise ``ValueError`` now, at start, where decoding on ``device`` cannot work."""
    try:
        from torchvision.io import decode_jpeg  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"--decode-device {device} needs torchvision's JPEG decoder (torchvision.io): {exc}") from None
    if torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--decode-device {device} needs a CUDA device; torch.cuda.is_available() is False "
                         "(use --decode-device cpu)")


def _device_decodable(img: Any, data: bytes) -> bool:
    """A 3-channel JPEG that ends with an end-of-image marker (after at most a little padding)."""
    return img.format == "JPEG" and img.mode == "RGB" and data.rfind(_EOI, max(0, len(data) - _EOI_TAIL)) >= 0


class DeviceTrainPipeline(ImagePipeline):
    """The GPU path (see the module): bytes and boxes from the workers, pixels made on ``device``.

    ``device``: ``cuda`` (the current CUDA device when a batch is finished), ``cuda:N``, or ``cpu``
    (decode in the training process with torchvision's CPU decoder: the same code path, testable
    without a GPU).
    """

    def __init__(self, spec: CropSpec, device: str | torch.device = "cuda"):
        self.spec = spec
        self.device = str(device)
        self._normalizers: dict[torch.device, Normalizer] = {}

    # --- in the DataLoader worker -------------------------------------------------------------

    def decode(self, data: bytes) -> EncodedCrop | torch.Tensor:
        """An :class:`EncodedCrop` for a JPEG the device can decode, else the CPU path's uint8 crop."""
        with open_image(data) as img:
            box = sample_crop(self.spec, *img.size)
            if _device_decodable(img, data):
                return EncodedCrop(data, box)
        return decode_crop(data, self.spec, draft=False, box=box)

    def collate(self, pixels: Sequence[EncodedCrop | torch.Tensor]) -> dict[str, Any]:
        """``_jpeg`` (uint8, the encoded images back to back), ``_jpeg_offsets`` (``[n + 1]``),
        ``_jpeg_boxes`` (``[n, 5]``: top, left, height, width, flip), ``_jpeg_index`` (their places
        in the batch), ``_decoded`` (uint8 ``[m, 3, H, W]``: the ones decoded in the worker) and
        ``_decoded_index``; the tensors in shared memory inside a worker."""
        encoded = [(i, p) for i, p in enumerate(pixels) if isinstance(p, EncodedCrop)]
        decoded = [(i, p) for i, p in enumerate(pixels) if not isinstance(p, EncodedCrop)]
        sizes = [len(p.data) for _, p in encoded]
        offsets = torch.zeros(len(encoded) + 1, dtype=torch.int64)
        if sizes:
            offsets[1:] = torch.cumsum(torch.tensor(sizes, dtype=torch.int64), 0)
        blob = batch_buffer((int(offsets[-1]),), torch.uint8)
        view = memoryview(blob.numpy())
        for (_, p), start, end in zip(encoded, offsets[:-1].tolist(), offsets[1:].tolist()):
            view[start:end] = p.data
        boxes = torch.tensor([[p.box.top, p.box.left, p.box.height, p.box.width, int(p.box.flip)] for _, p in encoded],
                             dtype=torch.int64).view(-1, 5)
        out: dict[str, Any] = {
            "_jpeg": blob,
            "_jpeg_offsets": offsets,
            "_jpeg_boxes": boxes,
            "_jpeg_index": torch.tensor([i for i, _ in encoded], dtype=torch.int64),
            "_decoded_index": torch.tensor([i for i, _ in decoded], dtype=torch.int64),
        }
        h, w = self.spec.size
        out["_decoded"] = (torch.stack([p for _, p in decoded]) if decoded
                           else torch.empty(0, 3, h, w, dtype=torch.uint8))
        return out

    # --- in the training process --------------------------------------------------------------

    def _device(self) -> torch.device:
        device = torch.device(self.device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    def _normalizer(self, device: torch.device) -> Normalizer:
        if device not in self._normalizers:
            norm = Normalizer(self.spec.mean, self.spec.std)
            norm.mean, norm.std = norm.mean.to(device), norm.std.to(device)
            self._normalizers[device] = norm
        return self._normalizers[device]

    def _resize(self, image: torch.Tensor, box: Sequence[int]) -> torch.Tensor:
        """Crop, resize (float, antialiased, clamped to [0, 255]) and flip one decoded ``[3, H, W]`` image."""
        from torchvision.transforms.v2 import InterpolationMode
        from torchvision.transforms.v2.functional import resize

        top, left, h, w, flip = box
        crop = image[:, top : top + h, left : left + w].float()
        mode = InterpolationMode.BICUBIC if self.spec.interpolation == "bicubic" else InterpolationMode.BILINEAR
        out = resize(crop, list(self.spec.size), interpolation=mode, antialias=True).clamp_(0, 255)
        return out.flip(-1) if flip else out

    def _decode_all(self, datas: list[torch.Tensor], device: torch.device) -> tuple[list[torch.Tensor | None], int]:
        """Decode every JPEG on ``device`` (one batched call; one by one when it fails, then on the
        CPU); None where nothing could decode it. Returns the images and the count of failures."""
        from torchvision.io import ImageReadMode, decode_jpeg

        if not datas:
            return [], 0
        try:
            return list(decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)), 0
        except RuntimeError:
            pass
        out: list[torch.Tensor | None] = []
        failed = 0
        for data in datas:
            try:
                out.append(decode_jpeg(data, mode=ImageReadMode.RGB, device=device))
                continue
            except RuntimeError:
                pass
            try:  # the CPU decoder is more forgiving than nvJPEG
                with open_image(data.numpy().tobytes()) as img:
                    pixels = uint8_hwc(img)
                out.append(pixels.permute(2, 0, 1).to(device))
            except Exception:  # PIL raises many types for bad data
                out.append(None)
                failed += 1
        return out, failed

    def finish(self, batch: dict[str, Any]) -> tuple[dict[str, Any], Counter]:
        """Replace the packed entries of ``batch`` by ``pixel_values`` (float32 ``[B, 3, H, W]`` on
        the device). Returns the batch and the skips met (``corrupt_image``)."""
        if "_jpeg" not in batch:
            return batch, Counter()
        device = self._device()
        norm = self._normalizer(device)
        blob, offsets = batch.pop("_jpeg"), batch.pop("_jpeg_offsets").tolist()
        boxes, index = batch.pop("_jpeg_boxes").tolist(), batch.pop("_jpeg_index").tolist()
        decoded, decoded_index = batch.pop("_decoded"), batch.pop("_decoded_index").tolist()
        size = len(index) + len(decoded_index)
        out = torch.empty(size, 3, *self.spec.size, dtype=torch.float32, device=device)
        datas = [blob[a:b] for a, b in zip(offsets[:-1], offsets[1:])]
        images, failed = self._decode_all(datas, device)
        good = []
        for i, image, box in zip(index, images, boxes):
            if image is not None:
                out[i] = self._resize(image, box)  # 0..255 floats
                good.append(i)
        if len(decoded_index):
            on_device = decoded.to(device, non_blocking=True)
            for j, i in enumerate(decoded_index):
                out[i] = on_device[j]
                good.append(i)
        norm.into(out, out)  # one normalisation of the whole batch, in place
        batch["pixel_values"] = out
        stats: Counter = Counter()
        if failed:
            if not good:
                raise RuntimeError(f"no image of a batch of {size} could be decoded on {device}")
            stats["corrupt_image"] += failed
            stats["repeated"] += failed
            for k, i in enumerate(sorted(set(range(size)) - set(good))):
                _copy_sample(batch, i, good[k % len(good)], size)
        return batch, stats


def _copy_sample(batch: dict[str, Any], dst: int, src: int, size: int) -> None:
    """Make sample ``dst`` of ``batch`` a copy of sample ``src`` in every per-sample entry."""
    for value in batch.values():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == size:
            value[dst] = value[src]
        elif isinstance(value, list) and len(value) == size:
            value[dst] = value[src]


__all__ = ["DeviceTrainPipeline", "EncodedCrop", "check_device_decoding"]
