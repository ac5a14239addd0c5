"""benchmarks/numerics_routes.py (gpu_check.sh's opt-in `numerics` step) on CPU ranks, tiny: the three
arms start from the same weights on the same batches, each writes its loss curve, and one figure holds
them."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_three_arms_same_start_one_figure(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "n.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "numerics_routes.py"), "--device", "cpu", "--preset", "tiny",
           "--batch", "4", "--steps", "3", "--pool", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    arms = {r["arm"]: r for r in result["arms"]}
    assert set(arms) == {"sr", "all-sr", "standard"}
    assert arms["standard"]["optimizer"] != arms["sr"]["optimizer"] == arms["all-sr"]["optimizer"] == "SRAdamW"
    for r in arms.values():
        assert r["steps"] == 3 and r["complete"] and all(math.isfinite(x) for x in r["losses"]), r
    # same initial weights, same first batch: the first losses agree (the first update differs by route)
    assert len({round(r["losses"][0], 4) for r in arms.values()}) == 1, arms
    png = out.with_suffix(".png")
    assert png.stat().st_size > 10_000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
