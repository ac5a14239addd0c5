"""Find image-caption data on disk and open map-style sources through Hugging Face ``datasets``.

Two kinds of source feed the loaders:

* :class:`MapSource` (here) wraps a map-style :class:`datasets.Dataset` (random access by row)
  read from CSV/TSV, JSON lines, parquet, an imagefolder with a metadata file, or a
  ``save_to_disk`` directory. The image column may hold paths (relative to ``image_root`` or to
  the folder of the file that names them), raw bytes, or ``datasets.Image`` values. Evaluation
  data may have no caption column when it has labels (zero-shot classification only); a folder of
  class subfolders without metadata is such a source (:mod:`recipe.data.classfolder`).
* :class:`recipe.data.webdataset.StreamSource` wraps a streamed :class:`datasets.IterableDataset`
  over webdataset tar shards.

Every problem the user can fix (missing path, unknown format, wrong column name) raises at
start-up, with the offending name in the message; so does a column whose type cannot hold what
it should (numbers as captions, a label column of class names). Problems with single samples are
left to the decoder (:mod:`recipe.data.decode`), which skips and counts them; each raw sample
carries its origin (data file and row, or tar shard and key) for the skip messages.

Paths, format names and format detection live in :mod:`recipe.data.paths`; their public names
are importable from here as well.
"""

from __future__ import annotations

import bisect
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Sequence

import datasets
import numpy as np

from .paths import (
    _IMAGE_SUFFIXES,
    FORMAT_ALIASES,
    MAP_FORMATS,
    STREAM_FORMATS,
    canonical_format,
    detect_format,
    expand_braces,
    expand_paths,
    files_for_format,
    sniff_separator,
)

logger = logging.getLogger(__name__)

#: Column names tried, in order, when no image/caption column is configured.
IMAGE_COLUMN_CANDIDATES = ("filepath", "image", "image_path", "img", "jpg", "png", "jpeg", "webp", "file_name", "path")
CAPTION_COLUMN_CANDIDATES = ("title", "caption", "text", "txt", "sentence")


# ----------------------------------------------------------------------------------------------
# columns
# ----------------------------------------------------------------------------------------------


def _pick_column(
    kind: str, configured: str | None, candidates: Sequence[str], columns: Sequence[str], where: str
) -> str:
    if configured is not None:
        if configured not in columns:
            raise ValueError(f"--{kind}-column {configured!r} not found in {where}; available columns: {list(columns)}")
        return configured
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"no {kind} column found in {where} (tried {list(candidates)}); available columns: {list(columns)}. "
        f"Set --{kind}-column explicitly."
    )


# ----------------------------------------------------------------------------------------------
# samples and map-style sources
# ----------------------------------------------------------------------------------------------


@dataclass
class RawSample:
    """One undecoded sample as read from a source.

    Attributes:
        key: A stable identifier (row index for map sources, ``shard/key`` for streams).
        image: A path (str), encoded bytes, a ``{"bytes", "path"}`` dict, or None.
        caption: The caption value as stored (may be any type, or None).
        label: The class label as stored, or None.
        base_dir: Folder that relative image paths are resolved against.
        error: Set when the reader itself failed (e.g. a truncated tar shard).
        origin: Where the sample comes from, for messages: ``row 5 of /data/train.csv`` or
            ``tar shard /data/00001.tar, key 0000123``.
    """

    key: str
    image: Any
    caption: Any
    label: Any = None
    base_dir: str | None = None
    error: str | None = None
    origin: str = ""


