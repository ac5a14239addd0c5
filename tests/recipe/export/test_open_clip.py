"""Tests of recipe.export.open_clip: each supported tower pair exported and loaded by the installed
open_clip (``local-dir:``) gives the recipe's normalised embeddings, token ids and logit scale; a
perturbed weight is detected; unsupported pairs are refused with what open_clip lacks; bf16 weights;
the ViT-B-32 preset; preprocessing; moved directories; and the way back (read -> recipe model ->
export again gives identical tensors), also from a directory open_clip wrote itself.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import open_clip  # noqa: E402  (the test extra installs open_clip_torch: the export is checked against it)
from safetensors.torch import load_file, save_file  # noqa: E402

from recipe.export import LoadedRun, UnsupportedExport, export_run, read_pretrained  # noqa: E402
from recipe.export import open_clip as oc_export  # noqa: E402
from recipe.model import CLIPConfig, ImageTowerConfig, TextTowerConfig, create_model  # noqa: E402

from .conftest import CAPTIONS, save_run  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:open_clip export")

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
# ordinary captions, an empty one, and one longer than the 32-token context (truncated the same way)
TEXTS = CAPTIONS[:4] + ["A photo of a dog, playing in the snow.", "", " ".join(CAPTIONS[:6])]
ATOL = 1e-5


def _config(image: str, text: str, proj_bias: bool = False, **image_kwargs) -> CLIPConfig:
    return CLIPConfig(ImageTowerConfig(image, timm_kwargs=image_kwargs), TextTowerConfig(text), embed_dim=32,
                      proj_bias=proj_bias)


# name -> (create_model kwargs, expected (vision, text) towers in open_clip)
PAIRS = {
    "tiny": (dict(preset="tiny"), ("native", "native")),  # plain ViT: no ln_pre, patch bias folded, eps 1e-6
    "clip-vit": (dict(image_encoder="vit_base_patch32_clip_224", image_kwargs=TINY_VIT, text_encoder="clip-text-tiny",
                      embed_dim=32), ("native", "native")),
    "clip-vit-quickgelu": (dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny",
                                image_kwargs={**TINY_VIT, "act_layer": "quick_gelu"},
                                text_overrides={"hidden_act": "quick_gelu"}), ("native", "native")),
    "clip-vit-tanh-gelu": (dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny",
                                image_kwargs={**TINY_VIT, "act_layer": "gelu_tanh"},
                                text_overrides={"hidden_act": "gelu_pytorch_tanh"}), ("native", "native")),
    "tiny-text-cls": (dict(preset="tiny", text_pooling="cls"), ("native", "native")),
    "test_vit-bert-mean": (dict(image_encoder="test_vit", text_encoder="bert-tiny", text_pooling="mean"),
                           ("native", "hf")),
    "test_vit-projbias": (dict(config=_config("test_vit", "clip-text-tiny", proj_bias=True)), ("timm", "native")),
    "test_vit-quickgelu-text": (dict(image_encoder="test_vit", text_encoder="clip-text-tiny",
                                     text_overrides={"hidden_act": "quick_gelu"}), ("timm", "native")),
    "test_resnet-bert-cls": (dict(image_encoder="test_resnet", text_encoder="bert-tiny", embed_dim=32),
                             ("timm", "hf")),
    "test_convnext-roberta-mean": (dict(image_encoder="test_convnext", text_encoder="roberta-tiny",
                                        text_pooling="mean"), ("timm", "hf")),
    "test_resnet-projbias": (dict(config=_config("test_resnet", "clip-text-tiny", proj_bias=True)),
                             ("timm", "native")),
}


def _pixels(model, n: int = 2) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.rand(n, *model.image_data_config()["input_size"], generator=g) * 4 - 2


def _compare(model, tokenizer, out: Path) -> tuple[float, float, torch.nn.Module]:
    """Max |difference| of the normalised image and text embeddings of the recipe ``model`` and open_clip's
    model loaded from ``out``; the token ids of both tokenizers must be equal."""
    oc, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    oc.eval()
    ids = open_clip.get_tokenizer(f"local-dir:{out}")(TEXTS)
    batch = tokenizer(TEXTS)
    assert torch.equal(ids, batch["input_ids"]) and batch["attention_mask"][-1].all()  # the last one is truncated
    x = _pixels(model)
    with torch.no_grad():
        image = (oc.encode_image(x, normalize=True) - model.encode_image(x)).abs().max().item()
        text = (oc.encode_text(ids, normalize=True) - model.encode_text(**batch)).abs().max().item()
    return image, text, oc


def _towers(out: Path) -> tuple[str, str]:
    cfg = json.loads((out / oc_export.CONFIG_FILE).read_text())["model_cfg"]
    return ("timm" if "timm_model_name" in cfg["vision_cfg"] else "native",
            "hf" if "hf_model_name" in cfg["text_cfg"] else "native")


@pytest.mark.parametrize("name", list(PAIRS))
def test_pair_matches_open_clip(make_run, tokenizer, tmp_path, name):
    kwargs, towers = PAIRS[name]
    run_dir, model = make_run(name, **kwargs)
    out = export_run(run_dir, "open_clip", tmp_path / "out")
    assert _towers(out) == towers
    assert (out / oc_export.WEIGHTS_FILE).is_file() and (out / "tokenizer.json").is_file()
    assert (out / oc_export.HF_TEXT_DIR / "config.json").is_file() == (towers[1] == "hf")
    image, text, oc = _compare(model, tokenizer, out)
    assert image <= ATOL and text <= ATOL, (image, text)
    assert oc.logit_scale.shape == () and oc.logit_scale.item() == model.logit_scale.item()
    data, pre = model.image_data_config(), oc.visual.preprocess_cfg
    assert tuple(pre["mean"]) == data["mean"] and tuple(pre["std"]) == data["std"]
    assert pre["interpolation"] == data["interpolation"] and pre["resize_mode"] == "shortest"
    assert tuple(oc.visual.image_size) == data["input_size"][1:]

    # one perturbed weight in each tower of the written file is detected
    weights = load_file(out / oc_export.WEIGHTS_FILE)
    for prefix in ("visual.", "text." if towers[1] == "hf" else "transformer."):
        key = max((k for k in weights if k.startswith(prefix) and k.endswith("weight")),
                  key=lambda k: weights[k].numel())
        weights[key] = weights[key] + 0.05 * torch.randn_like(weights[key])
    save_file(weights, out / oc_export.WEIGHTS_FILE)
    image, text, _ = _compare(model, tokenizer, out)
    assert image > 1e-3 and text > 1e-3, (image, text)


REFUSALS = {
    "bert-eos": (dict(image_encoder="test_resnet", text_encoder="bert-tiny", text_pooling="eos"),
                 ["'eos' pooling in its Hugging Face text towers"]),
    "roberta-last": (dict(image_encoder="test_resnet", text_encoder="roberta-tiny", text_pooling="last"),
                     ["'last' pooling"]),
    "clip-text-mean": (dict(preset="tiny", text_pooling="mean"), ["'mean' pooling in its native text tower"]),
    "distilbert": (dict(image_encoder="test_resnet", text_encoder="distilbert-tiny"), ["model type 'distilbert'"]),
    "timm-kwargs-cnn": (dict(preset="tiny-resnet"), ["only timm VisionTransformer trunks (this is ResNet)",
                                                     "without ['channels', 'layers', 'stem_width']"]),
    "vit-kwargs-projbias": (dict(config=_config("vit_tiny_patch16_224", "clip-text-tiny", True, **TINY_VIT)),
                            ["no image projection bias", "without ['depth', 'embed_dim', 'num_heads', 'patch_size']"]),
    "hf-projbias": (dict(config=_config("test_resnet", "bert-tiny", proj_bias=True)), ["text projection bias"]),
    "quickgelu-one-tower": (dict(preset="tiny", text_overrides={"hidden_act": "quick_gelu"}),
                            ["QuickGELU in one tower only"]),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_unsupported_pairs_are_refused(make_run, tmp_path, name):
    kwargs, needles = REFUSALS[name]
    run_dir, _ = make_run(name, **kwargs)
    with pytest.raises(UnsupportedExport) as info:
        export_run(run_dir, "open_clip", tmp_path / "out")
    for needle in needles:
        assert needle in str(info.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_bf16_weights(make_run, tokenizer, tmp_path):
    run_dir, model = make_run("tiny", preset="tiny")
    out = export_run(run_dir, "open_clip", tmp_path / "bf16", dtype="bf16")
    weights = load_file(out / oc_export.WEIGHTS_FILE)
    assert {v.dtype for v in weights.values()} == {torch.bfloat16}
    image, text, _ = _compare(model, tokenizer, out)
    assert 0 < image < 0.05 and 0 < text < 0.05
    assert json.loads((out / oc_export.CONFIG_FILE).read_text())["recipe"]["dtype"] == "bfloat16"


def test_preprocessing_matches_recipe_eval_transform(make_run, tmp_path):
    from PIL import Image

    from recipe.data.decode import build_transform

    run_dir, model = make_run("tiny", preset="tiny")
    out = export_run(run_dir, "open_clip", tmp_path / "out")
    _, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    image = Image.fromarray(torch.randint(0, 256, (45, 61, 3), dtype=torch.uint8).numpy())
    expected = build_transform(model.image_data_config(), train=False)(image)
    assert torch.allclose(preprocess(image), expected, atol=1e-6)

    # crop_pct 0.95 (timm's test models): exported as crop_pct 1.0, with a warning and a note in the config
    run_dir, _ = make_run("resnet", image_encoder="test_resnet", text_encoder="bert-tiny")
    with pytest.warns(UserWarning, match="crop_pct 0.95"):
        out = export_run(run_dir, "open_clip", tmp_path / "resnet-out")
    assert "crop_pct 0.95" in json.loads((out / oc_export.CONFIG_FILE).read_text())["recipe"]["notes"][0]


def test_vit_b_32_preset(tokenizer, tmp_path):
    """The preset exports to open_clip's native ViT-B-32 layout (random weights, written in memory)."""
    torch.manual_seed(0)
    model = create_model("ViT-B-32", tokenizer=tokenizer).eval()
    run = LoadedRun(model, tokenizer, model.config, tmp_path, tmp_path, 0, torch.float32)
    out = tmp_path / "b32"
    out.mkdir()
    oc_export.write(run, out, torch.float32)
    vision = json.loads((out / oc_export.CONFIG_FILE).read_text())["model_cfg"]["vision_cfg"]
    builtin = open_clip.get_model_config("ViT-B-32")["vision_cfg"]
    assert {k: vision[k] for k in builtin} == builtin and not vision["no_ln_pre"]
    image, text, oc = _compare(model, tokenizer, out)
    assert image <= ATOL and text <= ATOL, (image, text)
    reference = open_clip.create_model("ViT-B-32", device="meta")
    assert {k: v.shape for k, v in oc.visual.state_dict().items()} == \
           {k: v.shape for k, v in reference.visual.state_dict().items()}


