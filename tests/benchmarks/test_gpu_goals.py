"""benchmarks/gpu_goals.py on fabricated result files (CPU): each goal line is PASS, FAIL or MISSING
from the figures the benchmarks write (bench_optim/bench_train JSON, bench_loss's markdown table)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_goals

GIB = 2**30

LOSS_TABLE = """# bench_loss: NVIDIA H200; torch 2.x; ...

| B | D | implementation | fwd+bwd ms | floor ms | x floor | peak extra MiB | loss |
|---:|---:|---|---:|---:|---:|---:|---:|
| 32768 | 1024 | chunked c=4096 | 30.2 | 11.1 | 2.72 | 900.0 | 6.123456 |
| 32768 | 1024 | fused | {fused_ms} | 11.1 | 1.10 | 300.0 | 6.123456 |
| 32768 | 1024 | open_clip | 26.0 | 11.1 | 2.34 | 8200.0 | 6.123456 |
| 131072 | 1024 | chunked c=4096 | 480.0 (3 passes) | 178 | 2.70 | 3000.0 | 7.5 |
| 131072 | 1024 | fused | 200.0 | 178 | 1.12 | {fused_mib} | 7.5 |
| 131072 | 1024 | open_clip | OOM | | | |
"""


def _optim(ms: float) -> list[dict]:
    return [
        {"optimizer": "torch AdamW bf16 (RTN)", "ms": 5.9, "layout": "gpu-1b"},
        {"optimizer": "SRAdamW bf16 w + bf16 SR states (fused)", "ms": ms, "layout": "gpu-1b"},
        {"optimizer": "SRAdamW bf16 w + bf16 SR states (fused, check_finite=False)", "ms": ms - 0.2, "layout": "gpu-1b"},
        {"optimizer": "torch AdamW bf16 (RTN)", "ms": 1.12, "layout": "vit-b-32"},
        {"optimizer": "SRAdamW bf16 w + bf16 SR states (fused)", "ms": 1.12 * ms / 4.0, "layout": "vit-b-32"},
        {"optimizer": "torchao _AdamW bf16 SR", "error": "ImportError: x", "layout": "gpu-1b"},
    ]


def _train(sps: float, peak_gib: float) -> dict:
    row = {"batch": 512, "ckpt": False, "accumulation": 1, "fits": True}
    return {"rows": [
        dict(row, arm="recipe-fused", samples_per_s=sps, peak_bytes=peak_gib * GIB),
        dict(row, arm="recipe-fused", ckpt=True, samples_per_s=99999.0, peak_bytes=1),  # not the setting judged
        dict(row, arm="openclip", samples_per_s=4000.0, peak_bytes=25 * GIB),
    ]}


def _write(folder: Path, optim=None, loss=None, train=None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    if optim is not None:
        (folder / "bench_optim.json").write_text(json.dumps(optim))
    if loss is not None:
        (folder / "bench_loss.md").write_text(loss)
    if train is not None:
        (folder / "bench_train.json").write_text(json.dumps(train))


def test_all_goals_pass(tmp_path: Path) -> None:
    _write(tmp_path, _optim(3.5), LOSS_TABLE.format(fused_ms="12.5", fused_mib="700.0"), _train(5400.0, 15.0))
    lines = gpu_goals.evaluate(tmp_path)
    assert [x.status for x in lines] == ["PASS"] * 7, "\n".join(map(str, lines))
    text = "\n".join(map(str, lines))
    assert "3.50 ms" in text and "torch AdamW bf16 (RTN) 5.90 ms" in text  # the figure and this run's anchor
    assert "fused 12.5 ms" in text and "open_clip 26.0 ms" in text and "open_clip OOM" in text
    assert "5400 samples/s" in text and "openclip 4000 samples/s" in text


def test_failing_goals(tmp_path: Path) -> None:
    _write(tmp_path, _optim(4.5), LOSS_TABLE.format(fused_ms="16.5", fused_mib="2048.0"), _train(5200.0, 17.5))
    assert [x.status for x in gpu_goals.evaluate(tmp_path)] == ["FAIL"] * 7


def test_missing_files_rows_and_figures(tmp_path: Path) -> None:
    assert [x.status for x in gpu_goals.evaluate(tmp_path)] == ["MISSING"] * 7  # nothing written
    optim = [r for r in _optim(3.0) if "SRAdamW" not in r["optimizer"]]  # the row judged is absent
    loss = LOSS_TABLE.format(fused_ms="OOM", fused_mib="1.0").replace("| 131072 | 1024 | fused | 200.0 | 178 | 1.12 | 1.0 | 7.5 |\n", "")
    train = {"rows": [r for r in _train(5000.0, 10.0)["rows"] if r["arm"] == "openclip"]}
    _write(tmp_path / "b", optim, loss, train)
    lines = gpu_goals.evaluate(tmp_path / "b")
    assert [x.status for x in lines] == ["MISSING"] * 7, "\n".join(map(str, lines))
    assert "fused: OOM" in str(lines[3]) and "no fused row" in str(lines[4])


def test_loss_json_is_preferred_to_the_table(tmp_path: Path) -> None:
    rows = [{"B": 32768, "D": 1024, "impl": "fused", "ms": 10.0, "peak_mib": 100.0},
            {"B": 131072, "D": 1024, "impl": "fused", "ms": 150.0, "peak_mib": 5000.0}]
    _write(tmp_path, loss=LOSS_TABLE.format(fused_ms="99.0", fused_mib="1.0"))
    (tmp_path / "bench_loss.json").write_text(json.dumps({"rows": rows}))
    assert [x.status for x in gpu_goals.loss_goals(tmp_path)] == ["PASS", "FAIL"]


def test_parse_loss_markdown_finds_columns_by_header() -> None:
    table = ("| B | D | implementation | fwd+bwd ms | floor ms | x floor | peak extra MiB | loss | x open_clip time "
             "| x open_clip mem |\n|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
             "| 32768 | 1024 | fused | 12.0 | 11.1 | 1.08 | 300.0 | 6.1 | 0.46 | 0.04 |\n"
             "| 32768 | 1024 | open_clip | not installed | | | | | | |\n")
    rows = gpu_goals.parse_loss_markdown(table)
    assert rows[0] == {"B": 32768, "D": 1024, "impl": "fused", "ms": 12.0, "peak_mib": 300.0, "status": "ok"}
    assert rows[1]["status"] == "not installed" and rows[1]["ms"] is None


def test_parse_loss_markdown() -> None:
    rows = gpu_goals.parse_loss_markdown(LOSS_TABLE.format(fused_ms="12.5", fused_mib="700.0"))
    assert len(rows) == 6
    assert rows[3] == {"B": 131072, "D": 1024, "impl": "chunked c=4096", "ms": 480.0, "peak_mib": 3000.0, "status": "ok"}
    assert rows[5]["status"] == "OOM" and rows[5]["ms"] is None


@pytest.mark.parametrize("strict,code", [(False, 0), (True, 1)])
def test_command_line_writes_goals_md(tmp_path: Path, strict: bool, code: int) -> None:
    _write(tmp_path, _optim(3.5), LOSS_TABLE.format(fused_ms="12.5", fused_mib="700.0"))
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_goals.py"), "goals", str(tmp_path)] + (["--strict"] * strict)
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert res.returncode == code, res.stderr
    out = res.stdout.splitlines()
    assert out[0] == "GOALS"
    assert [line.split()[0] for line in out[1:]] == ["PASS"] * 5 + ["MISSING", "MISSING"]
    md = (tmp_path / "goals.md").read_text()
    assert "| **PASS** | optimizer step" in md and "5 PASS, 0 FAIL, 2 MISSING" in md


def test_env_json_without_a_gpu(tmp_path: Path) -> None:
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_goals.py"), "env", str(tmp_path)],
                         capture_output=True, text=True, timeout=300, check=False, env={"GIT_COMMIT": "abc123", "PATH": ""})
    assert res.returncode == 0, res.stderr
    env = json.loads((tmp_path / "env.json").read_text())
    assert env["git_commit"] == "abc123" and env["versions"]["torch"]
    assert {"date", "host", "versions"} <= set(env)


@pytest.mark.parametrize("ratio, status", [(0.95, "PASS"), (0.85, "FAIL")])
def test_data_goal_only_when_the_data_step_ran(tmp_path: Path, ratio: float, status: str) -> None:
    """The opt-in data step's goal: one line per loader arm, judged on its ratio to synthetic inputs;
    an arm that could not run is MISSING with its reason; no line when bench_data.json is absent."""
    assert gpu_goals.data_goals(tmp_path) == []
    res = {"train_step": {"preset": "ViT-B-32", "batch": 512, "workers": 14, "arms": {
        "synthetic": {"samples_per_s": 5000.0},
        "loader-cpu": {"samples_per_s": 5000.0 * ratio, "ratio_to_synthetic": ratio, "loader_only_samples_per_s": 7000},
        "loader-cuda": {"unavailable": "no nvJPEG"},
    }}}
    (tmp_path / "bench_data.json").write_text(json.dumps(res))
    lines = gpu_goals.data_goals(tmp_path)
    assert [x.status for x in lines] == [status, "MISSING"], "\n".join(map(str, lines))
    assert f"{ratio:.2f}x" in str(lines[0]) and "no nvJPEG" in str(lines[1])
    assert lines[0] in gpu_goals.evaluate(tmp_path)