@dataclass
class MapSource:
    """A map-style dataset with resolved column names.

    Attributes:
        dataset: The ``datasets.Dataset``, reduced to the used columns, images undecoded.
        image_column: Column with image paths/bytes.
        caption_column: Column with captions; None for labelled evaluation data without captions.
        label_column: Column with class labels, or None.
        base_dirs: Per part of the dataset, the folder relative paths resolve against.
        part_starts: Row index at which each part starts (parts are concatenated files).
        description: Human-readable description for messages.
        part_names: Per part, the file or directory it was read from (for messages).
        class_names: Of a folder of class subfolders, the folder name of each label index (None
            where a label is not numbered here).
    """

    dataset: datasets.Dataset
    image_column: str
    caption_column: str | None
    label_column: str | None
    base_dirs: list[str]
    part_starts: list[int]
    description: str
    part_names: list[str] = field(default_factory=list)
    class_names: list[str] | None = None

    def __len__(self) -> int:
        return len(self.dataset)

    @property
    def num_samples(self) -> int:
        """Rows of the dataset (as :attr:`recipe.data.webdataset.StreamSource.num_samples`)."""
        return len(self.dataset)

    def base_dir(self, index: int) -> str:
        """Return the folder that relative image paths of row ``index`` resolve against."""
        return self.base_dirs[bisect.bisect_right(self.part_starts, index) - 1]

    def origin(self, index: int) -> str:
        """Where row ``index`` comes from: ``row <row in its file> of <file>``."""
        part = bisect.bisect_right(self.part_starts, index) - 1
        name = self.part_names[part] if part < len(self.part_names) else self.description
        return f"row {index - self.part_starts[part]} of {name}"

    def rows(self, indices: Sequence[int]) -> list[RawSample]:
        """Read rows ``indices`` (in that order) as undecoded samples."""
        if len(indices) == 0:
            return []
        cols = self.dataset[[int(i) for i in indices]]
        labels = cols[self.label_column] if self.label_column else [None] * len(indices)
        captions = cols[self.caption_column] if self.caption_column else [None] * len(indices)
        return [
            RawSample(str(int(i)), img, cap, lab, self.base_dir(int(i)), None, self.origin(int(i)))
            for i, img, cap, lab in zip(indices, cols[self.image_column], captions, labels)
        ]

    def captions(self) -> list[Any]:
        """All caption values, as stored.

        Raises:
            ValueError: The source has no caption column.
        """
        if self.caption_column is None:
            raise ValueError(f"{self.description} has no captions")
        return self.dataset[self.caption_column]


def _load_file_parts(
    files: Sequence[str], fmt: str, separator: str | None, cache_dir: str | None
) -> list[datasets.Dataset]:
    parts = []
    for f in files:
        if fmt in ("csv", "tsv"):
            sep = separator or ("\t" if fmt == "tsv" else sniff_separator(f))
            ds = datasets.load_dataset("csv", data_files=[f], sep=sep, split="train", cache_dir=cache_dir)
        else:
            ds = datasets.load_dataset(fmt, data_files=[f], split="train", cache_dir=cache_dir)
        parts.append(ds)
    return parts


def _choose_split(dd: datasets.DatasetDict, split: str, where: str) -> datasets.Dataset:
    if split in dd:
        return dd[split]
    if len(dd) == 1:
        only = next(iter(dd))
        logger.info("%s has the single split %r; using it for requested split %r", where, only, split)
        return dd[only]
    raise ValueError(f"split {split!r} not found in {where}; available splits: {list(dd)}")


