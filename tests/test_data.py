"""Tests of recipe.data / recipe.data_formats: formats, rank shares, bad samples, resume."""

from __future__ import annotations

import csv
import io
import json
import multiprocessing
import os
import shutil
import tarfile
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import datasets  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402
from timm.data import create_transform  # noqa: E402

from recipe import synthetic  # noqa: E402
from recipe.data import (  # noqa: E402
    REPEATED,
    SKIP_REASONS,
    ZEROSHOT_FILENAME,
    DataConfig,
    build_eval_loader,
    build_train_loader,
    clean_caption,
    find_zeroshot_file,
    load_zeroshot_prompts,
    read_captions,
)
from recipe.data_formats import expand_braces  # noqa: E402

datasets.disable_progress_bars()

IMAGE_CFG = {
    "input_size": (3, 16, 16),
    "interpolation": "bilinear",
    "mean": (0.5, 0.5, 0.5),
    "std": (0.25, 0.25, 0.25),
    "crop_pct": 0.875,
    "crop_mode": "center",
}
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


def cfg_for(path, tmp_path=None, **kw) -> DataConfig:
    kw.setdefault("num_workers", 0)
    if tmp_path is not None:
        kw.setdefault("cache_dir", str(tmp_path / "hf_cache"))
    return DataConfig(path=str(path) if not isinstance(path, list) else path, **kw)


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


@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    root = tmp_path_factory.mktemp("syn")
    synthetic.write_dataset(str(root), N_TRAIN, n_val=N_VAL, seed=3, image_size=20, shard_size=SHARD)
    return root


