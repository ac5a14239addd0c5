"""A trained run as one model: the checkpoint's consolidated weights, the run's model config and tokenizer.

Every checkpoint holds ``model_weights.pt``, the module's full state dict (gathered across ranks under
ZeRO-3; the same file on every ZeRO stage and on the fp16 route), so reading a run needs no
DeepSpeed and no knowledge of how it was sharded. The weights are those the model trained and
evaluated with (the module's, in the run's dtype); the fp32 masters that SRAdamW keeps for mastered
groups live in the sharded optimizer state and are not used.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .. import checkpoint
from ..model import CLIP, CLIPConfig, create_model
from ..tokenizer import Tokenizer, load_tokenizer

__all__ = ["LoadedRun", "load_run", "DTYPES", "parse_dtype"]

#: ``--dtype`` names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (``fp32``, ``bf16``, ``fp16``).

    Raises:
        ValueError: Another name.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class LoadedRun:
    """A run's model at one checkpoint.

    Attributes:
        model: The :class:`recipe.model.CLIP` with the checkpoint's weights, in evaluation mode.
        tokenizer: The run's tokenizer.
        config: The model's :class:`recipe.model.CLIPConfig`.
        run_dir: The run directory.
        tag_dir: The checkpoint directory the weights came from.
        step: The checkpoint's optimizer step.
        saved_dtype: The dtype the weights were saved in (the run's training dtype).
        weights_file: The file the weights came from (``model_weights.pt`` or ``ema_weights.pt``).
    """

    model: CLIP
    tokenizer: Tokenizer
    config: CLIPConfig
    run_dir: Path
    tag_dir: Path
    step: int
    saved_dtype: torch.dtype
    weights_file: str = checkpoint.MODEL_WEIGHTS


def load_run(path: str | os.PathLike, dtype: torch.dtype = torch.float32, ema: bool = False) -> LoadedRun:
    """Loads the model of a run directory (its ``latest`` complete checkpoint), of its
    ``checkpoints/`` directory, or of one checkpoint tag directory, cast to ``dtype``; with ``ema``
    the checkpoint's EMA weights (``ema_weights.pt``, runs with ``--ema-decay``) instead.

    Raises:
        FileNotFoundError: The directory, its ``model_config.json`` or tokenizer is missing.
        recipe.checkpoint.CheckpointError: No complete checkpoint there, or an unreadable one.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"run directory not found: {path}")
    tag_dir = checkpoint.resolve(str(path), path / "checkpoints")
    run_dir = tag_dir.parent.parent
    for needed in ("model_config.json", "tokenizer"):
        if not (run_dir / needed).exists():
            raise FileNotFoundError(f"{run_dir} is not a recipe run directory: {needed} is missing")
    config = CLIPConfig.from_dict(json.loads((run_dir / "model_config.json").read_text()))
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    weights = tag_dir / (checkpoint.EMA_WEIGHTS if ema else checkpoint.MODEL_WEIGHTS)
    if ema and not weights.is_file():
        raise checkpoint.CheckpointError(f"{weights} not found: the run has no EMA (train with --ema-decay)")
    try:
        state: dict[str, Any] = torch.load(weights, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise checkpoint.CheckpointError(f"cannot read {weights}: {e}") from e
    # the architecture as trained, randomly initialised, then the saved weights (not a text tower's
    # original pretrained files: those need not exist where the run is exported)
    model = create_model(config=config, tokenizer=tokenizer, text_load_weights=False)
    model.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise checkpoint.CheckpointError(
            f"{weights} does not fit the run's model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    step = int(json.loads((tag_dir / checkpoint.COMPLETE).read_text())["step"])
    saved = next(iter(state.values())).dtype if state else dtype
    return LoadedRun(model.eval(), tokenizer, model.config, run_dir, tag_dir, step, saved, weights.name)
