"""Folders of class subfolders as labelled evaluation data without captions.

An ImageNet-style folder ``DIR/<class>/*.JPEG`` (``DIR/n01440764/ILSVRC2012_val_00000293.JPEG``...)
has no metadata file and no captions: the label of an image is its class folder. Evaluation opens
such an imagefolder with :func:`open_class_folder` (zero-shot classification, no retrieval):

* ``classes`` maps folder names to class indices (ImageNet-1k: WordNet id -> 0..999, from
  :mod:`recipe.zeroshot`); any subset of the classes may be present, and a folder it does not name
  is an error naming the folder. Without it the classes are the subfolders in sorted order, as
  torchvision's ``ImageFolder`` numbers them (empty ones included).
* Images are the files with an image suffix anywhere under a class folder (sorted); other files
  are ignored, and image files directly in ``DIR`` are an error. An unreadable or corrupt image is
  a counted skip of the decoder, as for every source.
* ``DIR`` holding split folders only (``train``, ``validation``...) means its ``split`` folder.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import datasets

from .formats import _IMAGE_SUFFIXES, MapSource

#: Subfolder names that make a folder of splits rather than of classes.
SPLIT_NAMES = frozenset({"train", "training", "validation", "valid", "val", "test", "testing", "dev", "eval"})
_METADATA_SUFFIXES = (".csv", ".jsonl", ".json", ".parquet")


def _visible(folder: str) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def has_metadata_file(paths: Sequence[str]) -> bool:
    """Whether an imagefolder has a ``metadata.csv``/``.jsonl``/``.parquet`` anywhere (captions, labels)."""
    for root in paths:
        for _, dirs, names in os.walk(root):
            dirs[:] = [d for d in dirs if not d.startswith(".")]
            if any(n.lower().startswith("metadata.") and n.lower().endswith(_METADATA_SUFFIXES) for n in names):
                return True
    return False


def class_folder_root(directory: str, split: str) -> str:
    """``directory``, or its ``split`` subfolder when every subfolder of it is a split folder."""
    subdirs = [n for n in _visible(directory) if os.path.isdir(os.path.join(directory, n))]
    if split in subdirs and all(n.lower() in SPLIT_NAMES for n in subdirs):
        return os.path.join(directory, split)
    return directory


def _images_under(folder: str) -> list[str]:
    """Image files under ``folder``, relative to it, sorted (hidden folders and files left out)."""
    out = []
    for here, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        rel = os.path.relpath(here, folder)
        for n in sorted(names):
            if not n.startswith(".") and n.lower().endswith(_IMAGE_SUFFIXES):
                out.append(n if rel == "." else os.path.join(rel, n))
    return out


def open_class_folder(
    paths: Sequence[str], classes: Mapping[str, int] | None = None, split: str = "validation"
) -> MapSource:
    """A labelled, caption-less :class:`~recipe.data.formats.MapSource` over folders of class subfolders.

    Args:
        paths: Directories (expanded); each holds class subfolders (or split folders, see ``split``).
        classes: Folder name -> class index; None: the sorted subfolder names of all ``paths``.
        split: The split folder to read when a directory holds split folders only.

    Returns:
        A source with columns ``image`` (paths relative to the class folder) and ``label``, one
        part per class folder; ``class_names`` lists the folder of each index when ``classes`` is None.

    Raises:
        ValueError: A path is not a directory, images lie directly in it, or a class folder is not
            in ``classes`` (the message names it).
        FileNotFoundError: No image file under any class folder.
    """
    roots = []
    for p in paths:
        if not os.path.isdir(p):
            raise ValueError(f"a folder of class subfolders must be a directory, got file {p!r}")
        root = class_folder_root(p, split)
        loose = [n for n in _visible(root) if n.lower().endswith(_IMAGE_SUFFIXES)]
        if loose:
            raise ValueError(
                f"{root!r} holds image files outside class folders (first: {loose[0]!r}); give it a "
                "metadata.csv with captions or labels, or put each image into the folder of its class"
            )
        roots.append((root, [n for n in _visible(root) if os.path.isdir(os.path.join(root, n))]))
    names = sorted({n for _, subdirs in roots for n in subdirs})
    class_names = None
    if classes is None:
        class_names, classes = names, {n: i for i, n in enumerate(names)}
    unknown = [n for n in names if n not in classes]
    if unknown:
        known = ", ".join(repr(k) for k in list(classes)[:3])
        raise ValueError(
            f"class folder {unknown[0]!r} in {', '.join(r for r, _ in roots)} is not one of the {len(classes)} "
            f"classes of the zero-shot class names (such as {known}); {len(unknown)} unknown folder(s): "
            f"{', '.join(repr(u) for u in unknown[:5])}{' ...' if len(unknown) > 5 else ''}"
        )
    images: list[str] = []
    labels: list[int] = []
    bases: list[str] = []
    starts: list[int] = []
    for root, subdirs in roots:
        for name in subdirs:
            found = _images_under(os.path.join(root, name))
            if found:
                starts.append(len(images))
                bases.append(os.path.join(root, name))
                images.extend(found)
                labels.extend([int(classes[name])] * len(found))
    where = f"class folders at {', '.join(r for r, _ in roots)}"
    if not images:
        raise FileNotFoundError(f"{where} hold no image files")
    dataset = datasets.Dataset.from_dict(
        {"image": images, "label": labels},
        features=datasets.Features({"image": datasets.Value("string"), "label": datasets.Value("int64")}),
    )
    return MapSource(dataset, "image", None, "label", bases, starts, where, list(bases), class_names)


__all__ = ["SPLIT_NAMES", "class_folder_root", "has_metadata_file", "open_class_folder"]
