"""The EMA experiment (benchmarks/ema_experiment.py) at a small size: round-to-nearest freezes, the
stochastically rounded bf16 EMA follows the exact one within the stated bound."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import ema_experiment  # noqa: E402


def test_rtn_ema_freezes_while_the_sr_ema_tracks_the_exact_one() -> None:
    result = ema_experiment.run(n=4096, steps=1500, decays=(0.999,))
    r = result["results"]["0.999"]
    fp32, rtn, sr = (r["arms"][a] for a in ("fp32", "bf16 RTN", "bf16 SR"))
    assert rtn["frozen"] == 1.0 and abs(rtn["followed"]) < 0.01  # stuck at the initial weights
    assert rtn["lag_ulp"] > 10 * r["sr_mean_bound_ulp"]
    assert abs(sr["mean_err_ulp"]) <= r["sr_mean_bound_ulp"] and abs(sr["lag_ulp"]) <= r["sr_mean_bound_ulp"]
    assert sr["rms_err_ulp"] <= r["sr_sigma_bound_ulp"] and abs(sr["followed"] - 1) < 0.05
    assert fp32["rms_err_ulp"] < 0.01
    text = ema_experiment.table(result)
    assert "| 0.999 | bf16 SR |" in text and "4096 bf16 weights" in text
