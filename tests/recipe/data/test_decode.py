"""recipe.data.decode: caption/label cleaning, transforms, bad samples skipped and counted, collation."""

from __future__ import annotations

import json
import logging
import os
import random
import tarfile

import pandas as pd
import pytest
import torch
from PIL import Image
from timm.data import create_transform

from recipe.data import (
    REPEATED,
    SKIP_REASONS,
    DataConfig,
    build_eval_loader,
    build_train_loader,
    build_transform,
    clean_caption,
    clean_label,
)

from .helpers import IMAGE_CFG, cfg_for, collect, png_bytes, read_split_rows, reference_pixels, tokenize, write_tar


def test_clean_caption():
    assert clean_caption("  a cat ") == ("a cat", None)
    assert clean_caption(b"a dog") == ("a dog", None)
    assert clean_caption(float("nan")) == (None, "empty_caption")
    assert clean_caption(None) == (None, "empty_caption")
    assert clean_caption(" \n") == (None, "empty_caption")
    assert clean_caption(3) == (None, "bad_caption")
    assert clean_caption(b"\xff") == (None, "bad_caption")


def test_clean_label():
    assert [clean_label(v) for v in (3, 4.0, " 7 ", b"12", "-1")] == [3, 4, 7, 12, -1]
    assert [clean_label(v) for v in (True, 2.5, "x", None, [1])] == [None] * 5


# --------------------------------------------------------------------------------------------
# transforms
# --------------------------------------------------------------------------------------------


def test_build_transform_defaults_are_the_config_defaults(syn):
    """cfg=None means DataConfig()'s augmentation: timm's random resized crop with scale 0.9-1.0."""
    defaults = DataConfig()
    assert defaults.train_scale == (0.9, 1.0) and defaults.hflip == 0.0 and defaults.color_jitter is None
    reference = create_transform(**IMAGE_CFG, scale=(0.9, 1.0), hflip=0.0, color_jitter=None, is_training=True)
    with Image.open(os.path.join(syn, read_split_rows(syn)[0]["filepath"])) as img:
        rgb = img.convert("RGB")
    for transform in (build_transform(IMAGE_CFG, True), build_transform(IMAGE_CFG, True, DataConfig())):
        for seed in range(3):
            random.seed(seed)
            torch.manual_seed(seed)
            got = transform(rgb)
            random.seed(seed)
            torch.manual_seed(seed)
            assert torch.equal(got, reference(rgb))
    assert torch.equal(build_transform(IMAGE_CFG, False)(rgb), create_transform(**IMAGE_CFG, is_training=False)(rgb))


def test_train_augmentation_is_a_random_resized_crop(syn, tmp_path):
    """Train pixels differ from eval pixels but stay in the normalised range of the images."""
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path)
    train = collect(build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=0))
    eval_batches = collect(build_eval_loader(cfg, tokenize, IMAGE_CFG, 4))
    evald = {k: px for b in eval_batches for k, px in zip(b["keys"], b["pixel_values"])}
    diffs = [not torch.equal(px, evald[k]) for b in train for k, px in zip(b["keys"], b["pixel_values"])]
    assert sum(diffs) >= len(diffs) - 1
    lo, hi = (0 - 0.5) / 0.25, (1 - 0.5) / 0.25
    for b in train:
        assert b["pixel_values"].min() >= lo - 1e-5 and b["pixel_values"].max() <= hi + 1e-5


def test_transform_from_a_timm_model_data_config(syn, tmp_path):
    """The data config a timm model resolves (224 px, bicubic, ImageNet mean/std) drives the transform."""
    import timm

    model = timm.create_model("resnet18", pretrained=False, num_classes=0)
    data_config = timm.data.resolve_model_data_config(model)
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path)
    expected = reference_pixels(os.path.join(syn, read_split_rows(syn)[0]["filepath"]), data_config)
    evald = next(iter(build_eval_loader(cfg, tokenize, data_config, 2)))
    assert evald["pixel_values"].shape == (2, *data_config["input_size"])
    assert torch.equal(evald["pixel_values"][0], expected)
    trained = next(iter(build_train_loader(cfg, tokenize, data_config, 2)))
    assert trained["pixel_values"].shape == (2, *data_config["input_size"])


