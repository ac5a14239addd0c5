"""The loader: DataLoader workers make batches, :class:`ClipLoader` merges them in a fixed order.

How an epoch is laid out, how resume works and what happens to bad samples is described in
:mod:`recipe.data`. Every function here reads one :class:`recipe.config.DataConfig`: training
loaders its ``train_data``/``split``/``workers``, evaluation loaders its
``val_data``/``val_split``/``eval_workers`` (and ``label_column``). What each worker runs is
:mod:`recipe.data.producer`.
"""

from __future__ import annotations

import functools
import logging
import os
import weakref
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any, Iterator, Mapping, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader

from recipe.config import DataConfig
from recipe.run.preempt import forking_workers, protect_worker

from .classfolder import has_metadata_file, open_class_folder
from .decode import (
    REPEATED,
    SKIP_REASONS,
    PILPipeline,
    SampleDecoder,
    Tokenize,
    build_train_pipeline,
    build_transform,
    clean_caption,
)
from .formats import MAP_FORMATS, MapSource, canonical_format, detect_format, expand_paths, open_map_source
from .plans import Layout, MapPlan, Remainder, StreamPlan, remainder_after
from .producer import _BatchProducer
from .webdataset import StreamSource, open_stream_source

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------
# sources
# ----------------------------------------------------------------------------------------------


def _label_column(cfg: DataConfig, train: bool) -> str | None:
    """The label column an evaluation pass reads (None, or ``""`` in a config, means no labels)."""
    return None if train else (cfg.label_column or None)


def open_source(
    cfg: DataConfig, train: bool = True, classes: Mapping[str, int] | None = None
) -> MapSource | StreamSource:
    """Open and validate the training data of ``cfg`` or, with ``train=False``, its validation data.

    Training reads ``train_data`` (``split`` of a multi-split directory, ``num_samples`` of
    webdataset shards), never labels; evaluation reads ``val_data`` (``val_split``) and the
    ``label_column`` when set. Both use the format, column, ``image_root``, separator and cache
    settings.

    Evaluation data needs no captions when it has labels: a table without a caption column (its
    ``label_column`` then must exist), or an imagefolder without metadata file (class subfolders,
    :func:`recipe.data.classfolder.open_class_folder`: the label is the folder's index in
    ``classes``, a mapping from folder names such as WordNet ids; default: sorted folder order).
    Given ``classes``, an imagefolder is always read by its class folders.

    Raises:
        FileNotFoundError: The path (or all first image paths) do not exist.
        ValueError: No ``val_data`` for evaluation, an unknown format or a wrong column name.
    """
    if train:
        data, split = cfg.train_data, cfg.split
    elif not cfg.val_data:
        raise ValueError("no validation data: DataConfig.val_data is not set (--val-data); an eval loader needs it")
    else:
        data, split = cfg.val_data, cfg.val_split
    paths = expand_paths(data)
    fmt = canonical_format(cfg.data_format) if cfg.data_format else detect_format(paths)
    labels = _label_column(cfg, train)
    if not train and fmt == "imagefolder" and (classes is not None or not has_metadata_file(paths)):
        return open_class_folder(paths, classes, split)
    columns = dict(image_column=cfg.image_column, caption_column=cfg.caption_column, label_column=labels)
    if fmt in MAP_FORMATS:
        return open_map_source(paths, fmt, **columns, image_root=cfg.image_root, csv_separator=cfg.csv_separator,
                               split=split, cache_dir=cfg.cache_dir, require_captions=train)
    return open_stream_source(paths, **columns, num_samples=cfg.num_samples if train else None)


def read_captions(cfg: DataConfig, limit: int | None = None) -> Iterator[str]:
    """Yield the usable captions of the training data (e.g. to train a tokenizer), skipping bad ones."""
    count = 0
    for value in open_source(cfg).captions():
        caption, _ = clean_caption(value)
        if caption is None:
            continue
        yield caption
        count += 1
        if limit is not None and count >= limit:
            return


# ----------------------------------------------------------------------------------------------
# the loader: ordered merge, epochs, resume, counts
# ----------------------------------------------------------------------------------------------


