"""benchmarks/gpu_check.sh's structure, without a GPU: the plan its dry run prints (every step with an
explicit time limit; the default run within 8 minutes; at most 8 result files, as the device tool
returns), and a whole run with a stand-in for Python (every step "succeeds" at once), whose results
under ``$OUT`` are the returned files and one archive holding everything."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import gpu_rank

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
DEFAULT = ["optim", "loss", "train", "memory", "tests"]
OPT_IN = ["compile", "accum", "zero0", "verify", "numerics"]
ALWAYS = ["setup", "env", "goals", "pack"]
BUDGET_S = 8 * 60  # the default run, tests included
MAX_FILES = 8  # what the device tool returns from $OUT
PLAN_LINE = re.compile(r"^(?P<key>[a-z0-9]+)\s+(?P<limit>\d+) s  (?P<what>.+)$")

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("timeout") is None,
                                reason="needs bash and coreutils' timeout")


def dry_run(*steps: str) -> tuple[list[tuple[str, int]], dict[str, int], str]:
    """``(plan, figures, output)``: the ``(key, limit)`` of every planned step in run order, and the
    dry run's ``budget_s`` / ``returned_files``."""
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", *steps], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    plan = [(m["key"], int(m["limit"])) for m in map(PLAN_LINE.match, res.stdout.splitlines()) if m]
    figures = {k: int(v) for k, v in re.findall(r"^(budget_s|returned_files)=(\d+)$", res.stdout, re.MULTILINE)}
    return plan, figures, res.stdout


def test_default_run_fits_8_minutes_and_returns_at_most_8_files() -> None:
    plan, figures, out = dry_run()
    keys = [k for k, _ in plan]
    assert keys == ["setup", "env", *DEFAULT, "goals", "pack"], out
    assert all(limit > 0 for _, limit in plan), plan
    # the budget is each step's limit plus the seconds to stop it, and it holds the whole run
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)", SCRIPT.read_text(), re.MULTILINE)[1])
    assert figures["budget_s"] == sum(limit + kill_after for _, limit in plan)
    assert figures["budget_s"] <= BUDGET_S, out
    assert figures["returned_files"] <= MAX_FILES, out
    assert dict(plan)["tests"] <= 150  # pytest -m gpu within 150 s (tests/conftest.py runs the kernel tests first)


def test_every_step_has_an_explicit_limit_and_every_selection_returns_at_most_8_files() -> None:
    plan, figures, out = dry_run(*DEFAULT, *OPT_IN)
    assert sorted(k for k, _ in plan) == sorted(ALWAYS + DEFAULT + OPT_IN), out
    assert dict(plan)["numerics"] <= 4 * 60
    assert figures["returned_files"] <= MAX_FILES, out
    for key in OPT_IN:  # opt-in steps are named only: in no default plan
        assert key not in [k for k, _ in dry_run()[0]]
        one, _, _ = dry_run(key)
        assert [k for k, _ in one] == ["setup", "env", key, "goals", "pack"]


def test_unknown_step_is_refused() -> None:
    res = subprocess.run(["bash", str(SCRIPT), "--dry-run", "nonsense"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60, check=False)
    assert res.returncode == 2 and "unknown step 'nonsense'" in res.stderr


STUB = """#!/usr/bin/env bash
# a stand-in for python: every step succeeds at once; --json/--png/--junitxml PATH files are written
echo "stub: $*"
prev=""
for a in "$@"; do
  case "$prev" in --json|--png|--junitxml) echo '{}' > "$a" ;; esac
  prev=$a
done
case "$*" in
  *"gpu_goals.py env "*) echo '{}' > "${@: -1}/env.json" ;;
  *"gpu_goals.py goals "*) echo '# GOALS' > "${@: -1}/goals.md" ;;
esac
exit 0
"""


@pytest.mark.parametrize("steps", [[], ["numerics"]], ids=["default", "numerics"])
def test_a_run_leaves_the_returned_files_and_one_archive_under_out(tmp_path: Path, steps: list[str]) -> None:
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {"PATH": "/usr/bin:/bin", "OUT": str(out), "PYTHON": str(stub), "HOME": str(tmp_path)}
    res = subprocess.run(["bash", str(SCRIPT), *steps], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
                         check=False)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    (folder,) = out.iterdir()  # one folder: gpu_<date>_<host>
    assert re.fullmatch(r"gpu_\d{8}-\d{6}_[A-Za-z0-9_.-]+", folder.name)
    files = sorted(p.name for p in folder.iterdir())
    _, figures, _ = dry_run(*steps)
    assert len(files) == figures["returned_files"] <= MAX_FILES, files
    assert all(p.is_file() for p in folder.iterdir())
    expected = {"gpu_check.log", "goals.md", "env.json", "gpu_check_results.tar.gz"}
    expected |= {"numerics_routes.png"} if steps else {"tests.log"}
    assert set(files) == expected
    with tarfile.open(folder / "gpu_check_results.tar.gz") as tar:
        packed = {Path(n).name for n in tar.getnames()}
    if steps:  # the step's own output and JSON
        assert {"numerics_routes.md", "numerics_routes.json", "numerics_routes.png"} <= packed, packed
    else:  # each benchmark's output and JSON, the test log and report
        assert {"bench_optim.md", "bench_optim.json", "bench_loss.md", "bench_train.json", "bench_memory.json",
                "tests.log", "tests.xml", "env.json", "goals.md"} <= packed, packed
    log = (folder / "gpu_check.log").read_text()
    assert "0 step(s) failed" in log and "returned:" in log


def test_gpu_selection_runs_the_kernel_tests_first() -> None:
    # tests/conftest.py: under -m gpu the fused optimizer kernel's tests, then the rest of tests/optim, then
    # the fused loss's, then the others, the benchmark scripts' smoke tests last
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "--collect-only", "-p", "no:cacheprovider",
                          "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert res.returncode == 0, res.stdout[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    assert len(ids) >= 20, res.stdout[-3000:]
    ranks = [gpu_rank(i) for i in ids]
    assert ranks == sorted(ranks), ids
    assert ids[0].startswith("tests/optim/test_triton_kernel.py::") and ids[-1].startswith("tests/benchmarks/"), ids
    assert {0, 1, 2, 3, 4, 5} <= set(ranks), ids
