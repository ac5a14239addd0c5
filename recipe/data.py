"""Image-caption loaders for CLIP training and evaluation.

The train loop calls::

    from recipe.data import DataConfig, build_train_loader, build_eval_loader
    loader = build_train_loader(cfg, tokenize, image_data_config, batch_size, rank, world_size, seed)
    for epoch in range(loader.epoch, epochs):
        loader.set_epoch(epoch)            # keeps a restored mid-epoch position
        for batch in loader:               # dict: pixel_values, input_ids, attention_mask, captions, keys
            ...
        state = loader.state_dict()        # resume with loader.load_state_dict(state)

How the data of an epoch is laid out (per rank ``r`` of ``W``, batch size ``B``):

* Map-style sources (CSV/TSV, JSON lines, parquet, imagefolder, ``save_to_disk``): a permutation
  of all ``N`` rows seeded by ``(seed, epoch)``; rank ``r`` takes rows ``perm[r::W]``, which makes
  the rank shares disjoint and complete. Every rank yields exactly ``N // W // B`` batches of
  exactly ``B`` samples, so collective ops in the train step stay in lock-step. Batch ``b`` is made
  from the block ``share[b*B:(b+1)*B]``; an unreadable sample is replaced by the next sample of the
  same DataLoader worker's stream (its later blocks, then the leftover tail of the share, then a
  second lap over its own samples, whose reuse is counted as ``repeated``).
* Streamed webdataset shards: ``datasets.IterableDataset.shuffle(seed, buffer)`` with
  ``set_epoch(epoch)``, then ``datasets.distributed.split_dataset_by_node`` (whole shards per rank
  when the shard count divides by ``W``, else every ``W``-th sample), then shards per DataLoader
  worker. Each rank again yields exactly ``N // W // B`` batches (``N`` counted from the tar
  headers or given as ``num_samples``); a worker tops up its last batch from the start of its own
  stream, a rank whose share runs short starts another pass over it (both counted as
  ``repeated``), and a rank whose share is longer than its quota leaves the rest for the next
  epoch's shuffle. Shards of equal size in a number divisible by ``W`` times the worker count make
  every epoch one exact pass; with a shard count not divisible by ``W`` every rank reads all shards.
* Evaluation: rank ``r`` takes a contiguous slice of the rows (or its node split of a stream), in
  order, no shuffling, no augmentation, and the last batch may be short. Samples are never
  repeated or dropped except the counted bad ones.

Batches from DataLoader workers are merged in a fixed round-robin order (worker 0, 1, ...,
skipping workers that have finished), so the sequence of batches does not depend on timing. The
position (epoch, batches consumed, each worker's read position) is what
:meth:`ClipLoader.state_dict` saves; :meth:`ClipLoader.load_state_dict` restores it and the next
batch is exactly the one an uninterrupted run would have produced next, augmentation included
(random crops are seeded per batch).

Bad samples -- a missing, unreadable or corrupt image, an empty (``None``/blank) or non-string
caption, an unparsable label, a tar shard that cannot be read to its end -- are skipped and
counted per reason; the first few are logged with their key, and each epoch ends with a summary
line. Counts travel with the batches, so they are exact for what was consumed, and
:meth:`ClipLoader.global_stats` sums them over ranks.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import os
import random
import weakref
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from recipe.data_formats import (
    MAP_FORMATS,
    MapSource,
    RawSample,
    StreamSource,
    canonical_format,
    detect_format,
    expand_paths,
    iter_tar_samples,
    open_map_source,
    open_stream_source,
    read_image_bytes,
)

logger = logging.getLogger(__name__)

#: Reasons a sample is skipped, in the order they are checked.
SKIP_REASONS = (
    "unreadable_shard",
    "empty_caption",
    "bad_caption",
    "bad_label",
    "missing_image",
    "unreadable_image",
    "corrupt_image",
)
#: Count of good samples served a second time in one epoch (top-ups, short shares).
REPEATED = "repeated"
#: File name of the zero-shot class names and prompt templates next to a dataset.
ZEROSHOT_FILENAME = "zeroshot.json"

Tokenize = Callable[[list[str]], Mapping[str, Any]]


@dataclass
class DataConfig:
    """Where one dataset is and how to read it.

    Train and validation data are two configs (``dataclasses.replace(train_cfg, path=...)``).

    Attributes:
        path: A file, directory, glob, brace pattern (``shards-{0000..0099}.tar``), a
            ``::``-separated list, or a list of those.
        format: ``csv``, ``tsv``, ``json`` (JSON lines), ``parquet``, ``imagefolder``, ``disk``
            (``save_to_disk``) or ``webdataset``; detected from the path when None.
        split: Split to use from a multi-split ``save_to_disk``/imagefolder directory.
        image_column: Image column (paths, bytes or ``datasets.Image``); for webdataset the
            extension(s), ``;``-separated (``"jpg;png"``). Auto-detected when None.
        caption_column: Caption column (webdataset: extension, default ``txt``). Auto when None.
        label_column: Class-label column (webdataset: e.g. ``cls``); used by eval loaders only.
        image_root: Folder relative image paths resolve against; default the folder of the file
            naming them (the dataset directory for imagefolder/``save_to_disk``).
        csv_separator: CSV separator; sniffed from the header line when None (OpenCLIP writes
            tab-separated ``.csv`` files).
        num_workers: DataLoader worker processes (0: load in the calling process). Capped by the
            number of batches, or by this rank's shard count for webdataset.
        prefetch_factor: Batches prefetched per worker.
        pin_memory: Pin batches in page-locked memory (for CUDA training).
        shuffle_buffer: Shuffle buffer size for streamed (webdataset) training data.
        num_samples: Total samples of a webdataset; counted from the tar headers when None.
        train_scale: Area range of the random resized crop (OpenCLIP's CLIP recipe: 0.9-1.0).
        train_ratio: Aspect-ratio range of the random resized crop (timm default when None).
        hflip: Horizontal flip probability for training (CLIP used none).
        color_jitter: Colour jitter strength for training (CLIP used none).
        cache_dir: ``datasets`` cache directory for converted CSV/JSON/parquet files.
        log_bad_samples: How many bad samples each worker logs individually per epoch.
    """

    path: str | list[str]
    format: str | None = None
    split: str = "train"
    image_column: str | None = None
    caption_column: str | None = None
    label_column: str | None = None
    image_root: str | None = None
    csv_separator: str | None = None
    num_workers: int = 2
    prefetch_factor: int = 2
    pin_memory: bool = False
    shuffle_buffer: int = 1000
    num_samples: int | None = None
    train_scale: tuple[float, float] = (0.9, 1.0)
    train_ratio: tuple[float, float] | None = None
    hflip: float = 0.0
    color_jitter: float | None = None
    cache_dir: str | None = None
    log_bad_samples: int = 10


# ----------------------------------------------------------------------------------------------
# sources, transforms, decoding
# ----------------------------------------------------------------------------------------------


def open_source(cfg: DataConfig, with_labels: bool = False) -> MapSource | StreamSource:
    """Open the dataset of ``cfg`` and validate its paths and columns.

    Args:
        cfg: The data config.
        with_labels: Whether ``cfg.label_column`` is needed (eval loaders).

    Raises:
        FileNotFoundError: The path (or all first image paths) do not exist.
        ValueError: Unknown format or a wrong column name.
    """
    paths = expand_paths(cfg.path)
    fmt = canonical_format(cfg.format) if cfg.format else detect_format(paths)
    label_column = cfg.label_column if with_labels else None
    if fmt in MAP_FORMATS:
        return open_map_source(
            paths,
            fmt,
            image_column=cfg.image_column,
            caption_column=cfg.caption_column,
            label_column=label_column,
            image_root=cfg.image_root,
            csv_separator=cfg.csv_separator,
            split=cfg.split,
            cache_dir=cfg.cache_dir,
        )
    return open_stream_source(
        paths,
        image_column=cfg.image_column,
        caption_column=cfg.caption_column,
        label_column=label_column,
        num_samples=cfg.num_samples,
    )


def build_transform(image_data_config: Mapping[str, Any], train: bool, cfg: DataConfig | None = None) -> Callable:
    """Image transform from a timm data config (``timm.data.resolve_model_data_config``).

    Training: random resized crop (``cfg.train_scale``/``train_ratio``), optional flip and colour
    jitter; evaluation: resize and centre crop by ``crop_pct``. Both normalise with the config's
    mean and std.

    Args:
        image_data_config: Keys accepted by ``timm.data.create_transform``: ``input_size``,
            ``interpolation``, ``mean``, ``std``, ``crop_pct``, ``crop_mode``.
        train: Training or evaluation transform.
        cfg: Augmentation settings (defaults of :class:`DataConfig` when None).
    """
    from timm.data import create_transform

    cfg = cfg or DataConfig(path="")
    kwargs = dict(image_data_config)
    if train:
        kwargs.update(scale=tuple(cfg.train_scale), hflip=cfg.hflip, color_jitter=cfg.color_jitter)
        if cfg.train_ratio is not None:
            kwargs["ratio"] = tuple(cfg.train_ratio)
    return create_transform(**kwargs, is_training=train)


def clean_caption(value: Any) -> tuple[str | None, str | None]:
    """Return ``(caption, None)`` for a usable caption, else ``(None, reason)``.

    ``None``, NaN and blank strings are ``empty_caption``; bytes are decoded as UTF-8; anything
    else that is not a string (numbers, lists, undecodable bytes) is ``bad_caption``.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None, "empty_caption"
    if isinstance(value, (bytes, bytearray)):
        try:
            value = bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            return None, "bad_caption"
    if not isinstance(value, str):
        return None, "bad_caption"
    value = value.strip()
    if not value:
        return None, "empty_caption"
    return value, None


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


@dataclass
class Sample:
    """One decoded sample."""

    key: str
    pixels: torch.Tensor
    caption: str
    label: int | None = None


class SampleDecoder:
    """Turn a :class:`RawSample` into a :class:`Sample`, or name why it cannot be used."""

    def __init__(self, transform: Callable, with_labels: bool):
        self.transform = transform
        self.with_labels = with_labels

    def __call__(self, raw: RawSample) -> tuple[Sample | None, str | None, str]:
        """Decode one sample.

        Returns:
            ``(sample, None, "")`` or ``(None, reason, detail)`` with a reason of
            :data:`SKIP_REASONS`.
        """
        if raw.error is not None:
            return None, "unreadable_shard", raw.error
        caption, reason = clean_caption(raw.caption)
        if reason is not None:
            return None, reason, f"caption {raw.caption!r:.80}"
        label = None
        if self.with_labels:
            label = clean_label(raw.label)
            if label is None:
                return None, "bad_label", f"label {raw.label!r:.80}"
        try:
            data, where = read_image_bytes(raw.image, raw.base_dir)
        except FileNotFoundError as exc:
            return None, "missing_image", str(exc)
        except (OSError, TypeError) as exc:
            return None, "unreadable_image", f"{type(exc).__name__}: {exc}"
        if data is None:
            return None, "missing_image", "no image in sample"
        try:
            with Image.open(io.BytesIO(data)) as img:
                img.load()
                rgb = img.convert("RGB")
            pixels = self.transform(rgb)
        except Exception as exc:  # PIL raises many types for bad data; all mean a corrupt image
            return None, "corrupt_image", f"{where}: {type(exc).__name__}: {exc}"
        return Sample(raw.key, pixels, caption, label), None, ""


def collate(samples: Sequence[Sample], tokenize: Tokenize | None, with_labels: bool) -> dict[str, Any]:
    """Stack decoded samples into a batch and tokenise the captions.

    Returns:
        ``pixel_values`` (float ``[B, 3, H, W]``), ``captions`` (list of str), ``keys`` (list of
        str), and when ``tokenize`` is given ``input_ids``/``attention_mask`` (long ``[B, L]``),
        and with labels ``labels`` (long ``[B]``).
    """
    captions = [s.caption for s in samples]
    batch: dict[str, Any] = {
        "pixel_values": torch.stack([s.pixels for s in samples]),
        "captions": captions,
        "keys": [s.key for s in samples],
    }
    if tokenize is not None:
        tokens = tokenize(captions)
        for name in ("input_ids", "attention_mask"):
            if name not in tokens:
                raise ValueError(f"tokenize() must return {name!r}; got keys {list(tokens)}")
            value = torch.as_tensor(tokens[name], dtype=torch.long)
            if value.dim() != 2 or value.shape[0] != len(captions):
                raise ValueError(f"tokenize() returned {name} of shape {tuple(value.shape)} for {len(captions)} captions")
            batch[name] = value
    if with_labels:
        batch["labels"] = torch.tensor([s.label for s in samples], dtype=torch.long)
    return batch


# ----------------------------------------------------------------------------------------------
# per-worker sample streams
# ----------------------------------------------------------------------------------------------


class _Cursor:
    """Position-counting iterator over one worker's raw samples that can start further laps.

    Position ``p`` is the ``p``-th sample read since the start of the pass; lap ``p // length``.
    For streams the length is learned when the first lap ends.
    """

    def __init__(self, open_lap: Callable[[int], Iterator[RawSample]], length: int | None, start: int):
        self._open = open_lap
        self.length = length
        self.pos = 0
        self._pending: RawSample | None = None
        if length:
            self.pos = start
            self._it = open_lap(start % length)
        else:
            self._it = open_lap(0)
            while self.pos < start and self.next(wrap=True) is not None:
                pass

    def lap0_done(self) -> bool:
        """Whether every sample of the first lap has been read."""
        if self.length is not None:
            return self.pos >= self.length
        if self._pending is None:
            try:
                self._pending = next(self._it)
            except StopIteration:
                self.length = self.pos
                return True
        return False

    def next(self, wrap: bool) -> tuple[RawSample, int] | None:
        """Next ``(raw sample, lap)``; None at the end of the first lap without ``wrap``, or if empty."""
        if self._pending is not None:
            raw, self._pending = self._pending, None
        else:
            while True:
                try:
                    raw = next(self._it)
                    break
                except StopIteration:
                    if self.length is None:
                        self.length = self.pos
                    if not wrap or self.length == 0:
                        return None
                    self._it = self._open(0)
        lap = self.pos // self.length if self.length else 0
        self.pos += 1
        return raw, lap


class _MapPlan:
    """How the rows of a map-style source are split over ranks, batches and workers."""

    def __init__(self, source: MapSource, train: bool, batch_size: int, rank: int, world_size: int, seed: int):
        self.source = source
        self.train = train
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        n = len(source)
        if train:
            self.num_batches = n // world_size // batch_size
            if self.num_batches == 0:
                raise ValueError(
                    f"{source.description}: {n} samples are too few for world_size={world_size} and batch_size={batch_size}"
                )
        else:
            div, mod = divmod(n, world_size)
            self.eval_start = rank * div + min(rank, mod)
            self.eval_size = div + (1 if rank < mod else 0)
            self.num_batches = math.ceil(self.eval_size / batch_size)

    def max_workers(self) -> int:
        return self.num_batches

    def share(self, epoch: int) -> np.ndarray:
        """This rank's row indices for ``epoch``, in reading order."""
        if not self.train:
            return np.arange(self.eval_start, self.eval_start + self.eval_size, dtype=np.int64)
        perm = np.random.default_rng([self.seed, epoch]).permutation(len(self.source))
        return perm[self.rank :: self.world_size]

    def worker_blocks(self, epoch: int, w: int, k: int) -> list[np.ndarray]:
        share = self.share(epoch)
        b = self.batch_size
        return [share[j * b : (j + 1) * b] for j in range(w, self.num_batches, k)]

    def worker_sequence(self, epoch: int, w: int, k: int) -> np.ndarray:
        """Train: worker ``w``'s blocks followed by its part of the share's leftover tail."""
        share = self.share(epoch)
        tail = share[self.num_batches * self.batch_size :][w::k]
        return np.concatenate([*self.worker_blocks(epoch, w, k), tail]).astype(np.int64)

    def cursor(self, epoch: int, w: int, k: int, start: int) -> tuple[_Cursor, int]:
        seq = self.worker_sequence(epoch, w, k)
        chunk = max(self.batch_size, 16)

        def open_lap(offset: int) -> Iterator[RawSample]:
            for lo in range(offset, len(seq), chunk):
                yield from self.source.rows(seq[lo : lo + chunk])

        return _Cursor(open_lap, len(seq), start), len(range(w, self.num_batches, k))


class _StreamPlan:
    """How a streamed webdataset is split over ranks and workers (``datasets`` does the split)."""

    def __init__(
        self, source: StreamSource, train: bool, batch_size: int, rank: int, world_size: int, seed: int, shuffle_buffer: int
    ):
        from datasets.distributed import split_dataset_by_node

        self.source = source
        self.train = train
        self.batch_size = batch_size
        ds = source.dataset
        if train:
            ds = ds.shuffle(seed=seed, buffer_size=max(1, shuffle_buffer))
        self.dataset = split_dataset_by_node(ds, rank=rank, world_size=world_size)
        n_shards = len(source.shards)
        self.rank_shards = n_shards // world_size if n_shards % world_size == 0 else n_shards
        n = source.num_samples
        if train:
            self.num_batches = n // world_size // batch_size
            if self.num_batches == 0:
                raise ValueError(
                    f"{source.description}: {n} samples are too few for world_size={world_size} and batch_size={batch_size}"
                )
        else:
            per_rank = n // world_size + (1 if rank < n % world_size else 0)
            self.num_batches = math.ceil(per_rank / batch_size)

    def max_workers(self) -> int:
        return self.rank_shards

    def cursor(self, epoch: int, start: int) -> _Cursor:
        self.dataset.set_epoch(epoch)

        def open_lap(offset: int) -> Iterator[RawSample]:
            for record in self.dataset:
                yield self.source.to_raw(record)

        return _Cursor(open_lap, None, start)


@contextlib.contextmanager
def _seeded(*entropy: int) -> Iterator[None]:
    """Seed Python's and torch's CPU RNGs for one batch, restoring them afterwards."""
    state = random.getstate()
    seed = int(np.random.SeedSequence([int(e) for e in entropy]).generate_state(1)[0])
    with torch.random.fork_rng(devices=[]):
        random.seed(seed)
        torch.manual_seed(seed)
        try:
            yield
        finally:
            random.setstate(state)


class _BatchProducer(IterableDataset):
    """Runs in each DataLoader worker: reads, decodes and collates that worker's batches.

    Yields items ``{"w", "i", "pos", "batch", "stats", "end"}``: ``i`` counts the worker's items,
    ``pos`` is its stream position after the item, ``stats`` the skips met while making it. The
    last item of every worker has ``end=True``.
    """

    def __init__(
        self,
        plan: _MapPlan | _StreamPlan,
        decoder: SampleDecoder,
        tokenize: Tokenize | None,
        batch_size: int,
        seed: int,
        rank: int,
        train: bool,
        log_limit: int,
    ):
        self.plan = plan
        self.decoder = decoder
        self.tokenize = tokenize
        self.batch_size = batch_size
        self.seed = seed
        self.rank = rank
        self.train = train
        self.log_limit = log_limit
        self.epoch = 0
        self.pass_index = 0
        self.num_workers = 1
        self.starts: dict[int, tuple[int, int] | None] = {}
        self._logged = 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        w = info.id if info is not None else 0
        k = self.num_workers
        start = self.starts.get(w, (0, 0))
        if start is None:  # this worker already finished in the restored position
            return
        i, pos = start
        self._logged = 0
        if isinstance(self.plan, _MapPlan) and not self.train:
            yield from self._blocks(w, k, i)
        elif isinstance(self.plan, _MapPlan):
            cursor, count = self.plan.cursor(self.epoch, w, k, pos)
            yield from self._fill(w, k, i, cursor, max_batches=count, stop_at_lap_end=False)
        elif self.train:
            yield from self._fill(w, k, i, self.plan.cursor(self.epoch, pos), max_batches=None, stop_at_lap_end=True)
        else:
            yield from self._stream_eval(w, i, self.plan.cursor(self.epoch, pos))

    def _decode(self, raw: RawSample, repeated: bool, stats: Counter) -> Sample | None:
        sample, reason, detail = self.decoder(raw)
        if reason is None:
            if repeated:
                stats[REPEATED] += 1
            return sample
        if not repeated:
            stats[reason] += 1
            if self._logged < self.log_limit:
                self._logged += 1
                logger.warning("skipping sample %s (%s): %s", raw.key, reason, detail)
        return None

    def _item(self, w: int, i: int, pos: int, samples: list[Sample] | None, stats: Counter, end: bool = False) -> dict:
        batch = collate(samples, self.tokenize, self.decoder.with_labels) if samples else None
        return {"w": w, "i": i, "pos": pos, "batch": batch, "stats": dict(stats), "end": end}

    def _fill(
        self, w: int, k: int, i: int, cursor: _Cursor, max_batches: int | None, stop_at_lap_end: bool
    ) -> Iterator[dict]:
        stats: Counter = Counter()
        last_good = cursor.pos
        while max_batches is None or i < max_batches:
            if stop_at_lap_end and cursor.lap0_done():
                break
            samples: list[Sample] = []
            # Map-style worker w's i-th batch is block w + i*k whatever the worker count, so its
            # augmentation seed is that block's index; a stream batch is known by (worker, item).
            batch_id = (w + i * k, 0) if max_batches is not None else (w, i)
            with _seeded(self.seed, self.epoch, self.pass_index, self.rank, *batch_id):
                while len(samples) < self.batch_size:
                    got = cursor.next(wrap=True)
                    if got is None:
                        break
                    raw, lap = got
                    sample = self._decode(raw, lap > 0 or self.pass_index > 0, stats)
                    if sample is not None:
                        samples.append(sample)
                        last_good = cursor.pos
                    elif cursor.length is not None and cursor.pos - last_good > cursor.length:
                        break  # a whole lap without one readable sample
            if len(samples) < self.batch_size:
                break
            yield self._item(w, i, cursor.pos, samples, stats)
            stats = Counter()
            i += 1
        yield self._item(w, i, cursor.pos, None, stats, end=True)

    def _stream_eval(self, w: int, i: int, cursor: _Cursor) -> Iterator[dict]:
        stats: Counter = Counter()
        done = False
        while not done:
            samples: list[Sample] = []
            while len(samples) < self.batch_size:
                got = cursor.next(wrap=False)
                if got is None:
                    done = True
                    break
                sample = self._decode(got[0], False, stats)
                if sample is not None:
                    samples.append(sample)
            if samples:
                yield self._item(w, i, cursor.pos, samples, stats)
                stats = Counter()
                i += 1
        yield self._item(w, i, cursor.pos, None, stats, end=True)

    def _blocks(self, w: int, k: int, i: int) -> Iterator[dict]:
        blocks = self.plan.worker_blocks(self.epoch, w, k)
        for j in range(i, len(blocks)):
            stats: Counter = Counter()
            samples = [s for raw in self.plan.source.rows(blocks[j]) if (s := self._decode(raw, False, stats)) is not None]
            yield self._item(w, j, j + 1, samples, stats)
        yield self._item(w, len(blocks), len(blocks), None, Counter(), end=True)


def _identity(item: Any) -> Any:
    return item


# ----------------------------------------------------------------------------------------------
# the loader: ordered merge, epochs, resume, counts
# ----------------------------------------------------------------------------------------------


@dataclass
class _WorkerState:
    i: int = 0
    pos: int = 0
    ended: bool = False


class ClipLoader:
    """Iterable of collated batches with epochs, an exact resumable position and skip counts.

    Iterating yields the rest of the current epoch; when the epoch is complete the loader moves
    to the next one. Breaking out early keeps the position, and iterating again continues there.

    Attributes:
        train: Whether this is a training loader.
        rank: This process's rank.
        world_size: Number of ranks.
        batch_size: Samples per batch.
        num_workers: DataLoader worker processes used (after capping).
        stats: Counts per skip reason (and ``repeated``) over all consumed batches, all epochs.
        epoch_stats: The same for the current epoch.
        description: Where the data comes from.
    """

    def __init__(
        self,
        producer: _BatchProducer,
        *,
        train: bool,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int,
        prefetch_factor: int,
        pin_memory: bool,
        description: str,
        num_source_samples: int,
    ):
        self._producer = producer
        self.train = train
        self.batch_size = batch_size
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.description = description
        self.num_source_samples = num_source_samples
        self.stats: Counter = Counter()
        self.epoch_stats: Counter = Counter()
        self._epoch = 0
        self._reset_position()
        # A weak reference: the running generator (and with it the DataLoader workers) goes away
        # as soon as the caller drops it, e.g. on ``break``, instead of waiting for the cyclic GC.
        self._active: weakref.ref | None = None

    # --- position -------------------------------------------------------------------------

    def _reset_position(self) -> None:
        self._pass = 0
        self._emitted = 0
        self._pass_emitted = 0
        self._rr = 0
        self._workers = [_WorkerState() for _ in range(max(1, self.num_workers))]
        self.epoch_stats = Counter()

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self._epoch

    @property
    def batches_consumed(self) -> int:
        """Batches of the current epoch already yielded."""
        return self._emitted

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``; a no-op when already there, so a restored position is kept."""
        if epoch != self._epoch:
            self.close()
            self._epoch = int(epoch)
            self._reset_position()

    def __len__(self) -> int:
        """Batches per epoch: exact for training; for evaluation the number without skips."""
        return self._producer.plan.num_batches

    def _meta(self) -> dict[str, Any]:
        return {
            "train": self.train,
            "rank": self.rank,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "num_workers": self.num_workers,
            "seed": self.seed,
            "num_source_samples": self.num_source_samples,
        }

    def state_dict(self) -> dict[str, Any]:
        """The position (epoch, pass, batches consumed, per-worker read positions) and counts."""
        return {
            "epoch": self._epoch,
            "pass": self._pass,
            "batches": self._emitted,
            "pass_batches": self._pass_emitted,
            "next_worker": self._rr,
            "workers": [asdict(s) for s in self._workers],
            "stats": dict(self.stats),
            "epoch_stats": dict(self.epoch_stats),
            "meta": self._meta(),
        }

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> None:
        """Restore a position saved by :meth:`state_dict` (or pick this rank's from a list).

        A mid-epoch position needs the same world size, batch size, worker count, seed and data
        size; at an epoch boundary only the epoch and counts are taken.

        Raises:
            ValueError: On a mismatch that makes an exact mid-epoch resume impossible.
        """
        if isinstance(state, Sequence) and not isinstance(state, Mapping):
            if len(state) != self.world_size:
                raise ValueError(f"got {len(state)} rank states for world_size={self.world_size}")
            state = state[self.rank]
        self.close()
        mid_epoch = state["batches"] > 0 or state["pass"] > 0
        if mid_epoch:
            saved, here = state["meta"], self._meta()
            diff = {k: (saved.get(k), v) for k, v in here.items() if saved.get(k) != v}
            if diff:
                raise ValueError(f"cannot resume mid-epoch: data loader settings changed (saved, now): {diff}")
        self._epoch = int(state["epoch"])
        self._reset_position()
        self.stats = Counter(state.get("stats", {}))
        if mid_epoch:
            self._pass = int(state["pass"])
            self._emitted = int(state["batches"])
            self._pass_emitted = int(state["pass_batches"])
            self._rr = int(state["next_worker"])
            self._workers = [_WorkerState(**w) for w in state["workers"]]
            self.epoch_stats = Counter(state.get("epoch_stats", {}))

    def all_rank_state_dicts(self) -> list[dict[str, Any]]:
        """Every rank's :meth:`state_dict` (a collective: call on all ranks)."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return [self.state_dict()]
        out: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(out, self.state_dict())
        return out

    def global_stats(self) -> dict[str, int]:
        """:attr:`stats` summed over all ranks (a collective when torch.distributed is initialised)."""
        import torch.distributed as dist

        keys = [*SKIP_REASONS, REPEATED]
        if not (dist.is_available() and dist.is_initialized()):
            return {k: int(self.stats.get(k, 0)) for k in keys}
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
        t = torch.tensor([self.stats.get(k, 0) for k in keys], dtype=torch.int64, device=device)
        dist.all_reduce(t)
        return {k: int(v) for k, v in zip(keys, t.tolist())}

    @property
    def num_skipped(self) -> int:
        """Samples skipped as bad on this rank, all epochs."""
        return sum(self.stats.get(k, 0) for k in SKIP_REASONS)

    # --- iteration ------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes of an unfinished iteration (the position is kept)."""
        if self._active is not None:
            active, self._active = self._active(), None
            if active is not None:
                active.close()

    def __iter__(self) -> Iterator[dict[str, Any]]:
        self.close()
        if not self.train:  # an evaluation pass always starts from the beginning
            self._reset_position()
        gen = self._run()
        self._active = weakref.ref(gen)
        return gen

    def _add_stats(self, stats: Mapping[str, int]) -> None:
        self.stats.update(stats)
        self.epoch_stats.update(stats)

    def _finish_epoch(self) -> None:
        skipped = {k: v for k, v in self.epoch_stats.items() if k in SKIP_REASONS and v}
        repeated = self.epoch_stats.get(REPEATED, 0)
        msg = (
            f"data {self.description} rank {self.rank}/{self.world_size} epoch {self._epoch}: "
            f"{self._emitted} batches, skipped {sum(skipped.values())} bad samples"
        )
        if skipped:
            msg += " (" + ", ".join(f"{k}={v}" for k, v in sorted(skipped.items())) + ")"
        if repeated:
            msg += f", {repeated} samples repeated to fill batches"
        (logger.warning if skipped else logger.info)(msg)
        if self.train:
            self._epoch += 1
        self._reset_position()

    def _next_worker(self) -> int:
        n = len(self._workers)
        for step in range(n):
            w = (self._rr + step) % n
            if not self._workers[w].ended:
                return w
        raise RuntimeError("no active worker")  # callers check first

    def _run(self) -> Iterator[dict[str, Any]]:
        producer = self._producer
        target = producer.plan.num_batches
        while True:
            producer.epoch = self._epoch
            producer.pass_index = self._pass
            producer.num_workers = max(1, self.num_workers)
            producer.starts = {w: (None if s.ended else (s.i, s.pos)) for w, s in enumerate(self._workers)}
            dl = DataLoader(
                producer,
                batch_size=None,
                num_workers=self.num_workers,
                collate_fn=_identity,
                pin_memory=self.pin_memory,
                prefetch_factor=self.prefetch_factor if self.num_workers > 0 else None,
            )
            it = iter(dl)
            buffer: dict[tuple[int, int], dict] = {}
            try:
                while not all(s.ended for s in self._workers):
                    w = self._next_worker()
                    state = self._workers[w]
                    while (w, state.i) not in buffer:
                        try:
                            item = next(it)
                        except StopIteration:
                            raise RuntimeError(f"data worker {w} stopped before its end marker") from None
                        buffer[(item["w"], item["i"])] = item
                    item = buffer.pop((w, state.i))
                    self._add_stats(item["stats"])
                    self._rr = (w + 1) % len(self._workers)
                    if item["end"]:
                        state.ended = True
                        continue
                    state.i += 1
                    state.pos = item["pos"]
                    if item["batch"] is None:
                        continue
                    self._emitted += 1
                    self._pass_emitted += 1
                    batch = item["batch"]
                    if self.train and self._emitted >= target:
                        it = None
                        self._finish_epoch()
                        yield batch
                        return
                    yield batch
            finally:
                it = None
                buffer.clear()
            if not self.train:
                self._finish_epoch()
                return
            if self._pass_emitted == 0:
                raise RuntimeError(
                    f"no readable samples in rank {self.rank}'s share of {self.description} "
                    f"(skipped so far: {dict(self.epoch_stats)})"
                )
            logger.warning(
                "rank %d's share of %s gave %d of %d batches in pass %d of epoch %d; reading it again",
                self.rank,
                self.description,
                self._emitted,
                target,
                self._pass,
                self._epoch,
            )
            self._pass += 1
            self._pass_emitted = 0
            self._rr = 0
            self._workers = [_WorkerState() for _ in self._workers]


# ----------------------------------------------------------------------------------------------
# factories
# ----------------------------------------------------------------------------------------------


def _build_loader(
    cfg: DataConfig,
    tokenize: Tokenize | None,
    image_data_config: Mapping[str, Any],
    batch_size: int,
    rank: int,
    world_size: int,
    seed: int,
    train: bool,
) -> ClipLoader:
    if batch_size < 1:
        raise ValueError(f"batch_size must be positive, got {batch_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if cfg.num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {cfg.num_workers}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    source = open_source(cfg, with_labels=not train and cfg.label_column is not None)
    transform = build_transform(image_data_config, train, cfg)
    decoder = SampleDecoder(transform, with_labels=not train and cfg.label_column is not None)
    if isinstance(source, MapSource):
        plan: _MapPlan | _StreamPlan = _MapPlan(source, train, batch_size, rank, world_size, seed)
        n = len(source)
    else:
        plan = _StreamPlan(source, train, batch_size, rank, world_size, seed, cfg.shuffle_buffer)
        n = source.num_samples
    num_workers = min(cfg.num_workers, max(1, plan.max_workers()))
    producer = _BatchProducer(plan, decoder, tokenize, batch_size, seed, rank, train, cfg.log_bad_samples)
    return ClipLoader(
        producer,
        train=train,
        batch_size=batch_size,
        rank=rank,
        world_size=world_size,
        seed=seed,
        num_workers=num_workers,
        prefetch_factor=cfg.prefetch_factor,
        pin_memory=cfg.pin_memory,
        description=source.description,
        num_source_samples=n,
    )


def build_train_loader(
    cfg: DataConfig,
    tokenize: Tokenize | None,
    image_data_config: Mapping[str, Any],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
) -> ClipLoader:
    """Training loader: this rank's shuffled share, random-resized-crop augmentation.

    Every rank yields ``len(loader)`` batches of exactly ``batch_size`` samples per epoch.

    Args:
        cfg: Dataset and loading settings.
        tokenize: ``tokenize(list[str]) -> {"input_ids": [B, L], "attention_mask": [B, L]}``;
            None to get captions only.
        image_data_config: timm data config of the image tower (``input_size``, ``mean``,
            ``std``, ``interpolation``, ``crop_pct``, ...).
        batch_size: Per-rank batch size.
        rank: This process's rank.
        world_size: Number of ranks.
        seed: Seed of the shuffling and augmentation (same on all ranks).

    Raises:
        FileNotFoundError: Missing data path.
        ValueError: Wrong column name, unknown format, or too little data for one batch per rank.
    """
    return _build_loader(cfg, tokenize, image_data_config, batch_size, rank, world_size, seed, train=True)


def build_eval_loader(
    cfg: DataConfig,
    tokenize: Tokenize | None,
    image_data_config: Mapping[str, Any],
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> ClipLoader:
    """Evaluation loader: this rank's contiguous share in order, resize + centre crop.

    Batches carry ``labels`` when ``cfg.label_column`` is set. The last batch may be short and
    bad samples are skipped (counted), never replaced.

    Args: as :func:`build_train_loader`, without ``seed``.
    """
    return _build_loader(cfg, tokenize, image_data_config, batch_size, rank, world_size, 0, train=False)


def read_captions(cfg: DataConfig, limit: int | None = None) -> Iterator[str]:
    """Yield the usable captions of a dataset (e.g. to train a tokenizer), skipping bad ones."""
    source = open_source(cfg)
    if isinstance(source, MapSource):
        values: Iterator[Any] = iter(source.captions())
    else:
        fields = (source.caption_field,)
        values = (r[source.caption_field] for r in iter_tar_samples(source.shards, fields) if r["__error__"] is None)
    count = 0
    for value in values:
        caption, _ = clean_caption(value)
        if caption is None:
            continue
        yield caption
        count += 1
        if limit is not None and count >= limit:
            return


# ----------------------------------------------------------------------------------------------
# zero-shot class names and prompts
# ----------------------------------------------------------------------------------------------


@dataclass
class ZeroShotPrompts:
    """Class names and prompt templates for zero-shot classification.

    Attributes:
        classnames: Name of class ``i`` at index ``i``.
        templates: Prompt templates with a ``{}`` (or ``{c}``) placeholder for the class name.
    """

    classnames: list[str]
    templates: list[str] = field(default_factory=lambda: ["a photo of a {}."])

    def prompts(self) -> list[list[str]]:
        """``prompts()[i]`` are the prompts of class ``i``, one per template."""
        return [[t.replace("{c}", c).replace("{}", c) for t in self.templates] for c in self.classnames]


def load_zeroshot_prompts(path: str | os.PathLike) -> ZeroShotPrompts:
    """Read a ``zeroshot.json`` (``{"classnames": [...], "templates": [...]}``).

    Raises:
        FileNotFoundError: The file does not exist.
        ValueError: Missing or malformed fields.
    """
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"zero-shot prompt file {path!r} does not exist")
    with open(path, encoding="utf-8") as f:
        spec = json.load(f)
    names, templates = spec.get("classnames"), spec.get("templates")
    if not names or not all(isinstance(c, str) and c for c in names):
        raise ValueError(f"{path}: 'classnames' must be a non-empty list of strings")
    if not templates or not all(isinstance(t, str) and ("{}" in t or "{c}" in t) for t in templates):
        raise ValueError(f"{path}: 'templates' must be a non-empty list of strings with a '{{}}' placeholder")
    return ZeroShotPrompts(list(names), list(templates))


def find_zeroshot_file(data_path: str | os.PathLike | Sequence[str]) -> str | None:
    """Look for :data:`ZEROSHOT_FILENAME` next to a dataset: in its folder or up to two levels up."""
    first = expand_paths(data_path)[0]
    folder = first if os.path.isdir(first) else os.path.dirname(first)
    for _ in range(3):
        p = os.path.join(folder, ZEROSHOT_FILENAME)
        if os.path.exists(p):
            return p
        folder = os.path.dirname(folder)
    return None


__all__ = [
    "REPEATED",
    "SKIP_REASONS",
    "ZEROSHOT_FILENAME",
    "ClipLoader",
    "DataConfig",
    "Sample",
    "SampleDecoder",
    "ZeroShotPrompts",
    "build_eval_loader",
    "build_train_loader",
    "build_transform",
    "clean_caption",
    "clean_label",
    "collate",
    "find_zeroshot_file",
    "load_zeroshot_prompts",
    "open_source",
    "read_captions",
]
