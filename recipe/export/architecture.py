"""A run's architecture from its run directory alone: model config, tokenizer and a randomly initialised
model, as trained (shared by :mod:`recipe.export.run`, which loads the weights into it, and
:mod:`recipe.export.masters`, which maps ZeRO-0 optimizer state onto its parameters)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..model.clip import CLIP, CLIPConfig, create_model
from ..model.tokenizer import Tokenizer, load_tokenizer

__all__ = ["build_architecture"]


def build_architecture(run_dir: str | os.PathLike) -> tuple[CLIPConfig, Tokenizer, CLIP]:
    """The run's model config, tokenizer and model as trained, randomly initialised, in fp32 (not a
    text tower's original pretrained files: those need not exist where the run is read).

    Raises:
        FileNotFoundError: ``model_config.json`` or ``tokenizer`` is missing.
    """
    run_dir = Path(run_dir)
    for needed in ("model_config.json", "tokenizer"):
        if not (run_dir / needed).exists():
            raise FileNotFoundError(f"{run_dir} is not a recipe run directory: {needed} is missing")
    config = CLIPConfig.from_dict(json.loads((run_dir / "model_config.json").read_text()))
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    return config, tokenizer, create_model(config=config, tokenizer=tokenizer, text_load_weights=False)
