"""Shared helpers of the recipe.data tests: a stand-in tokenizer, configs, references, writers."""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import tarfile
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from timm.data import create_transform  # noqa: E402

from recipe.config import DataConfig  # noqa: E402

datasets.disable_progress_bars()


def image_data_config(size: int, interpolation: str, mean: tuple, std: tuple, crop_pct: float) -> dict:
    """A timm data config (as ``resolve_data_config`` gives it): square RGB ``size`` input, center crop."""
    return {
        "input_size": (3, size, size),
        "interpolation": interpolation,
        "mean": mean,
        "std": std,
        "crop_pct": crop_pct,
        "crop_mode": "center",
    }


IMAGE_CFG = image_data_config(16, "bilinear", mean=(0.5, 0.5, 0.5), std=(0.25, 0.25, 0.25), crop_pct=0.875)
N_TRAIN, N_VAL, SHARD = 24, 10, 4


def tokenize(captions: list[str]) -> dict[str, torch.Tensor]:
    """A deterministic stand-in tokenizer: character codes, padded/truncated to 12."""
    ids = torch.zeros(len(captions), 12, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, c in enumerate(captions):
        codes = [ord(ch) for ch in c][:12]
        ids[i, : len(codes)] = torch.tensor(codes)
        mask[i, : len(codes)] = 1
    return {"input_ids": ids, "attention_mask": mask}


def cfg_for(path, tmp_path=None, *, workers: int = 0, label_column: str | None = None, **kw) -> DataConfig:
    """One config whose training and validation data are both ``path``.

    ``workers`` sets both ``workers`` and ``eval_workers`` unless ``eval_workers`` is given; no
    labels unless ``label_column`` is given.
    """
    kw.setdefault("eval_workers", workers)
    if tmp_path is not None:
        kw.setdefault("cache_dir", str(tmp_path / "hf_cache"))
    path = str(path) if not isinstance(path, list) else path
    return DataConfig(train_data=path, val_data=path, workers=workers, label_column=label_column, **kw)


def collect(loader) -> list[dict]:
    return [b for b in loader]


def sample_set(batches) -> Counter:
    """Multiset of (caption, exact pixel bytes) over batches."""
    out = Counter()
    for b in batches:
        for cap, px in zip(b["captions"], b["pixel_values"]):
            out[(cap, px.numpy().tobytes())] += 1
    return out


def keys_of(batches) -> list[str]:
    return [k for b in batches for k in b["keys"]]


def read_split_rows(root, split="train"):
    with open(os.path.join(root, f"{split}.csv"), newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def reference_pixels(path, image_data_config=IMAGE_CFG) -> torch.Tensor:
    """Evaluation pixels of one image file computed with PIL and timm directly, without recipe.data."""
    transform = create_transform(**image_data_config, is_training=False)
    with Image.open(path) as img:
        return transform(img.convert("RGB"))


def reference_set(root, split="train") -> Counter:
    """(caption, pixels) of a synthetic split computed with PIL and timm directly."""
    out = Counter()
    for row in read_split_rows(root, split):
        px = reference_pixels(os.path.join(root, row["filepath"]))
        out[(row["title"], px.numpy().tobytes())] += 1
    return out


def png_bytes(seed: int, size: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_pngs(d, n: int, prefix: str = "") -> list[str]:
    """Folder ``d`` (made here) of ``n`` images ``<prefix><i>.png`` (:func:`png_bytes` of seed i); their names."""
    d.mkdir()
    names = [f"{prefix}{i}.png" for i in range(n)]
    for i, name in enumerate(names):
        (d / name).write_bytes(png_bytes(i))
    return names


def write_tar(path, samples):
    with tarfile.open(path, "w") as tf:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


def write_formats(root, out) -> dict[str, DataConfig]:
    """Write the synthetic train split in every supported format; return a config for each."""
    rows = read_split_rows(root)
    abs_paths = [os.path.join(root, r["filepath"]) for r in rows]
    caps = [r["title"] for r in rows]
    blobs = [open(p, "rb").read() for p in abs_paths]
    cfgs = {}
    # OpenCLIP's csv: tab-separated .csv with relative paths (written by the generator itself).
    cfgs["csv_openclip"] = cfg_for(os.path.join(root, "train.csv"), out)
    # comma-separated csv with absolute paths, elsewhere.
    d = out / "csv_abs"
    d.mkdir()
    pd.DataFrame({"filepath": abs_paths, "title": caps}).to_csv(d / "data.csv", index=False)
    cfgs["csv_abs"] = cfg_for(d / "data.csv", out)
    # tsv in a sub folder, paths relative to that folder, custom column names.
    d = out / "tsv" / "sub"
    d.mkdir(parents=True)
    rel = [os.path.relpath(p, d) for p in abs_paths]
    pd.DataFrame({"img_file": rel, "desc": caps}).to_csv(d / "data.tsv", sep="\t", index=False)
    cfgs["tsv"] = cfg_for(d / "data.tsv", out, image_column="img_file", caption_column="desc")
    # JSON lines with paths relative to an explicit image_root.
    d = out / "jsonl"
    d.mkdir()
    with open(d / "data.jsonl", "w") as f:
        for r in rows:
            f.write(json.dumps({"image_path": r["filepath"], "caption": r["title"]}) + "\n")
    cfgs["jsonl"] = cfg_for(d / "data.jsonl", out, image_root=str(root))
    # parquet with image bytes.
    d = out / "pq_bytes"
    d.mkdir()
    pd.DataFrame({"image": blobs, "text": caps}).to_parquet(d / "data.parquet")
    cfgs["parquet_bytes"] = cfg_for(d / "data.parquet", out)
    # parquet with paths, split over two files given as a glob.
    d = out / "pq_paths"
    d.mkdir()
    half = len(rows) // 2
    pd.DataFrame({"filepath": abs_paths[:half], "title": caps[:half]}).to_parquet(d / "part-0.parquet")
    pd.DataFrame({"filepath": abs_paths[half:], "title": caps[half:]}).to_parquet(d / "part-1.parquet")
    cfgs["parquet_paths"] = cfg_for(str(d / "part-*.parquet"), out)
    # imagefolder with metadata.csv.
    d = out / "imagefolder"
    d.mkdir()
    names = []
    for i, p in enumerate(abs_paths):
        names.append(f"img{i:03d}.png")
        shutil.copy(p, d / names[-1])
    pd.DataFrame({"file_name": names, "text": caps}).to_csv(d / "metadata.csv", index=False)
    cfgs["imagefolder"] = cfg_for(d, out)
    # save_to_disk with a datasets.Image column (bytes embedded on save).
    d = out / "disk"
    ds = datasets.Dataset.from_dict({"image": abs_paths, "caption": caps}).cast_column("image", datasets.Image())
    ds.save_to_disk(str(d))
    cfgs["save_to_disk"] = cfg_for(d, out)
    # webdataset shards written by the generator, as a brace pattern.
    n_shards = -(-N_TRAIN // SHARD)
    cfgs["webdataset"] = cfg_for(os.path.join(root, "wds", "train", f"{{00000..{n_shards - 1:05d}}}.tar"), out)
    return cfgs


def run_steps(loader, steps):
    out = []
    while len(out) < steps:
        for b in loader:
            out.append(b)
            if len(out) == steps:
                break
    return out


def assert_same_batches(a, b):
    assert [x["keys"] for x in a] == [y["keys"] for y in b]
    for x, y in zip(a, b):
        assert torch.equal(x["pixel_values"], y["pixel_values"])
        assert torch.equal(x["input_ids"], y["input_ids"])


def write_shard(path, shard: int, n: int = 4) -> list[str]:
    """A tar of ``n`` samples ``s<shard>k<i>``: png and caption ``shard <shard> sample <i>``; returns the captions."""
    samples = [
        (f"s{shard}k{i}", {"png": png_bytes(100 * shard + i), "txt": f"shard {shard} sample {i}".encode()})
        for i in range(n)
    ]
    write_tar(path, samples)
    return [f"shard {shard} sample {i}" for i in range(n)]


#: Ways to damage a shard of :func:`write_shard` (members k0.png, k0.txt, k1.png, ...):
#: kind -> (indices of the samples still readable, samples counted from its headers).
DAMAGE = {
    "cut_in_data": ((0, 1), 3),  # cut inside k2.png's data
    "cut_at_header": ((0, 1), 2),  # cut exactly where k2.png's header starts: no end-of-archive blocks
    "cut_in_header": ((0, 1), 2),  # cut in the middle of k2.png's header
    "cut_before_caption": ((0,), 2),  # cut where k1.txt's header starts: k1 is incomplete
    "junk_after": ((0, 1), 2),  # k2.png's header and all after it overwritten with junk
    "not_a_tar": ((), 0),
    "empty": ((), 0),
}


def damage_tar(path, kind: str) -> None:
    """Damage the tar at ``path`` in place as :data:`DAMAGE` describes."""
    with open(path, "rb") as f:
        data = f.read()
    with tarfile.open(path) as tf:
        members = tf.getmembers()
    cuts = {
        "cut_in_data": data[: members[4].offset_data + 100],
        "cut_at_header": data[: members[4].offset],
        "cut_in_header": data[: members[4].offset + 100],
        "cut_before_caption": data[: members[3].offset],
        "junk_after": data[: members[4].offset] + b"junk " * 400,
        "not_a_tar": b"this is not a tar file " * 100,
        "empty": b"",
    }
    with open(path, "wb") as f:
        f.write(cuts[kind])
