"""``launch.sh`` as a user runs it: from another directory, with the demo's defaults overridden, a
finished or continued run resumed, a locked run directory, a configuration error, preemption by
SIGTERM, and no DeepSpeed files left in /dev/shm. Each run is 2 CPU ranks under the real launcher."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from recipe.synthetic import write_dataset

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch.sh"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A working directory outside the repository with a small dataset and a small-batch DS JSON."""
    work = tmp_path_factory.mktemp("work")
    write_dataset(str(work / "data"), 64, n_val=24, image_size=32, seed=0)
    cfg = json.loads((ROOT / "ds_configs" / "zero2_bf16_halfmaster.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 8
    (work / "ds.json").write_text(json.dumps(cfg))
    return work


def env(work: Path, **extra: str) -> dict[str, str]:
    e = {**os.environ, "DS_CONFIG": str(work / "ds.json"), "DATA_DIR": str(work / "data"), **extra}
    e.pop("RECIPE_TRACEBACK", None)
    return e


def launch(work: Path, *args: str, timeout: float = 600, **extra: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(LAUNCH), *args], cwd=work, env=env(work, **extra), capture_output=True,
                          text=True, timeout=timeout)


def rows(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def shm_files() -> set[str]:
    return {p.name for p in Path("/dev/shm").glob("deepspeed_*")} if Path("/dev/shm").is_dir() else set()


SMALL = ("--steps", "4", "--log-every", "1", "--eval-every", "0", "--save-every", "2", "--workers", "0",
         "--vocab-size", "300")


def test_help_is_printed_once() -> None:
    res = subprocess.run(["bash", str(LAUNCH), "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.count("usage:") == 1
    assert "--train-data" in res.stdout and "(default: " in res.stdout


def test_configuration_error_is_one_line_and_nonzero(work: Path) -> None:
    res = launch(work, "--steps", "0", "--output-dir", "runs/bad", timeout=300)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 2, out
    assert out == ["error: --steps must be >= 1, got 0"], out
    assert not (work / "runs" / "bad").exists()  # nothing was written


def test_demo_defaults_are_overridden_by_arguments_relative_to_the_caller(work: Path) -> None:
    """No --train-data: the demo's data, evaluation and settings stay, the arguments change steps and
    logging; relative paths are the caller's; the run ends with a readable summary, writes
    final_metrics.json, prints no library noise and leaves nothing in /dev/shm."""
    before = shm_files()
    (work / "runs" / "demo").mkdir(parents=True)
    (work / "runs" / "demo" / "run.lock").write_text(json.dumps({"host": socket.gethostname(), "pid": 2**22 + 7}))
    res = launch(work, *SMALL, "--output-dir", "runs/demo")
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    run = work / "runs" / "demo"
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["data"]["train_data"] == str(work / "data" / "train.csv") and cfg["data"]["val_data"]
    assert cfg["steps"] == 4 and cfg["optim"]["lr"] == 2e-3 and cfg["model"]["preset"] == "tiny-clip"
    assert not (ROOT / "runs" / "demo").exists()
    final = json.loads((run / "final_metrics.json").read_text())
    assert final["steps"] == 4 and 0 <= final["zeroshot_top1"] <= 1
    lines = [x for x in res.stdout.splitlines() if x.strip()]
    assert lines[-1].strip() == "all metrics: runs/demo/final_metrics.json"
    assert any("zero-shot top-1" in x and "chance 0.083" in x for x in lines[-5:]), lines[-5:]
    assert "taking over the stale lock" in out and not (run / "run.lock").exists()
    for noise in ("untested optimizer", "CUDA", "Traceback", "exits successfully", "deprecated", "built successfully"):
        assert noise not in out, noise
    assert shm_files() <= before


@pytest.mark.parametrize("ranks", ["1", "2"])
def test_default_is_bf16_at_zero0_on_any_number_of_ranks(work: Path, ranks: str) -> None:
    """Without DS_CONFIG, on one rank or several: the planner's choice, bf16 at ZeRO-0 (replicated, one bf16
    gradient all-reduce per step), trains and evaluates."""
    e = env(work, NUM_GPUS=ranks)
    e.pop("DS_CONFIG")
    if ranks != "1":  # the shipped JSON's micro-batch 64 on every rank: more samples than the fixture's 64
        if not (work / "data-large" / "train.csv").is_file():
            write_dataset(str(work / "data-large"), 160, n_val=24, image_size=32, seed=0)
        e["DATA_DIR"] = str(work / "data-large")
    res = subprocess.run(["bash", str(LAUNCH), *SMALL, "--output-dir", f"runs/default{ranks}"], cwd=work, env=e,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    cfg = json.loads((work / "runs" / f"default{ranks}" / "config.json").read_text())
    assert cfg["deepspeed_config"] == str(ROOT / "ds_configs" / "zero0_bf16_sr.json")
    assert f"(bf16/zero0, {ranks} ranks, " in res.stdout, res.stdout[-2000:]  # the closing summary
    assert f"bf16/zero0, {ranks} ranks x micro-batch 64" in res.stdout + res.stderr  # the opening line
    assert json.loads((work / "runs" / f"default{ranks}" / "final_metrics.json").read_text())["steps"] == 4


def test_resume_uses_the_runs_config_and_never_replays_rows(work: Path) -> None:
    res = launch(work, "--train-data", "data/train.csv", "--val-data", "data/val.csv", *SMALL, "--output-dir", "runs/r")
    assert res.returncode == 0, (res.stdout + res.stderr)[-3000:]
    run = work / "runs" / "r"
    saved = (run / "config.json").read_text()
    # a finished run: says so, exits 0, leaves config.json alone
    res = launch(work, "--output-dir", "runs/r", "--resume", "latest")
    assert res.returncode == 0 and "already reached step 4 of 4" in res.stderr, (res.stdout + res.stderr)[-3000:]
    assert json.loads((run / "config.json").read_text())["data"] == json.loads(saved)["data"]
    # more steps continue it, with only --steps changed
    res = launch(work, "--output-dir", "runs/r", "--resume", "latest", "--steps", "6")
    assert res.returncode == 0 and "resumed from step 4 (checkpoint" in res.stderr, (res.stdout + res.stderr)[-3000:]
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["steps"] == 6 and cfg["data"]["val_data"] == "data/val.csv"
    # replay from an older checkpoint: rows of the replayed steps are replaced, not duplicated
    res = launch(work, "--output-dir", "runs/r", "--resume", "runs/r/checkpoints/step00000002", "--steps", "6")
    assert res.returncode == 0 and "resumed from step 2" in res.stderr, (res.stdout + res.stderr)[-3000:]
    keys = [(r["kind"], r["step"]) for r in rows(run)]
    assert len(keys) == len(set(keys)) and ("train", 6) in keys and ("final", 6) in keys, keys
    latest = (run / "checkpoints" / "latest").read_text()
    assert latest.startswith("step00000006") and (run / "checkpoints" / latest / "COMPLETE").exists()


def test_a_second_run_into_a_locked_directory_refuses(work: Path) -> None:
    run = work / "runs" / "locked"
    run.mkdir(parents=True)
    holder = {"host": socket.gethostname(), "pid": os.getpid(), "started": "now"}  # alive: this test
    (run / "run.lock").write_text(json.dumps(holder))
    res = launch(work, "--train-data", "data/train.csv", *SMALL, "--output-dir", "runs/locked", timeout=300)
    out = (res.stdout + res.stderr).strip().splitlines()
    assert res.returncode == 1 and len(out) == 1, out
    assert f"is in use by pid {os.getpid()}" in out[0] and "(lock file runs/locked/run.lock)" in out[0]
    assert json.loads((run / "run.lock").read_text()) == holder and not (run / "config.json").exists()


def _as_from_a_terminal() -> None:
    """In the child before exec: the signal state of a job started from a shell. Signals blocked or
    ignored in this test process (libraries loaded by earlier tests may leave them so) would be
    inherited, and a shell started with SIGINT ignored cannot trap it."""
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def start_long_run(work: Path, name: str, *args: str, workers: int = 0, own_session: bool = False,
                   **extra: str) -> subprocess.Popen:
    """A run far longer than the test, returned once it has logged two steps (``own_session``: in a
    session of its own, so that the test can signal its whole process group or session)."""
    proc = subprocess.Popen(
        ["bash", str(LAUNCH), "--train-data", "data/train.csv", "--steps", "100000", "--log-every", "1",
         "--eval-every", "0", "--workers", str(workers), "--vocab-size", "300", "--output-dir", f"runs/{name}", *args],
        cwd=work, env=env(work, **extra), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        preexec_fn=_as_from_a_terminal, start_new_session=own_session,
    )
    run = work / "runs" / name
    deadline = time.monotonic() + 300
    while not ((run / "metrics.jsonl").exists() and len(rows(run)) >= 2):
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "timeout"
        time.sleep(0.5)
    return proc


def ranks_of(name: str) -> bytes:
    return subprocess.run(["pgrep", "-f", f"output-dir runs/{name}"], capture_output=True).stdout


def test_sigint_stops_every_rank(work: Path) -> None:
    proc = start_long_run(work, "i")
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]
    assert ranks_of("i") == b"" and not (work / "runs" / "i" / "run.lock").exists()


def test_sigterm_saves_a_checkpoint_on_every_rank_and_stops(work: Path) -> None:
    proc = start_long_run(work, "p")
    run = work / "runs" / "p"
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 143, out[-3000:]
    latest = (run / "checkpoints" / "latest").read_text()
    step = json.loads((run / "checkpoints" / latest / "COMPLETE").read_text())["step"]
    assert 2 <= step < 100000 and "stopped by SIGTERM at step" in out
    assert ranks_of("p") == b""  # no rank left
    assert not (run / "run.lock").exists()
    res = launch(work, "--output-dir", "runs/p", "--resume", "latest", "--steps", str(step + 1))
    assert res.returncode == 0 and f"resumed from step {step}" in res.stderr, (res.stdout + res.stderr)[-3000:]


def last_line(text: str) -> str:
    return [x for x in text.replace("\r", "\n").splitlines() if x.strip()][-1].strip()


def saved_step(run: Path) -> int:
    latest = (run / "checkpoints" / "latest").read_text()
    return json.loads((run / "checkpoints" / latest / "COMPLETE").read_text())["step"]


@pytest.mark.parametrize("sig, scope, ds", [
    ("TERM", "session", "zero2_bf16_halfmaster.json"),  # SLURM's scancel / time limit: every process of the job
    ("USR1", "session", "zero0_bf16_sr.json"),  # SLURM's --signal=USR1@SECONDS, on the one-GPU route
    ("TERM", "group", "zero2_bf16_halfmaster.json"),  # `timeout`, `kill -- -PGID`: launch.sh's process group
])
def test_a_job_wide_signal_saves_a_checkpoint_with_dataloader_workers(work: Path, sig: str, scope: str, ds: str) -> None:
    """Every process of the job gets the signal (DataLoader workers included, --workers 2): every rank
    saves, launch.sh returns 143 only once every rank has ended, and the run resumes."""
    cfg = json.loads((ROOT / "ds_configs" / ds).read_text())
    cfg["train_micro_batch_size_per_gpu"] = 8
    (work / f"sig-{ds}").write_text(json.dumps(cfg))
    name = f"sig-{sig}-{scope}"
    proc = start_long_run(work, name, workers=2, own_session=True, DS_CONFIG=str(work / f"sig-{ds}"))
    run = work / "runs" / name
    time.sleep(1.0)  # the workers of the current pass are up
    if scope == "session":
        subprocess.run(["pkill", f"-{sig}", "-s", str(proc.pid)], check=True)
    else:
        os.killpg(proc.pid, getattr(signal, f"SIG{sig}"))
    out, _ = proc.communicate(timeout=180)
    alive = ranks_of(name)
    assert proc.returncode == 143, out[-3000:]
    assert alive == b""  # launch.sh returned after its ranks
    assert "is killed by signal" not in out and "Traceback" not in out, out[-3000:]
    step = saved_step(run)
    assert step >= 2 and f"stopped by SIG{sig} at step {step}: checkpoint" in last_line(out), out[-2000:]
    assert not (run / "run.lock").exists()
    res = launch(work, "--output-dir", f"runs/{name}", "--resume", "latest", "--steps", str(step + 1),
                 DS_CONFIG=str(work / f"sig-{ds}"))
    assert res.returncode == 0 and f"resumed from step {step}" in res.stderr, (res.stdout + res.stderr)[-3000:]


def test_a_stop_whose_checkpoint_cannot_be_saved_exits_3_naming_the_step(work: Path) -> None:
    proc = start_long_run(work, "unsaved", own_session=True)
    run = work / "runs" / "unsaved"
    (run / "checkpoints").write_text("")  # a file where the checkpoints must go: the save fails
    subprocess.run(["pkill", "-TERM", "-s", str(proc.pid)], check=True)
    out, _ = proc.communicate(timeout=180)
    assert proc.returncode == 3, out[-3000:]
    line = last_line(out)
    assert line.startswith("error: stopped by SIGTERM after step ") and "its checkpoint was not saved" in line, line
    assert "there is no complete checkpoint: the run restarts from step 0" in line
    assert line.endswith(f"(traceback: runs/unsaved/error.log)") and "Traceback" not in out
    assert ranks_of("unsaved") == b""


def merged(work: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    """launch.sh with stdout and stderr in one stream, in the order they were written."""
    return subprocess.run(["bash", str(LAUNCH), *args], cwd=work, env=env(work, **extra), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=600)


def test_a_new_run_never_goes_into_another_run(work: Path) -> None:
    res = merged(work, "--train-data", "data/train.csv", *SMALL, "--output-dir", "runs/first")
    assert res.returncode == 0, res.stdout[-3000:]
    run = work / "runs" / "first"
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    res = merged(work, "--train-data", "data/train.csv", *SMALL, "--steps", "2", "--output-dir", "runs/first")
    assert res.returncode == 2 and res.stdout.strip().splitlines() == [
        "error: --output-dir runs/first already holds a run (config.json, checkpoints/, metrics.jsonl, "
        "final_metrics.json, model_config.json, tokenizer/): give --resume latest to continue it, or another "
        "--output-dir for a new run"], res.stdout[-3000:]
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing written
    res = merged(work, "--resume", "latest", "--output-dir", "runs/nothing-here")
    assert res.returncode == 2 and res.stdout.strip().splitlines() == [
        "error: --resume latest: runs/nothing-here does not exist, so there is no run to continue (leave out "
        "--resume to start a new run there)"], res.stdout
    assert not (work / "runs" / "nothing-here").exists()


@pytest.mark.parametrize("args, expected", [
    (("--train-data", "data/missing.csv"), "error: data path 'data/missing.csv' does not exist"),
    (("--train-data", "data/train.csv", "--image-column", "picture"),
     "error: --image-column 'picture' not found in csv data at "),
])
def test_a_failed_start_is_one_line_and_takes_back_what_it_wrote(work: Path, args: tuple, expected: str) -> None:
    """Rank 0 and rank 1 both fail (rank 1 in a collective rank 0 left): the output ends with one
    line naming the cause and the log holding both tracebacks; the run directory keeps only that log."""
    name = "failed-" + args[-1].replace(".", "-").replace("/", "-")
    res = merged(work, *args, *SMALL, "--output-dir", f"runs/{name}")
    assert res.returncode == 1, res.stdout[-3000:]
    line = last_line(res.stdout)
    assert line.startswith(expected) and line.endswith(f"(traceback: runs/{name}/error.log)"), res.stdout[-3000:]
    assert res.stdout.count("error:") == 1 and "Traceback" not in res.stdout and "[rank1]" not in res.stdout
    run = work / "runs" / name
    assert sorted(p.name for p in run.iterdir()) == ["error.log"]
    log = (run / "error.log").read_text()
    assert "=== rank 0 " in log and "=== rank 1 " in log and "Traceback" in log


def test_a_mistyped_flag_is_one_line_with_the_flag_meant(work: Path) -> None:
    res = merged(work, "--train-data", "data/train.csv", "--imge-column", "x", "--output-dir", "runs/typo")
    assert res.returncode == 2 and res.stdout.strip().splitlines() == [
        "error: unrecognized arguments: --imge-column x (did you mean --image-column?); --help lists every flag"
    ], res.stdout
    assert not (work / "runs" / "typo").exists()
