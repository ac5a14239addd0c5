"""Per-rank plans: which samples a rank reads, in which batches and DataLoader workers, in what order.

* :class:`Layout`: a training or evaluation pass of one rank (batch size, rank, world size, seed)
  and the batch counts that follow from a data size.
* :class:`MapPlan`: a seeded permutation per epoch of a map-style source, ``perm[rank::world]``
  per rank, blocks of ``batch_size`` dealt round-robin to the workers (evaluation: a contiguous
  slice per rank, in order).
* :class:`StreamPlan`: ``datasets`` shuffles a streamed source and splits it by node.
* :class:`Cursor`: one worker's position-counting reader over its samples, which can start
  further laps (to replace bad samples or top up a short share).
* :class:`Remainder`: the rest of one epoch after an elastic resume (another world size or batch
  size): the epoch's permutation without the rows read before the resume, dealt to the new ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from .formats import MapSource, RawSample
from .webdataset import StreamSource


@dataclass(frozen=True)
class Layout:
    """One rank's pass over a dataset: training (shuffled, full batches) or evaluation (in order).

    Raises:
        ValueError: A batch size below 1, a rank outside ``[0, world_size)`` or a negative seed.
    """

    train: bool
    batch_size: int
    rank: int = 0
    world_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be positive, got {self.batch_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.seed < 0:
            raise ValueError(f"seed must be >= 0, got {self.seed}")

    def eval_slice(self, n: int) -> tuple[int, int]:
        """Start and size of this rank's contiguous evaluation share of ``n`` samples."""
        div, mod = divmod(n, self.world_size)
        return self.rank * div + min(self.rank, mod), div + (1 if self.rank < mod else 0)

    def num_batches(self, n: int, description: str) -> int:
        """Batches per epoch of ``n`` samples: ``n // world_size // batch_size`` full ones for
        training, every sample of the rank's share (the last batch may be short) for evaluation.

        Raises:
            ValueError: Training data too small for one batch per rank.
        """
        if not self.train:
            return math.ceil(self.eval_slice(n)[1] / self.batch_size)
        count = n // self.world_size // self.batch_size
        if count == 0:
            raise ValueError(
                f"{description}: {n} samples are too few for world_size={self.world_size} "
                f"and batch_size={self.batch_size}"
            )
        return count


class Cursor:
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


