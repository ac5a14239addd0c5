"""Tests of recipe.synthetic: determinism, on-disk structure, rendering, learnability."""

from __future__ import annotations

import csv
import hashlib
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from recipe import synthetic as S

ROOT = Path(__file__).resolve().parents[2]  # the repository root
N, N_VAL, SIZE, SHARD = 30, 12, 32, 8


def tree_digest(root) -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            out[os.path.relpath(p, root)] = hashlib.sha256(open(p, "rb").read()).hexdigest()
    return out


@pytest.fixture(scope="module")
def ds(tmp_path_factory):
    root = tmp_path_factory.mktemp("synthetic")
    info = S.write_dataset(str(root), N, n_val=N_VAL, seed=7, image_size=SIZE, shard_size=SHARD)
    return root, info


def rows(root, split):
    with open(os.path.join(root, f"{split}.csv"), newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def test_deterministic_given_the_seed(ds, tmp_path):
    root, _ = ds
    again = tmp_path / "again"
    S.write_dataset(str(again), N, n_val=N_VAL, seed=7, image_size=SIZE, shard_size=SHARD)
    assert tree_digest(again) == tree_digest(root)
    other = tmp_path / "other"
    S.write_dataset(str(other), N, n_val=N_VAL, seed=8, image_size=SIZE, shard_size=SHARD)
    a, b = tree_digest(root), tree_digest(other)
    assert a.keys() == b.keys()
    differing = [k for k in a if a[k] != b[k] and k.endswith(".png")]
    assert len(differing) == N + N_VAL  # every image changes with the seed


def test_layout_and_csv(ds):
    root, info = ds
    names = S.class_names(S.DEFAULT_COLOURS, S.DEFAULT_SHAPES)
    assert info["num_classes"] == len(names) == 12
    for split, n in (("train", N), ("val", N_VAL)):
        r = rows(root, split)
        assert len(r) == n and list(r[0]) == ["filepath", "title", "label"]
        for i, row in enumerate(r):
            label = int(row["label"])
            assert label == i % 12  # balanced
            colour, shape = names[label].split()
            assert colour in row["title"] and shape in row["title"]
            assert row["filepath"] == f"images/{split}/{i:08d}.png"
            with Image.open(os.path.join(root, row["filepath"])) as img:
                assert img.format == "PNG" and img.mode == "RGB" and img.size == (SIZE, SIZE)
    # the captions vary: several templates in use
    assert len({r["title"] for r in rows(root, "train")}) > 12
    with open(os.path.join(root, "train.csv"), encoding="utf-8") as f:
        assert f.readline() == "filepath\ttitle\tlabel\n"  # OpenCLIP's tab-separated csv


def test_webdataset_shards_match_the_csv(ds):
    root, _ = ds
    for split, n in (("train", N), ("val", N_VAL)):
        shard_dir = os.path.join(root, "wds", split)
        shards = sorted(os.listdir(shard_dir))
        assert shards == [f"{i:05d}.tar" for i in range(math.ceil(n / SHARD))]
        samples = {}
        for s in shards:
            with tarfile.open(os.path.join(shard_dir, s)) as tf:
                for m in tf.getmembers():
                    key, ext = m.name.split(".", 1)
                    samples.setdefault(key, {})[ext] = tf.extractfile(m).read()
        assert list(samples) == [f"{i:08d}" for i in range(n)]
        for i, row in enumerate(rows(root, split)):
            sample = samples[f"{i:08d}"]
            assert set(sample) == {"png", "txt", "cls", "json"}
            assert sample["png"] == open(os.path.join(root, row["filepath"]), "rb").read()
            assert sample["txt"].decode() == row["title"]
            assert int(sample["cls"]) == int(row["label"])
            assert json.loads(sample["json"])["label"] == int(row["label"])


def test_zeroshot_file(ds):
    root, info = ds
    spec = json.load(open(os.path.join(root, S.ZEROSHOT_FILENAME)))
    assert spec["classnames"] == info["classnames"]
    assert spec["templates"] and all("{}" in t for t in spec["templates"])
    captions = {r["title"] for r in rows(root, "train")} | {r["title"] for r in rows(root, "val")}
    prompts = {t.format(c) for t in spec["templates"] for c in spec["classnames"]}
    assert not prompts & captions  # zero-shot prompts are phrased unlike any caption

    from recipe.zeroshot import ZEROSHOT_FILENAME

    assert ZEROSHOT_FILENAME == S.ZEROSHOT_FILENAME


AREA_PER_R2 = {
    "circle": math.pi,
    "square": 2.0,
    "triangle": 3 * math.sqrt(3) / 4 * 1.15**2,
    "diamond": 1.2 * 1.2,
    "cross": 2 * (2 * 0.72) - 0.72**2,
}


@pytest.mark.parametrize("shape", list(S.SHAPES))
def test_rendered_shape_colour_and_area(shape):
    """Pixels at the shape's centre have its colour; the coloured area matches the geometry."""
    size = 96
    for i, colour in enumerate(S.PALETTE):
        rng = np.random.default_rng([1, i])
        label = 0
        spec = S.sample_scene(rng, label, [colour], [shape])
        img = np.asarray(S.render(spec, size, rng), dtype=np.float64)
        base = np.array(S.PALETTE[colour], dtype=np.float64)
        bg = np.full(3, S.BACKGROUNDS[spec.background], dtype=np.float64)
        cx, cy = (int(spec.center[0] * size), int(spec.center[1] * size))
        # colour jitter <= 18 and pixel noise <= 8 per channel
        assert np.abs(img[cy, cx] - base).max() <= 18 + 8 + 1
        inside = np.linalg.norm(img - base, axis=-1) < np.linalg.norm(img - bg, axis=-1)
        expected = AREA_PER_R2[shape] * (spec.radius * size) ** 2
        assert abs(inside.sum() - expected) / expected < 0.08, (shape, colour, inside.sum(), expected)
        # the pixel farthest from the shape is background
        far = (size - 1 if cy < size / 2 else 0, size - 1 if cx < size / 2 else 0)
        assert np.abs(img[far] - bg).max() <= 8


def test_written_image_is_the_specified_scene(ds):
    root, _ = ds
    for i, row in enumerate(rows(root, "train")[:5]):
        rng = np.random.default_rng([7, 0, i])
        spec = S.sample_scene(rng, i % 12, S.DEFAULT_COLOURS, S.DEFAULT_SHAPES)
        assert spec.caption == row["title"]
        expected = np.asarray(S.render(spec, SIZE, rng))
        with Image.open(os.path.join(root, row["filepath"])) as img:
            assert np.array_equal(np.asarray(img), expected)


def test_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="unknown colours/shapes"):
        S.write_dataset(str(tmp_path), 4, colours=["mauve"])
    with pytest.raises(ValueError, match="image_format"):
        S.write_dataset(str(tmp_path), 4, image_format="gif")
    assert not os.listdir(tmp_path)


