"""Checkpoints: DeepSpeed's sharded save plus per-rank client state, written so a crash never
damages the last good checkpoint.

Layout of ``<run>/checkpoints``::

    step00000100/            one DeepSpeed tag: model + ZeRO optimizer shards (incl. SRAdamW state
                             with its seed and per-tensor steps)
        rank00000.pt         this rank's client state: step, data position, RNG states
        model_weights.pt     the full module state dict (for ``python -m recipe.evaluate``)
        ema_weights.pt       with ``--ema-decay``: the EMA's full state dict, same names (:mod:`recipe.training.ema`)
        COMPLETE             written last, after every rank has finished (atomic rename)
    step00000100.r1/         a later save of the same step (e.g. after resuming from an older one)
    latest                   the tag of the newest complete checkpoint (atomic rename)

Guarantees:

* A save never modifies or removes an existing checkpoint directory: it writes a new tag (the step,
  or ``stepN.rK`` when that step was saved before), marks it ``COMPLETE`` once every rank has
  written its files, points ``latest`` at it, and only then removes older saves of the same step.
  A save that dies midway leaves a tag directory without ``COMPLETE`` and ``latest`` naming the
  previous complete checkpoint.
* A save that fails on any rank (a full disk, a permission error) fails on every rank with a
  :class:`CheckpointError` naming the directory, and the previous checkpoint stays intact.
* ``--resume latest`` takes the tag ``latest`` names; when ``latest`` is missing or names an
  incomplete checkpoint while complete ones exist, the newest complete one, with a warning.
  Loading a tag without ``COMPLETE``, a missing directory or an unreadable file raises
  :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..training.batchnorm import average_batchnorm_stats
from ..training.distributed import barrier, broadcast_from_rank0, collective_device, max_over_ranks_, rank_world
from .elastic import client_state_resharded, load_resharded
from .files import COMPLETE, CheckpointError, load_engine_state, read_file

__all__ = [
    "CheckpointError", "save", "load", "resolve", "complete_checkpoints", "rng_state", "set_rng_state",
    "atomic_write_bytes", "load_engine_state", "read_file",
]

logger = logging.getLogger(__name__)

LATEST = "latest"
MODEL_WEIGHTS = "model_weights.pt"
EMA_WEIGHTS = "ema_weights.pt"
_TAG = re.compile(r"step(\d{8})(?:\.r(\d+))?")


def _atomic(path: Path, write: Any) -> None:
    """Runs ``write(file)`` on a temporary sibling, fsyncs and renames it over ``path``; on any
    failure the temporary is removed and ``path`` keeps its old content."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` via a temporary file, fsync and rename (never half-written)."""
    _atomic(path, lambda f: f.write(data))


def _atomic_torch_save(obj: Any, path: Path) -> None:
    _atomic(path, lambda f: torch.save(obj, f))


def rng_state() -> dict[str, Any]:
    """Python, NumPy, torch CPU (and CUDA) generator states of this process."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what :func:`rng_state` returned."""
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _parse_tag(name: str) -> tuple[int, int] | None:
    """``(step, revision)`` of a tag name (``step00000100`` -> (100, 0), ``step00000100.r2`` -> (100, 2))."""
    m = _TAG.fullmatch(name)
    return (int(m.group(1)), int(m.group(2) or 0)) if m else None


def new_tag(ckpt_dir: Path, step: int) -> str:
    """A tag for a new save of ``step`` that names no existing directory."""
    base = f"step{step:08d}"
    taken = {p.name for p in ckpt_dir.iterdir()} if ckpt_dir.is_dir() else set()
    if base not in taken:
        return base
    return next(f"{base}.r{k}" for k in range(1, len(taken) + 2) if f"{base}.r{k}" not in taken)


