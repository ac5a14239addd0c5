"""A checkpoint's files at the lowest level, shared by :mod:`recipe.run.checkpoint` (saves, loads) and
:mod:`recipe.run.elastic` (re-sharded loads): the ``COMPLETE`` marker, :class:`CheckpointError`, reading one
file, and DeepSpeed's part of a load."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

__all__ = ["COMPLETE", "CheckpointError", "read_file", "load_engine_state"]

#: The marker written last into a checkpoint tag directory, once every rank has written its files.
COMPLETE = "COMPLETE"


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or unreadable."""


def read_file(path: Path, key: str | None = None, mmap: bool = False) -> Any:
    """A checkpoint file's content (``key`` of it); ``mmap`` maps its tensors instead of reading them.

    Raises:
        CheckpointError: The file is missing, unreadable or truncated, or has no ``key`` (named).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} is missing")
    try:
        content = torch.load(path, map_location="cpu", weights_only=False, mmap=mmap)
        return content if key is None else content[key]
    except Exception as e:  # a truncated or foreign file
        raise CheckpointError(f"cannot read checkpoint file {path}: {type(e).__name__}: {e}") from e


def load_engine_state(engine: Any, tag_dir: Path, optimizer_states: bool = True) -> None:
    """DeepSpeed's part of checkpoint ``tag_dir`` into ``engine`` (module, scheduler and, unless
    ``optimizer_states`` is False, optimizer); ``CheckpointError`` naming the directory when a file is
    unreadable or DeepSpeed finds nothing there."""
    try:
        path, _ = engine.load_checkpoint(
            str(tag_dir.parent), tag=tag_dir.name, load_optimizer_states=optimizer_states, load_lr_scheduler_states=True
        )
    except CheckpointError:
        raise
    except Exception as e:  # unreadable or truncated files
        raise CheckpointError(f"cannot read checkpoint {tag_dir}: {type(e).__name__}: {e}") from e
    if path is None:
        raise CheckpointError(f"DeepSpeed found no checkpoint in {tag_dir}")
