"""recipe.data.images: the training images' fast path against timm's transform, draft decoding's bound."""

from __future__ import annotations

import io
import os
import random
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw
from timm.data import create_transform
from timm.data.transforms import RandomResizedCropAndInterpolation
from torchvision.transforms import Normalize, ToTensor

from recipe.config import DataConfig
from recipe.data import build_train_loader
from recipe.data.decode import PILPipeline, build_train_pipeline
from recipe.data.images import (
    DRAFT_MARGIN,
    DRAFT_PSNR_BOUND_DB,
    RESIZE_BOUND,
    CropBox,
    CropSpec,
    Normalizer,
    TrainImagePipeline,
    decode_crop,
    draft_psnr,
    draft_scale,
    resize_agreement,
    sample_crop,
)

from .helpers import cfg_for, collect, image_data_config, png_bytes, tokenize, write_tar

CLIP_CFG = image_data_config(  # the ViT-B-32 preset's data config
    224,
    "bicubic",
    mean=(0.48145466, 0.4578275, 0.40821073),
    std=(0.26862954, 0.26130258, 0.27577711),
    crop_pct=1.0,
)


def natural_jpeg(seed: int, short: int, aspect: float = 1.2, quality: int = 90) -> bytes:
    """A JPEG with natural-image-like content: smooth colour noise at several scales, a gradient, shapes."""
    rng = np.random.default_rng(seed)
    h, w = short, int(short * aspect)
    img = np.zeros((h, w, 3))
    for cells, amp in ((4, 60.0), (16, 30.0), (64, 15.0), (256, 8.0)):
        noise = Image.fromarray(rng.integers(0, 256, (min(cells, h), min(cells, w), 3), dtype=np.uint8))
        img += (np.asarray(noise.resize((w, h), Image.BICUBIC), dtype=np.float64) - 128) * amp / 128
    img += np.linspace(0, 1, w)[None, :, None] * rng.uniform(-80, 80, 3) + rng.uniform(80, 170, 3)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(4):
        x, y = int(rng.integers(0, w)), int(rng.integers(0, h))
        draw.ellipse((x, y, x + w // 5, y + h // 6), fill=tuple(int(v) for v in rng.integers(0, 256, 3)))
    buf = io.BytesIO()
    im.save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def levels(a: torch.Tensor, b: torch.Tensor, std=CLIP_CFG["std"]) -> torch.Tensor:
    """|a - b| of normalised pixels, in levels of 255."""
    return ((a - b).abs() * torch.tensor(std).view(-1, 1, 1) * 255)


def seeded(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


# --------------------------------------------------------------------------------------------
# the crop box: timm's draws
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("scale,ratio", [((0.9, 1.0), (3 / 4, 4 / 3)), ((0.08, 1.0), (3 / 4, 4 / 3)), ((0.5, 1.0), (2.0, 3.0))])
@pytest.mark.parametrize("size", [(256, 320), (320, 256), (40, 500), (224, 224)])
def test_sample_crop_draws_timms_box_and_torchvisions_flip(scale, ratio, size):
    """Seeded alike, sample_crop gives timm's RandomResizedCrop box and RandomHorizontalFlip's coin."""
    w, h = size
    spec = CropSpec((224, 224), scale, ratio, 0.5, "bicubic", (0.5,) * 3, (0.5,) * 3)
    img = Image.new("RGB", (w, h))
    for seed in range(40):
        seeded(seed)
        top, left, ch, cw = RandomResizedCropAndInterpolation.get_params(img, scale, ratio)
        flip = bool(torch.rand(1) < 0.5)
        seeded(seed)
        assert sample_crop(spec, w, h) == CropBox(top, left, ch, cw, flip)


def test_crop_spec_falls_back_to_timm_where_it_cannot_reproduce_it():
    assert CropSpec.from_config(CLIP_CFG, DataConfig()) is not None
    assert CropSpec.from_config(CLIP_CFG, DataConfig(color_jitter=0.4)) is None
    assert CropSpec.from_config({**CLIP_CFG, "interpolation": "random"}, DataConfig()) is None
    assert CropSpec.from_config({**CLIP_CFG, "input_size": (1, 224, 224)}, DataConfig()) is None
    assert isinstance(build_train_pipeline(CLIP_CFG, DataConfig(color_jitter=0.4)), PILPipeline)
    assert isinstance(build_train_pipeline(CLIP_CFG, DataConfig()), TrainImagePipeline)
    with pytest.raises(ValueError, match="image_pipeline must be one of"):
        build_train_pipeline(CLIP_CFG, DataConfig(), "nvjpeg")


# --------------------------------------------------------------------------------------------
# the uint8 pipeline against timm's transform on PIL images
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("image", [b"\x89PNG", b"gray", b"jpeg"])
def test_normalizer_is_bit_exact_to_totensor_and_normalize(image):
    rng = np.random.default_rng(len(image))
    arr = rng.integers(0, 256, (24, 30, 3), dtype=np.uint8)
    pil = Image.fromarray(arr)
    expected = Normalize(CLIP_CFG["mean"], CLIP_CFG["std"])(ToTensor()(pil))
    norm = Normalizer(CLIP_CFG["mean"], CLIP_CFG["std"])
    got = norm.into(torch.empty(3, 24, 30), torch.from_numpy(arr).permute(2, 0, 1))  # channels-last strides
    assert torch.equal(got, expected)
    batch = norm.batch([torch.from_numpy(arr).permute(2, 0, 1)] * 2)
    assert torch.equal(batch[1], expected)


@pytest.mark.parametrize("interpolation", ["bicubic", "bilinear"])
@pytest.mark.parametrize("hflip", [0.0, 0.5])
@pytest.mark.parametrize("short,aspect", [(256, 1.25), (256, 0.8), (300, 1.0), (180, 1.3)])
def test_uint8_pipeline_matches_timms_transform_within_the_resize_bound(interpolation, hflip, short, aspect):
    """Same per-sample seed: same box and flip, identical conversion and normalisation; the pixels
    differ only by the resampling (torch's uint8 kernel vs PIL's), within RESIZE_BOUND."""
    data_cfg = {**CLIP_CFG, "interpolation": interpolation}
    cfg = DataConfig(hflip=hflip)
    timm_transform = create_transform(**data_cfg, scale=cfg.train_scale, hflip=hflip, color_jitter=None,
                                      is_training=True)
    fast = build_train_pipeline(data_cfg, cfg, "exact")
    diffs = []
    for seed in range(6):
        data = natural_jpeg(seed, short, aspect)
        seeded(seed)
        with Image.open(io.BytesIO(data)) as img:
            expected = timm_transform(img.convert("RGB"))
        seeded(seed)
        got = fast.collate([fast.decode(data)])["pixel_values"][0]
        assert got.shape == expected.shape == (3, 224, 224) and got.dtype == torch.float32
        diffs.append(levels(got, expected))
    d = torch.cat([x.flatten() for x in diffs])
    assert d.max() <= RESIZE_BOUND["max_levels"] + 1e-3
    assert (d <= 1 + 1e-3).float().mean() >= RESIZE_BOUND["within_one_level"]


def test_resize_agreement_reports_the_bound():
    agreement = resize_agreement([natural_jpeg(s, 256) for s in range(4)], CLIP_CFG)
    assert agreement["max_levels"] <= RESIZE_BOUND["max_levels"]
    assert agreement["within_one"] >= RESIZE_BOUND["within_one_level"]
    assert agreement["identical"] > 0.5 and agreement["psnr_min_db"] > 45


# --------------------------------------------------------------------------------------------
# draft decoding
# --------------------------------------------------------------------------------------------


def test_draft_scale_keeps_the_crop_at_least_margin_times_the_output():
    out = (224, 224)
    assert draft_scale(CropBox(0, 0, 448, 448, False), out) == 1  # 448 / 2 < 2 x 224
    assert draft_scale(CropBox(0, 0, 896, 900, False), out) == 2
    assert draft_scale(CropBox(0, 0, 1800, 1792, False), out) == 4
    assert draft_scale(CropBox(0, 0, 5000, 3584, False), out) == 8
    assert draft_scale(CropBox(0, 0, 5000, 900, False), out) == 2  # the smaller side decides
    assert draft_scale(CropBox(0, 0, 250, 250, False), out, margin=1.0) == 1
    assert draft_scale(CropBox(0, 0, 500, 460, False), out, margin=1.0) == 2
    assert DRAFT_MARGIN == 2.0


@pytest.mark.parametrize("short", [1024, 2048])
def test_draft_decoding_stays_within_its_psnr_bound(short):
    images = [natural_jpeg(100 + s, short) for s in range(3)]
    q = draft_psnr(images, CLIP_CFG)
    assert q["drafted"] == len(images)
    assert q["psnr_min_db"] >= DRAFT_PSNR_BOUND_DB


def test_images_below_the_margin_are_not_drafted_and_decode_identically():
    spec = CropSpec.from_config(CLIP_CFG, DataConfig())
    for seed in range(4):
        data = natural_jpeg(seed, 400)
        seeded(seed)
        drafted = decode_crop(data, spec, draft=True)
        seeded(seed)
        assert torch.equal(drafted, decode_crop(data, spec, draft=False))
    assert draft_psnr([natural_jpeg(0, 400)], CLIP_CFG)["drafted"] == 0


def test_draft_is_the_training_default_and_exact_turns_it_off():
    assert build_train_pipeline(CLIP_CFG, DataConfig()).draft is True
    assert build_train_pipeline(CLIP_CFG, DataConfig(), "exact").draft is False


# --------------------------------------------------------------------------------------------
# through the loader
# --------------------------------------------------------------------------------------------


@pytest.fixture()
def jpeg_shards(tmp_path):
    """3 shards of 4 samples: JPEGs of several sizes (one grayscale, one PNG), a truncated JPEG."""
    d = tmp_path / "wds"
    d.mkdir()
    n = 0
    for s in range(3):
        samples = []
        for i in range(4):
            key = f"s{s}k{i}"
            if (s, i) == (1, 2):
                img = {"png": png_bytes(7, size=60)}
            elif (s, i) == (2, 1):
                gray = Image.open(io.BytesIO(natural_jpeg(n, 90))).convert("L")
                buf = io.BytesIO()
                gray.save(buf, "JPEG")
                img = {"jpg": buf.getvalue()}
            elif (s, i) == (0, 3):
                img = {"jpg": natural_jpeg(n, 120)[:900]}  # truncated
            else:
                img = {"jpg": natural_jpeg(n, 64 + 40 * i)}
            samples.append((key, {**img, "txt": f"caption {key}".encode()}))
            n += 1
        write_tar(d / f"{s:03d}.tar", samples)
    return d


@pytest.mark.parametrize("workers", [0, 2])
def test_training_loader_counts_a_truncated_jpeg_and_reads_other_formats(jpeg_shards, tmp_path, workers):
    cfg = cfg_for(str(jpeg_shards), tmp_path, workers=workers, data_format="webdataset", shuffle_buffer=4)
    loader = build_train_loader(cfg, tokenize, {**CLIP_CFG, "input_size": (3, 32, 32)}, 4, seed=1)
    batches = collect(loader)
    assert loader.epoch_stats.get("corrupt_image", 0) == 0  # the epoch ended: counts are in stats
    assert loader.stats["corrupt_image"] == 1
    keys = [k for b in batches for k in b["keys"]]
    assert len(keys) == 12 and "000.tar/s0k3" not in keys
    assert all(b["pixel_values"].shape == (4, 3, 32, 32) for b in batches)


@pytest.mark.parametrize("pipeline", ["fast", "exact", "pil"])
def test_every_pipeline_keeps_the_per_sample_seeds_across_worker_counts(jpeg_shards, tmp_path, pipeline):
    """A sample's pixels depend on its key and the seed only, whatever the worker count (first
    visits: keys served once; a top-up repeat gets a new draw)."""
    out = {}
    for workers in (0, 2):
        cfg = cfg_for(str(jpeg_shards), tmp_path, workers=workers, data_format="webdataset", shuffle_buffer=4)
        loader = build_train_loader(cfg, tokenize, {**CLIP_CFG, "input_size": (3, 32, 32)}, 2, seed=5,
                                    image_pipeline=pipeline)
        pairs = [(k, px) for b in collect(loader) for k, px in zip(b["keys"], b["pixel_values"])]
        once = Counter(k for k, _ in pairs)
        out[workers] = {k: px for k, px in pairs if once[k] == 1}
    common = set(out[0]) & set(out[2])
    assert len(common) >= 8
    assert all(torch.equal(out[0][k], out[2][k]) for k in common)


def test_fast_path_batches_match_timms_path_within_the_bound(jpeg_shards, tmp_path):
    cfg = cfg_for(str(jpeg_shards), tmp_path, workers=0, data_format="webdataset", shuffle_buffer=4, hflip=0.5)
    data_cfg = {**CLIP_CFG, "input_size": (3, 48, 48)}
    fast = collect(build_train_loader(cfg, tokenize, data_cfg, 4, seed=2))
    pil = collect(build_train_loader(cfg, tokenize, data_cfg, 4, seed=2, image_pipeline="pil"))
    assert [b["keys"] for b in fast] == [b["keys"] for b in pil]
    for a, b in zip(fast, pil):
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert levels(a["pixel_values"], b["pixel_values"]).max() <= RESIZE_BOUND["max_levels"] + 1e-3


def test_the_training_loader_reads_real_files_of_the_synthetic_set(syn, tmp_path):
    """The default training path on the synthetic PNG dataset (map-style), two workers."""
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path, workers=2)
    batches = collect(build_train_loader(cfg, tokenize, {**CLIP_CFG, "input_size": (3, 16, 16)}, 4, seed=0))
    assert sum(len(b["keys"]) for b in batches) == 24
    assert all(torch.isfinite(b["pixel_values"]).all() for b in batches)