@pytest.mark.parametrize("name", ["tiny", "clip-vit-quickgelu", "clip-vit-tanh-gelu", "test_vit-bert-mean",
                                  "test_convnext-roberta-mean", "test_resnet-projbias"])
def test_round_trip(make_run, tokenizer, tmp_path, name):
    run_dir, model = make_run(name, **PAIRS[name][0])
    out = export_run(run_dir, "open_clip", tmp_path / "first")
    imported = read_pretrained(out)
    assert imported.source.startswith("open_clip")
    # as ``python -m recipe.train --init-from`` builds it
    again = create_model(config=imported.config, tokenizer=imported.tokenizer, text_load_weights=False)
    again.load_state_dict(imported.state_dict)  # strict
    assert again.eval().text.pooling == model.text.pooling
    x, batch = _pixels(model), imported.tokenizer(TEXTS)
    assert torch.equal(batch["input_ids"], tokenizer(TEXTS)["input_ids"])
    with torch.no_grad():
        assert torch.allclose(again.encode_image(x), model.encode_image(x), atol=ATOL)
        assert torch.allclose(again.encode_text(**batch), model.encode_text(**batch), atol=ATOL)
    second = export_run(save_run(again, imported.tokenizer, tmp_path / "run2"), "open_clip", tmp_path / "second")
    a, b = load_file(out / oc_export.WEIGHTS_FILE), load_file(second / oc_export.WEIGHTS_FILE)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg_a, cfg_b = (json.loads((d / oc_export.CONFIG_FILE).read_text()) for d in (out, second))
    for cfg in (cfg_a, cfg_b):
        cfg["model_cfg"]["text_cfg"].pop("hf_model_name", None)
    assert cfg_a["model_cfg"] == cfg_b["model_cfg"] and cfg_a["preprocess_cfg"] == cfg_b["preprocess_cfg"]


