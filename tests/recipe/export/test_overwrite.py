"""What an export may replace (issue 26): ``--overwrite`` replaces an earlier export (a directory holding
``recipe_export.json``) and nothing else; never the source run, a directory around it (its parent, with
an unrelated run beside it), one inside it, a symbolic link to it, a training run, a file or any other
non-empty directory. Each refusal leaves every byte in place, reads nothing, and is one ``error:`` line
with exit code 2 on the command line; the Python API raises ``FileExistsError``."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import recipe.export as export
from recipe.export.__main__ import main as export_main

#: The marker every export holds (``recipe.export.MARKER``), by its name: the name is the contract.
MARKER = "recipe_export.json"


def snapshot(root: Path) -> dict[str, str]:
    """Every entry under ``root`` (symbolic links not followed): a file's sha256, ``dir``, or a link's target."""
    entries = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(folder) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                entries[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                entries[rel] = "dir"
            else:
                entries[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return entries


def refused(via: str, source: Path, out: Path, capsys: pytest.CaptureFixture, overwrite: bool = True) -> str:
    """Exports ``source`` to ``out`` through the Python API or the command line, which must refuse; the message."""
    if via == "api":
        with pytest.raises(FileExistsError) as e:
            export.export_run(source, "open_clip", out, overwrite=overwrite)
        return str(e.value)
    argv = [str(source), "--format", "open_clip", "--out", str(out)] + (["--overwrite"] if overwrite else [])
    assert export_main(argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("error: ") and captured.err.count("\n") == 1, captured.err
    assert captured.out == ""
    return captured.err


@pytest.fixture
def runs(make_run: Any, tmp_path: Path) -> tuple[Path, Path]:
    """Two unrelated runs side by side: ``runs/run`` (the one exported) and ``runs/other``."""
    run, _ = make_run("runs/run", preset="tiny")
    other, _ = make_run("runs/other", preset="tiny", seed=1)
    return run, other


@pytest.mark.parametrize("via", ["api", "cli"])
def test_out_is_the_run(runs: tuple[Path, Path], tmp_path: Path, via: str, capsys: pytest.CaptureFixture,
                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``--out RUN --overwrite`` (the bug: the export replaced the run), also when the source is named by
    its checkpoint tag directory; with and without --overwrite; refused before the checkpoint is read."""
    run, _ = runs
    before = snapshot(tmp_path)
    assert "is the source run" in refused(via, run, run, capsys)
    assert snapshot(tmp_path) == before

    def not_read(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the checkpoint was read before the refusal")

    monkeypatch.setattr(export, "load_run", not_read)
    tag = run / "checkpoints" / "step00000007"
    for source in (run, tag):
        for overwrite in (True, False):
            assert "is the source run" in refused(via, source, run, capsys, overwrite)
    assert "is inside the source run" in refused(via, tag, run / "checkpoints", capsys)
    assert "is inside the source run" in refused(via, run, tag, capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("via", ["api", "cli"])
def test_out_contains_the_run(runs: tuple[Path, Path], tmp_path: Path, via: str,
                              capsys: pytest.CaptureFixture) -> None:
    """``--out`` one folder above the run (the bug: it deleted the run and the unrelated one beside it)."""
    run, other = runs
    before = snapshot(tmp_path)
    for out in (run.parent, tmp_path):
        message = refused(via, run, out, capsys)
        assert f"contains the source run {run.resolve()}" in message
    assert snapshot(tmp_path) == before and (other / "model_config.json").is_file()


@pytest.mark.parametrize("via", ["api", "cli"])
def test_out_is_a_symlink_to_the_run(runs: tuple[Path, Path], tmp_path: Path, via: str,
                                     capsys: pytest.CaptureFixture) -> None:
    run, _ = runs
    link = tmp_path / "link"
    link.symlink_to(run, target_is_directory=True)
    parent_link = tmp_path / "parent-link"
    parent_link.symlink_to(run.parent, target_is_directory=True)
    before = snapshot(tmp_path)
    for overwrite in (True, False):
        message = refused(via, run, link, capsys, overwrite)
        assert f"(a symbolic link to {run.resolve()}) is the source run" in message
    assert "contains the source run" in refused(via, run, parent_link, capsys)
    assert "is the source run" in refused(via, run, parent_link / "run", capsys)  # a link on the way
    assert snapshot(tmp_path) == before


def test_checkpoints_elsewhere(runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """A run whose ``checkpoints/`` is a symbolic link (to another disk): its checkpoints are protected where
    they are, and an export beside them is written and replaced as anywhere else."""
    run, _ = runs
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    (run / "checkpoints").rename(scratch / "ckpts")
    (run / "checkpoints").symlink_to(scratch / "ckpts", target_is_directory=True)
    for _ in range(2):
        export.export_run(run, "open_clip", scratch / "oc", overwrite=True)
    assert json.loads((scratch / "oc" / MARKER).read_text())["run_dir"] == str(run.resolve())
    before = snapshot(tmp_path)
    for out in (scratch, scratch / "ckpts", scratch / "ckpts" / "step00000007"):
        assert "source run" in refused("api", run, out, capsys)
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("via", ["api", "cli"])
def test_out_is_not_an_export(runs: tuple[Path, Path], tmp_path: Path, via: str, capsys: pytest.CaptureFixture) -> None:
    """Another training run, a directory of other files and a file are never replaced; without
    --overwrite the message says that --overwrite only replaces an earlier export."""
    run, other = runs
    folder = tmp_path / "results"
    (folder / "plots").mkdir(parents=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "open_clip_config.json").write_text("{}")  # looks like an export, but has no marker
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"weights")
    before = snapshot(tmp_path)
    message = refused(via, run, other, capsys)
    assert "is a training run (model_config.json, checkpoints/), not an earlier export" in message
    message = refused(via, run, folder, capsys)
    assert "is a non-empty directory (holds 3 entries: notes.txt, open_clip_config.json, plots/)" in message
    assert "not an earlier export" in message and "refusing to replace it" in message
    assert "is a file" in refused(via, run, file, capsys)
    for out in (other, folder, file):
        message = refused(via, run, out, capsys, overwrite=False)
        assert "already exists and is a" in message and "--overwrite only replaces an earlier export" in message
    assert snapshot(tmp_path) == before


@pytest.mark.parametrize("via", ["api", "cli"])
def test_export_inside_the_run(runs: tuple[Path, Path], tmp_path: Path, via: str,
                               capsys: pytest.CaptureFixture) -> None:
    """A new directory inside the run (``RUN/exports/oc``) is written; once there it is inside the source
    run, and --overwrite does not replace it."""
    run, _ = runs
    out = run / "exports" / "oc"
    export.export_run(run, "open_clip", out)
    assert json.loads((out / MARKER).read_text())["run_dir"] == str(run.resolve())
    before = snapshot(tmp_path)
    assert f"is inside the source run {run.resolve()}" in refused(via, run, out, capsys)
    assert snapshot(tmp_path) == before


def test_an_earlier_export_is_replaced(runs: tuple[Path, Path], tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--overwrite replaces an earlier export (its marker rewritten, its old files gone, nothing left
    beside it), and open_clip loads the result; without --overwrite it is kept, with a hint."""
    import open_clip
    from safetensors.torch import load_file

    run, other = runs
    runs_before = snapshot(run.parent)
    out = tmp_path / "exported"
    export.export_run(other, "open_clip", out)
    first = json.loads((out / MARKER).read_text())
    (out / "stale.txt").write_text("from the earlier export")
    before = snapshot(tmp_path)
    message = refused("cli", run, out, capsys, overwrite=False)
    assert "already exists (an earlier export): pass --overwrite" in message
    assert snapshot(tmp_path) == before

    argv = [str(run), "--format", "open_clip", "--out", str(out), "--overwrite", "--dtype", "bf16"]
    assert export_main(argv) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    marker = json.loads((out / MARKER).read_text())
    assert first["run_dir"] == str(other.resolve()) and first["dtype"] == "fp32"
    assert marker["run_dir"] == str(run.resolve()) and marker["dtype"] == "bf16"
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "runs"]  # nothing moved aside is left
    assert load_file(out / "open_clip_model.safetensors")["logit_scale"].dtype == torch.bfloat16
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    saved = torch.load(run / "checkpoints" / "step00000007" / "model_weights.pt", weights_only=True)
    assert float(model.logit_scale.detach()) == float(saved["logit_scale"].bfloat16())
    assert snapshot(run.parent) == runs_before


def test_the_marker(runs: tuple[Path, Path], make_run: Any, tmp_path: Path) -> None:
    """``recipe_export.json`` says what was exported, from where and when (the Hugging Face export's own
    fields kept); a marker that is a symbolic link or sits in a training run does not make a directory an
    export."""
    from .test_hf import tiny_pair

    hf_run, _ = tiny_pair(make_run)
    hf_out = export.export_run(hf_run, "hf", tmp_path / "hf", dtype="bf16")
    marker = json.loads((hf_out / MARKER).read_text())
    assert marker["format"] == "hf" and marker["dtype"] == "bf16" and marker["weights"] == "master"
    assert marker["run_dir"] == str(hf_run.resolve()) and marker["token_id_swap"] is not None
    run, _ = runs
    out = export.export_run(run / "checkpoints", "open_clip", tmp_path / "oc", weights="module")
    marker = json.loads((out / MARKER).read_text())
    assert {k: marker[k] for k in ("format", "dtype", "weights", "checkpoint", "step")} == \
           dict(format="open_clip", dtype="fp32", weights="module", checkpoint="step00000007", step=7)
    assert marker["run_dir"] == str(run.resolve()) and marker["git_revision"] and "T" in marker["time"]
    assert export.detect_format(out) == "open_clip"
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / MARKER).symlink_to(out / MARKER)
    assert export.atomic.is_export(out) and not export.atomic.is_export(linked)
    (run / MARKER).write_text("{}")
    assert not export.atomic.is_export(run)
