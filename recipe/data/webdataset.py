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
_HEADER_DAMAGE = {
    tarfile.EmptyHeaderError: "the file ends at byte {} without an end-of-archive block (truncated)",
    tarfile.TruncatedHeaderError: "the file ends inside the tar header at byte {} (truncated)",
    tarfile.InvalidHeaderError: "invalid tar header at byte {} (corrupt)",
}


class _DamagedHeaderError(tarfile.ReadError):
    """A missing, cut or invalid header after the first: everything up to it was read intact."""


class _CheckedTarInfo(tarfile.TarInfo):
    """``TarInfo`` whose reader ends an archive only at an end-of-archive (zero) block.

    ``tarfile`` ends an archive silently where the header after a member is missing, cut short or
    invalid, so a truncated shard would read as a shorter one; here that raises
    :class:`_DamagedHeaderError`. (A bad first header is tarfile's own ``ReadError``.)
    """

    @classmethod
    def fromtarfile(cls, tf: tarfile.TarFile) -> tarfile.TarInfo:
        try:
            return super().fromtarfile(tf)
        except tuple(_HEADER_DAMAGE) as exc:
            if tf.offset == 0:
                raise
            raise _DamagedHeaderError(_HEADER_DAMAGE[type(exc)].format(tf.offset)) from None


def _open_tar(url: str, mode: str) -> tarfile.TarFile:
    return tarfile.open(url, mode, tarinfo=_CheckedTarInfo)


def _describe_error(exc: BaseException) -> str:
    text = str(exc) if isinstance(exc, _DamagedHeaderError) else f"{type(exc).__name__}: {exc}"
    return text.replace("\n", " ")


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


def iter_tar_samples(
    shards: list[str], fields: tuple[str, ...], required: tuple[tuple[str, ...], ...] = ()
) -> Iterator[dict[str, Any]]:
    """Yield webdataset samples of ``shards`` with the raw bytes of ``fields``.

    Used as the generator of a ``datasets.IterableDataset``; ``shards`` is the list that
    ``datasets`` splits between nodes and workers. A shard that cannot be read to its end (cut
    short, no end-of-archive block, corrupt, not a tar, missing) yields the samples before the
    damage and then one record with ``__error__`` set, so the loss is counted instead of ending
    the stream or going unnoticed. The sample being read when the damage is met is part of the
    loss unless all its members were read and it has a member of every group of ``required``.
    """
    for url in shards:
        key, sample, last = None, {}, None
        try:
            with _open_tar(url, "r|*") as tf:
                for member, k, ext in _sample_members(tf):
                    if k != key:
                        if key is not None:
                            yield _tar_record(url, key, sample, fields)
                        key, sample = k, {}
                    if ext in fields:
                        handle = tf.extractfile(member)
                        sample[ext] = handle.read() if handle is not None else None
                    last = member.name
            if key is not None:
                yield _tar_record(url, key, sample, fields)
        except _TAR_ERRORS as exc:  # truncated, corrupt, unreadable or missing shard
            intact = isinstance(exc, _DamagedHeaderError) and all(any(f in sample for f in g) for g in required)
            if key is not None and intact:
                yield _tar_record(url, key, sample, fields)
            where = f"past member {last!r}" if last else "from its start"
            lost = f"; sample {key!r} and the rest are lost" if key is not None and not intact else ""
            record = _tar_record(url, f"{'' if intact else key or ''}<unreadable rest of shard>", {}, fields)
            record["__error__"] = f"the shard cannot be read {where}: {_describe_error(exc)}{lost}"
            yield record


def _tar_record(url: str, key: str, sample: dict[str, bytes], fields: tuple[str, ...]) -> dict[str, Any]:
    record: dict[str, Any] = {"__key__": key, "__url__": url, "__error__": None}
    for f in fields:
        record[f] = sample.get(f)
    return record


def _scan_tar(url: str, max_samples: int | None = None) -> tuple[int, set[str], str | None]:
    """Read the headers of one shard (up to ``max_samples`` samples).

    Returns:
        The samples (distinct consecutive keys) whose headers precede any damage, the
        extensions seen, and what stopped the reading early (None if read to its end).
    """
    count, last, found = 0, None, set()
    try:
        with _open_tar(url, "r:*") as tf:
            for _, k, ext in _sample_members(tf):
                if k != last:
                    if count == max_samples:
                        break
                    count += 1
                    last = k
                found.add(ext)
    except _TAR_ERRORS as exc:
        return count, found, _describe_error(exc)
    return count, found, None


