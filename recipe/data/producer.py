"""The batch producer: what every DataLoader worker runs to read, decode and collate its batches.

:class:`_BatchProducer` walks one worker's share of a :mod:`recipe.data.plans` plan (a cursor
over a training epoch or stream, or the blocks of an evaluation pass), decodes each raw sample
with a :class:`~recipe.data.decode.SampleDecoder`, counts (and logs the first few) skips and
yields numbered items that :class:`recipe.data.loader.ClipLoader` merges in a fixed order.
Training augmentation is seeded per sample (:func:`_sample_seed`), so a sample looks the same at
any batch size, world size or worker count.

Skip warnings go to the ``recipe.data.loader`` logger, as they did before this module was split
out of the loader.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import random
from collections import Counter
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .decode import REPEATED, Sample, SampleDecoder, Tokenize, collate
from .formats import RawSample
from .plans import Cursor, MapPlan, StreamPlan

# The loader's logger: skip messages keep the name they are filtered and tested by.
logger = logging.getLogger("recipe.data.loader")


@contextlib.contextmanager
def _rng_scope() -> Iterator[None]:
    """Keep Python's and torch's CPU RNG states as they were, whatever the block does with them."""
    state = random.getstate()
    with torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            random.setstate(state)


def _key_words(key: str) -> tuple[int, int]:
    """A sample key as two uint32 words of a stable hash (Python's ``hash`` of a str varies per process)."""
    digest = hashlib.blake2b(key.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")


def _sample_seed(seed: int, epoch: int, key: str, pass_index: int, lap: int) -> int:
    """The augmentation seed of one visit of sample ``key``: the first visit of an epoch is pass 0, lap 0.

    Nothing about batches, ranks or workers goes in, so a sample looks the same at any batch size,
    world size or worker count. ``seed`` is the entropy and the rest the spawn key, so a large
    seed cannot run into the other words.
    """
    spawn_key = (int(epoch), *_key_words(key), int(pass_index), int(lap))
    return int(np.random.SeedSequence(int(seed), spawn_key=spawn_key).generate_state(1)[0])


def _seed_cpu_rngs(seed: int) -> None:
    """Seed Python's ``random`` and torch's CPU generator (the ones the timm transforms draw from)."""
    random.seed(seed)
    torch.random.default_generator.manual_seed(seed)


class _BatchProducer(IterableDataset):
    """Runs in each DataLoader worker: reads, decodes and collates that worker's batches.

    Yields items ``{"w", "i", "pos", "batch", "stats", "end"}``: ``i`` counts the worker's items,
    ``pos`` is its stream position after the item, ``stats`` the skips met while making it. The
    last item of every worker has ``end=True``.
    """

    def __init__(self, plan: MapPlan | StreamPlan, decoder: SampleDecoder, tokenize: Tokenize | None, log_limit: int):
        self.plan = plan
        self.layout = plan.layout
        self.decoder = decoder
        self.tokenize = tokenize
        self.log_limit = log_limit
        # set by ClipLoader before each DataLoader is made
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
        if isinstance(self.plan, MapPlan) and not self.layout.train:
            yield from self._blocks(w, k, i)
        elif isinstance(self.plan, MapPlan):
            cursor, count = self.plan.cursor(self.epoch, w, k, pos)
            yield from self._fill(w, i, cursor, max_batches=count, stop_at_lap_end=False)
        elif self.layout.train:
            yield from self._fill(w, i, self.plan.cursor(self.epoch, pos), max_batches=None, stop_at_lap_end=True)
        else:
            yield from self._stream_eval(w, i, self.plan.cursor(self.epoch, pos))

    def _decode(self, raw: RawSample, repeated: bool, stats: Counter,
                visit: tuple[int, int] | None = None) -> Sample | None:
        """Decode ``raw``, counting (and logging the first few) skips.

        ``visit`` is ``(pass_index, lap)`` of a training sample: its augmentation is then seeded by
        :func:`_sample_seed` right before the decoder runs the transform (callers keep the RNG states
        with :func:`_rng_scope`). Evaluation transforms draw nothing and pass None.
        """
        if visit is not None:
            _seed_cpu_rngs(_sample_seed(self.layout.seed, self.epoch, raw.key, *visit))
        sample, reason, detail = self.decoder(raw)
        if reason is None:
            if repeated:
                stats[REPEATED] += 1
            return sample
        if not repeated:
            stats[reason] += 1
            # a damaged shard is rare and costs many samples: always named, beyond the limit
            if self._logged < self.log_limit or reason == "unreadable_shard":
                self._logged += 1
                origin = f" from {raw.origin}" if raw.origin else ""
                logger.warning("skipping sample %s (%s)%s: %s", raw.key, reason, origin, detail)
        return None

    def _item(self, w: int, i: int, pos: int, samples: list[Sample] | None, stats: Counter, end: bool = False) -> dict:
        dec = self.decoder
        batch = collate(samples, self.tokenize, dec.with_labels, dec.with_captions, dec.pipeline) if samples else None
        return {"w": w, "i": i, "pos": pos, "batch": batch, "stats": dict(stats), "end": end}

    def _fill(self, w: int, i: int, cursor: Cursor, max_batches: int | None, stop_at_lap_end: bool) -> Iterator:
        stats: Counter = Counter()
        last_good = cursor.pos
        lay = self.layout
        while max_batches is None or i < max_batches:
            if stop_at_lap_end and cursor.lap0_done():
                break
            samples: list[Sample] = []
            # Augmentation is seeded per sample, from (seed, epoch, key, pass, lap) only: a sample
            # looks the same whatever batch, rank or worker it lands in, and a repeat of it (a later
            # lap or pass) gets a fresh draw. One RNG save/restore covers the whole batch.
            with _rng_scope():
                while len(samples) < lay.batch_size:
                    got = cursor.next(wrap=True)
                    if got is None:
                        break
                    raw, lap = got
                    sample = self._decode(raw, lap > 0 or self.pass_index > 0, stats, (self.pass_index, lap))
                    if sample is not None:
                        samples.append(sample)
                        last_good = cursor.pos
                    elif cursor.length is not None and cursor.pos - last_good > cursor.length:
                        break  # a whole lap without one readable sample
            if len(samples) < lay.batch_size:
                break
            yield self._item(w, i, cursor.pos, samples, stats)
            stats = Counter()
            i += 1
        yield self._item(w, i, cursor.pos, None, stats, end=True)

    def _stream_eval(self, w: int, i: int, cursor: Cursor) -> Iterator[dict]:
        stats: Counter = Counter()
        done = False
        while not done:
            samples: list[Sample] = []
            while len(samples) < self.layout.batch_size:
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
            rows = self.plan.source.rows(blocks[j])
            samples = [s for raw in rows if (s := self._decode(raw, False, stats)) is not None]
            yield self._item(w, j, j + 1, samples, stats)
        yield self._item(w, len(blocks), len(blocks), None, Counter(), end=True)
