"""recipe.data.webdataset: damaged, missing and unreadable tar shards, at start and while reading."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from recipe.data import REPEATED, build_eval_loader, build_train_loader
from recipe.data.webdataset import count_tar_samples

from .helpers import (
    DAMAGE,
    IMAGE_CFG,
    cfg_for,
    collect,
    damage_tar,
    keys_of,
    png_bytes,
    tokenize,
    write_shard,
    write_tar,
)

START_LOGGER = "recipe.data.webdataset"
SKIP_LOGGER = "recipe.data.loader"


def shard_dir(tmp_path, n_shards: int, damaged: int | None, kind: str | None):
    """``n_shards`` shards of 4 samples, shard ``damaged`` damaged by ``kind``.

    Returns the directory, the damaged shard's path, the captions still readable and the
    samples counted from the tar headers.
    """
    d = tmp_path / "wds"
    d.mkdir()
    readable, counted = [], 0
    for j in range(n_shards):
        captions = write_shard(d / f"s-{j}.tar", j)
        if j == damaged:
            damage_tar(d / f"s-{j}.tar", kind)
            indices, n = DAMAGE[kind]
            readable += [captions[i] for i in indices]
            counted += n
        else:
            readable += captions
            counted += len(captions)
    return d, (d / f"s-{damaged}.tar" if damaged is not None else None), readable, counted


def messages(caplog, logger: str, *needles: str) -> list[str]:
    """Warnings of ``logger`` that contain every needle."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == logger and r.levelno == logging.WARNING and all(n in r.getMessage() for n in needles)
    ]


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_count_tar_samples_of_a_damaged_shard_warns_naming_it(tmp_path, caplog, kind):
    write_shard(tmp_path / "s.tar", 0)
    damage_tar(tmp_path / "s.tar", kind)
    with caplog.at_level(logging.WARNING):
        assert count_tar_samples(str(tmp_path / "s.tar")) == DAMAGE[kind][1]
    assert len(messages(caplog, START_LOGGER, str(tmp_path / "s.tar"))) == 1


@pytest.mark.parametrize("position", [0, 1])
@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_damaged_shard_is_read_to_the_damage_and_counted_once(tmp_path, caplog, kind, position):
    """Evaluation reads what is readable, counts the damaged shard once and names it in two warnings."""
    d, bad, readable, counted = shard_dir(tmp_path, 3, position, kind)
    with caplog.at_level(logging.WARNING):
        loader = build_eval_loader(cfg_for(d, tmp_path), tokenize, IMAGE_CFG, 3)
        assert loader.num_source_samples == counted
        start = messages(caplog, START_LOGGER, str(bad))
        assert len(start) == 1 and "unreadable_shard" in start[0]
        caplog.clear()
        caps = [c for b in collect(loader) for c in b["captions"]]
    assert sorted(caps) == sorted(readable)
    assert dict(loader.stats) == {"unreadable_shard": 1}
    assert len(messages(caplog, SKIP_LOGGER, "(unreadable_shard)", str(bad))) == 1


@pytest.mark.parametrize("kind", ["cut_in_data", "cut_at_header", "empty"])
def test_damaged_shard_with_eval_workers_and_ranks(tmp_path, kind):
    """Two workers on each of two ranks: every readable sample once, the damaged shard counted once."""
    d, _, readable, _ = shard_dir(tmp_path, 4, 1, kind)
    caps, stats = [], Counter()
    for rank in range(2):
        loader = build_eval_loader(cfg_for(d, tmp_path, workers=2), tokenize, IMAGE_CFG, 3, rank, 2)
        caps += [c for b in collect(loader) for c in b["captions"]]
        stats += loader.stats
    assert sorted(caps) == sorted(readable)
    assert dict(stats) == {"unreadable_shard": 1}


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", ["cut_in_data", "cut_at_header", "not_a_tar"])
def test_damaged_shard_in_training_keeps_every_rank_at_its_quota(tmp_path, kind, workers):
    """Every rank yields exactly len(loader) full batches per epoch; a short share is topped up."""
    d, _, readable, counted = shard_dir(tmp_path, 4, 1, kind)
    cfg = cfg_for(d, tmp_path, workers=workers, shuffle_buffer=4)
    loaders = [build_train_loader(cfg, tokenize, IMAGE_CFG, 2, rank, 2, seed=3) for rank in range(2)]
    quota = counted // 2 // 2
    assert [len(lo) for lo in loaders] == [quota, quota]
    good_keys = {f"s-{j}.tar/s{j}k{i}" for j in range(4) for i in range(4) if f"shard {j} sample {i}" in readable}
    for epoch in range(2):
        damaged = 0
        for lo in loaders:
            lo.set_epoch(epoch)
            before = Counter(lo.stats)
            batches = collect(lo)
            stats = Counter(lo.stats)
            stats.subtract(before)
            assert len(batches) == quota and all(len(b["keys"]) == 2 for b in batches)
            keys = keys_of(batches)
            assert set(keys) <= good_keys
            assert len(keys) - len(set(keys)) == stats[REPEATED]
            assert set(stats) <= {"unreadable_shard", REPEATED}
            damaged += stats["unreadable_shard"]
            assert lo.epoch == epoch + 1
        assert damaged == 1  # whichever rank reads the damaged shard counts it, once an epoch


