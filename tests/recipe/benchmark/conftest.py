"""Fixtures of the CLIP_benchmark tests: the demo's shapes as two small CLIP_benchmark sets written by its
own converter (a classification set and a retrieval set, 36 images each), and a recipe run directory as
training leaves one (model config, tokenizer, a complete checkpoint) made from a randomly initialised
``tiny`` model with a one-layer text tower, so that no training is needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

import pytest
import torch

pytest.importorskip("clip_benchmark")

from recipe import synthetic as syn  # noqa: E402
from recipe.config import TrainConfig  # noqa: E402
from recipe.model import create_model  # noqa: E402
from recipe.model.tokenizer import train_tokenizer  # noqa: E402
from recipe.run import checkpoint  # noqa: E402

N_IMAGES = 36
STEP = 5
SMALL_TEXT = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


@pytest.fixture(scope="session")
def bench_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``ROOT/wds_synthetic_shapes`` (12 classes, CLIP_benchmark's CIFAR-10 templates) and
    ``ROOT/wds_synthetic_captions`` (two captions an image), CLIP_benchmark's converter's output."""
    from recipe.benchmark.synthetic import write_benchmarks

    root = tmp_path_factory.mktemp("clip_benchmark")
    write_benchmarks(root, n=N_IMAGES, image_size=32, seed=3)
    return root


def save_run(run: Path, context_length: int = 24, seed: int = 0) -> Path:
    """A run directory whose tokenizer knows the captions and templates, with ``context_length``."""
    from recipe.benchmark.synthetic import clip_benchmark_templates

    names = syn.class_names(syn.DEFAULT_COLOURS, syn.DEFAULT_SHAPES)
    texts = [t.format(c=c) for c in names for t in clip_benchmark_templates()]
    texts += [t.format(colour=c, shape=s, position=p, size="small", background="dark") for t in syn.CAPTION_TEMPLATES
              for c in syn.DEFAULT_COLOURS for s in syn.DEFAULT_SHAPES for p in syn.POSITIONS]
    tok = train_tokenizer(texts, vocab_size=400, context_length=context_length)
    torch.manual_seed(seed)
    model = create_model("tiny", tokenizer=tok, text_overrides=SMALL_TEXT)
    with torch.no_grad():  # away from the initial values: biases and norms not trivially 0 or 1
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    tag = run / "checkpoints" / f"step{STEP:08d}"
    tag.mkdir(parents=True)
    tok.save(run / "tokenizer")
    (run / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    (run / "config.json").write_text(json.dumps(TrainConfig(output_dir=str(run)).to_dict()))
    torch.save(model.state_dict(), tag / checkpoint.MODEL_WEIGHTS)
    (tag / checkpoint.COMPLETE).write_text(json.dumps({"step": STEP, "world_size": 1}))
    (run / "checkpoints" / checkpoint.LATEST).write_text(tag.name)
    return run


@pytest.fixture(scope="session")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_run(tmp_path_factory.mktemp("run"))


@pytest.fixture(scope="session")
def make_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_run(context_length=..., seed=...)``: another run directory."""
    return lambda **kw: save_run(tmp_path_factory.mktemp("run"), **kw)
