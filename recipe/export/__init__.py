"""Models in and out: export a run to open_clip or Hugging Face, and read such directories back.

* ``python -m recipe.export RUN_DIR --format open_clip|hf --out DIR`` (:mod:`recipe.export.__main__`)
  writes a directory that ``open_clip.create_model_and_transforms("local-dir:DIR")`` or
  ``transformers.CLIPModel.from_pretrained(DIR)`` loads offline; a model a format cannot represent
  exactly is refused with :class:`UnsupportedExport` naming what is missing.
* :func:`read_pretrained` reads an open_clip directory, a Hugging Face CLIP directory or a recipe run
  into the recipe's own model config, weights and tokenizer (``python -m recipe.train --init-from``).

What a run exports (``--weights``, default ``master``): the fp32 masters SRAdamW keeps for mastered
groups (the image tower and the logit scale by default), bit for bit, read from the sharded optimizer
state; the module weights (bf16/fp16, upcast exactly) for the other parameters. ``--weights module``
exports ``model_weights.pt`` alone, as the model trained and evaluated. With ``--dtype bf16``/``fp16``
the masters are rounded to nearest (even) to that dtype. ``--ema`` exports the EMA weights, which have
no master (``--weights`` must then be ``module``, its default with ``--ema``). A recipe run read by
:func:`read_pretrained` (``--init-from``) gives its masters too.

One file per job: :mod:`.run` (a run's model from its checkpoint), :mod:`.masters` (the fp32 masters
out of the optimizer state), :mod:`.atomic` (an output directory appears whole or not at all),
:mod:`.open_clip` (+ :mod:`.open_clip_read`) and :mod:`.hf` (the two formats, both directions), :mod:`.formats`
(what they share with this package: :class:`UnsupportedExport`, :class:`Imported`).

Every export holds ``recipe_export.json`` (:data:`MARKER`); ``--overwrite`` replaces only such a
directory, and never one that is, contains or lies inside the source run (:func:`check_output`).
"""

from __future__ import annotations

import json
import os
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

import torch

from .atomic import MARKER, check_output, write_directory
from .formats import Imported, UnsupportedExport
from .masters import read_masters
from .run import DTYPES, WEIGHTS, LoadedRun, find_checkpoint, load_run, parse_dtype

__all__ = [
    "FORMATS",
    "MARKER",
    "Imported",
    "LoadedRun",
    "UnsupportedExport",
    "DTYPES",
    "WEIGHTS",
    "export_run",
    "read_masters",
    "load_run",
    "parse_dtype",
    "read_pretrained",
    "detect_format",
    "write_directory",
    "check_output",
]


def _writers() -> dict[str, Callable[..., None]]:
    from . import hf, open_clip

    return {"open_clip": open_clip.write, "hf": hf.write}


#: Export formats.
FORMATS = ("open_clip", "hf")


def export_run(
    run_dir: str | os.PathLike,
    fmt: str,
    out: str | os.PathLike,
    dtype: str = "fp32",
    overwrite: bool = False,
    ema: bool = False,
    weights: str | None = None,
) -> Path:
    """Exports the newest complete checkpoint of ``run_dir`` (or the given tag directory) to ``out``;
    with ``ema`` the checkpoint's EMA weights (runs trained with ``--ema-decay``).

    ``weights``: ``"master"`` (the default without ``ema``): the optimizer's fp32 masters where it keeps
    them, the module weights elsewhere; ``"module"`` (the default with ``ema``): the module (or EMA)
    weights alone (see the package docstring). The output directory appears complete or not at all
    (:func:`write_directory`), with ``recipe_export.json`` (:data:`MARKER`: format, dtype, weights, the
    source run and checkpoint, the recipe's git revision, the time).

    ``out`` may be missing or an empty directory; ``overwrite`` lets it be an earlier export (a directory
    holding ``recipe_export.json``), which is replaced. Nothing else is ever replaced, nor any directory
    that is, contains or lies inside the source run (real paths: symbolic links are followed): those are
    refused before the checkpoint is read. A new ``out`` inside the run (``RUN/export``) is fine.

    Raises:
        ValueError: An unknown format, dtype or weights, or ``weights="master"`` with ``ema``.
        UnsupportedExport: The model cannot be represented exactly in ``fmt``.
        FileExistsError: ``out`` may not be replaced (:func:`check_output`; the message says what is there);
            the checkpoint was not read, nothing was written.
    """
    return _export(run_dir, fmt, out, dtype, overwrite, ema, weights)[0]