def _identity(item: Any) -> Any:
    return item


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
        seed: Seed of shuffling and augmentation (augmentation is seeded per sample, see
            :func:`recipe.data.producer._sample_seed`).
        num_workers: DataLoader worker processes used (after capping).
        stats: Counts per skip reason (and ``repeated``) over all consumed batches, all epochs.
        epoch_stats: The same for the current epoch.
        description: Where the data comes from.
        num_source_samples: Samples in the whole dataset (all ranks).
        has_captions: Whether batches carry captions (labelled evaluation data may have none).
        class_names: Of class folders numbered in sorted order, the folder name of each label.
    """

    def __init__(self, producer: _BatchProducer, *, num_workers: int, prefetch_factor: int, pin_memory: bool):
        self._producer = producer
        layout = producer.layout
        self.train, self.rank, self.world_size = layout.train, layout.rank, layout.world_size
        self.batch_size, self.seed = layout.batch_size, layout.seed
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor
        self.pin_memory = pin_memory
        self.description = producer.plan.source.description
        self.num_source_samples = producer.plan.source.num_samples
        self.has_captions = producer.decoder.with_captions
        self.class_names: list[str] | None = getattr(producer.plan.source, "class_names", None)
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
        """What an exact mid-epoch resume needs unchanged (the remainder: after an elastic resume)."""
        layout = asdict(self._producer.layout)  # train, batch_size, rank, world_size, seed
        meta = {**layout, "num_workers": self.num_workers, "num_source_samples": self.num_source_samples}
        remainder = getattr(self._producer.plan, "remainder", None)
        meta["remainder"] = remainder.to_dict() if remainder is not None and remainder.epoch == self._epoch else None
        return meta

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
        size; at an epoch boundary only the epoch and counts are taken. A list of every saved
        rank's state from another world size, batch size or worker count re-shards the position
        (:meth:`_load_resharded`, an elastic resume).

        Raises:
            ValueError: On a mismatch that makes an exact mid-epoch resume impossible.
        """
        if isinstance(state, Sequence) and not isinstance(state, Mapping):
            if self._needs_reshard(state):
                self._load_resharded(state)
                return
            state = state[self.rank]
        self.close()
        mid_epoch = state["batches"] > 0 or state["pass"] > 0
        plan = self._producer.plan
        if isinstance(plan, MapPlan):  # mid-epoch: the rest of an epoch an elastic resume began, if any
            plan.set_remainder(Remainder.from_dict(state["meta"].get("remainder")) if mid_epoch else None)
        if mid_epoch:
            saved, here = state["meta"], self._meta()
            here["remainder"] = plan.remainder.to_dict() if getattr(plan, "remainder", None) else None
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

    # --- elastic resume: the position re-sharded over another world size -------------------

    _RESHARDABLE = ("rank", "world_size", "batch_size", "num_workers")

    def _needs_reshard(self, states: Sequence[Mapping[str, Any]]) -> bool:
        """Whether every rank's saved ``states`` need re-sharding here: another number of ranks, or
        (mid-epoch) another batch size or worker count."""
        if len(states) != self.world_size:
            return True
        saved, here = states[self.rank].get("meta", {}), self._meta()
        return any(saved.get(k) != here[k] for k in self._RESHARDABLE if k in saved)

    def _load_resharded(self, states: Sequence[Mapping[str, Any]]) -> None:
        """Continue from every saved rank's position on this loader's world size, batch size and
        workers (an elastic resume).

        The rows the saved ranks read in the current epoch (their workers' read positions through
        the saved layout) are taken out of the epoch's permutation; the rest, in permutation order,
        is this epoch's :class:`recipe.data.plans.Remainder`, dealt ``rest[rank::world]`` to the new
        ranks. So within the epoch no sample is read twice or left out, beyond the fewer than
        ``world_size x batch_size`` rows every epoch leaves at its end. The position is mapped by
        samples, not by batches: with no bad samples the rows read are the permutation's first
        ``steps x accumulation x micro-batch x world size`` of the saving run. Skip counts (of all
        saved ranks) go to rank 0, so that their sum over ranks is kept.

        Raises:
            ValueError: States of different epochs or not one per saved rank, another seed, data
                size or training/evaluation kind, or a mid-epoch position of a streamed source
                (``datasets`` splits a stream by node; its position cannot be re-sharded).
        """
        old_world = len(states)
        metas = [dict(s.get("meta", {})) for s in states]
        if old_world == 0 or any(m.get("world_size") != old_world or m.get("rank") != r for r, m in enumerate(metas)):
            raise ValueError(f"cannot re-shard the data position: expected one state per saved rank in rank "
                             f"order, got ranks {[m.get('rank') for m in metas]} of world sizes "
                             f"{sorted({m.get('world_size') for m in metas}, key=str)}")
        epochs = sorted({int(s["epoch"]) for s in states})
        if len(epochs) != 1:
            raise ValueError(f"cannot re-shard the data position: the saved ranks are in different epochs {epochs}")
        epoch = epochs[0]
        here = self._meta()
        diff = {k: (metas[0].get(k), here[k]) for k in ("train", "seed", "num_source_samples")
                if metas[0].get(k) != here[k]}
        if diff:
            raise ValueError(f"cannot re-shard the data position: data loader settings changed (saved, now): {diff}")
        self.close()
        plan = self._producer.plan
        mid_epoch = any(s["batches"] > 0 or s["pass"] > 0 for s in states)
        total: Counter = Counter()
        epoch_total: Counter = Counter()
        for s in states:
            total.update(s.get("stats", {}))
            epoch_total.update(s.get("epoch_stats", {}))
        if isinstance(plan, MapPlan):
            plan.set_remainder(None)
        self._epoch = epoch
        self._reset_position()
        self.stats = total if self.rank == 0 else Counter()
        if not mid_epoch:
            return
        if not isinstance(plan, MapPlan):
            raise ValueError(
                f"cannot resume the streamed source {self.description} mid-epoch on {self.world_size} ranks "
                f"(saved on {old_world} ranks, batch size {metas[0].get('batch_size')}): datasets splits a "
                "stream by node and its position cannot be re-sharded; resume on the saved layout, or from a "
                "checkpoint at an epoch boundary"
            )
        perm = plan.permutation(epoch)
        read = []
        for r, (s, m) in enumerate(zip(states, metas)):
            old_rem = Remainder.from_dict(m.get("remainder"))
            old = MapPlan(plan.source, Layout(True, int(m["batch_size"]), r, old_world, int(m["seed"])),
                          old_rem if old_rem is not None and old_rem.epoch == epoch else None)
            read.append(old.consumed(epoch, [int(w["pos"]) for w in s["workers"]], int(s["pass"])))
            if old.remainder is not None and r == 0:  # what was read before that earlier elastic resume
                read += [perm[: old.remainder.offset], np.asarray(old.remainder.exclude, dtype=np.int64)]
        plan.set_remainder(remainder_after(perm, epoch, np.concatenate(read)))
        self.epoch_stats = epoch_total if self.rank == 0 else Counter()
        if plan.batches_in(epoch) == 0:  # too little left for one batch per rank: the epoch is over
            self._finish_epoch()

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
        from recipe.training.distributed import collective_device

        t = torch.tensor([self.stats.get(k, 0) for k in keys], dtype=torch.int64, device=collective_device())
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
        finish = getattr(producer.decoder.pipeline, "finish", None)
        target = producer.plan.batches_in(self._epoch)
        while True:
            producer.epoch = self._epoch
            producer.pass_index = self._pass
            producer.num_workers = max(1, self.num_workers)
            producer.starts = {w: (None if s.ended else (s.i, s.pos)) for w, s in enumerate(self._workers)}
            prefetch = self.prefetch_factor if self.num_workers > 0 else None
            # workers deaf to a job-wide SIGTERM/SIGUSR1 (the rank saves, then ends them): recipe.run.preempt
            init = functools.partial(protect_worker, rank_pid=os.getpid()) if self.num_workers > 0 else None
            dl = DataLoader(producer, batch_size=None, num_workers=self.num_workers, collate_fn=_identity,
                            pin_memory=self.pin_memory, prefetch_factor=prefetch, worker_init_fn=init)
            with forking_workers():
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
                    if finish is not None:  # the GPU decode path: pixels made here, on the device
                        batch, finish_stats = finish(batch)
                        self._add_stats(finish_stats)
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
            logger.warning("rank %d's share of %s gave %d of %d batches in pass %d of epoch %d; reading it again",
                           self.rank, self.description, self._emitted, target, self._pass, self._epoch)
            self._pass += 1
            self._pass_emitted = 0
            self._rr = 0
            self._workers = [_WorkerState() for _ in self._workers]