# --------------------------------------------------------------------------------------------
# bad samples
# --------------------------------------------------------------------------------------------


def test_bad_samples_skipped_and_counted_eval(bad_jsonl, tmp_path):
    path, expected = bad_jsonl
    loader = build_eval_loader(cfg_for(path, tmp_path, workers=2), tokenize, IMAGE_CFG, 3)
    batches = collect(loader)
    assert sorted(c for b in batches for c in b["captions"]) == sorted(f"good sample {i}" for i in range(12))
    assert dict(loader.stats) == dict(expected)
    assert loader.num_skipped == 8
    assert loader.global_stats() == {k: expected.get(k, 0) for k in (*SKIP_REASONS, REPEATED)}


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_samples_skipped_and_counted_train(bad_jsonl, tmp_path, workers):
    """Training batches stay full: bad samples are replaced, each bad one counted once."""
    path, expected = bad_jsonl
    loader = build_train_loader(cfg_for(path, tmp_path, workers=workers), tokenize, IMAGE_CFG, 4, seed=0)
    assert len(loader) == 5  # 20 rows // 4
    batches = collect(loader)
    assert len(batches) == 5 and all(len(b["captions"]) == 4 for b in batches)
    caps = [c for b in batches for c in b["captions"]]
    assert set(caps) == {f"good sample {i}" for i in range(12)}
    stats = dict(loader.stats)
    assert stats.pop(REPEATED) == 20 - 12
    assert stats == dict(expected)


def test_bad_webdataset_samples_and_truncated_shard(tmp_path):
    d = tmp_path / "wds"
    d.mkdir()
    good = [(f"a{i:02d}", {"png": png_bytes(i), "txt": f"good {i}".encode()}) for i in range(6)]
    bad = [
        ("b00", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"corrupt"}),
        ("b01", {"txt": b"no image"}),
        ("b02", {"png": png_bytes(50), "txt": b"   "}),
        ("b03", {"png": png_bytes(51), "txt": b"\xff\xfe not utf-8"}),
        ("b04", {"png": png_bytes(52)}),
    ]
    write_tar(d / "s-0.tar", good[:3] + bad)
    # shard 2: two good samples, then the tar is cut inside the third sample's image
    write_tar(d / "full.tar", good[3:5] + [("c00", {"png": png_bytes(60, 64), "txt": b"cut"})])
    with tarfile.open(d / "full.tar") as tf:
        member = tf.getmember("c00.png")
    data = (d / "full.tar").read_bytes()[: member.offset_data + 100]
    (d / "full.tar").unlink()
    (d / "s-1.tar").write_bytes(data)
    write_tar(d / "s-2.tar", good[5:])
    # an evaluation loader counts the samples from the tar headers (num_samples is the training
    # data's): the cut shard counts the 3 samples whose headers precede the damage
    loader = build_eval_loader(cfg_for(d, tmp_path, num_samples=1000), tokenize, IMAGE_CFG, 2)
    assert loader.num_source_samples == 8 + 3 + 1
    caps = [c for b in collect(loader) for c in b["captions"]]
    assert sorted(caps) == sorted(f"good {i}" for i in range(6))
    assert dict(loader.stats) == {
        "corrupt_image": 1,
        "missing_image": 1,
        "empty_caption": 2,
        "bad_caption": 1,
        "unreadable_shard": 1,
    }


