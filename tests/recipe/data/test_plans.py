"""recipe.data.plans: rank shares, shuffling per epoch, worker split."""

from __future__ import annotations

import os

import pytest
import torch

from recipe.data import build_eval_loader, build_train_loader
from recipe.data.plans import Layout

from .helpers import IMAGE_CFG, N_TRAIN, cfg_for, collect, keys_of, tokenize


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_train_rank_shares_disjoint_and_complete(syn, tmp_path, world_size, kind):
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
    all_keys, lengths = [], set()
    for rank in range(world_size):
        cfg = cfg_for(path, tmp_path, workers=2)
        loader = build_train_loader(cfg, tokenize, IMAGE_CFG, batch_size=2, rank=rank, world_size=world_size, seed=5)
        batches = collect(loader)
        assert len(batches) == len(loader) == N_TRAIN // world_size // 2
        assert all(len(b["keys"]) == 2 for b in batches)
        assert not loader.stats  # nothing skipped, nothing repeated
        lengths.add(len(batches))
        all_keys += keys_of(batches)
    assert len(lengths) == 1  # every rank takes the same number of steps
    assert len(all_keys) == len(set(all_keys)) == N_TRAIN


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
@pytest.mark.parametrize("kind", ["map", "stream"])
def test_eval_rank_shares_disjoint_and_complete(syn, tmp_path, world_size, kind):
    """Eval shares cover the data exactly, also when N or the shard count does not divide."""
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train", "*.tar")
    all_keys = []
    for rank in range(world_size):
        loader = build_eval_loader(cfg_for(path, tmp_path, workers=2), tokenize, IMAGE_CFG, 5, rank, world_size)
        all_keys += keys_of(collect(loader))
    assert len(all_keys) == len(set(all_keys)) == N_TRAIN


def test_stream_shards_not_divisible_by_world_size(syn, tmp_path):
    """6 shards on 4 ranks: split by samples; shares disjoint, every batch full, same step count."""
    keys, lengths = [], set()
    cfg = cfg_for(os.path.join(syn, "wds", "train"), tmp_path, workers=2)
    for rank in range(4):
        batches = collect(build_train_loader(cfg, tokenize, IMAGE_CFG, 2, rank, 4, seed=0))
        lengths.add(len(batches))
        assert all(len(b["keys"]) == 2 for b in batches)
        keys.append(set(keys_of(batches)))
    assert lengths == {N_TRAIN // 4 // 2}
    for a in range(4):
        for b in range(a + 1, 4):
            assert not keys[a] & keys[b]


def test_shuffling_is_seeded_per_epoch(syn, tmp_path):
    def order(seed, epoch, kind):
        path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
        loader = build_train_loader(cfg_for(path, tmp_path, shuffle_buffer=8), tokenize, IMAGE_CFG, 2, seed=seed)
        loader.set_epoch(epoch)
        return keys_of(collect(loader))

    for kind in ("map", "stream"):
        a = order(0, 0, kind)
        assert a == order(0, 0, kind)
        assert a != order(0, 1, kind)
        assert a != order(1, 0, kind)
        assert sorted(a) == sorted(order(0, 1, kind))


def test_worker_count_does_not_change_map_batches(syn, tmp_path):
    """Without bad samples, a map-style epoch (augmentation included) is the same for 0 and 2 workers."""
    path = os.path.join(syn, "train.csv")
    runs = []
    for workers in (0, 2):
        loader = build_train_loader(cfg_for(path, tmp_path, workers=workers), tokenize, IMAGE_CFG, 3, seed=2)
        runs.append(collect(loader))
    assert [b["keys"] for b in runs[0]] == [b["keys"] for b in runs[1]]
    for a, b in zip(*runs):
        assert torch.equal(a["pixel_values"], b["pixel_values"])


def test_layout_batch_counts_and_checks():
    # evaluation: contiguous slices of 10 samples over 3 ranks are 4, 3, 3 long
    assert [Layout(False, 2, r, 3).eval_slice(10) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    assert [Layout(False, 2, r, 3).num_batches(10, "d") for r in range(3)] == [2, 2, 2]
    assert Layout(True, 2, 0, 3).num_batches(10, "d") == 10 // 3 // 2
    with pytest.raises(ValueError, match="d: 5 samples are too few for world_size=3 and batch_size=2"):
        Layout(True, 2, 0, 3).num_batches(5, "d")
    with pytest.raises(ValueError, match="batch_size must be positive"):
        Layout(True, 0)
    with pytest.raises(ValueError, match=r"rank 2 is not in \[0, world_size=2\)"):
        Layout(True, 1, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        Layout(True, 1, seed=-1)
