"""recipe.data.loader: which config fields each factory reads, resume, counts over ranks, captions."""

from __future__ import annotations

import json
import math
import os
from collections import Counter

import pytest
import torch
from torch.utils.data import get_worker_info

import recipe.config
import recipe.data
from recipe.data import REPEATED, SKIP_REASONS, DataConfig, build_eval_loader, build_train_loader, read_captions

from ...dist_utils import run_distributed
from .helpers import (
    IMAGE_CFG,
    N_TRAIN,
    assert_same_batches,
    cfg_for,
    collect,
    damage_tar,
    keys_of,
    read_split_rows,
    run_steps,
    tokenize,
    write_shard,
)

# --------------------------------------------------------------------------------------------
# the unified config: training and evaluation fields
# --------------------------------------------------------------------------------------------


def test_data_config_is_the_recipe_config():
    assert recipe.data.DataConfig is recipe.config.DataConfig


def test_eval_loader_without_val_data_is_a_clear_error(syn, tmp_path):
    train_csv = os.path.join(syn, "train.csv")
    for missing in (None, ""):
        cfg = DataConfig(train_data=train_csv, val_data=missing, workers=0, cache_dir=str(tmp_path / "c"))
        with pytest.raises(ValueError, match="val_data"):
            build_eval_loader(cfg, tokenize, IMAGE_CFG, 4)
    # the same config trains (and gives its captions) from train_data
    assert len(build_train_loader(cfg, tokenize, IMAGE_CFG, 4)) == N_TRAIN // 4
    assert list(read_captions(cfg)) == [r["title"] for r in read_split_rows(syn)]


def test_train_and_eval_loaders_read_their_own_data(syn, tmp_path):
    cfg = DataConfig(
        train_data=os.path.join(syn, "train.csv"),
        val_data=os.path.join(syn, "val.csv"),
        workers=0,
        cache_dir=str(tmp_path / "c"),
    )
    assert cfg.label_column == "label"  # the default: evaluation batches carry labels
    val_rows = read_split_rows(syn, "val")
    evald = collect(build_eval_loader(cfg, tokenize, IMAGE_CFG, 4))
    assert [c for b in evald for c in b["captions"]] == [r["title"] for r in val_rows]
    assert torch.cat([b["labels"] for b in evald]).tolist() == [int(r["label"]) for r in val_rows]
    train = collect(build_train_loader(cfg, tokenize, IMAGE_CFG, 4))
    assert sorted(c for b in train for c in b["captions"]) == sorted(r["title"] for r in read_split_rows(syn))
    assert all("labels" not in b for b in train)


