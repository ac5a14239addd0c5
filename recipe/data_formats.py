"""Open image-caption data in its on-disk format through Hugging Face ``datasets``.

Two kinds of source come out of here:

* :class:`MapSource` wraps a map-style :class:`datasets.Dataset` (random access by row) read from
  CSV/TSV, JSON lines, parquet, an imagefolder with a metadata file, or a ``save_to_disk``
  directory. The image column may hold paths (relative to ``image_root`` or to the folder of the
  file that names them), raw bytes, or ``datasets.Image`` values.
* :class:`StreamSource` wraps a streamed :class:`datasets.IterableDataset` over webdataset tar
  shards (``<key>.jpg``/``<key>.png`` + ``<key>.txt``, as img2dataset writes them). Shards are the
  unit ``datasets.distributed.split_dataset_by_node`` and DataLoader workers split on.

Every problem the user can fix (missing path, unknown format, wrong column name) raises here, at
start-up, with the offending name in the message. Problems with single samples are left to the
decoder in :mod:`recipe.data`, which skips and counts them.
"""

from __future__ import annotations

import bisect
import glob
import logging
import os
import re
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import datasets
from datasets import Features, Value

logger = logging.getLogger(__name__)

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

#: Column names tried, in order, when no image/caption column is configured.
IMAGE_COLUMN_CANDIDATES = ("filepath", "image", "image_path", "img", "jpg", "png", "jpeg", "webp", "file_name", "path")
CAPTION_COLUMN_CANDIDATES = ("title", "caption", "text", "txt", "sentence")
#: File extensions read as the image of a webdataset sample when none are configured.
WDS_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
WDS_CAPTION_EXTENSION = "txt"
WDS_LABEL_EXTENSION = "cls"

_BRACE = re.compile(r"\{([^{}]*)\}")


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


def _files_with_suffix(directory: str, suffixes: Sequence[str]) -> list[str]:
    names = sorted(os.listdir(directory))
    return [os.path.join(directory, n) for n in names if n.lower().endswith(tuple(suffixes))]


def _is_disk_dataset(directory: str) -> bool:
    has = set(os.listdir(directory))
    return "dataset_dict.json" in has or {"state.json", "dataset_info.json"} <= has


def detect_format(paths: Sequence[str]) -> str:
    """Guess the format of expanded data paths.

    Files are recognised by suffix (``.csv``, ``.tsv``, ``.jsonl``/``.json``, ``.parquet``,
    ``.tar``). A directory is a ``save_to_disk`` dataset if it has ``state.json`` or
    ``dataset_dict.json``, webdataset if it holds ``.tar`` files, parquet if it holds only
    ``.parquet`` files, and an imagefolder if it holds a ``metadata.csv``/``metadata.jsonl`` or
    image files.

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
            else:
                raise ValueError(f"cannot tell the data format of directory {p!r}; pass format= explicitly")
        else:
            suffix = os.path.splitext(p)[1].lower()
            if suffix not in _SUFFIX_FORMAT:
                raise ValueError(f"cannot tell the data format of {p!r} from its suffix; pass format= explicitly")
            kinds.add(_SUFFIX_FORMAT[suffix])
    if len(kinds) != 1:
        raise ValueError(f"data paths mix formats {sorted(kinds)}; give one format at a time")
    return kinds.pop()


def _files_for_format(paths: Sequence[str], fmt: str) -> list[str]:
    """Replace directories by the files of ``fmt`` inside them (for file-based formats)."""
    out = []
    for p in paths:
        if os.path.isdir(p):
            files = _files_with_suffix(p, _FORMAT_SUFFIXES[fmt])
            if not files:
                raise FileNotFoundError(f"directory {p!r} holds no {'/'.join(_FORMAT_SUFFIXES[fmt])} files")
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


def _pick_column(kind: str, configured: str | None, candidates: Sequence[str], columns: Sequence[str], where: str) -> str:
    if configured is not None:
        if configured not in columns:
            raise ValueError(f"{kind} column {configured!r} not found in {where}; available columns: {list(columns)}")
        return configured
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"no {kind} column found in {where} (tried {list(candidates)}); available columns: {list(columns)}. "
        f"Set {kind}_column explicitly."
    )


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
    """

    key: str
    image: Any
    caption: Any
    label: Any = None
    base_dir: str | None = None
    error: str | None = None