def test_command_line(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "recipe.synthetic", "--out", str(out), "--n", "20", "--seed", "2",
           "--image-size", "24", "--shapes", "circle,cross", "--colours", "red,blue,cyan", "--image-format", "jpg",
           "--shard-size", "16"]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert res.returncode == 0, res.stderr
    info = json.load(open(out / "info.json"))
    assert info["num_classes"] == 6 and info["n_train"] == 20 and info["n_val"] == 6
    assert sorted(os.listdir(out / "wds" / "train")) == ["00000.tar", "00001.tar"]
    with Image.open(out / "images" / "train" / "00000000.jpg") as img:
        assert img.format == "JPEG" and img.size == (24, 24)


@pytest.mark.slow
def test_a_small_clip_learns_zero_shot_far_above_chance(tmp_path):
    """A tiny CNN + bag-of-words CLIP, 48 steps through recipe.data, beats chance (1/12) by far.

    (It reaches about 0.5; colour alone would give 1/3, shape alone 1/4.)
    """
    import re

    import torch
    import torch.nn.functional as F
    from torch import nn

    from recipe.config import DataConfig
    from recipe.data import build_eval_loader, build_train_loader
    from recipe.zeroshot import find_zeroshot_file, load_zeroshot_prompts

    torch.manual_seed(0)
    root = tmp_path / "syn"
    S.write_dataset(str(root), 1024, n_val=240, seed=0, image_size=32)
    zs = load_zeroshot_prompts(find_zeroshot_file(str(root / "val.csv")))
    vocab: dict[str, int] = {}

    def words(text):
        return re.findall(r"[a-z]+", text.lower())

    for r in rows(root, "train"):
        for w in words(r["title"]):
            vocab.setdefault(w, len(vocab) + 1)

    def tokenize(captions):
        ids = torch.zeros(len(captions), 12, dtype=torch.long)
        for i, c in enumerate(captions):
            t = [vocab.get(w, 0) for w in words(c)][:12]
            ids[i, : len(t)] = torch.tensor(t)
        return {"input_ids": ids, "attention_mask": (ids > 0).long()}

    image = nn.Sequential(
        nn.Conv2d(3, 16, 3, 2, 1), nn.ReLU(), nn.Conv2d(16, 32, 3, 2, 1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU(), nn.Flatten(), nn.Linear(32 * 16, 64),
    )
    text = nn.EmbeddingBag(len(vocab) + 1, 64, mode="sum", padding_idx=0)
    logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))
    opt = torch.optim.AdamW([*image.parameters(), *text.parameters(), logit_scale], lr=3e-3)
    image_cfg = {
        "input_size": (3, 32, 32), "interpolation": "bilinear", "mean": (0.5,) * 3, "std": (0.25,) * 3, "crop_pct": 1.0
    }

    def encode_text(tokens):
        return F.normalize(text(tokens["input_ids"]), dim=-1)

    train = DataConfig(train_data=str(root / "train.csv"), workers=1)
    loader = build_train_loader(train, tokenize, image_cfg, 64, seed=0)
    for _ in range(3):  # 3 epochs of 16 steps
        for batch in loader:
            img = F.normalize(image(batch["pixel_values"]), dim=-1)
            txt = encode_text(batch)
            logits = logit_scale.exp().clamp(max=100) * img @ txt.T
            target = torch.arange(len(logits))
            loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
            opt.zero_grad()
            loss.backward()
            opt.step()
    with torch.no_grad():
        classifier = torch.stack([F.normalize(encode_text(tokenize(p)).mean(0), dim=-1) for p in zs.prompts()])
        correct = total = 0
        val = DataConfig(val_data=str(root / "val.csv"), label_column="label", eval_workers=0)
        for batch in build_eval_loader(val, tokenize, image_cfg, 120):
            pred = (F.normalize(image(batch["pixel_values"]), dim=-1) @ classifier.T).argmax(1)
            correct += int((pred == batch["labels"]).sum())
            total += len(pred)
    assert total == 240
    assert correct / total > 0.3, correct / total  # chance is 1/12