def read_split_rows(root, split="train"):
    with open(os.path.join(root, f"{split}.csv"), newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def reference_set(root, split="train") -> Counter:
    """(caption, pixels) computed with PIL and timm directly, without recipe.data."""
    transform = create_transform(**IMAGE_CFG, is_training=False)
    out = Counter()
    for row in read_split_rows(root, split):
        with Image.open(os.path.join(root, row["filepath"])) as img:
            px = transform(img.convert("RGB"))
        out[(row["title"], px.numpy().tobytes())] += 1
    return out


# --------------------------------------------------------------------------------------------
# every format yields the same samples
# --------------------------------------------------------------------------------------------


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


@pytest.fixture(scope="module")
def formats(syn, tmp_path_factory):
    return write_formats(syn, tmp_path_factory.mktemp("formats"))


FORMAT_NAMES = [
    "csv_openclip",
    "csv_abs",
    "tsv",
    "jsonl",
    "parquet_bytes",
    "parquet_paths",
    "imagefolder",
    "save_to_disk",
    "webdataset",
]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_every_format_yields_the_same_samples(syn, formats, name):
    ref = reference_set(syn)
    assert sum(ref.values()) == N_TRAIN
    batches = collect(build_eval_loader(formats[name], tokenize, IMAGE_CFG, batch_size=5))
    assert sample_set(batches) == ref
    for b in batches:
        assert b["pixel_values"].dtype == torch.float32 and b["pixel_values"].shape[1:] == (3, 16, 16)
        expected = tokenize(b["captions"])
        assert torch.equal(b["input_ids"], expected["input_ids"])
        assert torch.equal(b["attention_mask"], expected["attention_mask"])
        assert b["input_ids"].dtype == torch.long


def test_formats_in_training_mode_cover_the_epoch(syn, formats):
    """Train loaders of a map-style and a streamed format serve every sample once per epoch."""
    for name in ("jsonl", "webdataset"):
        cfg = formats[name]
        loader = build_train_loader(cfg, tokenize, IMAGE_CFG, batch_size=4, seed=1)
        batches = collect(loader)
        assert len(batches) == len(loader) == N_TRAIN // 4
        assert sorted(c for b in batches for c in b["captions"]) == sorted(r["title"] for r in read_split_rows(syn))
        assert all(b["pixel_values"].shape == (4, 3, 16, 16) for b in batches)
        assert loader.epoch == 1 and not loader.stats


def test_eval_labels_and_order(syn, tmp_path):
    rows = read_split_rows(syn, "val")
    loader = build_eval_loader(cfg_for(os.path.join(syn, "val.csv"), tmp_path, label_column="label"), tokenize, IMAGE_CFG, 4)
    batches = collect(loader)
    assert [len(b["captions"]) for b in batches] == [4, 4, 2]
    assert [c for b in batches for c in b["captions"]] == [r["title"] for r in rows]
    assert torch.cat([b["labels"] for b in batches]).tolist() == [int(r["label"]) for r in rows]
    wds = cfg_for(os.path.join(syn, "wds", "val", "*.tar"), tmp_path, label_column="cls")
    stream = collect(build_eval_loader(wds, tokenize, IMAGE_CFG, 4))
    assert torch.cat([b["labels"] for b in stream]).tolist() == [int(r["label"]) for r in rows]
    assert sample_set(stream) == sample_set(batches)


# --------------------------------------------------------------------------------------------
# rank shares
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_train_rank_shares_disjoint_and_complete(syn, tmp_path, world_size, kind):
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
    all_keys, lengths = [], set()
    for rank in range(world_size):
        loader = build_train_loader(
            cfg_for(path, tmp_path, num_workers=2), tokenize, IMAGE_CFG, batch_size=2, rank=rank, world_size=world_size, seed=5
        )
        batches = collect(loader)
        assert len(batches) == len(loader) == N_TRAIN // world_size // 2
        assert all(len(b["keys"]) == 2 for b in batches)
        assert not loader.stats  # nothing skipped, nothing repeated
        lengths.add(len(batches))
        all_keys += keys_of(batches)
    assert len(lengths) == 1  # every rank takes the same number of steps
    assert len(all_keys) == len(set(all_keys)) == N_TRAIN


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_eval_rank_shares_disjoint_and_complete(syn, tmp_path, world_size, kind):
    """Eval shares cover the data exactly, also when N or the shard count does not divide."""
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train", "*.tar")
    all_keys = []
    for rank in range(world_size):
        loader = build_eval_loader(cfg_for(path, tmp_path, num_workers=2), tokenize, IMAGE_CFG, 5, rank, world_size)
        all_keys += keys_of(collect(loader))
    assert len(all_keys) == len(set(all_keys)) == N_TRAIN


def test_stream_shards_not_divisible_by_world_size(syn, tmp_path):
    """6 shards on 4 ranks: split by samples; shares disjoint, every batch full, same step count."""
    keys, lengths = [], set()
    for rank in range(4):
        loader = build_train_loader(
            cfg_for(os.path.join(syn, "wds", "train"), tmp_path, num_workers=2), tokenize, IMAGE_CFG, 2, rank, 4, seed=0
        )
        batches = collect(loader)
        lengths.add(len(batches))
        assert all(len(b["keys"]) == 2 for b in batches)
        real = [k for b in batches for k in b["keys"]]
        keys.append(set(real))
    assert lengths == {N_TRAIN // 4 // 2}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not keys[a] & keys[b]


def test_shuffling_is_seeded_per_epoch(syn, tmp_path):
    def order(seed, epoch, kind):
        path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
        loader = build_train_loader(cfg_for(path, tmp_path, shuffle_buffer=8), tokenize, IMAGE_CFG, 2, seed=seed)
        loader.set_epoch(epoch)
        return keys_of(collect(loader))

    for kind in ("map", "stream"):
        a = order(0, 0, kind)
        assert a == order(0, 0, kind)
        assert a != order(0, 1, kind)
        assert a != order(1, 0, kind)
        assert sorted(a) == sorted(order(0, 1, kind))


def test_worker_count_does_not_change_map_batches(syn, tmp_path):
    """Without bad samples, a map-style epoch (augmentation included) is the same for 0 and 2 workers."""
    path = os.path.join(syn, "train.csv")
    runs = []
    for workers in (0, 2):
        loader = build_train_loader(cfg_for(path, tmp_path, num_workers=workers), tokenize, IMAGE_CFG, 3, seed=2)
        runs.append(collect(loader))
    assert [b["keys"] for b in runs[0]] == [b["keys"] for b in runs[1]]
    for a, b in zip(*runs):
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def test_train_augmentation_is_a_random_resized_crop(syn, tmp_path):
    """Train pixels differ from eval pixels but stay in the normalised range of the images."""
    path = os.path.join(syn, "train.csv")
    train = collect(build_train_loader(cfg_for(path, tmp_path), tokenize, IMAGE_CFG, 4, seed=0))
    evald = {k: px for b in collect(build_eval_loader(cfg_for(path, tmp_path), tokenize, IMAGE_CFG, 4)) for k, px in zip(b["keys"], b["pixel_values"])}
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
    path = os.path.join(syn, "train.csv")
    reference = create_transform(**data_config, is_training=False)
    row = read_split_rows(syn)[0]
    with Image.open(os.path.join(syn, row["filepath"])) as img:
        expected = reference(img.convert("RGB"))
    evald = next(iter(build_eval_loader(cfg_for(path, tmp_path), tokenize, data_config, 2)))
    assert evald["pixel_values"].shape == (2, *data_config["input_size"])
    assert torch.equal(evald["pixel_values"][0], expected)
    trained = next(iter(build_train_loader(cfg_for(path, tmp_path), tokenize, data_config, 2)))
    assert trained["pixel_values"].shape == (2, *data_config["input_size"])


# --------------------------------------------------------------------------------------------
# bad samples
# --------------------------------------------------------------------------------------------


def png_bytes(seed: int, size: int = 20) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


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


def test_bad_samples_skipped_and_counted_eval(bad_jsonl, tmp_path):
    path, expected = bad_jsonl
    loader = build_eval_loader(cfg_for(path, tmp_path, num_workers=2), tokenize, IMAGE_CFG, 3)
    batches = collect(loader)
    assert sorted(c for b in batches for c in b["captions"]) == sorted(f"good sample {i}" for i in range(12))
    assert dict(loader.stats) == dict(expected)
    assert loader.num_skipped == 8
    assert loader.global_stats() == {k: expected.get(k, 0) for k in (*SKIP_REASONS, REPEATED)}


@pytest.mark.parametrize("workers", [0, 2])
def test_bad_samples_skipped_and_counted_train(bad_jsonl, tmp_path, workers):
    """Training batches stay full: bad samples are replaced, each bad one counted once."""
    path, expected = bad_jsonl
    loader = build_train_loader(cfg_for(path, tmp_path, num_workers=workers), tokenize, IMAGE_CFG, 4, seed=0)
    assert len(loader) == 5  # 20 rows // 4
    batches = collect(loader)
    assert len(batches) == 5 and all(len(b["captions"]) == 4 for b in batches)
    caps = [c for b in batches for c in b["captions"]]
    assert set(caps) == {f"good sample {i}" for i in range(12)}
    stats = dict(loader.stats)
    assert stats.pop(REPEATED) == 20 - 12
    assert stats == dict(expected)


def write_tar(path, samples):
    with tarfile.open(path, "w") as tf:
        for key, files in samples:
            for ext, data in files.items():
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))


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
    cfg = cfg_for(d, tmp_path, num_samples=13)
    loader = build_eval_loader(cfg, tokenize, IMAGE_CFG, 2)
    caps = [c for b in collect(loader) for c in b["captions"]]
    assert sorted(caps) == sorted(f"good {i}" for i in range(6))
    assert dict(loader.stats) == {
        "corrupt_image": 1,
        "missing_image": 1,
        "empty_caption": 2,
        "bad_caption": 1,
        "unreadable_shard": 1,
    }