def open_map_source(
    paths: Sequence[str],
    fmt: str,
    *,
    image_column: str | None = None,
    caption_column: str | None = None,
    label_column: str | None = None,
    image_root: str | None = None,
    csv_separator: str | None = None,
    split: str = "train",
    cache_dir: str | None = None,
    require_captions: bool = True,
) -> MapSource:
    """Load a map-style source and check its columns.

    Args:
        paths: Expanded paths (see :func:`expand_paths`).
        fmt: One of :data:`MAP_FORMATS`.
        image_column: Image column; auto-detected from :data:`IMAGE_COLUMN_CANDIDATES` if None.
        caption_column: Caption column; auto-detected from :data:`CAPTION_COLUMN_CANDIDATES` if None.
        label_column: Optional label column; must exist when given.
        image_root: Folder relative image paths resolve against (default: the folder of the
            data file, or the dataset directory).
        csv_separator: CSV separator; sniffed from the header line if None.
        split: Split to take from a multi-split ``save_to_disk``/imagefolder directory.
        cache_dir: ``datasets`` cache directory.
        require_captions: False (evaluation): without a caption column (none configured, none of
            the candidates found) the source has labels only, and the label column must exist.

    Raises:
        ValueError: Wrong column name, a column of the wrong type, no parsable label among the
            first rows, unknown split, or an empty dataset.
        FileNotFoundError: A directory without files of the requested format (or images), or none
            of the first image paths exists.
    """
    if fmt not in MAP_FORMATS:
        raise ValueError(f"format {fmt!r} is not a map-style format {MAP_FORMATS}")
    where = f"{fmt} data at {', '.join(paths)}"
    if fmt in ("csv", "tsv", "json", "parquet"):
        files = files_for_format(paths, fmt)
        parts = _load_file_parts(files, fmt, csv_separator, cache_dir)
        bases = [image_root or os.path.dirname(f) for f in files]
        names = list(files)
    elif fmt == "imagefolder":
        parts, bases, names = [], [], list(paths)
        for d in paths:
            if not os.path.isdir(d):
                raise ValueError(f"imagefolder data must be a directory, got file {d!r}")
            try:
                dd = datasets.load_dataset("imagefolder", data_dir=d, cache_dir=cache_dir)
            except (FileNotFoundError, ValueError) as exc:  # datasets' messages do not always name d
                if not _holds_images(d):
                    raise FileNotFoundError(f"imagefolder directory {d!r} holds no image files") from exc
                raise
            parts.append(_choose_split(dd, split, d))
            bases.append(image_root or d)
    else:  # disk
        parts, bases, names = [], [], list(paths)
        for d in paths:
            loaded = datasets.load_from_disk(d)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = _choose_split(loaded, split, d)
            parts.append(loaded)
            bases.append(image_root or d)
    columns = parts[0].column_names
    for part in parts[1:]:
        if part.column_names != columns:
            raise ValueError(f"data files have different columns: {columns} vs {part.column_names}")
    img_col = _pick_column("image", image_column, IMAGE_COLUMN_CANDIDATES, columns, where)
    lab_col = None
    if label_column is not None:
        lab_col = _pick_column("label", label_column, (), columns, where)
    try:
        cap_col: str | None = _pick_column("caption", caption_column, CAPTION_COLUMN_CANDIDATES, columns, where)
    except ValueError:
        if require_captions or caption_column is not None or lab_col is None:
            raise
        cap_col = None  # labelled evaluation data without captions: zero-shot classification only
        logger.info("%s has no caption column: labels only (no retrieval metrics)", where)
    for kind, col in (("image", img_col), ("caption", cap_col), ("label", lab_col)):
        if col is not None:
            _check_column_type(kind, col, parts[0].features[col], where)
    keep = [c for c in dict.fromkeys([img_col, cap_col, lab_col]) if c is not None]
    starts, total, cleaned = [], 0, []
    for part in parts:
        part = part.select_columns(keep)
        if isinstance(part.features[img_col], datasets.Image):
            part = part.cast_column(img_col, datasets.Image(decode=False))
        starts.append(total)
        total += len(part)
        cleaned.append(part)
    dataset = cleaned[0] if len(cleaned) == 1 else datasets.concatenate_datasets(cleaned)
    if len(dataset) == 0:
        raise ValueError(f"{where} has no rows")
    source = MapSource(dataset, img_col, cap_col, lab_col, bases, starts, where, names)
    _check_some_images_exist(source)
    if lab_col is not None:
        _check_some_labels_parse(source)
    return source


# ----------------------------------------------------------------------------------------------
# start-up checks of column types and values
# ----------------------------------------------------------------------------------------------

#: Types any of the columns may have: text, bytes, or mixed JSON values (``datasets.Json``, checked per sample).
_TEXT_OR_BYTES = ("string", "large_string", "binary", "large_binary", "Json")
_EXPECTED = {"image": "image paths or bytes", "caption": "text", "label": "integer class indices"}


