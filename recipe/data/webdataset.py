"""Webdataset tar shards as a streamed ``datasets.IterableDataset``.

A shard holds samples as consecutive members ``<key>.<ext>`` (``<key>.jpg``/``<key>.png`` +
``<key>.txt``, as img2dataset writes them). Shards are the unit that
``datasets.distributed.split_dataset_by_node`` and DataLoader workers split on.
"""

from __future__ import annotations

import logging
import os
import tarfile
import zlib
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import datasets
from datasets import Features, Value

from .formats import RawSample, files_for_format

logger = logging.getLogger(__name__)

#: File extensions read as the image of a webdataset sample when none are configured.
WDS_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
WDS_CAPTION_EXTENSION = "txt"
WDS_LABEL_EXTENSION = "cls"
#: What reading a truncated or corrupt shard raises.
_TAR_ERRORS = (tarfile.TarError, OSError, EOFError, zlib.error)


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


def _sample_members(tf: tarfile.TarFile) -> Iterator[tuple[tarfile.TarInfo, str, str]]:
    """``(member, key, extension)`` of the regular files of a tar that belong to a sample."""
    for member in tf:
        if not member.isfile():
            continue
        key, ext = split_member_name(member.name)
        if key is not None:
            yield member, key, ext


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
                for member, k, ext in _sample_members(tf):
                    if k != key:
                        if key is not None:
                            yield _tar_record(url, key, sample, fields)
                        key, sample = k, {}
                    if ext in fields:
                        handle = tf.extractfile(member)
                        sample[ext] = handle.read() if handle is not None else None
            if key is not None:
                yield _tar_record(url, key, sample, fields)
        except _TAR_ERRORS as exc:  # truncated or corrupt shard
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
        for _, k, ext in _sample_members(tf):
            if not keys or keys[-1] != k:
                if len(keys) == max_samples:
                    break
                keys.append(k)
            found.add(ext)
    return found


def count_tar_samples(url: str) -> int:
    """Count the samples (distinct consecutive keys) of one shard by reading only tar headers.

    A shard whose headers cannot be read to the end counts the samples before the damage (reading
    it yields an ``unreadable_shard`` record there) and logs a warning.
    """
    count, last = 0, None
    try:
        with tarfile.open(url, "r:*") as tf:
            for _, k, _ in _sample_members(tf):
                if k != last:
                    count += 1
                    last = k
    except _TAR_ERRORS as exc:
        logger.warning("tar shard %s cannot be read to its end (%s: %s); counted %d samples before that",
                       url, type(exc).__name__, exc, count)
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

    def captions(self) -> Iterator[Any]:
        """The caption values of all shards in order, as stored (unreadable rests of shards left out)."""
        for record in iter_tar_samples(self.shards, (self.caption_field,)):
            if record["__error__"] is None:
                yield record[self.caption_field]


def _check_extension(kind: str, wanted: str, found: set[str], where: str) -> str:
    if wanted not in found:
        raise ValueError(f"{kind} column {wanted!r} not found in {where}; extensions found: {sorted(found)}")
    return wanted


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
    shards = files_for_format(paths, "webdataset")
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
    caption_field = _check_extension("caption", caption_field, found, where)
    label_field = None
    if label_column is not None:
        label_field = _check_extension("label", label_column.lower().lstrip("."), found, where)
    fields = tuple(dict.fromkeys([*image_fields, caption_field, *([label_field] if label_field else [])]))
    features = Features(
        {
            "__key__": Value("string"),
            "__url__": Value("string"),
            "__error__": Value("string"),
            **{f: Value("binary") for f in fields},
        }
    )
    dataset = datasets.IterableDataset.from_generator(
        iter_tar_samples, features=features, gen_kwargs={"shards": list(shards), "fields": fields}
    )
    if num_samples is None:
        num_samples = sum(count_tar_samples(s) for s in shards)
    if num_samples <= 0:
        raise ValueError(f"{where} holds no samples")
    return StreamSource(
        dataset, list(shards), tuple(image_fields), caption_field, label_field, int(num_samples), where, fields
    )


__all__ = [
    "WDS_CAPTION_EXTENSION",
    "WDS_IMAGE_EXTENSIONS",
    "WDS_LABEL_EXTENSION",
    "StreamSource",
    "count_tar_samples",
    "iter_tar_samples",
    "open_stream_source",
    "split_member_name",
]
