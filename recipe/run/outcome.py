"""How a launch ended: each rank's one-line outcome, and the one line ``launch.sh`` prints last.

Every rank of ``python -m recipe.train`` ends in one of a few ways (:data:`KINDS`): done, stopped on a
signal with its checkpoint saved (exit 143), stopped without it (exit 3, the step named), a user error
(a missing file, a wrong column: exit 1, or 2 for a bad command line or configuration), an unexpected
error (exit 1), Ctrl-C (exit 130), or a collective that failed because another rank had already ended ("peer", exit 1:
a consequence, never the cause). Tracebacks go to a log file (:func:`write_traceback`), not to the
terminal.

Under ``launch.sh`` the ranks print no error line themselves. ``launch.sh`` names a private directory
in ``RECIPE_LAUNCH_DIR``; each rank announces itself there at start (``rank<k>.pid``: pid and process
start time) and leaves its outcome at exit (``rank<k>.json``). Once the launcher has returned (or died
of a job-wide signal), ``python -m recipe.run.outcome DIR RUNNER_STATUS`` waits until every announced rank
has ended, prints the one line that explains the launch (the cause, from the lowest rank that has
one, and where its traceback is) and exits with the launch's status. Without ``RECIPE_LAUNCH_DIR``
(the ``deepspeed`` runner used directly, or several nodes) rank 0 prints its own line, as do other
ranks whose error is their own.

This module imports nothing heavy: ``launch.sh`` runs it after every launch.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["KINDS", "Outcome", "LAUNCH_DIR_ENV", "announce", "record", "collected", "write_traceback",
           "is_peer_lost", "summarise", "main", "process_running", "start_ticks"]

LAUNCH_DIR_ENV = "RECIPE_LAUNCH_DIR"

#: Outcome kinds, from the most to the least telling when several ranks report.
KINDS = ("stop_unsaved", "user", "internal", "interrupted", "vanished", "peer", "stopped", "done")

#: Substrings of the errors a collective raises when another rank has gone (gloo, NCCL, the store).
_PEER_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "remote process exited",
              "NCCL communicator was aborted", "Socket closed", "failed to recv, got 0 bytes",
              "Connection refused", "ECONNRESET")


@dataclass
class Outcome:
    """How one rank ended.

    Attributes:
        rank: The global rank.
        code: Its exit code.
        kind: One of :data:`KINDS`.
        message: The one line that says why (``None`` when done or stopped).
        log: The file holding its traceback, if any.
        pid: Its process id.
    """

    rank: int
    code: int
    kind: str
    message: str | None = None
    log: str | None = None
    pid: int | None = None


def _launch_dir() -> Path | None:
    value = os.environ.get(LAUNCH_DIR_ENV)
    return Path(value) if value and Path(value).is_dir() else None


def collected() -> bool:
    """Whether a launcher collects the outcomes (``launch.sh``): then the ranks print no error line."""
    return _launch_dir() is not None


def _write(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def process_running(pid: int, ticks: int | None) -> bool:
    """Whether ``pid`` is the process that started at ``ticks`` (:func:`start_ticks`; None: any) and
    has not ended (a zombie has ended). Without ``/proc`` (not Linux) the kernel is asked whether the
    pid exists, and a reused pid cannot be told apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        if os.path.isdir("/proc/self"):
            return False  # Linux: no such process
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # someone else's process
            return True
        return True
    except OSError:  # there but unreadable: count it as running (a lock stays held, a wait goes on)
        return True
    return fields[0] != "Z" and (ticks is None or int(fields[19]) == ticks)


def announce(rank: int | None = None) -> None:
    """At a rank's start: tells the launcher this rank's pid (nothing without ``RECIPE_LAUNCH_DIR``)."""
    where = _launch_dir()
    if where is None:
        return
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    pid = os.getpid()
    _write(where / f"rank{rank}.pid", {"pid": pid, "start_ticks": start_ticks(pid), "host": socket.gethostname()})


def record(outcome: Outcome) -> None:
    """At a rank's end: leaves its outcome for the launcher (nothing without ``RECIPE_LAUNCH_DIR``)."""
    where = _launch_dir()
    if where is not None:
        _write(where / f"rank{outcome.rank}.json", {**asdict(outcome), "pid": os.getpid()})


