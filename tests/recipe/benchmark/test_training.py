"""CLIP_benchmark datasets in training (``--eval-benchmark``, ``--benchmark-root``): the flags, their checks
before anything is written, the metrics ``run_eval`` adds; and the errors of ``python -m recipe.evaluate
--benchmark`` as a user sees them (one line, exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from recipe.benchmark.adapter import PromptsTooLong
from recipe.benchmark.datasets import MissingBenchmarkData, UnknownBenchmark
from recipe.config import TrainConfig, parse_args
from recipe.export.run import load_run

from .conftest import N_IMAGES, STEP

ROOT = Path(__file__).resolve().parents[3]
DS = str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json")


def test_run_eval_reports_the_benchmarks_beside_the_other_metrics(run_dir: Path, bench_root: Path) -> None:
    from recipe.train import run_eval

    loaded = load_run(run_dir)
    engine = SimpleNamespace(module=loaded.model.train(), zero_optimization_stage=lambda: 2)
    cfg = parse_args(["--eval-benchmark", "synthetic_shapes,synthetic_captions", "--benchmark-root", str(bench_root),
                      "--deepspeed-config", DS, "--eval-batch-size", "16"])
    assert (cfg.eval_benchmark, cfg.benchmark_root) == ("synthetic_shapes,synthetic_captions", str(bench_root))
    metrics = run_eval(engine, cfg, loaded.tokenizer)
    assert loaded.model.training  # back in training mode
    assert {k for k in metrics if k.startswith("benchmark_synthetic_shapes_")} == {
        f"benchmark_synthetic_shapes_{m}" for m in ("acc1", "acc5", "mean_per_class_recall", "samples")}
    assert metrics["benchmark_synthetic_captions_samples"] == N_IMAGES
    assert 0 <= metrics["benchmark_synthetic_captions_image_retrieval_recall@10"] <= 1
    # the numbers of python -m recipe.evaluate --benchmark on the same weights (test_agreement's result files)
    out = run_dir / "clip_benchmark" / f"step{STEP:08d}_master" / "synthetic_shapes_en_zeroshot_classification.json"
    if out.is_file():
        for k, v in json.loads(out.read_text())["metrics"].items():
            assert metrics[f"benchmark_synthetic_shapes_{k}"] == pytest.approx(v, abs=1e-6)


def test_the_flags_are_checked_before_anything_is_written(bench_root: Path, tmp_path: Path) -> None:
    base = ["--deepspeed-config", DS, "--output-dir", str(tmp_path / "run")]
    with pytest.raises(UnknownBenchmark, match="unknown benchmark 'cifar1O'.*cifar10"):
        parse_args(base + ["--eval-benchmark", "cifar1O", "--benchmark-root", str(bench_root)])
    with pytest.raises(MissingBenchmarkData, match="wds_cifar10.*clip_benchmark_export_wds --dataset cifar10"):
        parse_args(base + ["--eval-benchmark", "cifar10", "--benchmark-root", str(bench_root)])
    with pytest.raises(ValueError, match="need --benchmark-root DIR"):
        TrainConfig(eval_benchmark="synthetic_shapes", deepspeed_config=DS).validate()
    assert not (tmp_path / "run").exists()


def test_a_context_too_short_for_the_templates_says_so(make_run, bench_root: Path, capsys) -> None:
    from recipe.benchmark.training import check_tokenizer
    from recipe.evaluate import _cli

    short = make_run(context_length=8)
    tokenizer = load_run(short).tokenizer
    with pytest.raises(PromptsTooLong, match=r"context of 8 tokens: 216 of its 216 prompts are longer \(the longest, "
                                             r"'a black and white photo of a (red|green|blue|yellow) \w+\.', takes "
                                             r"1\d tokens.*--context-length 1\d or more"):
        check_tokenizer("synthetic_shapes,synthetic_captions", str(bench_root), tokenizer)
    check_tokenizer("synthetic_captions", str(bench_root), tokenizer)  # captions are truncated as in training
    import sys

    argv = sys.argv
    sys.argv = ["recipe.evaluate", "--checkpoint", str(short), "--benchmark", "synthetic_shapes", "--benchmark-root",
                str(bench_root), "--no-progress"]
    try:
        assert _cli() == 2
    finally:
        sys.argv = argv
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: benchmark 'synthetic_shapes': the run's tokenizer cannot encode its templates")
