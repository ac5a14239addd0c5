"""Runs to export: a recipe run directory as training leaves it (model config, tokenizer, a complete
checkpoint with the consolidated ``model_weights.pt``), made from a freshly built model without
training, so each tower pair costs a second. ``tests/recipe/export/test_cli.py`` also exports
checkpoints that DeepSpeed wrote (ZeRO-3, fp16 route)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from recipe import checkpoint
from recipe.model import CLIP, create_model
from recipe.tokenizer import Tokenizer, train_tokenizer

CAPTIONS = [f"a {c} {s} on a {b} background" for c in ("red", "green", "blue", "black") for s in
            ("circle", "square", "triangle") for b in ("white", "grey", "dark")]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """A byte-level BPE the way training makes one (pad 0, bos 1, eos 2), context 32."""
    return train_tokenizer(CAPTIONS * 4, vocab_size=300, context_length=32)


def save_run(model: CLIP, tokenizer: Tokenizer, run_dir: Path, step: int = 7) -> Path:
    """Writes ``run_dir`` as :mod:`recipe.train` would after saving a checkpoint at ``step``."""
    tag = run_dir / "checkpoints" / f"step{step:08d}"
    tag.mkdir(parents=True)
    tokenizer.save(run_dir / "tokenizer")
    (run_dir / "model_config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tag / checkpoint.MODEL_WEIGHTS)
    (tag / checkpoint.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    (run_dir / "checkpoints" / checkpoint.LATEST).write_text(tag.name)
    return run_dir


@pytest.fixture
def make_run(tmp_path: Path, tokenizer: Tokenizer) -> Callable[..., tuple[Path, CLIP]]:
    """``make_run(name, **create_model_kwargs) -> (run_dir, model)``: a random-initialised model of the
    given towers (weights perturbed away from their initial values, so that biases and norms are not
    trivially zero or one) saved as a run."""

    def make(name: str = "run", seed: int = 0, **kwargs: Any) -> tuple[Path, CLIP]:
        torch.manual_seed(seed)
        model = create_model(tokenizer=tokenizer, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        return save_run(model, tokenizer, tmp_path / name), model.eval()

    return make