def worker_tokenize(captions: list[str]) -> dict[str, torch.Tensor]:
    """Token ids that name the process that made the batch: 0 the loading process, 1 + id a worker."""
    info = get_worker_info()
    ids = torch.full((len(captions), 1), 0 if info is None else 1 + info.id, dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def made_by(batches) -> list[int]:
    return [int(b["input_ids"][0, 0]) for b in batches]


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_workers_and_eval_workers_are_honoured(syn, tmp_path, kind):
    """The training loader runs `workers` processes, the evaluation loader `eval_workers`."""
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
    eval_only = cfg_for(path, tmp_path, workers=0, eval_workers=2)
    evald = build_eval_loader(eval_only, worker_tokenize, IMAGE_CFG, 4)
    batches = collect(evald)
    assert evald.num_workers == 2
    assert made_by(batches) == [1, 2] * 3  # merged round-robin: worker 0, 1, 0, ...
    in_process = collect(build_eval_loader(cfg_for(path, tmp_path), tokenize, IMAGE_CFG, 4))
    assert sorted(keys_of(batches)) == sorted(keys_of(in_process)) and len(batches) == len(in_process)
    if kind == "map":  # contiguous blocks per worker, merged back into the order of the rows
        assert keys_of(batches) == [str(i) for i in range(N_TRAIN)]
    train = build_train_loader(eval_only, worker_tokenize, IMAGE_CFG, 4)
    assert train.num_workers == 0 and made_by(collect(train)) == [0] * (N_TRAIN // 4)
    train_only = cfg_for(path, tmp_path, workers=2, eval_workers=0)
    train = build_train_loader(train_only, worker_tokenize, IMAGE_CFG, 4)
    assert train.num_workers == 2 and made_by(collect(train)) == [1, 2] * 3
    evald = build_eval_loader(train_only, worker_tokenize, IMAGE_CFG, 4)
    assert evald.num_workers == 0 and made_by(collect(evald)) == [0] * math.ceil(N_TRAIN / 4)
    with pytest.raises(ValueError, match="--eval-workers must be >= 0, got -1"):
        build_eval_loader(cfg_for(path, tmp_path, eval_workers=-1), tokenize, IMAGE_CFG, 4)
    with pytest.raises(ValueError, match="workers must be >= 0, got -1"):
        build_train_loader(cfg_for(path, tmp_path, workers=-1, eval_workers=0), tokenize, IMAGE_CFG, 4)


def test_num_samples_applies_to_the_training_shards_only(syn, tmp_path):
    """A given num_samples sets the training epoch; evaluation counts its own shards."""
    cfg = cfg_for(os.path.join(syn, "wds", "train"), tmp_path, num_samples=12)
    train = build_train_loader(cfg, tokenize, IMAGE_CFG, 2)
    assert train.num_source_samples == 12 and len(train) == 6 and len(collect(train)) == 6
    evald = build_eval_loader(cfg, tokenize, IMAGE_CFG, 5)
    assert evald.num_source_samples == N_TRAIN and len(evald) == math.ceil(N_TRAIN / 5)
    assert len(keys_of(collect(evald))) == N_TRAIN


# --------------------------------------------------------------------------------------------
# resume
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind,stop",
    [("map_with_bad_samples", 3), ("map_with_bad_samples", 5), ("stream", 4), ("damaged_stream", 3)],
)  # 5 is an epoch boundary
def test_resume_yields_exactly_the_remaining_batches(syn, bad_jsonl, tmp_path, kind, stop):
    path = bad_jsonl[0] if kind == "map_with_bad_samples" else os.path.join(syn, "wds", "train")
    if kind == "damaged_stream":  # 6 shards of 4 samples, the third cut inside a sample
        path = tmp_path / "damaged"
        path.mkdir()
        for j in range(6):
            write_shard(path / f"s-{j}.tar", j)
        damage_tar(path / "s-2.tar", "cut_in_data")
    cfg = cfg_for(path, tmp_path, workers=2, shuffle_buffer=6)

    def make():
        return build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=11)

    ref_loader = make()
    per_epoch = len(ref_loader)
    total = 2 * per_epoch + 1
    reference = run_steps(ref_loader, total)
    first_loader = make()
    first = run_steps(first_loader, stop)
    state = json.loads(json.dumps(first_loader.state_dict()))  # must survive serialisation
    first_loader.close()
    resumed_loader = make()
    resumed_loader.load_state_dict(state)
    assert resumed_loader.epoch == stop // per_epoch
    rest = run_steps(resumed_loader, total - stop)
    assert_same_batches(first + rest, reference)
    assert resumed_loader.stats == ref_loader.stats
    if kind == "damaged_stream":
        # once in each of the two whole epochs, maybe once more in the first batch of the third
        assert ref_loader.stats["unreadable_shard"] in (2, 3)


def test_resume_across_epochs_with_set_epoch(syn, tmp_path):
    cfg = cfg_for(os.path.join(syn, "train.csv"), tmp_path, workers=2)
    ref = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    reference = []
    for epoch in range(3):
        ref.set_epoch(epoch)
        reference += collect(ref)
    a = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    got = []
    for epoch in range(3):
        a.set_epoch(epoch)
        for b in a:
            got.append(b)
            if len(got) == 8:
                break
        if len(got) == 8:
            break
    state = a.state_dict()
    b_loader = build_train_loader(cfg, tokenize, IMAGE_CFG, 4, seed=1)
    b_loader.load_state_dict([state])  # a list of per-rank states also works
    for epoch in range(b_loader.epoch, 3):
        b_loader.set_epoch(epoch)  # keeps the restored position within the restored epoch
        got += collect(b_loader)
    assert_same_batches(got, reference)


def test_resume_with_changed_settings_is_an_error(syn, tmp_path):
    path = os.path.join(syn, "train.csv")
    a = build_train_loader(cfg_for(path, tmp_path, workers=2), tokenize, IMAGE_CFG, 4, seed=1)
    run_steps(a, 2)
    state = a.state_dict()
    a.close()
    other = build_train_loader(cfg_for(path, tmp_path, workers=1), tokenize, IMAGE_CFG, 4, seed=1)
    with pytest.raises(ValueError, match="num_workers"):
        other.load_state_dict(state)
    # at an epoch boundary any worker count is fine
    boundary = dict(state, batches=0, pass_batches=0)
    other.load_state_dict(boundary)
    assert other.epoch == 0 and other.batches_consumed == 0


# --------------------------------------------------------------------------------------------
# augmentation: seeded per sample, whatever the batch size, world size or worker count
# --------------------------------------------------------------------------------------------


