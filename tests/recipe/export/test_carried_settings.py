"""Settings the export formats carry besides the weights:

* ``--patch-dropout``: the open_clip export records it as ``vision_cfg.patch_dropout``; open_clip builds
  its tower with it (native ViT and TimmModel), dropping the recipe's number of patch tokens in training
  and none in evaluation (where the embeddings are the recipe's); reading the directory carries it back.
* A Hugging Face image processor's ``resample``: reading the directory makes it the image tower's data
  config interpolation (PIL's 2 -> ``bilinear``), so the recipe's evaluation transform gives the
  processor's pixels (to one uint8 level) and an export writes it again; a value that is no PIL filter is
  one warning line naming it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from recipe.export import export_run, read_pretrained  # noqa: E402
from recipe.export import open_clip as oc_export  # noqa: E402
from recipe.model import create_model  # noqa: E402

from .conftest import save_run  # noqa: E402

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
#: name -> (create_model kwargs, open_clip's image tower)
TOWERS = {
    "native": (dict(preset="tiny"), "native"),
    # QuickGELU in the text tower only: the image tower goes through open_clip's TimmModel
    "timm": (dict(image_encoder="test_vit", text_encoder="clip-text-tiny", text_overrides={"hidden_act": "quick_gelu"}),
             "timm"),
}


def _tokens_seen(blocks: torch.nn.Module, forward, size: tuple[int, ...]) -> int:  # type: ignore[no-untyped-def]
    """The sequence length entering ``blocks`` (prefix and patch tokens) in one forward of 2 images."""
    seen = []
    handle = blocks.register_forward_pre_hook(lambda _m, args: seen.append(args[0].shape[1]))
    try:
        with torch.no_grad():
            forward(torch.randn(2, *size))
    finally:
        handle.remove()
    return seen[0]


@pytest.mark.filterwarnings("ignore:open_clip export")
@pytest.mark.parametrize("tower", list(TOWERS))
def test_patch_dropout_is_exported_and_open_clip_builds_with_it(make_run, tmp_path: Path, tower: str) -> None:
    import open_clip
    from timm.layers import PatchDropout

    kwargs, kind = TOWERS[tower]
    run_dir, model = make_run(tower, patch_dropout=0.5, **kwargs)
    assert json.loads((run_dir / "model_config.json").read_text())["image"]["patch_dropout"] == 0.5
    out = export_run(run_dir, "open_clip", tmp_path / "out")
    vision = json.loads((out / oc_export.CONFIG_FILE).read_text())["model_cfg"]["vision_cfg"]
    assert ("timm_model_name" in vision) == (kind == "timm") and vision["patch_dropout"] == 0.5
    oc = open_clip.create_model(f"local-dir:{out}")
    if kind == "native":
        assert isinstance(oc.visual.patch_dropout, open_clip.transformer.PatchDropout)
        assert oc.visual.patch_dropout.prob == 0.5
        blocks = oc.visual.transformer
    else:
        assert [m.prob for m in oc.visual.trunk.modules() if isinstance(m, PatchDropout)] == [0.5]
        blocks = oc.visual.trunk.blocks
    # both keep the class token and int(N * 0.5) of the N patches in training, all of them in evaluation
    trunk, size = model.visual.trunk, model.image_data_config()["input_size"]
    n, prefix = trunk.patch_embed.num_patches, trunk.num_prefix_tokens
    assert n >= 4 and prefix == 1
    for training, tokens in ((True, prefix + n // 2), (False, prefix + n)):
        oc.train(training)
        model.train(training)
        assert _tokens_seen(blocks, oc.encode_image, size) == tokens
        assert _tokens_seen(trunk.blocks, model.encode_image, size) == tokens
    pixels = torch.randn(2, *size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():  # evaluation: no patch dropped, the recipe's embeddings
        assert torch.allclose(oc.eval().encode_image(pixels, normalize=True), model.eval().encode_image(pixels),
                              atol=1e-5)
    assert read_pretrained(out).config.image.patch_dropout == 0.5  # carried back, with or without the
    doc = json.loads((out / oc_export.CONFIG_FILE).read_text())   # recipe's own section
    del doc["recipe"]
    (out / oc_export.CONFIG_FILE).write_text(json.dumps(doc))
    assert read_pretrained(out).config.image.patch_dropout == 0.5
    plain, _ = make_run(f"{tower}-plain", **kwargs)  # without --patch-dropout nothing is written
    vision = json.loads((export_run(plain, "open_clip", tmp_path / "plain") / oc_export.CONFIG_FILE).read_text())
    assert "patch_dropout" not in vision["model_cfg"]["vision_cfg"]


def _hf_dir(make_run, tmp_path: Path, resample: int) -> Path:  # type: ignore[no-untyped-def]
    """A Hugging Face CLIPModel directory of a tiny CLIP ViT whose image processor resamples with ``resample``."""
    run_dir, _ = make_run("vit", image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny",
                          image_kwargs=TINY_VIT, embed_dim=32)
    out = export_run(run_dir, "hf", tmp_path / "hf")
    path = out / "preprocessor_config.json"
    processor = json.loads(path.read_text())
    assert processor["resample"] == 3  # the run's bicubic
    # crop = shorter side (crop_pct 1.0): transformers and timm then crop at the same offsets (see recipe.export.hf)
    path.write_text(json.dumps({**processor, "resample": resample, "size": {"shortest_edge": 32}}))
    return out


def test_hf_import_applies_a_bilinear_resample(make_run, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import numpy as np
    from PIL import Image
    from transformers import CLIPImageProcessor

    from recipe.data.decode import build_transform

    out = _hf_dir(make_run, tmp_path, resample=2)  # PIL's BILINEAR
    with caplog.at_level(logging.WARNING, logger="recipe.export.hf"):
        imported = read_pretrained(out)
    assert not caplog.records  # applied, nothing to warn about
    assert imported.config.image.interpolation == "bilinear"
    model = create_model(config=imported.config, text_load_weights=False)
    data = model.image_data_config()
    assert data["interpolation"] == "bilinear"
    # the recipe's evaluation transform gives the processor's pixels: one uint8 level apart at most (PIL
    # images there, tensors in transformers), where the bicubic it had before is far off
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (57, 45, 3), dtype=np.uint8))
    reference = CLIPImageProcessor.from_pretrained(out)(images=[image], return_tensors="pt")["pixel_values"][0]
    level = 1 / 255 / min(data["std"])
    got = build_transform(data, train=False)(image)
    assert (got - reference).abs().max().item() <= level * 1.001
    bicubic = build_transform({**data, "interpolation": "bicubic"}, train=False)(image)
    assert (bicubic - reference).abs().max().item() > 10 * level
    # a run started from it keeps it (model_config.json), and its export writes it back
    again = save_run(model, imported.tokenizer, tmp_path / "again")
    assert json.loads((again / "model_config.json").read_text())["image"]["interpolation"] == "bilinear"
    second = export_run(again, "hf", tmp_path / "second")
    assert json.loads((second / "preprocessor_config.json").read_text())["resample"] == 2


def test_hf_import_names_a_resample_it_cannot_apply(make_run, tmp_path: Path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    out = _hf_dir(make_run, tmp_path, resample=7)
    with caplog.at_level(logging.WARNING, logger="recipe.export.hf"):
        imported = read_pretrained(out)
    [record] = caplog.records
    assert "resample 7" in record.getMessage() and "\n" not in record.getMessage()
    assert imported.config.image.interpolation == "bicubic"