def is_peer_lost(error: BaseException) -> bool:
    """Whether ``error`` is a collective's failure because another rank ended (not a cause of its own)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if type(error).__name__ in ("DistNetworkError",) or any(s in str(error) for s in _PEER_LOST):
            return True
        error = error.__cause__ or error.__context__
    return False


def write_traceback(error: BaseException, path: Path, rank: int) -> Path:
    """Appends ``error``'s traceback to ``path`` under a header naming the rank (one ``write``, so
    that ranks sharing the file do not interleave); returns ``path``."""
    header = f"=== rank {rank} (pid {os.getpid()} on {socket.gethostname()}) at {time.strftime('%Y-%m-%d %H:%M:%S')}"
    text = header + f": {type(error).__name__}\n" + "".join(traceback.format_exception(error)) + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
    return path


# --------------------------------------------------------------------------------------------------
# the launcher's side
# --------------------------------------------------------------------------------------------------


def _announced(where: Path) -> dict[int, dict]:
    out = {}
    for p in where.glob("rank*.pid"):
        try:
            out[int(p.stem[4:])] = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
    return out


def wait_for_ranks(where: Path, expect: int = 0, grace: float = 10.0, poll: float = 0.2) -> dict[int, dict]:
    """Waits until every rank that announced itself in ``where`` has ended (``expect`` ranks are waited
    for ``grace`` seconds to announce themselves, for ranks still starting when the launcher ended);
    returns the announcements."""
    deadline = time.monotonic() + grace
    while True:
        ranks = _announced(where)
        alive = [r for r, a in ranks.items() if process_running(int(a["pid"]), a.get("start_ticks"))]
        if not alive and (len(ranks) >= expect or time.monotonic() > deadline):
            return ranks
        time.sleep(poll)


def summarise(outcomes: dict[int, Outcome], announced: set[int], runner_status: int) -> tuple[int, str | None]:
    """The launch's exit status and the one line to print (``None``: nothing to add), from the
    ranks' outcomes; ``announced`` ranks without an outcome ended without a word (killed)."""
    everyone = dict(outcomes)
    for r in sorted(announced - set(outcomes)):
        everyone[r] = Outcome(r, 128 + 9 if runner_status == 0 else max(runner_status, 1), "vanished",
                              f"rank {r} ended without reporting how (killed by a signal, e.g. SIGKILL or the "
                              "out-of-memory killer)")
    if not everyone:
        return runner_status, None  # no rank started: the launcher said why
    by_kind = sorted(everyone.values(), key=lambda o: (KINDS.index(o.kind) if o.kind in KINDS else 0, o.rank))
    first = by_kind[0]
    if first.kind == "done":
        return 0, None
    stopped = [o for o in everyone.values() if o.kind == "stopped"]
    if first.kind == "stopped" or (first.kind == "vanished" and stopped):
        # the checkpoint is complete once any rank reported it saved (the save ends with a barrier)
        return stopped[0].code, None
    line = f"error: {first.message or f'rank {first.rank} failed (exit {first.code})'}"
    if first.log:
        line += f" (traceback: {first.log})"
    return first.code, line


def main(argv: list[str] | None = None) -> int:
    """``python -m recipe.run.outcome DIR RUNNER_STATUS [--expect N]``: see the module docstring."""
    ap = argparse.ArgumentParser(prog="python -m recipe.run.outcome", description=__doc__.splitlines()[0])
    ap.add_argument("dir", type=Path)
    ap.add_argument("runner_status", type=int)
    ap.add_argument("--expect", type=int, default=0, help="ranks this node starts (waited for a moment)")
    args = ap.parse_args(argv)
    announced = wait_for_ranks(args.dir, args.expect if args.runner_status > 128 else 0)
    outcomes = {}
    for r in announced:
        p = args.dir / f"rank{r}.json"
        if p.is_file():
            outcomes[r] = Outcome(**{k: v for k, v in json.loads(p.read_text()).items()
                                     if k in Outcome.__dataclass_fields__})
    status, line = summarise(outcomes, set(announced), args.runner_status)
    if line:
        print(line, file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