def augmented_epoch(path, tmp_path, *, batch_size=4, rank=0, world_size=1, workers=0, seed=5, epoch=0):
    """``{key: pixel bytes}`` of one training epoch with visible augmentation (crops and flips)."""
    cfg = cfg_for(path, tmp_path, workers=workers, hflip=0.5, train_scale=(0.3, 1.0), shuffle_buffer=6)
    loader = build_train_loader(cfg, tokenize, IMAGE_CFG, batch_size, rank, world_size, seed)
    loader.set_epoch(epoch)
    out = {}
    for b in collect(loader):
        for key, px in zip(b["keys"], b["pixel_values"]):
            assert key not in out  # one visit per sample: no repeats in these layouts
            out[key] = px.numpy().tobytes()
    assert loader.stats.get(REPEATED, 0) == 0
    return out


@pytest.mark.parametrize("kind", ["map", "stream"])
def test_augmentation_depends_on_the_sample_not_on_its_batch(syn, tmp_path, kind):
    path = os.path.join(syn, "train.csv") if kind == "map" else os.path.join(syn, "wds", "train")
    ref = augmented_epoch(path, tmp_path)
    assert len(ref) == N_TRAIN
    if kind == "stream":
        assert all(k.endswith(".tar/" + k.split("/")[-1]) for k in ref)  # keys are shard/key
    assert augmented_epoch(path, tmp_path, batch_size=8) == ref
    halves = [augmented_epoch(path, tmp_path, rank=r, world_size=2) for r in (0, 1)]
    assert not set(halves[0]) & set(halves[1]) and {**halves[0], **halves[1]} == ref
    assert augmented_epoch(path, tmp_path, workers=2) == ref
    # the augmentation is random: another epoch or seed changes most samples (same keys)
    for other in (augmented_epoch(path, tmp_path, epoch=1), augmented_epoch(path, tmp_path, seed=6)):
        assert set(other) == set(ref)
        assert sum(other[k] != ref[k] for k in ref) > N_TRAIN * 3 // 4


def test_a_repeated_sample_gets_a_new_draw(bad_jsonl, tmp_path):
    """12 good rows of 20 fill 5 batches of 4: 8 samples come twice (a second lap), augmented anew."""
    cfg = cfg_for(bad_jsonl[0], tmp_path, hflip=0.5, train_scale=(0.3, 1.0))

    def visits(batch_size):
        out: dict[str, list[bytes]] = {}
        for b in collect(build_train_loader(cfg, tokenize, IMAGE_CFG, batch_size, seed=3)):
            for key, px in zip(b["keys"], b["pixel_values"]):
                out.setdefault(key, []).append(px.numpy().tobytes())
        return out

    by4, by2 = visits(4), visits(2)
    assert len(by4) == 12 and sorted(len(v) for v in by4.values()) == [1] * 4 + [2] * 8
    assert {k: v[0] for k, v in by4.items()} == {k: v[0] for k, v in by2.items()}  # first visits
    assert all(v[1] != v[0] for v in by4.values() if len(v) == 2)


# --------------------------------------------------------------------------------------------
# multi-process: counts summed over ranks with torch.distributed (gloo)
# --------------------------------------------------------------------------------------------


def _dist_worker(rank, world_size, path, cache):
    cfg = DataConfig(train_data=path, workers=0, cache_dir=cache)
    loader = build_train_loader(cfg, tokenize, IMAGE_CFG, 2, rank, world_size, 0)
    batches = collect(loader)
    states = loader.all_rank_state_dicts()
    return rank, dict(loader.stats), loader.global_stats(), keys_of(batches), len(states)


def test_global_stats_sum_over_ranks_with_gloo(bad_jsonl, tmp_path):
    path, expected = bad_jsonl
    results = run_distributed(_dist_worker, 2, str(path), str(tmp_path / "c"), timeout_s=180)
    assert [r[0] for r in results] == [0, 1]
    local = [Counter(r[1]) for r in results]
    total = local[0] + local[1]
    for _, _, global_stats, _, n_states in results:
        assert global_stats == {k: total.get(k, 0) for k in (*SKIP_REASONS, REPEATED)}
        assert n_states == 2
    # every bad row is seen by exactly one rank
    assert sum(total[k] for k in SKIP_REASONS) == sum(expected.values())
    assert not set(results[0][3]) & set(results[1][3])


# --------------------------------------------------------------------------------------------
# captions
# --------------------------------------------------------------------------------------------


def test_read_captions(syn, bad_jsonl, tmp_path):
    expected = [r["title"] for r in read_split_rows(syn)]
    assert list(read_captions(cfg_for(os.path.join(syn, "train.csv"), tmp_path))) == expected
    assert sorted(read_captions(cfg_for(os.path.join(syn, "wds", "train"), tmp_path))) == sorted(expected)
    assert list(read_captions(cfg_for(os.path.join(syn, "train.csv"), tmp_path), limit=3)) == expected[:3]
    # bad captions are left out
    assert len(list(read_captions(cfg_for(bad_jsonl[0], tmp_path)))) == 12 + 4
