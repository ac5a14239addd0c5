"""How a launch ended (recipe/run/outcome.py): the one line and the exit status chosen from the ranks'
outcomes, peer-lost errors told apart from causes, and the launcher's wait for ranks that outlive it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from recipe.run import outcome
from recipe.run.outcome import Outcome, is_peer_lost, summarise

ROOT = Path(__file__).resolve().parents[3]

GLOO_PEER = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:561] Connection closed by peer "
                         "[127.0.0.1]:15571. This is typically caused by a remote worker crashing.")


def test_peer_lost_errors_are_told_apart_from_causes() -> None:
    assert is_peer_lost(GLOO_PEER)
    assert is_peer_lost(RuntimeError("NCCL error: remote process exited or there was a network error"))
    wrapped = ValueError("saving failed")
    wrapped.__cause__ = GLOO_PEER
    assert is_peer_lost(wrapped)  # a stop whose save failed because a peer had gone
    assert not is_peer_lost(FileNotFoundError("data path 'x.csv' does not exist"))
    assert not is_peer_lost(RuntimeError("CUDA out of memory"))


def O(rank: int, kind: str, code: int, message: str | None = None, log: str | None = None) -> Outcome:  # noqa: E743
    return Outcome(rank, code, kind, message, log)


@pytest.mark.parametrize(
    "outcomes, announced, runner, expected",
    [
        # every rank done: 0, nothing to add
        ({0: O(0, "done", 0), 1: O(1, "done", 0)}, {0, 1}, 0, (0, None)),
        # a saved stop: 143, rank 0 already said where the checkpoint is
        ({0: O(0, "stopped", 143), 1: O(1, "stopped", 143)}, {0, 1}, 143, (143, None)),
        # the launcher died of the job-wide signal (runner status 143 or 138): the ranks' word counts
        ({0: O(0, "stopped", 143), 1: O(1, "stopped", 143)}, {0, 1}, 138, (143, None)),
        # rank 1's own error is the cause; rank 0 only lost its peer
        ({0: O(0, "peer", 1, "rank 0 lost contact"), 1: O(1, "user", 1, "data path 'x' does not exist", "r/error.log")},
         {0, 1}, 1, (1, "error: data path 'x' does not exist (traceback: r/error.log)")),
        # both ranks raise the same user error: one line, rank 0's
        ({0: O(0, "user", 2, "--steps must be >= 1, got 0"), 1: O(1, "user", 2, "--steps must be >= 1, got 0")},
         {0, 1}, 2, (2, "error: --steps must be >= 1, got 0")),
        # a stop whose checkpoint was not saved outranks everything: exit 3, the lost step named
        ({0: O(0, "stop_unsaved", 3, "stopped by SIGTERM after step 7, but ...", "r/error.log"),
          1: O(1, "peer", 1, "rank 1 lost contact")}, {0, 1}, 1,
         (3, "error: stopped by SIGTERM after step 7, but ... (traceback: r/error.log)")),
        # a rank killed without a word while the other lost it: the killed rank is named
        ({0: O(0, "peer", 1, "rank 0 lost contact")}, {0, 1}, 137,
         (137, "error: rank 1 ended without reporting how (killed by a signal, e.g. SIGKILL or the out-of-memory "
               "killer)")),
        # a saved stop with a rank killed afterwards: the checkpoint is complete, 143
        ({0: O(0, "stopped", 143)}, {0, 1}, 1, (143, None)),
        # no rank ever started (the launcher failed): its own status
        ({}, set(), 1, (1, None)),
        # Ctrl-C
        ({0: O(0, "interrupted", 130, "interrupted (SIGINT): stopped without saving"),
          1: O(1, "interrupted", 130, "interrupted (SIGINT): stopped without saving")}, {0, 1}, 130,
         (130, "error: interrupted (SIGINT): stopped without saving")),
    ],
)
def test_the_launch_ends_with_the_cause_and_the_right_status(outcomes, announced, runner, expected) -> None:
    assert summarise(outcomes, announced, runner) == expected


def test_the_launcher_waits_for_ranks_that_outlive_it_and_prints_one_line(tmp_path: Path) -> None:
    """Two ranks announce themselves; the launcher's report returns only when both have ended (one
    of them 1.5 s after the report started), and prints the cause once."""
    rank_code = (
        "import os, sys, time; sys.path.insert(0, {root!r}); from recipe.run import outcome\n"
        "outcome.announce({rank}); time.sleep({sleep})\n"
        "outcome.record(outcome.Outcome({rank}, {code}, {kind!r}, {msg!r}, None))\n"
    )
    env = {**os.environ, outcome.LAUNCH_DIR_ENV: str(tmp_path)}
    ranks = [
        subprocess.Popen([sys.executable, "-c", rank_code.format(root=str(ROOT), rank=0, sleep=0.2, code=1,
                                                                  kind="peer", msg="rank 0 lost contact")], env=env),
        subprocess.Popen([sys.executable, "-c", rank_code.format(root=str(ROOT), rank=1, sleep=1.5, code=1,
                                                                  kind="user", msg="no such column")], env=env),
    ]
    while len(list(tmp_path.glob("rank*.pid"))) < 2:
        time.sleep(0.05)
    t0 = time.monotonic()
    res = subprocess.run([sys.executable, "-m", "recipe.run.outcome", str(tmp_path), "143", "--expect", "2"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    waited = time.monotonic() - t0
    for p in ranks:
        p.wait(timeout=10)
    assert res.returncode == 1 and res.stderr.strip().splitlines() == ["error: no such column"], res.stderr
    assert waited >= 1.0 and json.loads((tmp_path / "rank1.json").read_text())["kind"] == "user"


def test_ranks_outside_a_launch_leave_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(outcome.LAUNCH_DIR_ENV, raising=False)
    outcome.announce(0)
    outcome.record(Outcome(0, 0, "done"))
    assert not outcome.collected() and not list(tmp_path.iterdir())


def test_tracebacks_are_appended_per_rank(tmp_path: Path) -> None:
    log = tmp_path / "run" / "error.log"
    for rank, err in ((0, FileNotFoundError("missing.csv")), (1, GLOO_PEER)):
        try:
            raise err
        except Exception as e:
            outcome.write_traceback(e, log, rank)
    text = log.read_text()
    assert text.count("=== rank ") == 2 and "=== rank 0 " in text and "FileNotFoundError: missing.csv" in text
    assert text.index("=== rank 1 ") > text.index("missing.csv") and "Connection closed by peer" in text
