"""The run directory's guard (recipe/run/rundir.py): a new run never goes into another run, ``--resume
latest`` needs a run, a refusal writes nothing, and a failed start takes back exactly what it wrote."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from recipe.run.rundir import ERROR_LOG, LOCK_FILE, RunDirError, check_run_dir, claim_run_dir, run_files


def snapshot(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> content hash), directories as entries too."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = hashlib.sha1(p.read_bytes()).hexdigest() if p.is_file() else "dir"
    return out


def make_run(run: Path) -> Path:
    (run / "checkpoints" / "step00000040").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step00000040")
    (run / "config.json").write_text(json.dumps({"steps": 40}))
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 40}\n')
    return run


@pytest.mark.parametrize("marker", ["config.json", "checkpoints/", "metrics.jsonl", "final_metrics.json",
                                    "model_config.json", "tokenizer/"])
def test_any_run_file_makes_a_directory_a_run(tmp_path: Path, marker: str) -> None:
    p = tmp_path / marker.rstrip("/")
    p.mkdir() if marker.endswith("/") else p.write_text("{}")
    assert run_files(tmp_path) == [marker]
    with pytest.raises(RunDirError, match=f"already holds a run \\({marker}\\): give --resume latest"):
        check_run_dir(tmp_path, None)
    check_run_dir(tmp_path, "step00000010")  # an explicit checkpoint is the user's choice


def test_a_new_run_is_refused_in_a_finished_run_and_nothing_changes(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    before = snapshot(tmp_path)
    with pytest.raises(RunDirError, match=r"--output-dir .*run already holds a run \(config.json, checkpoints/, "
                                          r"metrics.jsonl\): give --resume latest to continue it, or another "
                                          r"--output-dir"):
        claim_run_dir(run, None)
    assert snapshot(tmp_path) == before  # not even a lock file


def test_resume_latest_needs_a_run(tmp_path: Path) -> None:
    with pytest.raises(RunDirError, match="--resume latest: .*nowhere does not exist, so there is no run to continue"):
        claim_run_dir(tmp_path / "nowhere", "latest")
    assert not (tmp_path / "nowhere").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(RunDirError, match="holds no run \\(no config.json\\)"):
        claim_run_dir(tmp_path / "empty", "latest")
    assert list((tmp_path / "empty").iterdir()) == []
    claim = claim_run_dir(make_run(tmp_path / "run"), "latest")
    assert (tmp_path / "run" / LOCK_FILE).is_file()
    claim.release()
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_a_failed_start_in_a_new_directory_leaves_only_its_error_log(tmp_path: Path) -> None:
    run = tmp_path / "a" / "new"
    claim = claim_run_dir(run, None)
    (run / "config.json").write_text("{}")
    (run / "tokenizer").mkdir()
    (run / "tokenizer" / "vocab.json").write_text("{}")
    claim.undo()
    assert not run.exists()
    claim = claim_run_dir(run, None)  # and again, this time with a traceback written before the undo
    (run / "config.json").write_text("{}")
    (run / ERROR_LOG).write_text("=== rank 1 ...")
    claim.undo()
    assert sorted(os.listdir(run)) == [ERROR_LOG]
    claim_run_dir(run, None).release()  # an error log alone is no run: a new start may go there


def test_a_failed_start_keeps_what_was_there_before(tmp_path: Path) -> None:
    """A directory holding other files (a scheduler's log): they stay, bit for bit; what the start
    added goes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "slurm-1234.out").write_text("job log")
    (run / "notes").mkdir()
    (run / "notes" / "plan.txt").write_text("plan")
    before = snapshot(tmp_path)
    claim = claim_run_dir(run, None)
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    (run / "notes" / "plan.txt").read_text()
    claim.undo()
    assert snapshot(tmp_path) == before


def test_a_failed_resumed_start_restores_the_files_it_rewrote(tmp_path: Path) -> None:
    run = make_run(tmp_path / "run")
    (run / "ds_config.json").write_text('{"zero": 2}')
    before = snapshot(tmp_path)
    claim = claim_run_dir(run, "latest")
    (run / "config.json").write_text(json.dumps({"steps": 2000}))  # what a resumed start writes first
    (run / "ds_config.json").write_text('{"zero": 3}')
    (run / "checkpoints" / "step00000040" / "x").write_text("")  # inside an old entry: not the start's to judge
    (run / "checkpoints" / "step00000040" / "x").unlink()
    claim.undo()
    assert snapshot(tmp_path) == before


def test_resume_latest_of_a_run_without_a_checkpoint_starts_it_again(tmp_path: Path, capsys) -> None:
    """A run that failed after its first step but before its first save: --resume latest starts it
    again from step 0 (saying so) instead of refusing; an explicit checkpoint still must exist."""
    from recipe.run.checkpoint import CheckpointError
    from recipe.train import restore

    run = tmp_path / "run"
    (run / "checkpoints" / "step00000004").mkdir(parents=True)  # a save cut short: no COMPLETE marker
    (run / "config.json").write_text("{}")
    state = restore(None, run, "latest", None, None)
    assert state.step == 0 and "has no complete checkpoint yet: starting it again from step 0" in capsys.readouterr().err
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        restore(None, run, str(run / "checkpoints" / "step00000004"), None, None)