def _drop_recipe_section(directory: Path) -> None:
    doc = json.loads((directory / oc_export.CONFIG_FILE).read_text())
    del doc["recipe"]
    if "hf_model_name" in doc["model_cfg"]["text_cfg"]:
        doc["model_cfg"]["text_cfg"]["hf_model_name"] = str(directory / oc_export.HF_TEXT_DIR)
    (directory / oc_export.CONFIG_FILE).write_text(json.dumps(doc))


def _open_clip_written(directory: Path, tokenizer) -> torch.nn.Module:
    """A directory as open_clip users make one: open_clip's own (perturbed) random model and an HF tokenizer."""
    from transformers import PreTrainedTokenizerFast

    cfg = dict(embed_dim=32, quick_gelu=True,
               vision_cfg=dict(image_size=32, layers=2, width=64, head_width=32, patch_size=8),
               text_cfg=dict(context_length=32, vocab_size=300, width=64, heads=2, layers=2, pool_type="eos", eos_id=2,
                             hf_tokenizer_name="."))
    directory.mkdir()
    (directory / oc_export.CONFIG_FILE).write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {"size": 32}}))
    torch.manual_seed(3)
    model = open_clip.create_model(f"local-dir:{directory}").eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "open_clip_model.safetensors")
    special = tokenizer.special
    PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend, bos_token=special.bos, eos_token=special.eos,
                            pad_token=special.pad).save_pretrained(directory)
    return model