# ----------------------------------------------------------------------------------------------
# factories
# ----------------------------------------------------------------------------------------------


def _build_loader(cfg: DataConfig, tokenize: Tokenize | None, image_data_config: Mapping[str, Any],
                  layout: Layout, classes: Mapping[str, int] | None = None,
                  image_pipeline: str | None = None) -> ClipLoader:
    workers_field = "workers" if layout.train else "eval_workers"
    workers = getattr(cfg, workers_field)
    if workers < 0:
        raise ValueError(f"--{workers_field.replace('_', '-')} must be >= 0, got {workers}")
    source = open_source(cfg, train=layout.train, classes=classes)
    with_labels = source.label_column is not None if isinstance(source, MapSource) else source.label_field is not None
    with_captions = not isinstance(source, MapSource) or source.caption_column is not None
    if layout.train:
        pipeline = build_train_pipeline(image_data_config, cfg, image_pipeline)
    else:
        pipeline = PILPipeline(build_transform(image_data_config, False, cfg))
    decoder = SampleDecoder(pipeline, with_labels, with_captions)
    if isinstance(source, MapSource):
        plan: MapPlan | StreamPlan = MapPlan(source, layout)
    else:
        plan = StreamPlan(source, layout, cfg.shuffle_buffer)
    producer = _BatchProducer(plan, decoder, tokenize, cfg.log_bad_samples)
    num_workers = min(workers, max(1, plan.max_workers()))
    return ClipLoader(producer, num_workers=num_workers, prefetch_factor=cfg.prefetch_factor,
                      pin_memory=cfg.pin_memory)