@dataclass
class MapSource:
    """A map-style dataset with resolved column names.

    Attributes:
        dataset: The ``datasets.Dataset``, reduced to the used columns, images undecoded.
        image_column: Column with image paths/bytes.
        caption_column: Column with captions.
        label_column: Column with class labels, or None.
        base_dirs: Per part of the dataset, the folder relative paths resolve against.
        part_starts: Row index at which each part starts (parts are concatenated files).
        description: Human-readable description for messages.
    """

    dataset: datasets.Dataset
    image_column: str
    caption_column: str
    label_column: str | None
    base_dirs: list[str]
    part_starts: list[int]
    description: str

    def __len__(self) -> int:
        return len(self.dataset)

    def base_dir(self, index: int) -> str:
        """Return the folder that relative image paths of row ``index`` resolve against."""
        return self.base_dirs[bisect.bisect_right(self.part_starts, index) - 1]

    def rows(self, indices: Sequence[int]) -> list[RawSample]:
        """Read rows ``indices`` (in that order) as undecoded samples."""
        if len(indices) == 0:
            return []
        cols = self.dataset[[int(i) for i in indices]]
        labels = cols[self.label_column] if self.label_column else [None] * len(indices)
        return [
            RawSample(str(int(i)), img, cap, lab, self.base_dir(int(i)))
            for i, img, cap, lab in zip(indices, cols[self.image_column], cols[self.caption_column], labels)
        ]

    def captions(self) -> list[Any]:
        """All caption values, as stored."""
        return self.dataset[self.caption_column]