@pytest.mark.parametrize("kind", ["cut_in_data", "empty"])
def test_damaged_first_shard_with_num_samples_warns_at_start(tmp_path, caplog, kind):
    """With num_samples given nothing is counted; peeking at the damaged first shard warns, never fails."""
    d, bad, readable, _ = shard_dir(tmp_path, 3, 0, kind)
    with caplog.at_level(logging.WARNING):
        loader = build_train_loader(cfg_for(d, tmp_path, num_samples=8), tokenize, IMAGE_CFG, 2)
    assert len(messages(caplog, START_LOGGER, str(bad))) == 1
    batches = collect(loader)
    assert len(batches) == len(loader) == 4
    assert {c for b in batches for c in b["captions"]} <= set(readable)


def test_no_readable_shard_is_a_clear_error(tmp_path):
    d = tmp_path / "wds"
    d.mkdir()
    for j, kind in enumerate(["empty", "not_a_tar"]):
        write_shard(d / f"s-{j}.tar", j)
        damage_tar(d / f"s-{j}.tar", kind)
    with pytest.raises(ValueError, match=r"no readable samples.*s-0\.tar.*s-1\.tar"):
        build_eval_loader(cfg_for(d, tmp_path), tokenize, IMAGE_CFG, 2)


def test_missing_shard(tmp_path, caplog):
    """A missing shard is a FileNotFoundError naming it at start; one gone later is a counted skip."""
    d, _, readable, _ = shard_dir(tmp_path, 3, None, None)
    with pytest.raises(FileNotFoundError, match=str(d / "s-3.tar")):
        build_train_loader(cfg_for(str(d / "s-{0..3}.tar"), tmp_path), tokenize, IMAGE_CFG, 2)
    with pytest.raises(FileNotFoundError, match=str(d / "s-9.tar")):
        build_eval_loader(cfg_for(f"{d / 's-0.tar'}::{d / 's-9.tar'}", tmp_path), tokenize, IMAGE_CFG, 2)
    loader = build_eval_loader(cfg_for(d, tmp_path), tokenize, IMAGE_CFG, 2)
    (d / "s-1.tar").unlink()
    with caplog.at_level(logging.WARNING):
        caps = [c for b in collect(loader) for c in b["captions"]]
    assert sorted(caps) == sorted(c for c in readable if not c.startswith("shard 1 "))
    assert dict(loader.stats) == {"unreadable_shard": 1}
    assert len(messages(caplog, SKIP_LOGGER, "(unreadable_shard)", str(d / "s-1.tar"))) == 1


def test_bad_sample_warnings_name_the_shard_and_key(tmp_path, caplog):
    d = tmp_path / "wds"
    d.mkdir()
    write_shard(d / "s-0.tar", 0)
    bad = [
        ("b0", {"jpg": b"\xff\xd8 not a jpeg", "txt": b"corrupt"}, "corrupt_image"),
        ("b1", {"txt": b"no image"}, "missing_image"),
        ("b2", {"png": png_bytes(7), "txt": b"   "}, "empty_caption"),
    ]
    write_tar(d / "s-1.tar", [(key, files) for key, files, _ in bad])
    with caplog.at_level(logging.WARNING):
        loader = build_eval_loader(cfg_for(d, tmp_path), tokenize, IMAGE_CFG, 2)
        assert len(keys_of(collect(loader))) == 4
    assert dict(loader.stats) == {"corrupt_image": 1, "missing_image": 1, "empty_caption": 1}
    for key, _, reason in bad:
        assert len(messages(caplog, SKIP_LOGGER, f"({reason})", str(d / "s-1.tar"), f"key {key}")) == 1
    assert len(messages(caplog, SKIP_LOGGER, "(corrupt_image)", "b0.jpg")) == 1

