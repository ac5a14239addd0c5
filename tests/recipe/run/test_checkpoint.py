"""Checkpoint directories: incomplete or missing checkpoints are clear errors, an interrupted save
leaves the last good one in place; RNG state round trip."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from recipe.run import checkpoint
from recipe.run.checkpoint import CheckpointError


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


class FakeEngine:
    """What checkpoint.save needs of a DeepSpeed engine; ``fail`` makes its shard write raise."""

    def __init__(self, fail: BaseException | None = None) -> None:
        self.fail = fail
        self.module = torch.nn.Linear(2, 2)

    def save_checkpoint(self, save_dir: str, tag: str, client_state: dict, save_latest: bool) -> None:
        (Path(save_dir) / tag).mkdir(parents=True, exist_ok=True)
        (Path(save_dir) / tag / "mp_rank_00_model_states.pt").write_bytes(b"shard")
        if self.fail is not None:
            raise self.fail

    def zero_optimization_stage(self) -> int:
        return 2


def test_resaving_a_step_never_touches_the_checkpoint_latest_names(tmp_path: Path) -> None:
    ck = tmp_path / "checkpoints"
    first = checkpoint.save(FakeEngine(), ck, 10, {"step": 10})
    assert first.name == "step00000010" and (ck / checkpoint.LATEST).read_text() == "step00000010"
    before = {p.name: p.read_bytes() for p in first.iterdir()}
    # a second save of step 10 (e.g. after resuming from an older checkpoint) dies midway
    with pytest.raises(CheckpointError, match="step00000010.r1"):
        checkpoint.save(FakeEngine(fail=RuntimeError("killed")), ck, 10, {"step": 10})
    assert {p.name: p.read_bytes() for p in first.iterdir()} == before  # COMPLETE and files untouched
    assert checkpoint.resolve("latest", ck) == first
    # a complete re-save supersedes it, and only then is the older one removed
    again = checkpoint.save(FakeEngine(), ck, 10, {"step": 10})
    assert again.name.startswith("step00000010.r") and checkpoint.resolve("latest", ck) == again
    assert not first.exists() and sorted(p.name for p in ck.iterdir()) == sorted([again.name, checkpoint.LATEST])


def test_full_disk_during_a_save_names_the_path_and_keeps_the_previous_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "checkpoints"
    good = checkpoint.save(FakeEngine(), ck, 10, {"step": 10})

    def no_space(*args: object, **kwargs: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.torch, "save", no_space)
    with pytest.raises(CheckpointError) as err:
        checkpoint.save(FakeEngine(), ck, 20, {"step": 20})
    msg = str(err.value)
    assert str(ck / "step00000020") in msg and "No space left on device" in msg
    assert "previous checkpoint (step00000010) is intact" in msg
    assert checkpoint.resolve("latest", ck) == good and (good / checkpoint.COMPLETE).exists()
    assert not (ck / "step00000020" / checkpoint.COMPLETE).exists()
    assert not list(ck.glob("step00000020/.*tmp*"))  # no temporary left behind


def test_resume_falls_back_to_the_newest_complete_checkpoint(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    ck = tmp_path / "checkpoints"
    for step in (10, 20, 30):
        complete(ck / f"step{step:08d}", step)
    complete(ck / "step00000030.r1", 30)
    (ck / "step00000040").mkdir()  # an interrupted save
    with caplog.at_level("WARNING", logger="recipe.run.checkpoint"):
        assert checkpoint.resolve("latest", ck) == ck / "step00000030.r1"  # no latest file at all
    assert "no 'latest' file" in caplog.text and "step00000030.r1" in caplog.text
    checkpoint.atomic_write_bytes(ck / checkpoint.LATEST, b"step00000040")  # names the incomplete one
    caplog.clear()
    with caplog.at_level("WARNING", logger="recipe.run.checkpoint"):
        assert checkpoint.resolve("latest", ck) == ck / "step00000030.r1"
    assert "step00000040, which is incomplete" in caplog.text
    assert checkpoint.resolve(str(tmp_path), tmp_path / "x") == ck / "step00000030.r1"  # a run directory