def test_share_without_readable_samples_is_an_error(tmp_path):
    d = tmp_path / "allbad"
    d.mkdir()
    pd.DataFrame({"filepath": [str(d / "x.png")] * 4, "title": ["t"] * 4}).to_csv(d / "a.csv", index=False)
    (d / "x.png").write_bytes(b"junk")
    loader = build_train_loader(cfg_for(d / "a.csv", tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(RuntimeError, match="no readable samples"):
        collect(loader)


def test_bad_tokenizer_output_is_an_error(syn, tmp_path):
    def short(captions):
        return {"input_ids": torch.zeros(1, 4), "attention_mask": torch.ones(1, 4)}

    loader = build_train_loader(cfg_for(os.path.join(syn, "train.csv"), tmp_path), short, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="shape"):
        collect(loader)


# --------------------------------------------------------------------------------------------
# skip warnings name the sample: data file and row, image path
# --------------------------------------------------------------------------------------------

_IMAGE_REASONS = {
    "corrupt.png": "corrupt_image",
    "truncated.png": "corrupt_image",
    "missing.png": "missing_image",
    "a_directory.png": "unreadable_image",
}


def _skip_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "recipe.data.loader" and "skipping" in r.getMessage()]


def test_bad_sample_warnings_name_the_row_and_the_image(bad_jsonl, tmp_path, caplog):
    path, expected = bad_jsonl
    with open(path) as f:
        rows = [json.loads(line) for line in f]
    with caplog.at_level(logging.WARNING):
        loader = build_eval_loader(cfg_for(path, tmp_path), tokenize, IMAGE_CFG, 4)
        collect(loader)
    assert dict(loader.stats) == dict(expected)
    skips = _skip_warnings(caplog)
    assert len(skips) == sum(expected.values())
    for i, row in enumerate(rows):
        if isinstance(row["caption"], str) and row["caption"].startswith("good sample"):
            continue
        reason = _IMAGE_REASONS.get(row["image"])
        if reason is None:
            reason = "bad_caption" if row["caption"] else "empty_caption"
        needles = [f"({reason})", f"row {i} of {path}"]
        if row["image"] in _IMAGE_REASONS:
            needles.append(str(path.parent / row["image"]))
        assert len([m for m in skips if all(n in m for n in needles)]) == 1, (needles, skips)


def test_corrupt_embedded_image_warning_names_the_row_and_file(tmp_path, caplog):
    """Image bytes have no path: the warning names the row of its data file (rows count per file)."""
    d = tmp_path / "pq"
    d.mkdir()
    pd.DataFrame({"image": [png_bytes(0), png_bytes(1)], "text": ["a", "b"]}).to_parquet(d / "part-0.parquet")
    pd.DataFrame({"image": [png_bytes(2), b"junk"], "text": ["c", "d"]}).to_parquet(d / "part-1.parquet")
    with caplog.at_level(logging.WARNING):
        loader = build_eval_loader(cfg_for(str(d / "part-*.parquet"), tmp_path), tokenize, IMAGE_CFG, 2)
        assert [c for b in collect(loader) for c in b["captions"]] == ["a", "b", "c"]
    assert dict(loader.stats) == {"corrupt_image": 1}
    skips = _skip_warnings(caplog)
    assert len(skips) == 1
    assert "skipping sample 3 (corrupt_image)" in skips[0] and f"row 1 of {d / 'part-1.parquet'}" in skips[0]


def test_unparsable_label_is_a_counted_skip_naming_the_row(tmp_path, caplog):
    d = tmp_path / "labels"
    d.mkdir()
    for i in range(4):
        (d / f"i{i}.png").write_bytes(png_bytes(i))
    rows = {"filepath": [f"i{i}.png" for i in range(4)], "title": list("abcd"), "label": ["1", "x", "2", "3"]}
    pd.DataFrame(rows).to_csv(d / "data.csv", index=False)
    with caplog.at_level(logging.WARNING):
        loader = build_eval_loader(cfg_for(d / "data.csv", tmp_path, label_column="label"), tokenize, IMAGE_CFG, 4)
        batches = collect(loader)
    assert torch.cat([b["labels"] for b in batches]).tolist() == [1, 2, 3]
    assert dict(loader.stats) == {"bad_label": 1}
    skips = _skip_warnings(caplog)
    assert len(skips) == 1 and f"(bad_label) from row 1 of {d / 'data.csv'}: label 'x'" in skips[0]