def _warn_damaged(url: str, error: str, count: int | None = None) -> None:
    counted = "" if count is None else f"; counted {count} samples from its headers"
    logger.warning("tar shard %s cannot be read to its end (%s)%s; reading it yields the samples before the "
                   "damage and counts the rest as one unreadable_shard", url, error, counted)


def _peek_tar_extensions(
    shards: Sequence[str], damaged: dict[str, str], max_samples: int = 8
) -> tuple[set[str], int]:
    """Extensions of the first ``max_samples`` samples, read from as many shards as that takes.

    Damaged shards are added to ``damaged`` (path -> what is wrong). Returns the extensions and
    the number of samples seen.
    """
    found: set[str] = set()
    seen = 0
    for url in shards:
        count, exts, error = _scan_tar(url, max_samples - seen)
        found |= exts
        seen += count
        if error is not None:
            damaged[url] = error
        if seen >= max_samples:
            break
    return found, seen


def count_tar_samples(url: str) -> int:
    """Count the samples (distinct consecutive keys) of one shard by reading only tar headers.

    A shard that cannot be read to its end (cut short, without end-of-archive block, corrupt, not
    a tar) counts the samples whose headers precede the damage and logs a warning naming it;
    reading it yields an ``unreadable_shard`` record there.
    """
    count, _, error = _scan_tar(url)
    if error is not None:
        _warn_damaged(url, error, count)
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
        url, key, error = record["__url__"], record["__key__"], record.get("__error__")
        image = None
        for f in self.image_fields:
            if record.get(f) is not None:
                image = {"bytes": record[f], "path": f"{key}.{f}"}
                break
        label = record.get(self.label_field) if self.label_field else None
        origin = f"tar shard {url}" if error else f"tar shard {url}, key {key}"
        return RawSample(f"{os.path.basename(url)}/{key}", image, record.get(self.caption_field), label, None,
                         error, origin)

    def captions(self) -> Iterator[Any]:
        """The caption values of all shards in order, as stored (unreadable rests of shards left out)."""
        fields = (self.caption_field,)
        for record in iter_tar_samples(self.shards, fields, (fields,)):
            if record["__error__"] is None:
                yield record[self.caption_field]


def _check_extension(kind: str, wanted: str, found: set[str], where: str) -> str:
    if wanted not in found:
        raise ValueError(f"--{kind}-column {wanted!r} not found in {where}; extensions found: {sorted(found)}")
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

    A shard that cannot be read to its end is not an error: a warning names it, reading it
    yields the samples before the damage and counts the rest as one ``unreadable_shard``.

    Raises:
        ValueError: If a configured extension is absent from the first samples, or no shard
            holds a readable sample.
        FileNotFoundError: A directory without tar files.
    """
    shards = files_for_format(paths, "webdataset")
    where = f"webdataset shards {shards[0]}{' ...' if len(shards) > 1 else ''} ({len(shards)} shards)"
    damaged: dict[str, str] = {}
    found, seen = _peek_tar_extensions(shards, damaged)
    if seen == 0:
        raise ValueError(f"{where} holds no readable samples; damaged shards: "
                         + ("; ".join(f"{url} ({error})" for url, error in damaged.items()) or "none"))
    if image_column is None:
        image_fields = WDS_IMAGE_EXTENSIONS
        if not found & set(image_fields):
            raise ValueError(
                f"no image files ({', '.join(image_fields)}) in the first samples of {where}; "
                f"extensions found: {sorted(found)}. Set --image-column."
            )
    else:
        image_fields = tuple(e.strip().lower().lstrip(".") for e in image_column.split(";") if e.strip())
        if not found & set(image_fields):
            raise ValueError(f"--image-column {image_column!r} not found in {where}; extensions found: {sorted(found)}")
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
    # a usable sample has one member of each group; the tuples go to every node and worker as they
    # are, ``datasets`` splits only the list ``shards`` between them
    required = (tuple(image_fields), (caption_field,), *([(label_field,)] if label_field else []))
    dataset = datasets.IterableDataset.from_generator(
        iter_tar_samples, features=features, gen_kwargs={"shards": list(shards), "fields": fields, "required": required}
    )
    counts: dict[str, int] = {}
    if num_samples is None:
        for url in shards:
            counts[url], _, error = _scan_tar(url)
            if error is not None:
                damaged[url] = error
        num_samples = sum(counts.values())
    for url, error in damaged.items():
        _warn_damaged(url, error, counts.get(url))
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