@dataclass(frozen=True)
class Remainder:
    """The unread rest of training epoch ``epoch`` after an elastic resume.

    The rows read before the resume are the first ``offset`` rows of the epoch's permutation plus
    the rows in ``exclude`` (read ahead of that prefix, e.g. to replace bad samples); the rest of the
    permutation, in its order, is what the ranks of the resumed run share (``rest[rank::world]``).
    Without bad samples ``exclude`` is empty and ``offset`` is the samples consumed: steps in the
    epoch x accumulation x micro-batch x world size of the saving run.
    """

    epoch: int
    offset: int
    exclude: tuple[int, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "offset": self.offset, "exclude": list(self.exclude)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> Remainder | None:
        if d is None:
            return None
        return cls(int(d["epoch"]), int(d["offset"]), tuple(int(x) for x in d.get("exclude", ())))


class MapPlan:
    """How the rows of a map-style source are split over ranks, batches and workers.

    ``num_batches`` is the batches of a whole epoch; :meth:`batches_in` those of one epoch, which
    differ only in the epoch a :class:`Remainder` (an elastic resume) covers.
    """

    def __init__(self, source: MapSource, layout: Layout, remainder: Remainder | None = None):
        self.source = source
        self.layout = layout
        self.num_batches = layout.num_batches(len(source), source.description)
        self.remainder: Remainder | None = None
        if remainder is not None:
            self.set_remainder(remainder)

    def max_workers(self) -> int:
        return self.num_batches

    # --- elastic resume: the rest of an epoch (see Remainder) ---------------------------------

    def set_remainder(self, remainder: Remainder | None) -> None:
        """Let ``remainder.epoch`` cover only its unread rows (None: every epoch whole).

        Raises:
            ValueError: An evaluation plan, or an offset/excluded row outside the data.
        """
        if remainder is not None:
            n = len(self.source)
            if not self.layout.train:
                raise ValueError("an evaluation pass has no position to re-shard")
            if not 0 <= remainder.offset <= n or any(not 0 <= x < n for x in remainder.exclude):
                raise ValueError(f"remainder {remainder} does not fit {self.source.description} ({n} rows)")
        self.remainder = remainder

    def _covers(self, epoch: int) -> bool:
        return self.remainder is not None and self.remainder.epoch == epoch

    def permutation(self, epoch: int) -> np.ndarray:
        """Training: the epoch's order of all rows (the same for every world and batch size)."""
        return np.random.default_rng([self.layout.seed, epoch]).permutation(len(self.source))

    def epoch_rows(self, epoch: int) -> np.ndarray:
        """The rows all ranks share in ``epoch``, in order: the permutation, or its unread rest."""
        perm = self.permutation(epoch)
        if not self._covers(epoch):
            return perm
        rest = perm[self.remainder.offset :]
        if self.remainder.exclude:
            rest = rest[~np.isin(rest, np.asarray(self.remainder.exclude, dtype=np.int64))]
        return rest

    def batches_in(self, epoch: int) -> int:
        """Batches each rank makes in ``epoch`` (0 when a remainder is too short for one per rank)."""
        if not self._covers(epoch):
            return self.num_batches
        return len(self.epoch_rows(epoch)) // self.layout.world_size // self.layout.batch_size

    def consumed(self, epoch: int, positions: list[int], pass_index: int) -> np.ndarray:
        """Rows this rank has read in ``epoch``, given each DataLoader worker's read position in pass
        ``pass_index`` (a later pass has read the whole share; a position past a worker's sequence,
        a second lap, has read all of it). Positions advance only with consumed batches, so rows of
        prefetched batches are not counted."""
        if pass_index > 0:
            return self.share(epoch)
        k = len(positions)
        parts = [self.worker_sequence(epoch, w, k)[: max(0, pos)] for w, pos in enumerate(positions)]
        return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    # ------------------------------------------------------------------------------------------

    def share(self, epoch: int) -> np.ndarray:
        """This rank's row indices for ``epoch``, in reading order."""
        lay = self.layout
        if not lay.train:
            start, size = lay.eval_slice(len(self.source))
            return np.arange(start, start + size, dtype=np.int64)
        return self.epoch_rows(epoch)[lay.rank :: lay.world_size]

    def worker_blocks(self, epoch: int, w: int, k: int) -> list[np.ndarray]:
        """Worker ``w`` of ``k``: blocks (batches) ``w, w + k, ...`` of the share."""
        share = self.share(epoch)
        b = self.layout.batch_size
        return [share[j * b : (j + 1) * b] for j in range(w, self.batches_in(epoch), k)]

    def worker_sequence(self, epoch: int, w: int, k: int) -> np.ndarray:
        """Train: worker ``w``'s blocks followed by its part of the share's leftover tail."""
        share = self.share(epoch)
        tail = share[self.batches_in(epoch) * self.layout.batch_size :][w::k]
        return np.concatenate([*self.worker_blocks(epoch, w, k), tail]).astype(np.int64)

    def cursor(self, epoch: int, w: int, k: int, start: int) -> tuple[Cursor, int]:
        """Worker ``w``'s cursor at position ``start`` and how many batches it makes."""
        seq = self.worker_sequence(epoch, w, k)
        chunk = max(self.layout.batch_size, 16)

        def open_lap(offset: int) -> Iterator[RawSample]:
            for lo in range(offset, len(seq), chunk):
                yield from self.source.rows(seq[lo : lo + chunk])

        return Cursor(open_lap, len(seq), start), len(range(w, self.batches_in(epoch), k))


def remainder_after(perm: np.ndarray, epoch: int, read: np.ndarray) -> Remainder:
    """The :class:`Remainder` of ``epoch`` (permutation ``perm``) once the rows ``read`` are read:
    the longest prefix of ``perm`` inside ``read`` as the offset, the other read rows excluded."""
    seen = np.isin(perm, read)
    offset = int(np.argmin(seen)) if not seen.all() else len(perm)
    exclude = np.sort(perm[offset:][seen[offset:]])
    return Remainder(epoch, offset, tuple(int(x) for x in exclude))


class StreamPlan:
    """How a streamed webdataset is split over ranks and workers (``datasets`` does the split)."""

    def __init__(self, source: StreamSource, layout: Layout, shuffle_buffer: int):
        from datasets.distributed import split_dataset_by_node

        self.source = source
        self.layout = layout
        ds = source.dataset
        if layout.train:
            ds = ds.shuffle(seed=layout.seed, buffer_size=max(1, shuffle_buffer))
        self.dataset = split_dataset_by_node(ds, rank=layout.rank, world_size=layout.world_size)
        n_shards = len(source.shards)
        self.rank_shards = n_shards // layout.world_size if n_shards % layout.world_size == 0 else n_shards
        self.num_batches = layout.num_batches(source.num_samples, source.description)

    def max_workers(self) -> int:
        return self.rank_shards

    def batches_in(self, epoch: int) -> int:
        """Batches each rank makes in ``epoch`` (every epoch alike)."""
        return self.num_batches

    def cursor(self, epoch: int, start: int) -> Cursor:
        """This rank's (or, in a DataLoader worker, that worker's) stream at position ``start``."""
        self.dataset.set_epoch(epoch)

        def open_lap(offset: int) -> Iterator[RawSample]:
            for record in self.dataset:
                yield self.source.to_raw(record)

        return Cursor(open_lap, None, start)


__all__ = ["Cursor", "Layout", "MapPlan", "Remainder", "StreamPlan", "remainder_after"]