def build_train_loader(cfg: DataConfig, tokenize: Tokenize | None, image_data_config: Mapping[str, Any],
                       batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0,
                       image_pipeline: str | None = None) -> ClipLoader:
    """Training loader over ``cfg.train_data``: this rank's shuffled share, random resized crops.

    Every rank yields ``len(loader)`` batches of exactly ``batch_size`` samples per epoch. Reads
    ``train_data``, ``split``, ``workers`` (capped by the batches, or by this rank's shard count
    for webdataset), ``shuffle_buffer``, ``num_samples``, ``decode_device`` and the augmentation
    fields of ``cfg``; never labels.

    Images take :func:`recipe.data.decode.build_train_pipeline`'s path: by default
    (``decode_device="cpu"``) the workers crop first and resize uint8 pixels
    (:mod:`recipe.data.images`: timm's crop boxes and normalisation, torch's resampling, draft
    decoding of JPEGs at least twice the output size after the crop); with ``decode_device="cuda"``
    the workers read bytes and the batches' pixels are made on the GPU
    (:mod:`recipe.data.device_decode`; ``pixel_values`` then live on that device).

    Args:
        cfg: Dataset and loading settings.
        tokenize: ``tokenize(list[str]) -> {"input_ids": [B, L], "attention_mask": [B, L]}``;
            None to get captions only.
        image_data_config: timm data config of the image tower (``input_size``, ``mean``,
            ``std``, ``interpolation``, ``crop_pct``, ...).
        batch_size: Per-rank batch size.
        rank: This process's rank.
        world_size: Number of ranks.
        seed: Seed of the shuffling and augmentation (same on all ranks). A sample's augmentation
            depends only on ``seed``, the epoch, its key and which repeat of it this is in the epoch,
            never on batch size, rank, world size or worker count.
        image_pipeline: None (``cfg.decode_device``'s), or one of
            :data:`recipe.data.decode.TRAIN_PIPELINES` (``pil``: timm's transform on the fully
            decoded image, the path before :mod:`recipe.data.images`; ``exact``: no draft decoding).

    Raises:
        FileNotFoundError: Missing data path.
        ValueError: Wrong column name, unknown format, or too little data for one batch per rank.
    """
    return _build_loader(cfg, tokenize, image_data_config, Layout(True, batch_size, rank, world_size, seed),
                         image_pipeline=image_pipeline)


def build_eval_loader(cfg: DataConfig, tokenize: Tokenize | None, image_data_config: Mapping[str, Any],
                      batch_size: int, rank: int = 0, world_size: int = 1,
                      classes: Mapping[str, int] | None = None) -> ClipLoader:
    """Evaluation loader over ``cfg.val_data``: this rank's contiguous share in order, centre crops.

    Reads ``val_data``, ``val_split`` and ``eval_workers``; batches carry ``labels`` when
    ``cfg.label_column`` is set or the data is a folder of class subfolders, and no captions
    (``captions``, ``input_ids``) when the data has none (see :func:`open_source`). The last batch
    may be short and bad samples are skipped (counted), never replaced.

    Args: as :func:`build_train_loader`, without ``seed``; ``classes``: folder name -> class index
        of a folder of class subfolders (see :func:`open_source`).

    Raises:
        ValueError: ``cfg.val_data`` is not set; otherwise as :func:`build_train_loader`.
    """
    return _build_loader(cfg, tokenize, image_data_config, Layout(False, batch_size, rank, world_size), classes)


__all__ = ["ClipLoader", "build_eval_loader", "build_train_loader", "open_source", "read_captions"]
