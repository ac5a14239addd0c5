"""Fixtures of the recipe.data tests: a synthetic dataset, every format of it, a set with bad samples."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from recipe import synthetic

from .helpers import N_TRAIN, N_VAL, SHARD, png_bytes, write_formats


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    synthetic.write_dataset(str(root), N_TRAIN, n_val=N_VAL, seed=3, image_size=20, shard_size=SHARD)
    return root


@pytest.fixture(scope="module")
def formats(syn, tmp_path_factory):
    return write_formats(syn, tmp_path_factory.mktemp("formats"))


@pytest.fixture()
def bad_jsonl(tmp_path):
    """12 good rows and 8 bad ones of known kinds, interleaved."""
    d = tmp_path / "bad"
    d.mkdir()
    rows, expected = [], Counter()
    for i in range(12):
        (d / f"good{i}.png").write_bytes(png_bytes(i))
        rows.append({"image": f"good{i}.png", "caption": f"good sample {i}"})
    (d / "corrupt.png").write_bytes(b"\x89PNG this is not an image")
    (d / "truncated.png").write_bytes(png_bytes(99)[:200])
    (d / "a_directory.png").mkdir()
    (d / "ok.png").write_bytes(png_bytes(100))
    bad = [
        ({"image": "corrupt.png", "caption": "corrupt"}, "corrupt_image"),
        ({"image": "truncated.png", "caption": "truncated"}, "corrupt_image"),
        ({"image": "missing.png", "caption": "missing"}, "missing_image"),
        ({"image": "a_directory.png", "caption": "directory"}, "unreadable_image"),
        ({"image": "ok.png", "caption": ""}, "empty_caption"),
        ({"image": "ok.png", "caption": None}, "empty_caption"),
        ({"image": "ok.png", "caption": 5}, "bad_caption"),
        ({"image": "ok.png", "caption": ["a", "list"]}, "bad_caption"),
    ]
    for j, (row, reason) in enumerate(bad):
        rows.insert(2 + 2 * j, row)
        expected[reason] += 1
    with open(d / "data.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return d / "data.jsonl", expected
