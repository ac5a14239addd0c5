"""``--init-from DIR``: training starts from a recipe run's (or an export's) weights and tokenizer, with
the architecture read from DIR; flags that contradict it are errors; a restart needs DIR no more."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import recipe.train as T
from recipe import checkpoint
from recipe.config import config_from_dict, parse_args
from recipe.export import detect_format, export_run

from ...dist_utils import run_distributed
from ..test_train import ENV, _train_worker, ds_json, train_cfg
from .conftest import save_run

ROOT = Path(__file__).resolve().parents[3]


def _cfg(tmp: Path, init: Path | None, **model: object) -> object:
    return config_from_dict({
        "deepspeed_config": str(ROOT / "ds_configs" / "zero2_fp32.json"),
        "output_dir": str(tmp / "out"),
        "model": {**({"init_from": str(init)} if init else {}), **model},
    })


def test_init_from_a_run_starts_from_its_weights_and_tokenizer(make_run, tmp_path: Path) -> None:
    src, model = make_run("src", preset="tiny", seed=3)
    assert detect_format(src) == "recipe"
    cfg = _cfg(tmp_path, src, preset=None)
    out = tmp_path / "out"
    out.mkdir()
    imported = T.read_init_from(cfg, out)
    tokenizer = T.get_tokenizer(cfg, out, imported)
    built = T.build_model(cfg, tokenizer, out, imported)
    assert (out / "tokenizer" / "tokenizer.json").read_text() == (src / "tokenizer" / "tokenizer.json").read_text()
    got, want = built.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    saved, source = (json.loads((d / "model_config.json").read_text()) for d in (out, src))
    # the architecture came from src; the text tower is no longer loaded from its own files (the weights are src's)
    assert saved["text"].pop("load_weights") is False
    source["text"].pop("load_weights")
    assert saved == source


@pytest.mark.parametrize(
    "flags, error",
    [
        ({"image_encoder": "resnet18"}, "--image-encoder resnet18 contradicts --init-from"),
        ({"embed_dim": 32}, "--embed-dim 32 contradicts --init-from"),
    ],
)
def test_contradicting_model_flags_are_errors(make_run, tmp_path: Path, flags: dict, error: str) -> None:
    src, _ = make_run("src", preset="tiny")
    with pytest.raises(ValueError, match=error):
        T.read_init_from(_cfg(tmp_path, src, **flags), tmp_path / "out")


def test_command_line_checks(make_run, tmp_path: Path) -> None:
    src, _ = make_run("src", preset="tiny")
    ds = str(ROOT / "ds_configs" / "zero2_fp32.json")
    base = ["--deepspeed_config", ds, "--init-from", str(src)]
    assert parse_args(base).model.init_from == str(src)
    with pytest.raises(ValueError, match="--preset ViT-B-32 contradicts --init-from"):
        parse_args([*base, "--preset", "ViT-B-32"])
    with pytest.raises(ValueError, match="--tokenizer contradicts --init-from"):
        parse_args([*base, "--tokenizer", str(src / "tokenizer")])
    with pytest.raises(FileNotFoundError, match="--init-from directory not found"):
        parse_args(["--deepspeed_config", ds, "--init-from", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="neither an open_clip directory"):
        T.read_init_from(_cfg(tmp_path, tmp_path), tmp_path / "out")


def test_training_from_a_run_and_resuming_without_it(data: Path, make_run, tmp_path: Path) -> None:
    """Under DeepSpeed (2 CPU ranks): the first step trains the source's weights (its loss is the loss of
    the source model on that batch: the same as a run resumed from the source would see), and a restart
    rebuilds the architecture from the run's own model_config.json after the source is gone."""
    src, model = make_run("src", preset="tiny", seed=5)
    ds = ds_json(tmp_path, "zero2_fp32.json", micro=16)
    first = train_cfg(data, tmp_path / "ft", ds, steps=2, save_every=1, model={"init_from": str(src), "preset": None})
    first["data"]["val_data"] = None
    run_distributed(_train_worker, 2, [first], None, init_process_group=False, env=ENV, timeout_s=600)
    start = torch.load(checkpoint.complete_checkpoints(tmp_path / "ft" / "checkpoints")[0] / checkpoint.MODEL_WEIGHTS,
                       weights_only=True)
    # one small step away from the source (lr 2e-3 after a 2-step warm-up: a fraction of that)
    moved = max(float((start[k].float() - v.float()).abs().max()) for k, v in model.state_dict().items())
    assert 0 < moved < 5e-3, moved
    shutil.rmtree(src)
    again = dict(first, steps=3, resume="latest")
    run_distributed(_train_worker, 2, [again], None, init_process_group=False, env=ENV, timeout_s=600)
    rows = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]


TINY_CLIP_VIT = dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny", embed_dim=32,
                     image_kwargs=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2))


@pytest.mark.parametrize(
    "fmt, weights, kwargs",
    [
        ("open_clip", "open_clip_model.safetensors", dict(preset="tiny")),
        ("open_clip", "open_clip_model.safetensors",  # timm ResNet + BERT: open_clip's TimmModel and HF towers
         dict(image_encoder="test_resnet", text_encoder="bert-tiny", embed_dim=32)),
        ("hf", "model.safetensors", TINY_CLIP_VIT),
    ],
)
def test_export_then_init_from_then_export_gives_identical_weights(
    make_run, tmp_path: Path, fmt: str, weights: str, kwargs: dict
) -> None:
    """The round trip through ``--init-from``'s own code (read_init_from, get_tokenizer, build_model)."""
    from safetensors.torch import load_file

    src, _ = make_run("src", **kwargs)
    first = export_run(src, fmt, tmp_path / "first")
    cfg = _cfg(tmp_path, first, preset=None)
    out = tmp_path / "out"
    out.mkdir()
    imported = T.read_init_from(cfg, out)
    tokenizer = T.get_tokenizer(cfg, out, imported)
    model = T.build_model(cfg, tokenizer, out, imported)
    second = export_run(save_run(model, tokenizer, tmp_path / "again"), fmt, tmp_path / "second")
    a, b = load_file(first / weights), load_file(second / weights)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)