def complete_checkpoints(ckpt_dir: str | os.PathLike) -> list[Path]:
    """Complete tag directories under ``ckpt_dir``, oldest first (by step, then revision)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [(key, p) for p in ckpt_dir.iterdir() if (key := _parse_tag(p.name)) and (p / COMPLETE).is_file()]
    return [p for _, p in sorted(found)]


def _agree(failed: BaseException | None, what: str) -> None:
    """Raises the same :class:`CheckpointError` on every rank when any rank failed (no rank is left
    waiting in a collective the failed one never reaches)."""
    flag = max_over_ranks_(torch.tensor([0 if failed is None else 1], device=collective_device()))
    if int(flag.item()):  # host read: the decision is the host's
        detail = f": {type(failed).__name__}: {failed}" if failed is not None else " on another rank"
        raise CheckpointError(f"{what}{detail}") from failed


def save(
    engine: Any, ckpt_dir: str | os.PathLike, step: int, client_state: dict[str, Any], ema: Any | None = None
) -> Path:
    """Saves a checkpoint of ``engine`` at ``step`` with this rank's ``client_state``.

    Every rank must call it. ``client_state`` holds what differs between ranks (data position, RNG
    state) and is written to the tag's ``rankNNNNN.pt``; the shared state goes through DeepSpeed.
    ``ema`` (a :class:`recipe.training.ema.ModelEMA`) adds its full state dict as :data:`EMA_WEIGHTS`.
    Existing checkpoints are never modified (see the module docstring).

    Returns:
        The tag directory.

    Raises:
        CheckpointError: Writing failed on some rank (on every rank, naming the directory); the
            previous checkpoint is intact and ``latest`` still names it.
    """
    ckpt_dir = Path(ckpt_dir)
    rank = rank_world()[0]
    error: BaseException | None = None
    tag = ""
    if rank == 0:
        try:
            ckpt_dir.mkdir(parents=True, exist_ok=True)
            tag = new_tag(ckpt_dir, step)
        except OSError as e:
            error = e
    _agree(error, f"cannot create checkpoint directory {ckpt_dir}")
    tag = broadcast_from_rank0(tag)
    tag_dir = ckpt_dir / tag
    keep = f"; the previous checkpoint ({_latest_name(ckpt_dir)}) is intact"
    # every rank's BatchNorm statistics averaged: the checkpoint holds rank 0's (recipe.training.batchnorm)
    average_batchnorm_stats(engine.module, ema)
    try:
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
        tag_dir.mkdir(parents=True, exist_ok=True)
        if engine.zero_optimization_stage() == 3:
            weights = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls it
        else:
            weights = engine.module.state_dict() if rank == 0 else None
        if rank == 0:
            _atomic_torch_save({k: v.detach().cpu() for k, v in weights.items()}, tag_dir / MODEL_WEIGHTS)
        if ema is not None:
            ema_weights = ema.full_state_dict(dst=0)  # collective under ZeRO-3: every rank calls it
            if rank == 0:
                _atomic_torch_save(ema_weights, tag_dir / EMA_WEIGHTS)
        _atomic_torch_save(client_state, tag_dir / f"rank{rank:05d}.pt")
    except Exception as e:  # a full disk, a permission error, ...: every rank must learn of it
        error = e
    _agree(error, f"cannot write checkpoint {tag_dir}{keep}")  # every rank's files are on disk
    if rank == 0:
        try:
            meta = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "world_size": rank_world()[1]}
            atomic_write_bytes(tag_dir / COMPLETE, json.dumps(meta).encode())
            atomic_write_bytes(ckpt_dir / LATEST, tag.encode())
        except OSError as e:
            error = e
    _agree(error, f"cannot complete checkpoint {tag_dir}{keep}")
    if rank == 0:  # older saves of this step are superseded now that a complete one exists
        for old in ckpt_dir.iterdir():
            if old != tag_dir and (_parse_tag(old.name) or (None,))[0] == step:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return tag_dir


def _latest_name(ckpt_dir: Path) -> str:
    try:
        return (ckpt_dir / LATEST).read_text().strip() or "none"
    except OSError:
        return "none"


def resolve(resume: str, ckpt_dir: str | os.PathLike) -> Path:
    """The tag directory named by ``resume``: ``"latest"`` (from ``ckpt_dir``), a tag directory, a
    checkpoints directory holding ``latest``, or a run directory.

    When ``latest`` is missing or names an incomplete checkpoint but complete ones exist, the newest
    complete one is returned with a warning.

    Raises:
        CheckpointError: When nothing complete is found there.
    """
    if resume == "latest":
        base = Path(ckpt_dir)
    else:
        base = Path(resume)
        if (base / COMPLETE).exists():
            return base
        if not base.exists():
            raise CheckpointError(f"checkpoint not found: {base}")
        if any(base.glob("rank*.pt")):
            raise CheckpointError(f"checkpoint {base} is incomplete (no {COMPLETE} marker: the save was interrupted)")
        if (base / "checkpoints").is_dir() and not (base / LATEST).exists():
            base = base / "checkpoints"  # a run directory
    named = base / _latest_name(base) if (base / LATEST).exists() else None
    if named is not None and (named / COMPLETE).exists():
        return named
    complete = complete_checkpoints(base)
    if complete:
        why = f"'{LATEST}' names {named.name}, which is incomplete" if named else f"no '{LATEST}' file"
        logger.warning("%s in %s: resuming from the newest complete checkpoint, %s", why, base, complete[-1].name)
        return complete[-1]
    if named is not None:
        raise CheckpointError(f"checkpoint {named} is incomplete (no {COMPLETE} marker)")
    if not base.exists():
        raise CheckpointError(f"checkpoint not found: {base}")
    raise CheckpointError(f"no complete checkpoint under {base} (no '{LATEST}' file)")


def load(engine: Any, tag_dir: str | os.PathLike, optimizer_states: bool = True) -> dict[str, Any]:
    """Loads a complete checkpoint into ``engine`` (model, optimizer incl. SR seed, scheduler) and
    returns this rank's client state.

    A checkpoint written by another number of ranks is re-sharded (:mod:`recipe.run.elastic`, ZeRO 0-3):
    the client state then has ``"data"`` the list of every saved rank's data position and
    ``"resharded_from"`` the saved world size.

    ``optimizer_states=False`` (ZeRO 0-2) loads the module, scheduler and counters but no optimizer
    state, for a resume that maps it by parameter name itself (:mod:`recipe.run.regroup`); under ZeRO-1/2
    DeepSpeed's partitions then hold the module's weights.

    Raises:
        CheckpointError: On a missing, incomplete or unreadable checkpoint, or a world-size change
            that cannot be re-sharded (naming what is unsupported).
    """
    tag_dir = Path(tag_dir)
    if not (tag_dir / COMPLETE).exists():
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {COMPLETE} marker)")
    meta = json.loads((tag_dir / COMPLETE).read_text())
    world = rank_world()[1]
    if not optimizer_states:
        # the module file is whole at any world size. It holds every parameter, frozen ones too; DeepSpeed
        # (ZeRO-1/2) then copies the saved frozen parameters again by name, which fails for a parameter
        # frozen since the save (--lock-text on resume): none counts as frozen during the load
        frozen = [p for p in engine.module.parameters() if not p.requires_grad]
        try:
            for p in frozen:
                p.requires_grad_(True)
            load_engine_state(engine, tag_dir, optimizer_states=False)
        finally:
            for p in frozen:
                p.requires_grad_(False)
        if meta.get("world_size", world) != world:
            return client_state_resharded(tag_dir, rank_world()[0], int(meta["world_size"]))
        return read_file(tag_dir / f"rank{rank_world()[0]:05d}.pt")
    if meta.get("world_size", world) != world:
        try:
            return load_resharded(engine, tag_dir, int(meta["world_size"]))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"checkpoint {tag_dir} was written by {meta['world_size']} ranks, this run has "
                                  f"{world}, and re-sharding it failed: {type(e).__name__}: {e}") from e
    load_engine_state(engine, tag_dir)
    try:
        return torch.load(tag_dir / f"rank{rank_world()[0]:05d}.pt", map_location="cpu", weights_only=False)
    except Exception as e:  # unreadable or truncated files
        raise CheckpointError(f"cannot read checkpoint {tag_dir}: {type(e).__name__}: {e}") from e
