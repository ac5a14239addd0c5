"""recipe.data.formats / webdataset: every format, splits, paths and columns, start-up errors."""

from __future__ import annotations

import os
import shutil

import datasets
import pandas as pd
import pytest
import torch

from recipe.data import build_eval_loader, build_train_loader, expand_braces, read_captions

from .helpers import (
    IMAGE_CFG,
    N_TRAIN,
    cfg_for,
    collect,
    read_split_rows,
    reference_pixels,
    reference_set,
    sample_set,
    tokenize,
    write_pngs,
)

# --------------------------------------------------------------------------------------------
# every format yields the same samples
# --------------------------------------------------------------------------------------------

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
    cfg = cfg_for(os.path.join(syn, "val.csv"), tmp_path, label_column="label")
    batches = collect(build_eval_loader(cfg, tokenize, IMAGE_CFG, 4))
    assert [len(b["captions"]) for b in batches] == [4, 4, 2]
    assert [c for b in batches for c in b["captions"]] == [r["title"] for r in rows]
    assert torch.cat([b["labels"] for b in batches]).tolist() == [int(r["label"]) for r in rows]
    wds = cfg_for(os.path.join(syn, "wds", "val", "*.tar"), tmp_path, label_column="cls")
    stream = collect(build_eval_loader(wds, tokenize, IMAGE_CFG, 4))
    assert torch.cat([b["labels"] for b in stream]).tolist() == [int(r["label"]) for r in rows]
    assert sample_set(stream) == sample_set(batches)
    # training never reads labels, even when a label column is configured
    train = collect(build_train_loader(cfg, tokenize, IMAGE_CFG, 5))
    assert train and all("labels" not in b for b in train)


# --------------------------------------------------------------------------------------------
# splits of one multi-split directory: ``split`` for training, ``val_split`` for evaluation
# --------------------------------------------------------------------------------------------

SPLITS = {"train": slice(0, 8), "validation": slice(8, 14), "test": slice(14, 20)}


@pytest.fixture(scope="module")
def multi_split(syn, tmp_path_factory):
    """The first 20 synthetic rows as a 3-split ``save_to_disk`` DatasetDict and a 3-split imagefolder."""
    out = tmp_path_factory.mktemp("splits")
    rows = read_split_rows(syn)
    parts = {name: rows[s] for name, s in SPLITS.items()}
    columns = {}
    for name, part in parts.items():
        images = [os.path.join(syn, r["filepath"]) for r in part]
        captions, labels = [r["title"] for r in part], [int(r["label"]) for r in part]
        columns[name] = datasets.Dataset.from_dict({"image": images, "caption": captions, "label": labels})
        d = out / "imagefolder" / name
        d.mkdir(parents=True)
        names = [f"{name}{i:02d}.png" for i in range(len(part))]
        for src, dst in zip(images, names):
            shutil.copy(src, d / dst)
        pd.DataFrame({"file_name": names, "text": captions, "label": labels}).to_csv(d / "metadata.csv", index=False)
    dd = datasets.DatasetDict({k: v.cast_column("image", datasets.Image()) for k, v in columns.items()})
    dd.save_to_disk(str(out / "disk"))
    return out, parts


@pytest.mark.parametrize("kind", ["disk", "imagefolder"])
def test_split_and_val_split_pick_the_splits_of_one_directory(syn, multi_split, tmp_path, kind):
    out, parts = multi_split
    path = out / kind
    # detect_format recognises a save_to_disk DatasetDict, but not an imagefolder of split folders
    fmt = {"data_format": "imagefolder"} if kind == "imagefolder" else {}

    def expected(split):
        rows = parts[split]
        return [(r["title"], reference_pixels(os.path.join(syn, r["filepath"])).numpy().tobytes()) for r in rows]

    def served(batches):
        return [(c, px.numpy().tobytes()) for b in batches for c, px in zip(b["captions"], b["pixel_values"])]

    # the default val_split is "validation"
    default = cfg_for(path, tmp_path, **fmt)
    assert served(collect(build_eval_loader(default, tokenize, IMAGE_CFG, 4))) == expected("validation")
    cfg = cfg_for(path, tmp_path, val_split="test", label_column="label", **fmt)
    batches = collect(build_eval_loader(cfg, tokenize, IMAGE_CFG, 4))
    assert served(batches) == expected("test")
    assert torch.cat([b["labels"] for b in batches]).tolist() == [int(r["label"]) for r in parts["test"]]
    # training reads `split` (default "train") whatever val_split says
    train = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=0)
    assert len(train) == 2
    assert sorted(c for b in collect(train) for c in b["captions"]) == sorted(r["title"] for r in parts["train"])
    assert list(read_captions(cfg)) == [r["title"] for r in parts["train"]]
    assert list(read_captions(cfg_for(path, tmp_path, split="test", **fmt))) == [r["title"] for r in parts["test"]]
    with pytest.raises(ValueError, match=r"split 'valid_x' not found.*\['train', 'validation', 'test'\]"):
        build_eval_loader(cfg_for(path, tmp_path, val_split="valid_x", **fmt), tokenize, IMAGE_CFG, 4)


# --------------------------------------------------------------------------------------------
# configuration errors at start
# --------------------------------------------------------------------------------------------


