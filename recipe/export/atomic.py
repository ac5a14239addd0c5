"""Writing an export directory all at once: a reader sees no directory or the complete one, and nothing
but an earlier export is ever replaced.

:func:`write_directory` has the writer fill a hidden temporary sibling of the destination, adds the
marker file :data:`MARKER` (``recipe_export.json``: what was exported, from where, when), then renames
it into place (one ``rename`` on the same filesystem). A writer that raises, or a process that dies,
leaves the destination untouched (an existing one included); the temporary directory is removed on
errors.

What may be at the destination (:func:`check_output`, before anything is written and again just
before the rename): nothing, or an empty directory; with ``overwrite=True`` also an earlier export,
a directory holding :data:`MARKER` as a regular file (and no training run's files). Never a file, a
training run, any other non-empty directory, nor a directory that is, contains or lies inside one of
the ``protected`` directories (the source run; real paths, so a symbolic link to the run is refused
too). A new directory inside the source run (``RUN/export``) is allowed. Replacing an earlier export
moves the old one aside first and deletes it only after the new one is in place.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

__all__ = ["MARKER", "check_output", "is_export", "write_directory"]

#: The file every export holds; only a directory holding it may be replaced (``--overwrite``).
MARKER = "recipe_export.json"

#: Entries of a training run (``model_config.json``, ``checkpoints/``, as
#: :func:`recipe.export.detect_format` recognises one) or of its checkpoints (``latest``, ``COMPLETE``).
_RUN_ENTRIES = ("model_config.json", "checkpoints", "latest", "COMPLETE")

#: The entries named when describing a run, in this order.
_RUN_SHOWN = ("config.json", "model_config.json", "checkpoints", "metrics.jsonl", "latest", "COMPLETE")


def _run_entries(directory: Path) -> list[str]:
    """The entries that make ``directory`` a training run or part of one, with the run's other files
    (``name/`` for a directory); empty when it is none."""
    if not any((directory / name).exists() for name in _RUN_ENTRIES):
        return []
    found = [name for name in _RUN_SHOWN if (directory / name).exists()]
    return [f"{name}/" if (directory / name).is_dir() else name for name in found]


def is_export(directory: str | os.PathLike) -> bool:
    """Whether ``directory`` is an earlier export: a directory holding :data:`MARKER` as a regular file
    (not a symbolic link) and none of a training run's files (``model_config.json``, ``checkpoints/``)."""
    directory = Path(directory)
    marker = directory / MARKER
    return (directory.is_dir() and marker.is_file() and not marker.is_symlink()
            and not _run_entries(directory))


def _describe(path: Path) -> str:
    """What is at ``path`` (an existing file or non-empty directory, not an export), for a refusal."""
    if not path.is_dir():
        return "a file"
    run = _run_entries(path)
    if run:
        whole = (path / "checkpoints").exists() or (path / "model_config.json").exists()
        return f"{'a training run' if whole else 'part of a training run'} ({', '.join(run)})"
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    shown = ", ".join(names[:5]) + ("..." if len(names) > 5 else "")
    return f"a non-empty directory (holds {len(names)} entries: {shown})"


def _relation(real: Path, protected: Iterable[Path]) -> str | None:
    """How ``real`` (a resolved path) relates to the first protected directory it touches: ``is the
    source run``, ``contains the source run S``, ``is inside the source run S``; None for none."""
    for source in protected:
        source = Path(source).resolve()
        if real == source:
            return "is the source run"
        if real in source.parents:
            return f"contains the source run {source}"
        if source in real.parents:
            return f"is inside the source run {source}"
    return None


def check_output(out: str | os.PathLike, protected: Iterable[str | os.PathLike] = (), overwrite: bool = False) -> None:
    """Refuses a destination :func:`write_directory` must not replace (see the module docstring); reads
    ``out`` only. ``protected``: the source run directory (directories), compared by real path.

    Raises:
        FileExistsError: Something is at ``out`` that may not be replaced; the one-line message says
            what (the source run, a directory around or inside it, a training run, a file, a non-empty
            directory and some of its entries) and, without ``overwrite``, about an earlier export.
    """
    out = Path(out).absolute()
    if not os.path.lexists(out):
        return  # a new directory: it cannot contain the source, and one inside the source is harmless
    real = out.resolve()
    subject = f"--out {out}" + (f" (a symbolic link to {real})" if out.is_symlink() else "")
    if not real.exists():
        raise FileExistsError(f"{subject} is a broken symbolic link: refusing to replace it; choose another --out")
    if real.is_dir() and not any(real.iterdir()):
        return  # an empty directory is as good as none
    relation = _relation(real, (Path(p) for p in protected))
    if relation:
        raise FileExistsError(f"{subject} {relation}: refusing to replace it; choose another --out")
    if is_export(real):
        if overwrite:
            return
        raise FileExistsError(f"{subject} already exists (an earlier export): pass --overwrite to replace it, "
                              "or choose another --out")
    what = _describe(real)
    if overwrite:
        raise FileExistsError(f"{subject} is {what}, not an earlier export ({MARKER}): refusing to replace it; "
                              "choose another --out")
    raise FileExistsError(f"{subject} already exists and is {what}; choose another --out (--overwrite only "
                          f"replaces an earlier export, a directory holding {MARKER})")


def _write_marker(directory: Path, marker: Mapping[str, Any]) -> None:
    """Writes :data:`MARKER` into ``directory``: ``marker``'s fields first, then those the writer recorded
    in a marker of its own (a format's particulars, e.g. the Hugging Face export's token id swap)."""
    path = directory / MARKER
    written = json.loads(path.read_text()) if path.is_file() else {}
    doc = dict(marker)
    doc.update({k: v for k, v in written.items() if k not in doc})
    path.write_text(json.dumps(doc, indent=2) + "\n")
    path.chmod(0o644)


def write_directory(
    out: str | os.PathLike,
    writer: Callable[[Path, Path], None],
    overwrite: bool = False,
    protected: Iterable[str | os.PathLike] = (),
    marker: Mapping[str, Any] | None = None,
) -> Path:
    """Runs ``writer(tmp, final)`` on an empty temporary directory ``tmp``, adds :data:`MARKER` (with
    ``marker``'s fields) and renames it to ``out`` (``final``: the absolute path of ``out``, for a writer
    that must name it). ``overwrite`` lets an earlier export at ``out`` be replaced; nothing else ever
    is, nor anything that is, contains or lies inside a ``protected`` directory (:func:`check_output`,
    before the writer runs and again before the rename).

    Raises:
        FileExistsError: ``out`` may not be replaced (:func:`check_output`; ``out`` is then as it was).
        Whatever ``writer`` raises (``out`` is then as it was).
    """
    out = Path(out).absolute()
    protected = tuple(protected)
    check_output(out, protected, overwrite)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        writer(tmp, out)
        _write_marker(tmp, marker or {})
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; an export is for others to read
        check_output(out, protected, overwrite)  # the writer may have run for minutes
        if os.path.lexists(out):
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.rename(out, old / "previous")
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
