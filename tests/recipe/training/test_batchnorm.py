"""BatchNorm running statistics are the same on every rank where it matters (:mod:`recipe.training.batchnorm`).

On two gloo ranks: :func:`recipe.training.batchnorm.average_batchnorm_stats` turns different per-rank
statistics into their exact mean (an fp64 reference, for fp32, bf16 and fp64 buffers in one
collective), leaves a locked tower's BatchNorm and ``num_batches_tracked`` alone, refreshes the EMA's
copies, and makes no collective at all for a model without BatchNorm (the default ViT) or with only
locked ones. End to end: a tiny ResNet CLIP trained on 2 ranks saves checkpoints in which every rank's
statistics are the same, and its in-training evaluations equal a 1-rank evaluation of the saved
checkpoints (metrics exactly, image features to float rounding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from recipe.model import create_model
from recipe.synthetic import write_dataset
from recipe.training.batchnorm import average_batchnorm_stats, batchnorm_stats

from ...dist_utils import run_distributed

ROOT = Path(__file__).resolve().parents[3]
ENV = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
STATS = ("running_mean", "running_var")


# --------------------------------------------------------------------------------------------------
# the function, on two gloo ranks
# --------------------------------------------------------------------------------------------------


def _bn_model() -> nn.Module:
    """A tiny-resnet CLIP whose image tower is locked but for its last two layer groups, next to
    layers of other kinds and dtypes (never run forward: the statistics are set by hand)."""
    torch.manual_seed(0)
    clip = create_model("tiny-resnet")
    clip.lock_image_tower(unlocked_groups=2)  # the stem and the first blocks' BatchNorm locked
    return nn.ModuleDict({
        "clip": clip,
        "sync": nn.SyncBatchNorm(5),
        "bf16": nn.BatchNorm1d(3).to(torch.bfloat16),
        "fp64": nn.BatchNorm2d(4).double(),
        "untracked": nn.BatchNorm1d(3, track_running_stats=False),
    })


def _stats_of(module: nn.Module) -> dict[str, torch.Tensor]:
    """Every running statistic and counter, by name (independently of recipe.training.batchnorm)."""
    return {n: b.clone() for n, b in module.named_buffers() if n.rsplit(".", 1)[-1] in (*STATS, "num_batches_tracked")}


def _set_rank_stats(module: nn.Module, rank: int) -> None:
    """Different statistics on every rank (rank ``r``'s are a function of ``r`` alone), counter 7."""
    for i, (name, buf) in enumerate(_stats_of(module).items()):
        live = module.get_buffer(name)
        if name.endswith("num_batches_tracked"):
            live.fill_(7)
            continue
        g = torch.Generator().manual_seed(1000 * rank + i)
        values = torch.randn(buf.shape, generator=g, dtype=torch.float64)
        live.copy_(values.abs() + 0.25 if name.endswith("running_var") else values)


def _function_worker(rank: int, world: int) -> dict[str, Any]:
    import torch.distributed as dist

    from recipe.training.ema import ModelEMA

    calls = []
    all_reduce = dist.all_reduce

    def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(tensor.dtype)
        return all_reduce(tensor, *args, **kwargs)

    dist.all_reduce = counted
    out: dict[str, Any] = {}

    model = _bn_model()
    _set_rank_stats(model, rank)
    ema = ModelEMA(model, 0.9)  # its buffer copies: this rank's statistics
    out["before"] = _stats_of(model)
    out["averaged_names"] = sorted(batchnorm_stats(model))
    out["count"] = average_batchnorm_stats(model, ema)
    out["after"] = _stats_of(model)
    out["ema"] = {n: ema.buffers[n].clone() for n in out["after"]}
    out["calls"] = list(calls)

    calls.clear()
    locked = create_model("tiny-resnet")
    locked.lock_image_tower()  # every BatchNorm locked
    _set_rank_stats(locked, rank)
    vit = create_model("tiny")  # the default towers: no BatchNorm
    out["no_bn"] = [average_batchnorm_stats(vit), average_batchnorm_stats(nn.Linear(2, 2))]
    out["locked_before"], out["locked_count"] = _stats_of(locked), average_batchnorm_stats(locked)
    out["locked_after"] = _stats_of(locked)
    out["calls_without_bn"] = list(calls)
    dist.all_reduce = all_reduce
    return out


def _locked_names(model: nn.Module) -> set[str]:
    clip = model.clip
    return {f"clip.visual.trunk.{n}.{s}" for n in clip.visual.frozen_norms for s in STATS}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_distributed(_function_worker, 2, timeout_s=120)


def test_statistics_become_the_exact_mean_over_ranks(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks
    model = _bn_model()
    locked = _locked_names(model)
    assert locked and len(locked) < len(r0["averaged_names"])  # some locked, some trained
    expected = sorted(n for n in r0["before"] if n.rsplit(".", 1)[-1] in STATS and n not in locked)
    assert r0["averaged_names"] == r1["averaged_names"] == expected
    assert not any(n.startswith("untracked.") for n in r0["before"])
    assert {"sync.running_mean", "bf16.running_var", "fp64.running_mean"} <= set(expected)
    assert r0["count"] == r1["count"] == len(expected)
    assert r0["calls"] == r1["calls"] == [torch.float64]  # one collective for every buffer and dtype
    for name in expected:
        a, b = r0["before"][name], r1["before"][name]
        assert not torch.equal(a, b), name  # they differed
        mean = ((a.double() + b.double()) / 2).to(a.dtype)  # the fp64 mean rounded once to the buffer's dtype
        for r in (r0, r1):
            assert r["after"][name].dtype == a.dtype
            torch.testing.assert_close(r["after"][name], mean, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(r["ema"][name], mean, rtol=0, atol=0, msg=name)  # the EMA's copy too


def test_locked_batchnorm_and_counters_are_untouched(ranks: list[dict[str, Any]]) -> None:
    r0, r1 = ranks
    locked = _locked_names(_bn_model())
    for r in (r0, r1):
        for name, before in r["before"].items():
            if name in locked or name.endswith("num_batches_tracked"):
                torch.testing.assert_close(r["after"][name], before, rtol=0, atol=0, msg=name)  # this rank's own
    assert not torch.equal(r0["after"][min(locked)], r1["after"][min(locked)])


def test_no_collective_without_trainable_batchnorm(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["no_bn"] == [0, 0] and r["locked_count"] == 0
        assert r["calls_without_bn"] == []  # the default ViT route pays nothing
        for name, before in r["locked_before"].items():
            torch.testing.assert_close(r["locked_after"][name], before, rtol=0, atol=0, msg=name)


def test_one_process_is_a_no_op() -> None:
    model = _bn_model()
    _set_rank_stats(model, 3)
    before = _stats_of(model)
    assert average_batchnorm_stats(model) == 0  # no process group here
    for name, value in _stats_of(model).items():
        assert torch.equal(value, before[name]), name


# --------------------------------------------------------------------------------------------------
# end to end: 2-rank training of a tiny ResNet CLIP, checkpoints and evaluation
# --------------------------------------------------------------------------------------------------

STEPS, MICRO, N_VAL = 3, 4, 8


def _train_worker(rank: int, world: int, cfg: dict, average: bool = True) -> dict[str, Any]:
    """Trains ``cfg`` and records every rank's BatchNorm statistics right after each checkpoint save,
    and each evaluation's metrics, statistics and image features. ``average=False`` takes the
    averaging out (to see that the test catches its absence)."""
    import recipe.run.checkpoint as C
    import recipe.evaluate as E
    import recipe.train as T
    from recipe.config import config_from_dict

    if not average:
        T.average_batchnorm_stats = C.average_batchnorm_stats = lambda *a, **k: 0
    saves: list[dict[str, Any]] = []
    evals: list[dict[str, Any]] = []
    features: list[torch.Tensor] = []
    save, embed_split, evaluate_data = C.save, E.embed_split, T.evaluate_data

    def saving(engine: Any, ckpt_dir: Any, step: int, *args: Any, **kwargs: Any) -> Path:
        tag_dir = save(engine, ckpt_dir, step, *args, **kwargs)
        saves.append({"step": step, "tag_dir": str(tag_dir), "stats": _stats_of(engine.module)})
        return tag_dir

    def embedding(*args: Any, **kwargs: Any) -> Any:
        out = embed_split(*args, **kwargs)
        features.append(out[0].clone())
        return out

    def evaluating(model: nn.Module, *args: Any, **kwargs: Any) -> dict[str, float]:
        features.clear()
        metrics = evaluate_data(model, *args, **kwargs)
        evals.append({"metrics": metrics, "stats": _stats_of(model), "features": list(features)})
        return metrics

    C.save, E.embed_split, T.evaluate_data = saving, embedding, evaluating
    final = T.train(config_from_dict(cfg))
    return {"final": final, "saves": saves, "evals": evals}


def _train_cfg(tmp: Path) -> dict[str, Any]:
    data = tmp / "data"
    write_dataset(str(data), STEPS * MICRO * 2, n_val=N_VAL, image_size=32, seed=0)
    prompts = json.loads((data / "zeroshot.json").read_text())  # one template: a cheap classifier
    (data / "zeroshot.json").write_text(json.dumps({**prompts, "templates": prompts["templates"][:1]}))
    ds = json.loads((ROOT / "ds_configs" / "zero2_fp32.json").read_text())  # fp32: bf16 convolutions crawl on CPU
    ds["train_micro_batch_size_per_gpu"] = MICRO
    (tmp / "ds.json").write_text(json.dumps(ds))
    return {
        "deepspeed_config": str(tmp / "ds.json"),
        "output_dir": str(tmp / "run"),
        "steps": STEPS,
        "eval_every": 2,  # step 2: evaluated, then saved (save_every) with no step between
        "save_every": 2,
        "log_every": 1,
        "eval_batch_size": N_VAL,
        "seed": 0,
        "model": {"preset": "tiny-resnet"},
        "data": {"train_data": str(data / "train.csv"), "val_data": str(data / "val.csv"), "workers": 0,
                 "vocab_size": 300, "context_length": 12},
        "optim": {"lr": 1e-3, "warmup_steps": 0},
    }


def _evaluate_alone(tag_dir: str, monkeypatch: pytest.MonkeyPatch) -> tuple[dict[str, float], torch.Tensor]:
    """``python -m recipe.evaluate`` of a checkpoint on this one process: its metrics and image features."""
    import recipe.evaluate as E

    seen: list[torch.Tensor] = []
    embed_split = E.embed_split

    def embedding(*args: Any, **kwargs: Any) -> Any:
        out = embed_split(*args, **kwargs)
        seen.append(out[0])
        return out

    with monkeypatch.context() as m:
        m.setattr(E, "embed_split", embedding)
        metrics = E.main(["--checkpoint", tag_dir, "--no-progress", "--batch-size", str(N_VAL)])
    assert len(seen) == 1
    return metrics, seen[0]


def test_two_rank_training_saves_one_set_of_statistics_and_evaluates_what_it_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _train_cfg(tmp_path)
    r0, r1 = run_distributed(_train_worker, 2, cfg, init_process_group=False, env=ENV, timeout_s=300)
    assert [s["step"] for s in r0["saves"]] == [s["step"] for s in r1["saves"]] == [2, STEPS]
    assert len(r0["evals"]) == len(r1["evals"]) == 2  # at step 2 (before its save) and the final one
    for k, (save0, save1) in enumerate(zip(r0["saves"], r1["saves"], strict=True)):
        stats = save0["stats"]
        assert any(n.endswith("running_mean") for n in stats) and any((v != 0).any() for v in stats.values())
        saved = torch.load(Path(save0["tag_dir"]) / "model_weights.pt", map_location="cpu", weights_only=True)
        for name, value in stats.items():
            # every rank holds the statistics the checkpoint holds
            torch.testing.assert_close(save1["stats"][name], value, rtol=0, atol=0, msg=name)
            torch.testing.assert_close(saved[name], value, rtol=0, atol=0, msg=name)
            # and they are what was evaluated right before that save (step 2) or right after it (final)
            for r in (r0, r1):
                torch.testing.assert_close(r["evals"][k]["stats"][name], value, rtol=0, atol=0, msg=name)
        alone, features = _evaluate_alone(save0["tag_dir"], monkeypatch)
        during = r0["evals"][k]
        assert during["metrics"] == r1["evals"][k]["metrics"]
        assert {key: during["metrics"][key] for key in alone if key != "step"} == {
            key: v for key, v in alone.items() if key != "step"}, (during["metrics"], alone)
        assert len(during["features"]) == 1 and during["features"][0].shape == (N_VAL, 64)
        torch.testing.assert_close(during["features"][0], features, rtol=1e-5, atol=1e-6)
    final = r0["final"]
    assert final["steps"] == STEPS and final["world_size"] == 2
    assert {k: final[k] for k in r0["evals"][1]["metrics"]} == r0["evals"][1]["metrics"]