def test_wrong_column_names_are_clear_errors(syn, tmp_path):
    csv_path = os.path.join(syn, "train.csv")
    with pytest.raises(ValueError, match="--caption-column 'caption_x' not found.*title"):
        build_train_loader(cfg_for(csv_path, tmp_path, caption_column="caption_x"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="--image-column 'img_x' not found"):
        build_train_loader(cfg_for(csv_path, tmp_path, image_column="img_x"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="--label-column 'klass' not found"):
        build_eval_loader(cfg_for(csv_path, tmp_path, label_column="klass"), tokenize, IMAGE_CFG, 2)
    # a training loader never reads labels, so a wrong label column does not stop it
    assert len(build_train_loader(cfg_for(csv_path, tmp_path, label_column="klass"), tokenize, IMAGE_CFG, 2)) == 12
    wds = os.path.join(syn, "wds", "train")
    with pytest.raises(ValueError, match="--caption-column 'caption' not found.*txt"):
        build_train_loader(cfg_for(wds, tmp_path, caption_column="caption"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="--image-column 'jpg' not found"):
        build_train_loader(cfg_for(wds, tmp_path, image_column="jpg"), tokenize, IMAGE_CFG, 2)
    # no candidate column at all
    d = tmp_path / "nocols"
    d.mkdir()
    pd.DataFrame({"a": ["x"], "b": ["y"]}).to_csv(d / "x.csv", index=False)
    with pytest.raises(ValueError, match="no image column found"):
        build_train_loader(cfg_for(d / "x.csv", tmp_path), tokenize, IMAGE_CFG, 1)


def test_missing_paths_are_clear_errors(syn, tmp_path):
    missing = tmp_path / "nope" / "train.csv"
    train_csv = os.path.join(syn, "train.csv")
    with pytest.raises(FileNotFoundError, match="nope/train.csv"):
        build_train_loader(cfg_for(missing, tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(FileNotFoundError, match="matches no file"):
        build_train_loader(cfg_for(str(tmp_path / "*.tar"), tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(FileNotFoundError, match="check --image-root or --image-column"):
        build_train_loader(cfg_for(train_csv, tmp_path, image_root=str(tmp_path)), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="unknown data format 'xml'"):
        build_train_loader(cfg_for(train_csv, tmp_path, data_format="xml"), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="too few"):
        build_train_loader(cfg_for(os.path.join(syn, "val.csv"), tmp_path), tokenize, IMAGE_CFG, 4, 0, world_size=3)


def test_expand_braces():
    assert expand_braces("s-{008..011}.tar") == ["s-008.tar", "s-009.tar", "s-010.tar", "s-011.tar"]
    assert expand_braces("{a,b}/{1..2}") == ["a/1", "a/2", "b/1", "b/2"]


def _typed_csv(d, name, **columns) -> str:
    pd.DataFrame(columns).to_csv(d / name, index=False)
    return str(d / name)


def test_columns_of_the_wrong_type_are_clear_errors(tmp_path):
    """A column that cannot hold what it should is an error at start naming it, not a skip per sample."""
    d = tmp_path / "types"
    files = write_pngs(d, 4, prefix="i")
    numbers = _typed_csv(d, "numbers.csv", filepath=files, title=[1, 2, 3, 4])
    for build in (build_train_loader, build_eval_loader):
        with pytest.raises(ValueError, match=r"caption column 'title' of csv data at .*numbers\.csv holds int64"):
            build(cfg_for(numbers, tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match=r"caption column 'title' .* holds int64"):
        list(read_captions(cfg_for(numbers, tmp_path)))
    empty = _typed_csv(d, "empty.csv", filepath=files, title=[None] * 4)
    with pytest.raises(ValueError, match=r"caption column 'title' of csv data at .*empty\.csv holds float64"):
        build_train_loader(cfg_for(empty, tmp_path), tokenize, IMAGE_CFG, 2)
    ints = _typed_csv(d, "ints.csv", filepath=[1, 2, 3, 4], title=list("abcd"))
    with pytest.raises(ValueError, match=r"image column 'filepath' of csv data at .*ints\.csv holds int64"):
        build_train_loader(cfg_for(ints, tmp_path), tokenize, IMAGE_CFG, 2)
    # an image column of text that names no file
    text = _typed_csv(d, "text.csv", filepath=files, title=list("abcd"))
    with pytest.raises(FileNotFoundError, match="none of the first 4 image paths in column 'title'"):
        build_train_loader(cfg_for(text, tmp_path, image_column="title", caption_column="filepath"),
                           tokenize, IMAGE_CFG, 2)
    names = _typed_csv(d, "names.csv", filepath=files, title=list("abcd"), label=["cat", "dog", "cat", "owl"])
    cfg = cfg_for(names, tmp_path, label_column="label")
    with pytest.raises(ValueError, match=r"label column 'label' of csv data at .*names\.csv: none of the first 4 "
                                         r"values is an integer class index \(first: 'cat'\)"):
        build_eval_loader(cfg, tokenize, IMAGE_CFG, 2)
    assert len(collect(build_train_loader(cfg, tokenize, IMAGE_CFG, 2))) == 2  # training reads no labels
    flags = _typed_csv(d, "flags.csv", filepath=files, title=list("abcd"), label=[True, False, True, True])
    with pytest.raises(ValueError, match=r"label column 'label' of csv data at .*flags\.csv holds bool"):
        build_eval_loader(cfg_for(flags, tmp_path, label_column="label"), tokenize, IMAGE_CFG, 2)


def test_imagefolder_without_images_is_a_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    text_only = tmp_path / "text_only"
    text_only.mkdir()
    (text_only / "readme.txt").write_text("no images here")
    for d in (empty, text_only):
        cfg = cfg_for(d, tmp_path, data_format="imagefolder")
        with pytest.raises(FileNotFoundError, match=f"imagefolder directory '{d}' holds no image files"):
            build_train_loader(cfg, tokenize, IMAGE_CFG, 2)
