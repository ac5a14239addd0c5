"""Checkpoint directories: incomplete or missing checkpoints are clear errors, an interrupted save
leaves the last good one in place; RNG state round trip."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from recipe import checkpoint
from recipe.checkpoint import CheckpointError


def complete(tag_dir: Path, step: int) -> None:
    tag_dir.mkdir(parents=True)
    (tag_dir / "rank00000.pt").write_bytes(b"x")
    (tag_dir / checkpoint.COMPLETE).write_text(f'{{"step": {step}, "world_size": 1}}')


def test_resolve_latest_and_explicit(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    complete(ck / "step00000010", 10)
    complete(ck / "step00000020", 20)
    checkpoint.atomic_write_bytes(ck / checkpoint.LATEST, b"step00000020")
    assert checkpoint.resolve("latest", ck) == ck / "step00000020"
    assert checkpoint.resolve(str(ck / "step00000010"), ck) == ck / "step00000010"
    assert checkpoint.resolve(str(tmp_path), tmp_path / "elsewhere") == ck / "step00000020"  # a run directory


def test_interrupted_save_keeps_the_last_good_checkpoint(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    complete(ck / "step00000010", 10)
    checkpoint.atomic_write_bytes(ck / checkpoint.LATEST, b"step00000010")
    # a save of step 20 died after writing some shards: no COMPLETE, latest untouched
    (ck / "step00000020").mkdir()
    (ck / "step00000020" / "rank00000.pt").write_bytes(b"partial")
    assert checkpoint.resolve("latest", ck) == ck / "step00000010"
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve(str(ck / "step00000020"), ck)


def test_missing_and_corrupt_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        checkpoint.resolve(str(tmp_path / "nope"), tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        checkpoint.resolve("latest", tmp_path)
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    checkpoint.atomic_write_bytes(ck / checkpoint.LATEST, b"step00000005")  # names a missing tag
    with pytest.raises(CheckpointError, match="incomplete"):
        checkpoint.resolve("latest", ck)
    complete(ck / "step00000005", 5)

    class Engine:  # DeepSpeed's loader failing on a truncated file
        def load_checkpoint(self, *a, **k):
            raise EOFError("Ran out of input")

    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        checkpoint.load(Engine(), ck / "step00000005")
    (ck / "step00000005" / checkpoint.COMPLETE).write_text('{"step": 5, "world_size": 4}')
    with pytest.raises(CheckpointError, match="written by 4 ranks"):
        checkpoint.load(Engine(), ck / "step00000005")


def test_atomic_write_never_leaves_a_partial_file(tmp_path: Path) -> None:
    target = tmp_path / "latest"
    checkpoint.atomic_write_bytes(target, b"old")

    # a failing write (e.g. disk full) must leave the old content
    original = checkpoint.os.fsync

    def failing_fsync(fd: int) -> None:
        raise OSError("disk full")

    checkpoint.os.fsync = failing_fsync
    try:
        with pytest.raises(OSError):
            checkpoint.atomic_write_bytes(target, b"new")
    finally:
        checkpoint.os.fsync = original
    assert target.read_bytes() == b"old"
    assert [p.name for p in tmp_path.iterdir()] == ["latest"]  # no temporary left behind


def test_rng_state_round_trip() -> None:
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(3))
    random.random(), np.random.rand(), torch.rand(3)
    checkpoint.set_rng_state(state)
    got = (random.random(), np.random.rand(), torch.rand(3))
    assert got[0] == expected[0] and got[1] == expected[1] and torch.equal(got[2], expected[2])
