"""Labelled evaluation data without captions: folders of class subfolders (ImageNet-style) and tables
without a caption column give batches of images and labels, bad images are counted skips, and a folder
that is not a known class is an error naming it."""

from __future__ import annotations

import csv

import pytest
import torch

from recipe.data import build_eval_loader, build_train_loader
from recipe.data.formats import detect_format

from .helpers import IMAGE_CFG, cfg_for, collect, png_bytes, reference_pixels, tokenize, write_pngs

FOLDERS = {"n01440764": 3, "n01443537": 2, "n15075141": 4}  # folder -> images


@pytest.fixture()
def class_folder(tmp_path):
    """``val/<folder>/*.JPEG`` with a nested image, a corrupt one, a non-image file and an empty class."""
    root = tmp_path / "val"
    for j, (f, n) in enumerate(FOLDERS.items()):
        (root / f).mkdir(parents=True)
        for i in range(n):
            (root / f / f"{f}_{i}.JPEG").write_bytes(png_bytes(10 * j + i))  # PNG bytes: any decodable image
    (root / "n15075141" / "sub").mkdir()
    (root / "n15075141" / "sub" / "deep.png").write_bytes(png_bytes(7))
    (root / "n01443537" / "broken.JPEG").write_bytes(b"\xff\xd8\xff not really a jpeg")
    (root / "n01443537" / "notes.txt").write_text("ignored")
    (root / "n09999999").mkdir()  # an empty class folder: no images, still a class in sorted order
    (root / "zeroshot.json").write_text("{}")  # files at the top are ignored
    return root


def served(batches) -> list[tuple[str, int]]:
    return [(k, int(lab)) for b in batches for k, lab in zip(b["keys"], b["labels"])]


def test_class_folders_give_images_and_labels_without_captions(class_folder, tmp_path):
    assert detect_format([str(class_folder)]) == "imagefolder"  # class subfolders are recognised
    cfg = cfg_for(class_folder, tmp_path)  # label_column None: class folders are labelled all the same
    loader = build_eval_loader(cfg, tokenize, IMAGE_CFG, 4)
    batches = collect(loader)
    assert all(set(b) == {"pixel_values", "keys", "labels"} for b in batches)  # no captions, no tokens
    assert not loader.has_captions
    assert loader.class_names == ["n01440764", "n01443537", "n09999999", "n15075141"]
    labels = [lab for _, lab in served(batches)]
    # sorted folder order, corrupt image skipped and counted, nested and all suffixes read
    assert labels == [0, 0, 0, 1, 1, 3, 3, 3, 3, 3]
    assert loader.stats["corrupt_image"] == 1 and sum(len(b["keys"]) for b in batches) == 10
    # the pixels are those of the files, in sorted file order within a class folder
    first = reference_pixels(class_folder / "n01440764" / "n01440764_0.JPEG")
    assert torch.equal(batches[0]["pixel_values"][0], first)

    classes = {"n15075141": 999, "n01440764": 0, "n01443537": 1, "n09999999": 5}
    loader = build_eval_loader(cfg, tokenize, IMAGE_CFG, 3, classes=classes)
    assert [lab for _, lab in served(collect(loader))] == [0, 0, 0, 1, 1, 999, 999, 999, 999, 999]
    assert loader.class_names is None  # numbered by the mapping

    # two ranks: contiguous shares, together every good sample once
    shares = [served(collect(build_eval_loader(cfg, tokenize, IMAGE_CFG, 2, r, 2, classes=classes)))
              for r in range(2)]
    assert sorted(lab for s in shares for _, lab in s) == [0, 0, 0, 1, 1, 999, 999, 999, 999, 999]


def test_unknown_class_folder_and_images_outside_class_folders_are_errors(class_folder, tmp_path):
    cfg = cfg_for(class_folder, tmp_path)
    with pytest.raises(ValueError, match=r"class folder 'n09999999' .* is not one of the 3 classes"):
        build_eval_loader(cfg, tokenize, IMAGE_CFG, 4, classes={"n01440764": 0, "n01443537": 1, "n15075141": 2})
    (class_folder / "loose.jpg").write_bytes(png_bytes(1))
    with pytest.raises(ValueError, match="holds image files outside class folders .*'loose.jpg'"):
        build_eval_loader(cfg, tokenize, IMAGE_CFG, 4)
    with pytest.raises(ValueError, match="no caption column"):  # training needs captions
        build_train_loader(cfg_for(class_folder / "n01440764", tmp_path), tokenize, IMAGE_CFG, 1)


def test_a_folder_of_split_folders_reads_its_val_split(tmp_path):
    root = tmp_path / "splits"
    for split, classes in (("train", ["a"]), ("validation", ["b", "c"])):
        for c in classes:
            (root / split / c).mkdir(parents=True)
            (root / split / c / "x.png").write_bytes(png_bytes(len(c)))
    loader = build_eval_loader(cfg_for(root, tmp_path), tokenize, IMAGE_CFG, 8)  # val_split "validation"
    assert [lab for _, lab in served(collect(loader))] == [0, 1] and loader.class_names == ["b", "c"]


def test_a_table_without_captions_is_labelled_evaluation_data(tmp_path):
    d = tmp_path / "table"
    rows = [{"filepath": name, "label": i % 2} for i, name in enumerate(write_pngs(d, 5))]
    with open(d / "val.csv", "w", newline="") as f:
        w = csv.DictWriter(f, ["filepath", "label"])
        w.writeheader()
        w.writerows(rows)
    cfg = cfg_for(d / "val.csv", tmp_path, label_column="label")
    loader = build_eval_loader(cfg, tokenize, IMAGE_CFG, 2)
    batches = collect(loader)
    assert not loader.has_captions and all("input_ids" not in b and "captions" not in b for b in batches)
    assert torch.cat([b["labels"] for b in batches]).tolist() == [0, 1, 0, 1, 0]
    with pytest.raises(ValueError, match="no caption column"):  # without labels: nothing to evaluate
        build_eval_loader(cfg_for(d / "val.csv", tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(ValueError, match="--caption-column 'title' not found"):  # a configured column must exist
        build_eval_loader(cfg_for(d / "val.csv", tmp_path, label_column="label", caption_column="title"),
                          tokenize, IMAGE_CFG, 2)
