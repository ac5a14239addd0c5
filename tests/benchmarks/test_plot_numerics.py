"""benchmarks/plot_numerics.py: a tiny synthetic metrics.jsonl is read and plotted; missing files and
files without numerics rows are errors that name the file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import plot_numerics  # noqa: E402


def _write_run(run: Path, fp16: bool = True) -> Path:
    """A run directory as recipe/train.py writes it: train rows with numerics values every 10 steps,
    a numerics row of its own at step 15, an eval row, and a non-finite value logged as a string."""
    run.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in (10, 20, 30):
        row = {"kind": "train", "step": step, "loss": 5.0 - step / 100, "logit_scale": 14.0, "grad_norm": "nan",
               "numerics/sr_below_half_ulp": step / 40, "numerics/sr_below_half_ulp/text.decay": step / 35,
               "numerics/sr_below_half_ulp/text.no_decay": 0.25, "numerics/exp_avg_underflow": 0.0,
               "numerics/exp_avg_sq_underflow": 0.001, "numerics/exp_avg_saturated": 0.0,
               "numerics/exp_avg_sq_saturated": 0.0, "numerics/logit_scale_clamped": 0.0}
        if fp16:
            row.update({"numerics/exp_avg_scale_log2_min": -56.0 + step / 10, "numerics/exp_avg_scale_log2_max": -37.0,
                        "numerics/exp_avg_sq_scale_log2_min": -98.0, "numerics/exp_avg_sq_scale_log2_max": -62.0})
        rows.append(row)
    rows.insert(1, {"kind": "numerics", "step": 15, "numerics/sr_below_half_ulp": "inf"})
    rows.append({"kind": "eval", "step": 30, "val_loss": 4.0})
    path = run / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    (run / "model_config.json").write_text(json.dumps({"max_logit_scale": 50.0}), encoding="utf-8")
    return path


def test_load_run_reads_train_and_numerics_rows(tmp_path: Path) -> None:
    _write_run(tmp_path / "run")
    run = plot_numerics.load_run(tmp_path / "run")
    steps, values = run["series"]["numerics/sr_below_half_ulp"]
    assert steps == [10, 15, 20, 30] and values[1] == float("inf") and values[0] == 0.25
    assert run["series"]["numerics/exp_avg_scale_log2_min"] == ([10, 20, 30], [-55.0, -54.0, -53.0])
    assert run["logit_scale"] == ([10, 20, 30], [14.0] * 3) and run["max_logit_scale"] == 50.0
    assert "grad_norm" not in run["series"]
    assert plot_numerics.families_of(run) == ["sr", "stats", "scales", "clamp"]


def test_cli_writes_a_png_of_two_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    metrics = _write_run(tmp_path / "fp16")  # a metrics file and a run directory, one row of panels each
    _write_run(tmp_path / "bf16", fp16=False)  # no fp16 scales: that panel is marked "not logged"
    assert plot_numerics.families_of(plot_numerics.load_run(tmp_path / "bf16")) == ["sr", "stats", "clamp"]
    out = tmp_path / "sub" / "two.png"
    rc = plot_numerics.main(["--run", str(tmp_path / "bf16"), str(metrics), "--out", str(out), "--title", "synthetic",
                             "--label", "bf16", "--label", "fp16"])
    assert rc == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 1000


def test_missing_file_and_no_numerics_rows_name_the_file(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    missing = tmp_path / "nowhere" / "metrics.jsonl"
    with pytest.raises(plot_numerics.NumericsFileError, match="no such metrics file") as e:
        plot_numerics.plot([missing], tmp_path / "x.png")
    assert str(missing) in str(e.value)
    empty = tmp_path / "off"
    empty.mkdir()
    (empty / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 10, "loss": 5.0}) + "\n")
    with pytest.raises(plot_numerics.NumericsFileError, match="no numerics rows") as e:
        plot_numerics.plot([empty], tmp_path / "x.png")
    assert str(empty / "metrics.jsonl") in str(e.value)
    assert plot_numerics.main([str(empty), "--out", str(tmp_path / "x.png")]) == 2
    assert str(empty / "metrics.jsonl") in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
