"""Data paths and format names: expand path patterns, tell the format of data, list its files.

:func:`expand_paths` turns a ``train_data``/``val_data`` value (a path, glob, brace pattern such
as ``shard-{000..009}.tar``, ``::``-separated list, or a list of those) into existing paths;
:func:`detect_format` guesses their format from suffixes and directory listings, and
:func:`canonical_format` resolves a configured format name or alias. The sources
(:mod:`recipe.data.formats`, :mod:`recipe.data.webdataset`, :mod:`recipe.data.classfolder`) open
what these find. Nothing here opens a dataset; :func:`sniff_separator` reads one header line.
"""

from __future__ import annotations

import glob
import os
import re
from typing import Sequence

#: Canonical format names and the aliases accepted for them.
FORMAT_ALIASES = {
    "csv": "csv",
    "tsv": "tsv",
    "json": "json",
    "jsonl": "json",
    "parquet": "parquet",
    "imagefolder": "imagefolder",
    "disk": "disk",
    "save_to_disk": "disk",
    "arrow": "disk",
    "webdataset": "webdataset",
    "wds": "webdataset",
    "tar": "webdataset",
}
MAP_FORMATS = ("csv", "tsv", "json", "parquet", "imagefolder", "disk")
STREAM_FORMATS = ("webdataset",)

_SUFFIX_FORMAT = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".tab": "tsv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".tar": "webdataset",
}
_FORMAT_SUFFIXES = {
    "csv": (".csv",),
    "tsv": (".tsv", ".tab"),
    "json": (".json", ".jsonl", ".ndjson"),
    "parquet": (".parquet",),
    "webdataset": (".tar",),
}
_IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff")

_BRACE = re.compile(r"\{([^{}]*)\}")


# ----------------------------------------------------------------------------------------------
# paths and formats
# ----------------------------------------------------------------------------------------------


def canonical_format(fmt: str) -> str:
    """Return the canonical name of a format alias.

    Args:
        fmt: A format name such as ``"csv"``, ``"jsonl"``, ``"wds"`` or ``"save_to_disk"``.

    Raises:
        ValueError: For an unknown name.
    """
    key = fmt.lower().strip()
    if key not in FORMAT_ALIASES:
        raise ValueError(f"unknown data format {fmt!r}; expected one of {sorted(set(FORMAT_ALIASES))}")
    return FORMAT_ALIASES[key]


def expand_braces(pattern: str) -> list[str]:
    """Expand shell-style braces: ``a-{000..002}.tar`` and ``{train,val}.csv``.

    Numeric ranges keep the zero padding of their first bound, as webdataset shard lists use.
    """
    match = _BRACE.search(pattern)
    if match is None:
        return [pattern]
    body = match.group(1)
    head, tail = pattern[: match.start()], pattern[match.end() :]
    range_match = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if range_match:
        lo, hi = range_match.group(1), range_match.group(2)
        width = len(lo)
        items = [str(i).zfill(width) for i in range(int(lo), int(hi) + 1)]
    else:
        items = body.split(",")
    out = []
    for item in items:
        out.extend(expand_braces(head + item + tail))
    return out