def _check_column_type(kind: str, column: str, feature: Any, where: str) -> None:
    """Raise if a column's type cannot hold what the decoder reads from it.

    Raises:
        ValueError: e.g. a caption column of numbers, or an image column of integers.
    """
    name = feature.dtype if isinstance(feature, datasets.Value) else type(feature).__name__
    ok = name in _TEXT_OR_BYTES
    if kind == "image":
        ok = ok or name == "Image" or (isinstance(feature, dict) and bool({"bytes", "path"} & set(feature)))
    elif kind == "label":
        ok = ok or name == "ClassLabel" or name.startswith(("int", "uint", "float"))
    if not ok:
        raise ValueError(
            f"{kind} column {column!r} of {where} holds {name} values, not {_EXPECTED[kind]}; "
            f"set --{kind}-column to the column that does"
        )


def clean_label(value: Any) -> int | None:
    """Parse a class label (int, numpy integer, or digits as str/bytes); None if unusable."""
    if isinstance(value, (bool, np.bool_)):
        return None
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, (bytes, bytearray)):
        value = bytes(value).decode("utf-8", errors="replace")
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _check_some_labels_parse(source: MapSource, probe: int = 16) -> None:
    """Fail early when none of the first labels is a class index (e.g. a column of class names)."""
    if isinstance(source.dataset.features[source.label_column], datasets.ClassLabel):
        return
    values = source.dataset[:probe][source.label_column]
    if values and all(clean_label(v) is None for v in values):
        raise ValueError(
            f"label column {source.label_column!r} of {source.description}: none of the first {len(values)} "
            f"values is an integer class index (first: {values[0]!r})"
        )


def _holds_images(directory: str) -> bool:
    """Whether a directory tree holds a file with an image suffix that ``datasets``' imagefolder reads."""
    try:
        from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder

        suffixes = tuple(e.lower() for e in ImageFolder.EXTENSIONS)
    except (ImportError, AttributeError):
        suffixes = _IMAGE_SUFFIXES
    return any(n.lower().endswith(suffixes) for _, _, names in os.walk(directory) for n in names)


# ----------------------------------------------------------------------------------------------
# image values
# ----------------------------------------------------------------------------------------------


def resolve_image_path(path: str, base_dir: str | None) -> str:
    """Resolve a possibly relative image path against ``base_dir``."""
    path = os.path.expanduser(path)
    if os.path.isabs(path) or base_dir is None:
        return path
    return os.path.join(base_dir, path)


def _check_some_images_exist(source: MapSource, probe: int = 16) -> None:
    """Fail early when none of the first image paths exists (wrong ``image_root`` or column)."""
    samples = source.rows(range(min(probe, len(source))))
    paths = []
    for s in samples:
        img = s.image
        if isinstance(img, dict):
            if img.get("bytes") is not None:
                return
            img = img.get("path")
        if isinstance(img, (bytes, bytearray)):
            return
        if isinstance(img, str):
            paths.append(resolve_image_path(img, s.base_dir))
    if paths and not any(os.path.exists(p) for p in paths):
        raise FileNotFoundError(
            f"none of the first {len(paths)} image paths in column {source.image_column!r} of "
            f"{source.description} exists (first: {paths[0]!r}); check --image-root or --image-column"
        )


def read_image_bytes(image: Any, base_dir: str | None) -> tuple[bytes | None, str]:
    """Return the encoded bytes of an image value and a description of where they came from.

    Raises:
        FileNotFoundError: The path does not exist.
        OSError: The file exists but cannot be read.
        TypeError: The value is of an unsupported type.
    """
    if isinstance(image, dict):
        if image.get("bytes") is not None:
            return bytes(image["bytes"]), image.get("path") or "<bytes>"
        image = image.get("path")
    if image is None:
        return None, "<none>"
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image), "<bytes>"
    if isinstance(image, str):
        path = resolve_image_path(image, base_dir)
        with open(path, "rb") as f:
            return f.read(), path
    raise TypeError(f"unsupported image value of type {type(image).__name__}")


__all__ = [
    "CAPTION_COLUMN_CANDIDATES",
    "FORMAT_ALIASES",
    "IMAGE_COLUMN_CANDIDATES",
    "MAP_FORMATS",
    "STREAM_FORMATS",
    "MapSource",
    "RawSample",
    "canonical_format",
    "clean_label",
    "detect_format",
    "expand_braces",
    "expand_paths",
    "files_for_format",
    "open_map_source",
    "read_image_bytes",
    "resolve_image_path",
    "sniff_separator",
]
