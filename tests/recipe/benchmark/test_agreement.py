"""The same numbers as CLIP_benchmark's own command line: ``clip_benchmark eval`` on the run's open_clip
export (``--model_type open_clip --model local-dir:EXPORT``) and on the run directory itself
(``--model_type recipe``), against ``python -m recipe.evaluate --benchmark`` on the run, on the two
synthetic sets its converter wrote; and the same metrics when two ranks share the data."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from recipe.benchmark.loader import main as clip_benchmark_main
from recipe.evaluate import main as evaluate_main

from .conftest import N_IMAGES, STEP

SETS = {"synthetic_shapes": "zeroshot_classification", "synthetic_captions": "zeroshot_retrieval"}
#: Ratios of counts: identical; anything else (mAP) to 1e-6.
EXACT = ("acc1", "acc5", "mean_per_class_recall", "image_retrieval_recall", "text_retrieval_recall")


def clip_benchmark_eval(model_type: str, model: str, pretrained: str, root: Path, out: Path) -> dict[str, dict]:
    """``clip_benchmark eval`` (its own command line, in this process) on both sets; results by set name."""
    found = {}
    for name, task in SETS.items():
        rc = clip_benchmark_main([
            "eval", "--model_type", model_type, "--model", model, "--pretrained", pretrained,
            "--dataset", f"wds/{name}", "--dataset_root", str(root / "wds_{dataset}"), "--task", task,
            "--no_amp", "--recall_k", "1", "5", "10", "--batch_size", "16", "--num_workers", "0", "--quiet",
            "--output", str(out / "{dataset}_{task}.json")])
        assert rc == 0
        found[name] = json.loads((out / f"{name}_{task}.json").read_text())
    return found


def assert_same(ours: dict, theirs: dict) -> None:
    assert ours["dataset"] == theirs["dataset"] and ours["task"] == theirs["task"]
    assert ours["language"] == theirs["language"] == "en"
    assert set(ours["metrics"]) == set(theirs["metrics"])
    for key, value in theirs["metrics"].items():
        if key.startswith(EXACT):
            assert ours["metrics"][key] == value, key
        else:
            assert ours["metrics"][key] == pytest.approx(value, abs=1e-6), key


@pytest.fixture(scope="module")
def ours(run_dir: Path, bench_root: Path) -> dict[str, dict]:
    """``python -m recipe.evaluate --checkpoint RUN --benchmark ...``: its result files by set name."""
    metrics = evaluate_main(["--checkpoint", str(run_dir), "--benchmark", ",".join(SETS), "--benchmark-root",
                             str(bench_root), "--batch-size", "16", "--no-progress"])
    out = run_dir / "clip_benchmark" / f"step{STEP:08d}_master"  # the default weights, in fp32
    files = {name: json.loads((out / f"{name}_en_{task}.json").read_text()) for name, task in SETS.items()}
    for name, record in files.items():
        assert record["model"] == str(run_dir.resolve()) and record["pretrained"] == "master"
        for key, value in record["metrics"].items():
            assert metrics[f"benchmark_{name}_{key}"] == pytest.approx(value, abs=1e-12, nan_ok=True)
        assert metrics[f"benchmark_{name}_samples"] == N_IMAGES
    assert metrics["step"] == STEP
    summary = (out / "summary.csv").read_text().splitlines()
    assert summary[0].startswith(
        "dataset,task,images,captions,acc1,acc5,mean_per_class_recall,image_retrieval_recall@1")
    assert [line.split(",")[:4] for line in summary[1:]] == [
        ["wds/synthetic_shapes", "classification", str(N_IMAGES), ""],
        ["wds/synthetic_captions", "retrieval", str(N_IMAGES), str(2 * N_IMAGES)]]
    return files


def test_the_open_clip_export_scores_the_same_under_clip_benchmark(ours: dict, run_dir: Path, bench_root: Path,
                                                                    tmp_path: Path) -> None:
    from recipe.export import export_run

    export = export_run(run_dir, "open_clip", tmp_path / "export")  # fp32, its masters (here: its module weights)
    theirs = clip_benchmark_eval("open_clip", f"local-dir:{export}", "", bench_root, tmp_path)
    for name in SETS:
        assert_same(ours[name], theirs[name])
    shapes = theirs["synthetic_shapes"]["metrics"]
    assert 0 < shapes["acc5"] < 1 and not math.isnan(shapes["mean_per_class_recall"])  # not a degenerate case
    assert set(theirs["synthetic_captions"]["metrics"]) == {f"{d}_retrieval_recall@{k}" for d in ("image", "text")
                                                            for k in (1, 5, 10)}


def test_clip_benchmark_takes_the_run_directory(ours: dict, run_dir: Path, bench_root: Path, tmp_path: Path) -> None:
    theirs = clip_benchmark_eval("recipe", str(run_dir), "", bench_root, tmp_path)
    for name in SETS:
        assert_same(ours[name], theirs[name])
        assert theirs[name]["model"] == str(run_dir) and theirs[name]["pretrained"] == ""
    with pytest.raises(ValueError, match="--pretrained for --model_type recipe is one of master, module, ema"):
        clip_benchmark_eval("recipe", str(run_dir), "laion400m_e32", bench_root, tmp_path)


def _two_ranks(rank: int, world: int, run: str, root: str) -> dict:
    from recipe.benchmark.cli import evaluate_benchmarks
    from recipe.benchmark.results import flat_metrics
    from recipe.export.run import load_run

    loaded = load_run(run)
    return flat_metrics(evaluate_benchmarks(loaded.model, loaded.tokenizer, ",".join(SETS), root, batch_size=5))


def test_two_ranks_share_the_data_and_agree(ours: dict, run_dir: Path, bench_root: Path) -> None:
    """Each rank embeds half of the images (and classes); the gathered metrics are the single process's."""
    from ...dist_utils import run_distributed

    results = run_distributed(_two_ranks, 2, str(run_dir), str(bench_root), env={"TOKENIZERS_PARALLELISM": "false"},
                              threads_per_rank=1)
    for metrics in results:
        for name, record in ours.items():
            for key, value in record["metrics"].items():
                assert metrics[f"benchmark_{name}_{key}"] == pytest.approx(value, abs=1e-6), (name, key)
            assert metrics[f"benchmark_{name}_samples"] == N_IMAGES
