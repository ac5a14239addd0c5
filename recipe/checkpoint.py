"""Checkpoints: DeepSpeed's sharded save plus per-rank client state, written so a crash never
damages the last good checkpoint.

Layout of ``<run>/checkpoints``::

    step00000100/            one DeepSpeed tag: model + ZeRO optimizer shards (incl. SRAdamW state
                             with its seed and per-tensor steps)
        rank00000.pt         this rank's client state: step, data position, RNG states
        model_weights.pt     the full module state dict (for ``python -m recipe.evaluate``)
        COMPLETE             written last, after every rank has finished (atomic rename)
    latest                   the tag of the newest complete checkpoint (atomic rename)

A save that dies midway leaves a tag directory without ``COMPLETE`` and ``latest`` still naming the
previous tag, so ``--resume latest`` continues from the last good one. Loading a tag without
``COMPLETE``, a missing directory or an unreadable file raises :class:`CheckpointError`.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .distributed import barrier, rank_world

__all__ = ["CheckpointError", "save", "load", "resolve", "rng_state", "set_rng_state", "atomic_write_bytes"]

COMPLETE = "COMPLETE"
LATEST = "latest"
MODEL_WEIGHTS = "model_weights.pt"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


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


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def save(engine: Any, ckpt_dir: str | os.PathLike, step: int, client_state: dict[str, Any]) -> Path:
    """Saves a checkpoint of ``engine`` at ``step`` with this rank's ``client_state``.

    Every rank must call it. ``client_state`` holds what differs between ranks (data position, RNG
    state) and is written to the tag's ``rankNNNNN.pt``; the shared state goes through DeepSpeed.

    Returns:
        The tag directory.
    """
    ckpt_dir = Path(ckpt_dir)
    tag = tag_for(step)
    tag_dir = ckpt_dir / tag
    if rank_world()[0] == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if (tag_dir / COMPLETE).exists():  # re-saving a step: invalidate the old marker first
            (tag_dir / COMPLETE).unlink()
    barrier()
    engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False)
    tag_dir.mkdir(parents=True, exist_ok=True)
    if engine.zero_optimization_stage() == 3:
        weights = engine._zero3_consolidated_16bit_state_dict()  # collective: every rank calls it
    else:
        weights = engine.module.state_dict() if rank_world()[0] == 0 else None
    if rank_world()[0] == 0:
        _atomic_torch_save({k: v.detach().cpu() for k, v in weights.items()}, tag_dir / MODEL_WEIGHTS)
    _atomic_torch_save(client_state, tag_dir / f"rank{rank_world()[0]:05d}.pt")
    barrier()  # every rank's files are on disk
    if rank_world()[0] == 0:
        meta = {"step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), "world_size": rank_world()[1]}
        atomic_write_bytes(tag_dir / COMPLETE, json.dumps(meta).encode())
        atomic_write_bytes(ckpt_dir / LATEST, tag.encode())
    barrier()
    return tag_dir


def resolve(resume: str, ckpt_dir: str | os.PathLike) -> Path:
    """The tag directory named by ``resume``: ``"latest"`` (from ``ckpt_dir``), a tag directory, or a
    checkpoints directory holding ``latest``.

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
    latest = base / LATEST
    if latest.exists():
        tag_dir = base / latest.read_text().strip()
    elif (base / "checkpoints" / LATEST).exists():
        tag_dir = base / "checkpoints" / (base / "checkpoints" / LATEST).read_text().strip()
    else:
        if resume != "latest" and any(base.glob("rank*.pt")):
            raise CheckpointError(f"checkpoint {base} is incomplete (no {COMPLETE} marker: the save was interrupted)")
        raise CheckpointError(f"no complete checkpoint under {base} (no '{LATEST}' file)")
    if not (tag_dir / COMPLETE).exists():
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {COMPLETE} marker)")
    return tag_dir


def load(engine: Any, tag_dir: str | os.PathLike) -> dict[str, Any]:
    """Loads a complete checkpoint into ``engine`` (model, optimizer incl. SR seed, scheduler) and
    returns this rank's client state.

    Raises:
        CheckpointError: On a missing, incomplete or unreadable checkpoint, or a world-size change.
    """
    tag_dir = Path(tag_dir)
    if not (tag_dir / COMPLETE).exists():
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {COMPLETE} marker)")
    meta = json.loads((tag_dir / COMPLETE).read_text())
    world = rank_world()[1]
    if meta.get("world_size", world) != world:
        raise CheckpointError(f"checkpoint {tag_dir} was written by {meta['world_size']} ranks, this run has {world}")
    rank_file = tag_dir / f"rank{rank_world()[0]:05d}.pt"
    try:
        path, _ = engine.load_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=True, load_lr_scheduler_states=True
        )
        client = torch.load(rank_file, map_location="cpu", weights_only=False)
    except CheckpointError:
        raise
    except Exception as e:  # unreadable or truncated files
        raise CheckpointError(f"cannot read checkpoint {tag_dir}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {tag_dir}")
    return client