def expand_paths(path: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """Turn a path, glob, brace pattern, ``::``-separated list or list of those into paths.

    Directories are returned as they are; every returned path exists.

    Raises:
        FileNotFoundError: Naming the first path or pattern that matches nothing.
    """
    if isinstance(path, (str, os.PathLike)):
        parts = [p for p in str(path).split("::") if p]
    else:
        parts = [str(p) for p in path]
    if not parts:
        raise FileNotFoundError("no data path given")
    out: list[str] = []
    for part in parts:
        part = os.path.expanduser(part)
        for candidate in expand_braces(part):
            if any(ch in candidate for ch in "*?["):
                matches = sorted(glob.glob(candidate))
                if not matches:
                    raise FileNotFoundError(f"data path pattern {candidate!r} matches no file")
                out.extend(matches)
            elif os.path.exists(candidate):
                out.append(candidate)
            else:
                raise FileNotFoundError(f"data path {candidate!r} does not exist")
    return [os.path.abspath(p) for p in out]


def _is_disk_dataset(directory: str) -> bool:
    has = set(os.listdir(directory))
    return "dataset_dict.json" in has or {"state.json", "dataset_info.json"} <= has


def detect_format(paths: Sequence[str]) -> str:
    """Guess the format of expanded data paths.

    Files are recognised by suffix (``.csv``, ``.tsv``, ``.jsonl``/``.json``, ``.parquet``,
    ``.tar``). A directory is a ``save_to_disk`` dataset if it has ``state.json`` or
    ``dataset_dict.json``, webdataset if it holds ``.tar`` files, parquet if it holds only
    ``.parquet`` files, and an imagefolder if it holds a ``metadata.csv``/``metadata.jsonl`` or
    image files, or subfolders with image files (class folders, or split folders).

    Raises:
        ValueError: If the paths are of mixed or unrecognised kinds.
    """
    kinds = set()
    for p in paths:
        if os.path.isdir(p):
            if _is_disk_dataset(p):
                kinds.add("disk")
                continue
            names = os.listdir(p)
            lower = [n.lower() for n in names]
            if any(n.endswith(".tar") for n in lower):
                kinds.add("webdataset")
            elif any(n.startswith("metadata.") for n in lower) or any(n.endswith(_IMAGE_SUFFIXES) for n in lower):
                kinds.add("imagefolder")
            elif lower and all(n.endswith(".parquet") for n in lower):
                kinds.add("parquet")
            elif _has_image_subfolders(p):
                kinds.add("imagefolder")
            else:
                raise ValueError(f"cannot tell the data format of directory {p!r}; set data_format explicitly")
        else:
            suffix = os.path.splitext(p)[1].lower()
            if suffix not in _SUFFIX_FORMAT:
                raise ValueError(f"cannot tell the data format of {p!r} from its suffix; set data_format explicitly")
            kinds.add(_SUFFIX_FORMAT[suffix])
    if len(kinds) != 1:
        raise ValueError(f"data paths mix formats {sorted(kinds)}; give one format at a time")
    return kinds.pop()


def _has_image_subfolders(directory: str) -> bool:
    """Whether a subfolder of ``directory`` holds image files, directly or one level further down."""

    def images_in(folder: str) -> bool:
        return any(n.lower().endswith(_IMAGE_SUFFIXES) for n in os.listdir(folder))

    subdirs = sorted(os.path.join(directory, n) for n in os.listdir(directory) if not n.startswith("."))
    for sub in filter(os.path.isdir, subdirs):
        inner = [os.path.join(sub, n) for n in sorted(os.listdir(sub)) if not n.startswith(".")]
        if images_in(sub) or any(images_in(d) for d in inner[:8] if os.path.isdir(d)):
            return True
    return False


def files_for_format(paths: Sequence[str], fmt: str) -> list[str]:
    """Replace directories by the files of ``fmt`` inside them, sorted by name (file-based formats).

    Raises:
        FileNotFoundError: A directory without such files.
    """
    suffixes = _FORMAT_SUFFIXES[fmt]
    out = []
    for p in paths:
        if os.path.isdir(p):
            files = [os.path.join(p, n) for n in sorted(os.listdir(p)) if n.lower().endswith(suffixes)]
            if not files:
                raise FileNotFoundError(f"directory {p!r} holds no {'/'.join(suffixes)} files")
            out.extend(files)
        else:
            out.append(p)
    return out


def sniff_separator(path: str) -> str:
    """Return ``"\\t"`` if the header line of a CSV file holds a tab, else ``","``.

    OpenCLIP writes tab-separated ``.csv`` files; most other tools write commas.
    """
    with open(path, encoding="utf-8", errors="replace") as f:
        header = f.readline()
    return "\t" if "\t" in header else ","


__all__ = [
    "FORMAT_ALIASES",
    "MAP_FORMATS",
    "STREAM_FORMATS",
    "canonical_format",
    "detect_format",
    "expand_braces",
    "expand_paths",
    "files_for_format",
    "sniff_separator",
]