def test_clean_caption():
    assert clean_caption("  a cat ") == ("a cat", None)
    assert clean_caption(b"a dog") == ("a dog", None)
    assert clean_caption(float("nan")) == (None, "empty_caption")
    assert clean_caption(None) == (None, "empty_caption")
    assert clean_caption(" \n") == (None, "empty_caption")
    assert clean_caption(3) == (None, "bad_caption")
    assert clean_caption(b"\xff") == (None, "bad_caption")


def test_share_without_readable_samples_is_an_error(tmp_path):
    d = tmp_path / "allbad"
    d.mkdir()
    pd.DataFrame({"filepath": [str(d / "x.png")] * 4, "title": ["t"] * 4}).to_csv(d / "a.csv", index=False)
    (d / "x.png").write_bytes(b"junk")
    loader = build_train_loader(cfg_for(d / "a.csv", tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(RuntimeError, match="no readable samples"):
        collect(loader)


# --------------------------------------------------------------------------------------------
# configuration errors at start
# --------------------------------------------------------------------------------------------


def test_wrong_column_names_are_clear_errors(syn, tmp_path):
    csv_path = os.path.join(syn, "train.csv")
    with pytest.raises(ValueError, match="caption column 'caption_x' not found.*title"):
        build_train_loader(cfg_for(csv_path, tmp_path, caption_column="caption_x"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="image column 'img_x' not found"):
        build_train_loader(cfg_for(csv_path, tmp_path, image_column="img_x"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="label column 'klass' not found"):
        build_eval_loader(cfg_for(csv_path, tmp_path, label_column="klass"), tokenize, IMAGE_CFG, 2)
    wds = os.path.join(syn, "wds", "train")
    with pytest.raises(ValueError, match="caption column 'caption' not found.*txt"):
        build_train_loader(cfg_for(wds, tmp_path, caption_column="caption"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="image column 'jpg' not found"):
        build_train_loader(cfg_for(wds, tmp_path, image_column="jpg"), tokenize, IMAGE_CFG, 2)
    # no candidate column at all
    d = tmp_path / "nocols"
    d.mkdir()
    pd.DataFrame({"a": ["x"], "b": ["y"]}).to_csv(d / "x.csv", index=False)
    with pytest.raises(ValueError, match="no image column found"):
        build_train_loader(cfg_for(d / "x.csv", tmp_path), tokenize, IMAGE_CFG, 1)


def test_missing_paths_are_clear_errors(syn, tmp_path):
    missing = tmp_path / "nope" / "train.csv"
    with pytest.raises(FileNotFoundError, match="nope/train.csv"):
        build_train_loader(cfg_for(missing, tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        build_train_loader(cfg_for(str(tmp_path / "*.tar"), tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(FileNotFoundError, match="image_root"):
        build_train_loader(cfg_for(os.path.join(syn, "train.csv"), tmp_path, image_root=str(tmp_path)), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="unknown data format 'xml'"):
        build_train_loader(cfg_for(os.path.join(syn, "train.csv"), tmp_path, format="xml"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="too few"):
        build_train_loader(cfg_for(os.path.join(syn, "val.csv"), tmp_path), tokenize, IMAGE_CFG, 4, rank=0, world_size=3)


def test_bad_tokenizer_output_is_an_error(syn, tmp_path):
    def short(captions):
        return {"input_ids": torch.zeros(1, 4), "attention_mask": torch.ones(1, 4)}

    loader = build_train_loader(cfg_for(os.path.join(syn, "train.csv"), tmp_path), short, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="shape"):
        collect(loader)


# --------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------


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


@pytest.mark.parametrize(
    "kind,stop",
    [("map_with_bad_samples", 3), ("map_with_bad_samples", 5), ("stream", 4)],  # 5 is an epoch boundary
)
def test_resume_yields_exactly_the_remaining_batches(syn, bad_jsonl, tmp_path, kind, stop):
    path = bad_jsonl[0] if kind == "map_with_bad_samples" else os.path.join(syn, "wds", "train")
    cfg = cfg_for(path, tmp_path, num_workers=2, shuffle_buffer=6)

    def make():
        return build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=11)

    ref_loader = make()
    per_epoch = len(ref_loader)
    total = 2 * per_epoch + 1
    reference = run_steps(ref_loader, total)
    first_loader = make()
    first = run_steps(first_loader, stop)
    state = json.loads(json.dumps(first_loader.state_dict()))  # must survive serialisation
    first_loader.close()
    resumed_loader = make()
    resumed_loader.load_state_dict(state)
    assert resumed_loader.epoch == stop // per_epoch
    rest = run_steps(resumed_loader, total - stop)
    assert_same_batches(first + rest, reference)
    assert resumed_loader.stats == ref_loader.stats


def test_resume_across_epochs_with_set_epoch(syn, tmp_path):
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path, num_workers=2)
    ref = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    reference = []
    for epoch in range(3):
        ref.set_epoch(epoch)
        reference += collect(ref)
    a = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    got = []
    for epoch in range(3):
        a.set_epoch(epoch)
        for b in a:
            got.append(b)
            if len(got) == 8:
                break
        if len(got) == 8:
            break
    state = a.state_dict()
    b_loader = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    b_loader.load_state_dict([state])  # a list of per-rank states also works
    for epoch in range(b_loader.epoch, 3):
        b_loader.set_epoch(epoch)  # keeps the restored position within the restored epoch
        got += collect(b_loader)
    assert_same_batches(got, reference)


def test_resume_with_changed_settings_is_an_error(syn, tmp_path):
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path, num_workers=2)
    a = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    run_steps(a, 2)
    state = a.state_dict()
    a.close()
    other = build_train_loader(cfg_for(os.path.join(syn, "train.csv"), tmp_path, num_workers=1), tokenize, IMAGE_CFG, 4, seed=1)
    with pytest.raises(ValueError, match="num_workers"):
        other.load_state_dict(state)
    # at an epoch boundary any worker count is fine
    boundary = dict(state, batches=0, pass_batches=0)
    other.load_state_dict(boundary)
    assert other.epoch == 0 and other.batches_consumed == 0


# --------------------------------------------------------------------------------------------
# multi-process: counts summed over ranks with torch.distributed (gloo)
# --------------------------------------------------------------------------------------------


def _dist_worker(rank, world_size, port, path, cache, queue):
    import torch.distributed as dist

    torch.set_num_threads(1)  # a forked child must not use the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        loader = build_train_loader(DataConfig(path=path, num_workers=0, cache_dir=cache), tokenize, IMAGE_CFG, 2, rank, world_size, 0)
        batches = collect(loader)
        states = loader.all_rank_state_dicts()
        queue.put((rank, dict(loader.stats), loader.global_stats(), keys_of(batches), len(states)))
    finally:
        dist.destroy_process_group()


def test_global_stats_sum_over_ranks_with_gloo(bad_jsonl, tmp_path):
    path, expected = bad_jsonl
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [ctx.Process(target=_dist_worker, args=(r, 2, port, str(path), str(tmp_path / "c"), queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = sorted(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    local = [Counter(r[1]) for r in results]
    total = local[0] + local[1]
    for _, _, global_stats, _, n_states in results:
        assert global_stats == {k: total.get(k, 0) for k in (*SKIP_REASONS, REPEATED)}
        assert n_states == 2
    # every bad row is seen by exactly one rank
    assert sum(total[k] for k in SKIP_REASONS) == sum(expected.values())
    assert not set(results[0][3]) & set(results[1][3])


# --------------------------------------------------------------------------------------------
# zero-shot prompts, captions, helpers
# --------------------------------------------------------------------------------------------


def test_zeroshot_prompts_from_the_synthetic_set(syn, tmp_path):
    for data_path in (os.path.join(syn, "val.csv"), os.path.join(syn, "wds", "val", "00000.tar")):
        found = find_zeroshot_file(data_path)
        assert found == os.path.join(syn, ZEROSHOT_FILENAME)
    zs = load_zeroshot_prompts(found)
    assert zs.classnames == synthetic.class_names(synthetic.DEFAULT_COLOURS, synthetic.DEFAULT_SHAPES)
    prompts = zs.prompts()
    assert len(prompts) == 12 and all(len(p) == len(synthetic.ZEROSHOT_TEMPLATES) for p in prompts)
    assert prompts[0][0] == "a photo of a red circle."
    bad = tmp_path / "zs.json"
    bad.write_text(json.dumps({"classnames": ["a"], "templates": ["no placeholder"]}))
    with pytest.raises(ValueError, match="placeholder"):
        load_zeroshot_prompts(bad)
    with pytest.raises(FileNotFoundError):
        load_zeroshot_prompts(tmp_path / "absent.json")


def test_read_captions(syn, bad_jsonl, tmp_path):
    expected = [r["title"] for r in read_split_rows(syn)]
    assert list(read_captions(cfg_for(os.path.join(syn, "train.csv"), tmp_path))) == expected
    assert sorted(read_captions(cfg_for(os.path.join(syn, "wds", "train"), tmp_path))) == sorted(expected)
    assert list(read_captions(cfg_for(os.path.join(syn, "train.csv"), tmp_path), limit=3)) == expected[:3]
    # bad captions are left out
    assert len(list(read_captions(cfg_for(bad_jsonl[0], tmp_path)))) == 12 + 4


def test_expand_braces():
    assert expand_braces("s-{008..011}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]
