"""recipe.data.device_decode: the GPU decode path's CPU-independent parts, run with a CPU "device".

``DeviceTrainPipeline(spec, "cpu")`` is the ``--decode-device cuda`` code path with torchvision's CPU
JPEG decoder in the training process instead of nvJPEG: the workers' header parsing, crop boxes and
packing, and the batch finishing (decode, crop, resize, flip, normalise, failures) are the same code.
"""

from __future__ import annotations

import io
from collections import Counter

import pytest
import torch
from PIL import Image

from recipe.config import DataConfig, TrainConfig
from recipe.data import build_train_loader, device_decode, images
from recipe.data.decode import build_train_pipeline
from recipe.data.device_decode import DeviceTrainPipeline, EncodedCrop
from recipe.data.images import CropSpec, TrainImagePipeline, sample_crop

from .helpers import cfg_for, collect, png_bytes, tokenize, write_tar
from .test_images import CLIP_CFG, levels, natural_jpeg, seeded

#: The device path against the CPU path, same boxes: levels of 255 (the resize runs in float without
#: rounding to uint8, and torchvision's decoder is not PIL's; nvJPEG rounds its IDCT differently again).
DEVICE_BOUND = {"max_levels": 8.0, "mean_levels": 0.6}
SMALL = {**CLIP_CFG, "input_size": (3, 48, 48)}


def bogus_huffman_table(jpeg: bytes) -> bytes:
    """``jpeg`` with its first Huffman table's code counts overwritten: the header still opens and the
    file still ends in an end-of-image marker, but no decoder can read it."""
    i = jpeg.find(b"\xff\xc4")
    out = bytearray(jpeg)
    out[i + 5 : i + 21] = b"\xff" * 16
    return bytes(out)


def spec_of(data_cfg=CLIP_CFG, **cfg) -> CropSpec:
    return CropSpec.from_config(data_cfg, DataConfig(**cfg))


def test_both_paths_draw_their_boxes_with_the_one_sampler():
    assert device_decode.sample_crop is images.sample_crop


@pytest.mark.parametrize("hflip", [0.0, 0.5])
@pytest.mark.parametrize("scale", [(0.9, 1.0), (0.1, 1.0)])
def test_the_gpu_path_keeps_the_cpu_paths_box_and_flip_for_the_same_seed(hflip, scale):
    """The workers of the GPU path keep, for each seed, the box the CPU path crops."""
    spec = spec_of(hflip=hflip, train_scale=scale)
    device = DeviceTrainPipeline(spec, "cpu")
    calls = []
    original = images.sample_crop

    def spy(*args):  # record the CPU path's boxes
        calls.append(original(*args))
        return calls[-1]

    for seed in range(12):
        data = natural_jpeg(seed, 200 + 10 * seed, 1.1)
        seeded(seed)
        kept = device.decode(data)
        assert isinstance(kept, EncodedCrop) and kept.data is data
        seeded(seed)
        with Image.open(io.BytesIO(data)) as img:
            assert kept.box == sample_crop(spec, *img.size)
        seeded(seed)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(images, "sample_crop", spy)
            images.decode_crop(data, spec)
        assert calls[-1] == kept.box


@pytest.mark.parametrize("hflip", [0.0, 1.0])
def test_finishing_a_batch_matches_the_cpu_path_within_the_bound(hflip):
    spec = spec_of(hflip=hflip)
    cpu, device = TrainImagePipeline(spec, draft=False), DeviceTrainPipeline(spec, "cpu")
    datas = [natural_jpeg(s, 256, 1.0 + 0.1 * s) for s in range(5)] + [png_bytes(3, size=300)]
    packed, expected = [], []
    for seed, data in enumerate(datas):
        seeded(seed)
        packed.append(device.decode(data))
        seeded(seed)
        expected.append(cpu.decode(data))
    assert [isinstance(p, EncodedCrop) for p in packed] == [True] * 5 + [False]  # a PNG is decoded in the worker
    batch = {**device.collate(packed), "keys": [str(i) for i in range(6)]}
    assert batch["_jpeg"].dtype == torch.uint8 and batch["_jpeg_offsets"].tolist()[-1] == sum(map(len, datas[:5]))
    batch, stats = device.finish(batch)
    assert not stats and not any(k.startswith("_") for k in batch)
    want = cpu.collate(expected)["pixel_values"]
    got = batch["pixel_values"]
    assert got.shape == want.shape == (6, 3, 224, 224) and got.dtype == torch.float32
    d = levels(got, want)
    assert d.max() <= DEVICE_BOUND["max_levels"] and d.mean() <= DEVICE_BOUND["mean_levels"]
    assert torch.equal(got[5], want[5])  # decoded in the worker: the CPU path's pixels, normalised alike