@pytest.mark.parametrize("source", ["open_clip-native", "tiny", "clip-vit-tanh-gelu", "test_resnet-bert-cls"])
def test_read_open_clip_directories(make_run, tokenizer, tmp_path, source):
    """Directories without the recipe's own config (open_clip's own, or an export without its ``recipe``
    section): the architecture is derived from ``model_cfg``."""
    if source == "open_clip-native":
        out = tmp_path / "oc"
        _open_clip_written(out, tokenizer)
    else:
        run_dir, _ = make_run(source, **PAIRS[source][0])
        out = export_run(run_dir, "open_clip", tmp_path / "out")
        _drop_recipe_section(out)
    imported = read_pretrained(out)
    assert "recipe" not in json.loads((out / oc_export.CONFIG_FILE).read_text())
    model = create_model(config=imported.config, tokenizer=imported.tokenizer, text_load_weights=False)
    model.load_state_dict(imported.state_dict)
    image, text, _ = _compare(model.eval(), imported.tokenizer, out)
    assert image <= ATOL and text <= ATOL, (image, text)


def test_moved_directories(make_run, tokenizer, tmp_path):
    """Native towers move freely; a Hugging Face text tower needs relocate() after a move (open_clip resolves
    ``hf_model_name`` against the working directory); read() works either way."""
    run_dir, model = make_run("tiny", preset="tiny")
    moved = Path(shutil.move(export_run(run_dir, "open_clip", tmp_path / "a"), tmp_path / "elsewhere"))
    image, text, _ = _compare(model, tokenizer, moved)
    assert image <= ATOL and text <= ATOL

    run_dir, model = make_run("hf", image_encoder="test_resnet", text_encoder="bert-tiny")
    out = export_run(run_dir, "open_clip", tmp_path / "b")
    text_cfg = json.loads((out / oc_export.CONFIG_FILE).read_text())["model_cfg"]["text_cfg"]
    assert text_cfg["hf_model_name"] == str(out / oc_export.HF_TEXT_DIR)  # where the export landed
    copied = Path(shutil.copytree(out, tmp_path / "copy"))
    shutil.rmtree(out)
    with pytest.raises((OSError, ValueError)):  # the recorded absolute hf_model_name is gone
        open_clip.create_model(f"local-dir:{copied}")
    read_pretrained(copied)  # does not need it
    oc_export.relocate(copied)
    image, text, _ = _compare(model, tokenizer, copied)
    assert image <= ATOL and text <= ATOL


def test_read_refusals(make_run, tokenizer, tmp_path):
    run_dir, _ = make_run("resnet", image_encoder="test_resnet", text_encoder="bert-tiny")
    out = export_run(run_dir, "open_clip", tmp_path / "out")
    _drop_recipe_section(out)
    path = out / oc_export.CONFIG_FILE
    original = json.loads(path.read_text())
    cases = {"timm_proj 'mlp'": ("vision_cfg", "timm_proj", "mlp"),
             "cls_pooler": ("text_cfg", "hf_pooler_type", "cls_pooler"),
             "built-in CLIP tokenizer": ("text_cfg", "hf_tokenizer_name", "")}
    for needle, (tower, key, value) in cases.items():
        doc = json.loads(json.dumps(original))
        doc["model_cfg"][tower][key] = value
        path.write_text(json.dumps(doc))
        with pytest.raises(UnsupportedExport, match=needle):
            read_pretrained(out)


@pytest.mark.parametrize("post_processor", ["none", "byte_level"])
def test_tokenizer_without_bos_eos_post_processor(tokenizer, tmp_path, post_processor):
    """A tokenizer whose ``tokenizers`` backend adds no bos/eos (the recipe adds them) gets a post-processor
    that does, so open_clip's HFTokenizer gives the same ids (truncated rows included)."""
    from tokenizers import processors

    from recipe.model.tokenizer import Tokenizer

    backend = tokenizer.backend.__class__.from_str(tokenizer.backend.to_str())
    backend.post_processor = None if post_processor == "none" else processors.ByteLevel(trim_offsets=False)
    plain = Tokenizer(backend, tokenizer.special, tokenizer.context_length)
    assert plain.backend.encode("a red circle").ids[0] != plain.bos_token_id
    oc_export._export_tokenizer(plain).save(tmp_path)
    (tmp_path / oc_export.CONFIG_FILE).write_text(json.dumps({"model_cfg": {"text_cfg": {
        "context_length": plain.context_length, "hf_tokenizer_name": "."}}}))
    ids = open_clip.get_tokenizer(f"local-dir:{tmp_path}")(TEXTS)
    assert torch.equal(ids, plain(TEXTS)["input_ids"])