def _export(run_dir: str | os.PathLike, fmt: str, out: str | os.PathLike, dtype: str, overwrite: bool, ema: bool,
            weights: str | None) -> tuple[Path, LoadedRun]:
    """:func:`export_run`, also returning the run it exported (for the command line's report)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    torch_dtype = parse_dtype(dtype)
    weights = weights or ("module" if ema else "master")
    tag_dir, source = find_checkpoint(run_dir)
    protected = _source_dirs(tag_dir, source)
    check_output(out, protected, overwrite)  # before anything is read
    # exact fp32 copies of the saved weights (and masters); cast when written
    run = load_run(tag_dir, torch.float32, ema=ema, weights=weights)
    writer = _writers()[fmt]
    path = write_directory(out, lambda tmp, final: writer(run, tmp, torch_dtype, final=final), overwrite=overwrite,
                           protected=protected, marker=_marker(run, fmt, dtype))
    return path, run


def _source_dirs(tag_dir: Path, run_dir: Path) -> tuple[Path, ...]:
    """The real paths of what an export reads, which its output must not replace: the run directory (when
    it is one, with ``model_config.json``; :func:`load_run` refuses it otherwise), its checkpoints
    directory and the tag directory (elsewhere when ``checkpoints/`` or the tag is a symbolic link)."""
    dirs = [run_dir.resolve()] if (run_dir / "model_config.json").is_file() else []
    dirs += [tag_dir.parent.resolve(), tag_dir.resolve()]
    return tuple(dict.fromkeys(dirs))


def _marker(run: LoadedRun, fmt: str, dtype: str) -> dict[str, Any]:
    """The fields of an export's ``recipe_export.json`` (:data:`MARKER`)."""
    from ..run.rundir import git_revision

    return {
        "format": fmt,
        "dtype": dtype,
        "weights": run.provenance()["source"],
        "master_params": len(run.master_names),
        "saved_dtype": str(run.saved_dtype).replace("torch.", ""),
        "run_dir": str(run.run_dir.resolve()),
        "checkpoint": run.tag_dir.name,
        "step": run.step,
        "git_revision": git_revision(),
        "time": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def detect_format(directory: str | os.PathLike) -> str:
    """``open_clip``, ``hf`` or ``recipe`` for a directory ``--init-from`` may name.

    Raises:
        FileNotFoundError: The directory does not exist.
        ValueError: None of the three.
    """
    path = Path(directory)
    if not path.is_dir():
        raise FileNotFoundError(f"--init-from directory not found: {path}")
    if (path / "open_clip_config.json").is_file():
        return "open_clip"
    if (path / "model_config.json").is_file() or (path / "checkpoints").is_dir() or (path / "COMPLETE").is_file():
        return "recipe"
    config = path / "config.json"
    if config.is_file() and json.loads(config.read_text()).get("model_type") == "clip":
        return "hf"
    raise ValueError(
        f"{path} is neither an open_clip directory (open_clip_config.json), a Hugging Face CLIPModel directory "
        "(config.json with model_type 'clip') nor a recipe run directory (model_config.json, checkpoints/)"
    )


def read_pretrained(directory: str | os.PathLike) -> Imported:
    """Reads an open_clip directory, a Hugging Face CLIP directory or a recipe run (see :func:`detect_format`).

    A recipe run gives its exported weights: the fp32 masters of its mastered parameters, the module
    weights of the others (:func:`load_run` with ``weights="master"``)."""
    fmt = detect_format(directory)
    if fmt == "recipe":
        run = load_run(directory, torch.float32, weights="master")
        state = {k: v.detach().clone() for k, v in run.model.state_dict().items()}
        masters = f", fp32 masters of {len(run.master_names)} parameters" if run.master_names else ""
        return Imported(run.config, state, run.tokenizer, f"recipe run {run.tag_dir}{masters}")
    from . import hf, open_clip_read

    return {"open_clip": open_clip_read.read, "hf": hf.read}[fmt](Path(directory))
