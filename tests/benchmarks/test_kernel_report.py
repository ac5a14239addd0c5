"""The project's Triton kernels compile for sm_90 with their runtime specialisation (no GPU needed).

benchmarks/kernel_report.py records the real launches of the host code (every optimizer route of
``OPTIM_ROUTES``: one ``SRAdamW.step``; the fused loss at D = 512 in bf16: one forward and backward),
compiles each distinct kernel as ``JITFunction.run`` would on an sm_90 device and reads ``ptxas -v``.
The loss in fp16 and fp32 would add ~15 s on a 2-core machine; tests/recipe/loss/test_fused.py compiles
every loss variant for sm_90 itself. The report runs once, in a subprocess (it needs
``TRITON_INTERPRET=0`` before the kernels are decorated, while this process may hold the interpreted
ones), and is shared by the tests. Skipped only when Triton's CUDA backend tools are missing
(``kernel_report.tools_missing()``).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = """
import json, sys
sys.path.insert(0, {root!r})
from benchmarks import kernel_report as kr
why = kr.tools_missing()
if why:
    print(json.dumps({{"missing": why}}))
    sys.exit(0)
rows = kr.report(kr.OPTIM_ROUTES, loss_dims=(512,), loss_dtypes=("bf16",))
import torch
two = kr.optimizer_launches({{"two dtype groups": ((torch.float32, torch.bfloat16), {{}}, False)}})
print(json.dumps({{"rows": rows, "toy": kr.toy_check(), "routes": list(kr.OPTIM_ROUTES),
                  "two_groups": {{name: kr.kernel_name(launch[0]) for name, launch in two.items()}}}}))
"""


@pytest.fixture(scope="module")
def report() -> dict:
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", _SCRIPT.format(root=str(ROOT))], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600, check=False)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if "missing" in out:
        pytest.skip(f"cannot compile for sm_90 here: {out['missing']}")
    return out


def test_every_variant_compiles_without_spills(report: dict) -> None:
    rows = report["rows"]
    for r in rows:
        assert r["spills"] == 0, r
        assert 0 < r["regs"] <= 255, r
    optim = [r for r in rows if r["kind"] == "optimizer"]
    # the optimizer's budget: two programs of 16 warps per SM (tests/optim/test_triton_kernel.py checks the
    # same on its own specialisations; `kernel_report.py --python PY --max-regs 64` under another Triton)
    assert all(r["regs"] <= 64 for r in optim), [(r["name"], r["regs"]) for r in optim]
    # every route is reported (one row, or one per distinct kernel named "route [kernel]")
    for route in report["routes"]:
        assert any(r["name"] == route or r["name"].startswith(f"{route} [") for r in optim), route
    loss = {r["name"] for r in rows if r["kind"] == "loss"}
    for dtype in ("bf16",):
        assert any(n.startswith("loss fwd") and n.endswith(f"{dtype} D=512") for n in loss), (dtype, loss)
        assert any(n.startswith("loss bwd") and n.endswith(f"{dtype} D=512") for n in loss), (dtype, loss)


def test_optimizer_sass_per_element_is_finite(report: dict) -> None:
    optim = [r for r in report["rows"] if r["kind"] == "optimizer"]
    assert not [r for r in optim if "sass_error" in r], [(r["name"], r["sass_error"]) for r in optim if "sass_error" in r]
    streaming = [r for r in optim if "sass_per_elem" in r]
    for route in report["routes"]:  # each route's update kernel (launched with a BLOCK constexpr) has the figure
        assert any(r["name"] == route or r["name"].startswith(f"{route} [") for r in streaming), route
    for r in streaming:
        for key in ("sass_per_elem", "sass_per_elem_fast", "mem_per_elem"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        assert r["sass_per_elem_fast"] <= r["sass_per_elem"], r
        # a stream read and one written, each at most 8 (16-bit) elements per 16-byte access
        assert r["mem_per_elem"] >= 2 / 8, r
        assert r["sass_per_elem"] < r["sass_total"], r


def test_sass_per_element_method_on_toy_kernels(report: dict) -> None:
    # y = a x + b, fp32, 4 elements per thread: 1 FFMA per element, one 16-byte load and one store
    # per 4 elements -> 1.5; the two-copy kernel's unmasked copy is the same code
    toy = report["toy"]
    one, two = toy["y = a x + b"], toy["y = a x + b, masked + unmasked copies"]
    assert one["copies"] == 1 and two["copies"] == 2, toy
    for t in (one, two):
        assert t["sass_per_elem"] == pytest.approx(1.5), t
        assert t["mem_per_elem"] == pytest.approx(0.5), t
    assert two["sass_per_elem_masked"] >= two["sass_per_elem"], two


def test_every_launch_of_a_step_is_recorded(report: dict) -> None:
    # one step over an fp32 and a bf16 parameter launches the update kernel twice, with two
    # specialisations: both are recorded and reported, named after the route and the kernel
    names = report["two_groups"]
    assert len(names) == 2, names
    assert all(n.startswith("two dtype groups [") for n in names), names


def test_another_triton_runs_the_same_report(tmp_path: Path) -> None:
    # --python PY (or KERNEL_REPORT_PYTHON=PY) re-runs the script under PY with the same arguments, less the
    # flag, TRITON_INTERPRET=0 and this interpreter's site-packages to append after PY's own (its torch)
    stub = tmp_path / "python"
    record = tmp_path / "called"
    stub.write_text(f'#!/usr/bin/env bash\nprintf "%s\\n" "$@" > {record}\n'
                    f'printf "%s\\n" "$TRITON_INTERPRET" "$KERNEL_REPORT_BORROW" >> {record}\nexit 3\n')
    stub.chmod(0o755)
    script = ROOT / "benchmarks" / "kernel_report.py"
    for argv, env in (([f"--python={stub}", "--optimizer-only"], {}),
                      (["--optimizer-only"], {"KERNEL_REPORT_PYTHON": str(stub)})):
        res = subprocess.run([sys.executable, str(script), *argv, "--max-regs", "64"], cwd=ROOT, capture_output=True,
                             text=True, timeout=300, env=dict(os.environ, **env), check=False)
        assert res.returncode == 3, res.stderr[-2000:]  # the child's status
        lines = record.read_text().splitlines()
        assert lines[:4] == [str(script), "--optimizer-only", "--max-regs", "64"], lines
        assert lines[4] == "0" and any(p.endswith("-packages") for p in lines[5].split(os.pathsep)), lines