def test_what_the_device_cannot_decode_stays_on_the_cpu():
    spec = spec_of()
    device = DeviceTrainPipeline(spec, "cpu")
    gray = io.BytesIO()
    Image.open(io.BytesIO(natural_jpeg(1, 100))).convert("L").save(gray, "JPEG")
    cmyk = io.BytesIO()
    Image.open(io.BytesIO(natural_jpeg(2, 100))).convert("CMYK").save(cmyk, "JPEG")
    for data in (png_bytes(1, size=40), gray.getvalue(), cmyk.getvalue()):
        seeded(0)
        out = device.decode(data)
        assert isinstance(out, torch.Tensor) and out.shape == (3, 224, 224) and out.dtype == torch.uint8
    truncated = natural_jpeg(3, 200)[:-300]
    with pytest.raises(OSError):  # counted as corrupt_image by the decoder, in the worker
        device.decode(truncated)


def test_a_jpeg_no_decoder_can_read_is_counted_and_its_slot_refilled():
    spec = spec_of()
    device = DeviceTrainPipeline(spec, "cpu")
    good = [natural_jpeg(s, 120) for s in range(3)]
    broken = bogus_huffman_table(good[0])
    packed = []
    for seed, data in enumerate([good[0], broken, good[1], good[2]]):
        seeded(seed)
        packed.append(device.decode(data))
    assert isinstance(packed[1], EncodedCrop)  # it passes the workers' checks
    batch = {**device.collate(packed), "keys": ["a", "b", "c", "d"], "captions": ["A", "B", "C", "D"],
             "input_ids": torch.arange(4).view(4, 1)}
    batch, stats = device.finish(batch)
    assert stats == Counter(corrupt_image=1, repeated=1)
    assert batch["pixel_values"].shape == (4, 3, 224, 224)
    assert "b" not in batch["keys"] and batch["keys"][1] in ("a", "c", "d")  # a whole other sample in its slot
    src = ["a", "b", "c", "d"].index(batch["keys"][1])
    assert batch["captions"][1] == batch["captions"][src] and batch["input_ids"][1] == batch["input_ids"][src]
    assert torch.equal(batch["pixel_values"][1], batch["pixel_values"][src])


@pytest.fixture()
def shards(tmp_path):
    d = tmp_path / "wds"
    d.mkdir()
    for s in range(4):
        samples = []
        for i in range(6):
            data = png_bytes(10 * s + i, size=80) if (s, i) == (2, 3) else natural_jpeg(10 * s + i, 90, 1.2)
            ext = "png" if (s, i) == (2, 3) else "jpg"
            samples.append((f"s{s}k{i}", {ext: data, "txt": f"caption {s} {i}".encode()}))
        write_tar(d / f"{s:03d}.tar", samples)
    return d


@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_on_the_device_path_matches_the_cpu_path(shards, tmp_path, workers):
    cfg = cfg_for(str(shards), tmp_path, workers=workers, data_format="webdataset", shuffle_buffer=4, hflip=0.5)
    device = collect(build_train_loader(cfg, tokenize, SMALL, 4, seed=3, image_pipeline="device"))
    cpu = collect(build_train_loader(cfg, tokenize, SMALL, 4, seed=3, image_pipeline="exact"))
    assert [b["keys"] for b in device] == [b["keys"] for b in cpu]
    for a, b in zip(device, cpu):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert a["pixel_values"].shape == b["pixel_values"].shape == (4, 3, 48, 48)
        d = levels(a["pixel_values"], b["pixel_values"])
        assert d.max() <= DEVICE_BOUND["max_levels"] and d.mean() <= DEVICE_BOUND["mean_levels"]


def test_decode_device_is_a_checked_config_field():
    assert DataConfig().decode_device == "cpu"
    cfg = TrainConfig(data=DataConfig(decode_device="tpu"))
    with pytest.raises(ValueError, match="--decode-device must be cpu or cuda"):
        cfg.validate()
    with pytest.raises(ValueError, match="--decode-device must be cpu or cuda"):
        build_train_pipeline(CLIP_CFG, DataConfig(decode_device="tpu"))
    with pytest.raises(ValueError, match="random resized crops"):
        build_train_pipeline(CLIP_CFG, DataConfig(decode_device="cuda", color_jitter=0.4))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message without a CUDA device")
def test_decode_device_cuda_without_a_gpu_is_a_clear_error_at_start(shards, tmp_path):
    cfg = cfg_for(str(shards), tmp_path, data_format="webdataset", decode_device="cuda")
    with pytest.raises(ValueError, match="needs a CUDA device"):
        build_train_loader(cfg, tokenize, SMALL, 4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_decodes_on_the_gpu_within_the_bound(shards, tmp_path, workers):
    cfg = cfg_for(str(shards), tmp_path, workers=workers, data_format="webdataset", shuffle_buffer=4, hflip=0.5,
                  decode_device="cuda", pin_memory=True)
    gpu = collect(build_train_loader(cfg, tokenize, SMALL, 4, seed=3))
    cpu = collect(build_train_loader(cfg, tokenize, SMALL, 4, seed=3, image_pipeline="exact"))
    assert [b["keys"] for b in gpu] == [b["keys"] for b in cpu]
    for a, b in zip(gpu, cpu):
        assert a["pixel_values"].is_cuda and a["pixel_values"].dtype == torch.float32
        d = levels(a["pixel_values"].cpu(), b["pixel_values"])
        assert d.max() <= DEVICE_BOUND["max_levels"] and d.mean() <= DEVICE_BOUND["mean_levels"]

