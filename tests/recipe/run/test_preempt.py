"""Stop signals (recipe/run/preempt.py): SIGTERM and SIGUSR1 set the stop flag and name the signal; a
DataLoader worker survives a job-wide SIGTERM/SIGUSR1 sent by someone else (a scheduler) and still
ends when its rank ends it; a stop whose checkpoint was not saved names the steps that are lost."""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from recipe.run.preempt import PREEMPTED_EXIT_CODE, STOP_UNSAVED_EXIT_CODE, StopNotSaved, StopRequest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_stop_signals_set_the_flag_and_name_the_first(sig: signal.Signals) -> None:
    stop = StopRequest().install()
    try:
        assert not stop.requested and stop.signal_name is None
        os.kill(os.getpid(), sig)
        other = signal.SIGUSR1 if sig == signal.SIGTERM else signal.SIGTERM
        os.kill(os.getpid(), other)  # a second signal does not rename the stop
        assert stop.requested and stop.signal_name == sig.name
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGTERM) is not stop._on_stop


def test_exit_codes_are_distinct() -> None:
    assert PREEMPTED_EXIT_CODE == 143 and STOP_UNSAVED_EXIT_CODE not in (0, 1, 2, 143)


def test_stop_not_saved_names_the_lost_step_and_the_last_checkpoint(tmp_path: Path) -> None:
    cause = OSError("No space left on device")
    e = StopNotSaved("SIGTERM", 41, cause, [tmp_path / "step00000020", tmp_path / "step00000040"])
    assert str(e).startswith("stopped by SIGTERM after step 41, but its checkpoint was not saved "
                             "(OSError: No space left on device); the last complete checkpoint is ")
    assert str(e).endswith("step00000040") and e.last_saved == tmp_path / "step00000040"
    none = StopNotSaved("SIGUSR1", 3, RuntimeError("x\nmore lines"), [])
    assert "(RuntimeError: x)" in str(none) and "there is no complete checkpoint: the run restarts from step 0" in str(none)


# The worker side runs in a child interpreter: signals sent to it from a third process (as a scheduler
# does) must not disturb pytest's own process.
WORKER_SCRIPT = textwrap.dedent("""
    import contextlib, functools, os, signal, subprocess, sys, time
    import torch
    from torch.utils.data import DataLoader, IterableDataset
    from recipe.run.preempt import StopRequest, forking_workers, protect_worker

    class Slow(IterableDataset):
        def __iter__(self):
            for i in range(400):
                time.sleep(0.01)
                yield torch.tensor([i])

    protect, sig = sys.argv[1] == "1", getattr(signal, sys.argv[2])
    stop = StopRequest().install()
    init = functools.partial(protect_worker, rank_pid=os.getpid()) if protect else None
    dl = DataLoader(Slow(), batch_size=None, num_workers=2, worker_init_fn=init)
    with forking_workers() if protect else contextlib.nullcontext():
        it = iter(dl)
    next(it)
    workers = [w.pid for w in it._workers]
    # from another process, to the workers and to this rank, as SLURM or `timeout` do
    subprocess.run(["kill", f"-{sig.name[3:]}", *map(str, workers), str(os.getpid())], check=True)
    time.sleep(0.5)
    got = sum(1 for _ in zip(range(50), it))
    print("batches", got, "stop", stop.requested, stop.signal_name, flush=True)
    # the rank ends a worker itself (what DataLoader/multiprocessing do with one that hangs): it ends
    os.kill(workers[0], signal.SIGTERM)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        state = open(f"/proc/{workers[0]}/stat").read().rsplit(")", 1)[1].split()[0]
        if state in "ZX":
            break
        time.sleep(0.05)
    print("ended by its rank", state in "ZX", flush=True)
""")


def _run_worker_script(protect: bool, sig: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", WORKER_SCRIPT, "1" if protect else "0", sig], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1"])
def test_a_job_wide_signal_leaves_protected_workers_to_their_rank(sig: str) -> None:
    res = _run_worker_script(True, sig)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"batches 50 stop True {sig}" in res.stdout and "ended by its rank True" in res.stdout, res.stdout


def test_unprotected_workers_die_of_a_job_wide_sigterm() -> None:
    """The failure the protection prevents (the DataLoader as torch makes it, without it)."""
    res = _run_worker_script(False, "SIGTERM")
    assert res.returncode != 0 and "is killed by signal: Terminated" in res.stderr, (res.stdout, res.stderr[-2000:])