def _load_file_parts(files: Sequence[str], fmt: str, separator: str | None, cache_dir: str | None) -> list[datasets.Dataset]:
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

    Raises:
        ValueError: Wrong column name, unknown split, or an empty dataset.
        FileNotFoundError: A directory without files of the requested format.
    """
    if fmt not in MAP_FORMATS:
        raise ValueError(f"format {fmt!r} is not a map-style format {MAP_FORMATS}")
    where = f"{fmt} data at {', '.join(paths)}"
    if fmt in ("csv", "tsv", "json", "parquet"):
        files = _files_for_format(paths, fmt)
        parts = _load_file_parts(files, fmt, csv_separator, cache_dir)
        bases = [image_root or os.path.dirname(f) for f in files]
    elif fmt == "imagefolder":
        parts, bases = [], []
        for d in paths:
            if not os.path.isdir(d):
                raise ValueError(f"imagefolder data must be a directory, got file {d!r}")
            dd = datasets.load_dataset("imagefolder", data_dir=d, cache_dir=cache_dir)
            parts.append(_choose_split(dd, split, d))
            bases.append(image_root or d)
    else:  # disk
        parts, bases = [], []
        for d in paths:
            loaded = datasets.load_from_disk(d)
            if isinstance(loaded, datasets.DatasetDict):
                loaded = _choose_split(loaded, split, d)
            parts.append(loaded)
            bases.append(image_root or d)
    columns = parts[0].column_names
    for p, part in zip(paths, parts[1:]):
        if part.column_names != columns:
            raise ValueError(f"data files have different columns: {columns} vs {part.column_names}")
    img_col = _pick_column("image", image_column, IMAGE_COLUMN_CANDIDATES, columns, where)
    cap_col = _pick_column("caption", caption_column, CAPTION_COLUMN_CANDIDATES, columns, where)
    lab_col = None
    if label_column is not None:
        lab_col = _pick_column("label", label_column, (), columns, where)
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
    source = MapSource(dataset, img_col, cap_col, lab_col, bases, starts, where)
    _check_some_images_exist(source)
    return source


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
            f"{source.description} exists (first: {paths[0]!r}); check image_root or image_column"
        )


# ----------------------------------------------------------------------------------------------
# webdataset tar shards
# ----------------------------------------------------------------------------------------------


def split_member_name(name: str) -> tuple[str | None, str | None]:
    """Split a tar member name into (sample key, extension) the webdataset way.

    The key is the directory plus the basename up to its first dot; the extension is the rest,
    lower-cased. Names without a dot (or hidden files) have no key.
    """
    directory, base = os.path.split(name)
    if "." not in base or base.startswith("."):
        return None, None
    stem, ext = base.split(".", 1)
    return (os.path.join(directory, stem) if directory else stem), ext.lower()


def iter_tar_samples(shards: list[str], fields: tuple[str, ...]) -> Iterator[dict[str, Any]]:
    """Yield webdataset samples of ``shards`` with the raw bytes of ``fields``.

    Used as the generator of a ``datasets.IterableDataset``; ``shards`` is the list that
    ``datasets`` splits between nodes and workers. A shard that cannot be read to its end yields
    one record with ``__error__`` set, so the loss is counted instead of ending the stream.
    """
    for url in shards:
        key, sample = None, {}
        try:
            with tarfile.open(url, "r|*") as tf:
                for member in tf:
                    if not member.isfile():
                        continue
                    k, ext = split_member_name(member.name)
                    if k is None:
                        continue
                    if k != key:
                        if key is not None:
                            yield _tar_record(url, key, sample, fields)
                        key, sample = k, {}
                    if ext in fields:
                        handle = tf.extractfile(member)
                        sample[ext] = handle.read() if handle is not None else None
            if key is not None:
                yield _tar_record(url, key, sample, fields)
        except (tarfile.TarError, OSError, EOFError, zlib.error) as exc:  # truncated or corrupt shard
            record = _tar_record(url, f"{key or ''}<unreadable rest of shard>", {}, fields)
            record["__error__"] = f"{type(exc).__name__}: {exc}"
            yield record


def _tar_record(url: str, key: str, sample: dict[str, bytes], fields: tuple[str, ...]) -> dict[str, Any]:
    record: dict[str, Any] = {"__key__": key, "__url__": url, "__error__": None}
    for f in fields:
        record[f] = sample.get(f)
    return record


def _peek_tar_extensions(url: str, max_samples: int = 8) -> set[str]:
    """Extensions found in the first ``max_samples`` samples of a shard."""
    found: set[str] = set()
    keys: list[str] = []
    with tarfile.open(url, "r|*") as tf:
        for member in tf:
            if not member.isfile():
                continue
            k, ext = split_member_name(member.name)
            if k is None:
                continue
            if not keys or keys[-1] != k:
                if len(keys) == max_samples:
                    break
                keys.append(k)
            found.add(ext)
    return found


def count_tar_samples(url: str) -> int:
    """Count the samples (distinct consecutive keys) of one shard by reading only tar headers."""
    count, last = 0, None
    with tarfile.open(url, "r:*") as tf:
        for member in tf:
            if not member.isfile():
                continue
            k, _ = split_member_name(member.name)
            if k is not None and k != last:
                count += 1
                last = k
    return count


@dataclass
class StreamSource:
    """A streamed webdataset with resolved fields.

    Attributes:
        dataset: The un-shuffled, un-split ``datasets.IterableDataset``; one shard per tar.
        shards: Tar paths, in order.
        image_fields: Extensions tried, in order, for the image of a sample.
        caption_field: Extension holding the caption.
        label_field: Extension holding the class label, or None.
        num_samples: Total samples over all shards (given or counted from tar headers).
        description: Human-readable description for messages.
    """

    dataset: datasets.IterableDataset
    shards: list[str]
    image_fields: tuple[str, ...]
    caption_field: str
    label_field: str | None
    num_samples: int
    description: str = ""
    fields: tuple[str, ...] = field(default=())

    def to_raw(self, record: dict[str, Any]) -> RawSample:
        """Convert one streamed record to an undecoded sample."""
        image = None
        for f in self.image_fields:
            if record.get(f) is not None:
                image = record[f]
                break
        key = f"{os.path.basename(record['__url__'])}/{record['__key__']}"
        label = record.get(self.label_field) if self.label_field else None
        return RawSample(key, image, record.get(self.caption_field), label, None, record.get("__error__"))


def open_stream_source(
    paths: Sequence[str],
    *,
    image_column: str | None = None,
    caption_column: str | None = None,
    label_column: str | None = None,
    num_samples: int | None = None,
) -> StreamSource:
    """Open webdataset tar shards as a streamed ``datasets.IterableDataset``.

    Args:
        paths: Expanded paths: tar files and/or directories of tar files.
        image_column: Image extension(s), ``;``-separated (``"jpg;png"``); default: any of
            :data:`WDS_IMAGE_EXTENSIONS`.
        caption_column: Caption extension (default ``"txt"``).
        label_column: Label extension (e.g. ``"cls"``), or None.
        num_samples: Total number of samples; counted from the tar headers if None.

    Raises:
        ValueError: If a configured extension is absent from the first samples of the first shard.
        FileNotFoundError: A directory without tar files.
    """
    shards = _files_for_format(paths, "webdataset")
    where = f"webdataset shards {shards[0]}{' ...' if len(shards) > 1 else ''} ({len(shards)} shards)"
    try:
        found = _peek_tar_extensions(shards[0])
    except (tarfile.TarError, OSError) as exc:
        raise ValueError(f"cannot read tar shard {shards[0]!r}: {exc}") from exc
    if image_column is None:
        image_fields = WDS_IMAGE_EXTENSIONS
        if not found & set(image_fields):
            raise ValueError(
                f"no image files ({', '.join(image_fields)}) in the first samples of {where}; "
                f"extensions found: {sorted(found)}. Set image_column."
            )
    else:
        image_fields = tuple(e.strip().lower().lstrip(".") for e in image_column.split(";") if e.strip())
        if not found & set(image_fields):
            raise ValueError(f"image column {image_column!r} not found in {where}; extensions found: {sorted(found)}")
    caption_field = (caption_column or WDS_CAPTION_EXTENSION).lower().lstrip(".")
    if caption_field not in found:
        raise ValueError(f"caption column {caption_field!r} not found in {where}; extensions found: {sorted(found)}")
    label_field = None
    if label_column is not None:
        label_field = label_column.lower().lstrip(".")
        if label_field not in found:
            raise ValueError(f"label column {label_field!r} not found in {where}; extensions found: {sorted(found)}")
    fields = tuple(dict.fromkeys([*image_fields, caption_field, *([label_field] if label_field else [])]))
    features = Features(
        {"__key__": Value("string"), "__url__": Value("string"), "__error__": Value("string"), **{f: Value("binary") for f in fields}}
    )
    dataset = datasets.IterableDataset.from_generator(
        iter_tar_samples, features=features, gen_kwargs={"shards": list(shards), "fields": fields}
    )
    if num_samples is None:
        num_samples = sum(count_tar_samples(s) for s in shards)
    if num_samples <= 0:
        raise ValueError(f"{where} holds no samples")
    return StreamSource(dataset, list(shards), tuple(image_fields), caption_field, label_field, int(num_samples), where, fields)


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
    "FORMAT_ALIASES",
    "MAP_FORMATS",
    "STREAM_FORMATS",
    "MapSource",
    "RawSample",
    "StreamSource",
    "canonical_format",
    "count_tar_samples",
    "detect_format",
    "expand_braces",
    "expand_paths",
    "iter_tar_samples",
    "open_map_source",
    "open_stream_source",
    "read_image_bytes",
    "resolve_image_path",
    "sniff_separator",
    "split_member_name",
]
