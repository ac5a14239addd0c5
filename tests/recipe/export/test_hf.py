"""Hugging Face export and import (:mod:`recipe.export.hf`): a run exported with ``--format hf`` loads in
``transformers.CLIPModel``/``CLIPProcessor``/``AutoTokenizer`` and gives the run's normalised embeddings
(<= 1e-5 absolute, fp32) on the same pixels and captions; a perturbed weight shows; ``--dtype bf16``;
refusals; export -> read -> export is the identity on tensors; a directory transformers itself saved
(OpenAI's layout and legacy ``eos_token_id`` 2) reads into a recipe model with the same embeddings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from recipe import export
from recipe.export import UnsupportedExport, export_run, hf
from recipe.export.__main__ import main as export_main
from recipe.model import CLIP, create_model

from .conftest import CAPTIONS, save_run

TOL = 1e-5
TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
TEXTS = [*CAPTIONS[:6], "", "A LONG caption, " * 30, "unseen words: zebra quokka 42"]


#: Tiny CLIP ViT variants: the ViT-B-32 layout, and QuickGELU without qkv biases, another MLP ratio and patch.
VARIANTS = {
    "vit_clip": ("vit_base_patch32_clip_224", {}),
    "vit_clip_quickgelu_nobias": ("vit_base_patch16_clip_224", dict(qkv_bias=False, act_layer="quick_gelu",
                                                                    mlp_ratio=3.0, patch_size=4)),
}


def tiny_pair(make_run: Any, variant: str = "vit_clip", **kwargs: Any) -> tuple[Path, CLIP]:
    name, extra = VARIANTS[variant]
    return make_run(variant, image_encoder=name, text_encoder="clip-text-tiny", image_kwargs=dict(TINY_VIT, **extra),
                    embed_dim=32, **kwargs)


def hf_features(hf_model: Any, pixels: torch.Tensor, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        image = hf_model.get_image_features(pixel_values=pixels)
        text = hf_model.get_text_features(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    # transformers 5 returns a ModelOutput whose pooler_output is the projected, unnormalised feature
    image, text = (getattr(x, "pooler_output", x) for x in (image, text))
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1)


def compare(model: CLIP, tokenizer: Any, out: Path, hf_model: Any = None, seed: int = 0) -> dict[str, float]:
    """Max absolute differences of the normalised embeddings and logit scales of the recipe model and
    the export; captions go through each side's own tokenizer, whose ids must agree (after the
    recorded eos swap)."""
    from transformers import AutoTokenizer, CLIPModel

    hf_model = hf_model or CLIPModel.from_pretrained(out, dtype=torch.float32).eval()
    hf_tok = AutoTokenizer.from_pretrained(out)
    size = model.image_data_config()["input_size"]
    pixels = torch.randn(3, *size, generator=torch.Generator().manual_seed(seed))
    ours = tokenizer(TEXTS)
    theirs = hf_tok(TEXTS, padding="max_length", truncation=True, return_tensors="pt")
    ids = ours["input_ids"].clone()
    swap = json.loads((out / "recipe_export.json").read_text())["token_id_swap"]
    if swap:
        a, b = swap
        ids[ours["input_ids"] == a], ids[ours["input_ids"] == b] = b, a
    assert torch.equal(theirs["input_ids"], ids)
    assert torch.equal(theirs["attention_mask"], ours["attention_mask"])
    with torch.no_grad():
        image, text = model.encode_image(pixels), model.encode_text(**ours)
    hf_image, hf_text = hf_features(hf_model, pixels, theirs)
    return {
        "image": float((image - hf_image).abs().max()),
        "text": float((text - hf_text).abs().max()),
        "scale": float((model.logit_scale.detach().reshape(()) - hf_model.logit_scale.detach().float()).abs()),
    }


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_tiny_clip_pair_exports_exactly(make_run: Any, tmp_path: Path, variant: str) -> None:
    from transformers import AutoProcessor, CLIPImageProcessor, CLIPProcessor

    run_dir, model = tiny_pair(make_run, variant)
    out = export_run(run_dir, "hf", tmp_path / "hf")
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "preprocessor_config.json"} <= {p.name for p in out.iterdir()}
    diffs = compare(model, model_tokenizer(run_dir), out)
    assert max(diffs.values()) <= TOL, diffs
    # the recipe's tokenizer has eos id 2, which transformers would pool at argmax: moved to the last id
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["hidden_act"] == ("quick_gelu" if "quickgelu" in variant else "gelu")
    last = model_tokenizer(run_dir).vocab_size - 1
    assert json.loads((out / "recipe_export.json").read_text())["token_id_swap"] == [2, last]
    assert hf.check(model.config, model_tokenizer(run_dir)).swap == (2, last)  # from the config alone
    assert config["text_config"]["eos_token_id"] == last and config["text_config"]["bos_token_id"] == 1
    for cls in (CLIPProcessor, AutoProcessor):
        processor = cls.from_pretrained(out)
        assert isinstance(processor.image_processor, CLIPImageProcessor)
        batch = processor(text=["a red circle"], images=[torch.zeros(3, 40, 50, dtype=torch.uint8)],
                          return_tensors="pt", padding="max_length")
        assert batch["pixel_values"].shape == (1, 3, 32, 32) and batch["input_ids"].shape == (1, 32)
    data = model.image_data_config()  # timm's evaluation transform: resize to floor(32 / crop_pct), crop 32
    proc = json.loads((out / "preprocessor_config.json").read_text())
    assert proc["crop_size"] == {"height": 32, "width": 32}
    assert proc["size"] == {"shortest_edge": int(32 / data["crop_pct"])}
    assert proc["image_mean"] == list(data["mean"]) and proc["image_std"] == list(data["std"])
    assert proc["resample"] == 3 and proc["do_center_crop"]


def model_tokenizer(run_dir: Path) -> Any:
    from recipe.model.tokenizer import load_tokenizer

    return load_tokenizer(run_dir / "tokenizer")


@pytest.mark.parametrize("key", ["vision_model.encoder.layers.1.mlp.fc2.weight",
                                 "text_model.encoder.layers.0.self_attn.v_proj.weight"])
def test_perturbed_weight_is_detected(make_run: Any, tmp_path: Path, key: str) -> None:
    run_dir, model = tiny_pair(make_run)
    out = export_run(run_dir, "hf", tmp_path / "hf")
    tensors = load_file(out / "model.safetensors")
    tensors[key] = tensors[key] + 1e-3 * torch.randn_like(tensors[key])
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    diffs = compare(model, model_tokenizer(run_dir), out)
    assert diffs["image" if key.startswith("vision") else "text"] > TOL, diffs


def test_bf16_export(make_run: Any, tmp_path: Path) -> None:
    from transformers import CLIPModel

    run_dir, model = tiny_pair(make_run)
    out = export_run(run_dir, "hf", tmp_path / "hf", dtype="bf16")
    tensors = load_file(out / "model.safetensors")
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    hf_model = CLIPModel.from_pretrained(out, dtype=torch.float32).eval()
    diffs = compare(model, model_tokenizer(run_dir), out, hf_model)
    assert max(diffs.values()) < 0.05, diffs


@pytest.mark.parametrize("kwargs, needles", [
    (dict(preset="tiny"), ["vit_tiny_patch16_224", "pre-norm"]),
    (dict(preset="tiny-resnet"), ["resnet18", "VisionTransformer", "BertModel", "clip_text_model"]),
    (dict(image_encoder="vit_base_patch32_clip_224", text_encoder="bert-tiny", image_kwargs=TINY_VIT), ["BertModel"]),
    (dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny", image_kwargs=TINY_VIT,
          text_pooling="mean"), ["pools 'mean'"]),
    (dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny",
          image_kwargs=dict(TINY_VIT, global_pool="avg")), ["pools 'avg'", "final LayerNorm"]),
])
def test_refusals_name_what_is_missing(make_run: Any, tmp_path: Path, kwargs: dict[str, Any],
                                       needles: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    run_dir, model = make_run("refused", **kwargs)
    with pytest.raises(UnsupportedExport) as err:
        export_run(run_dir, "hf", tmp_path / "hf")
    for needle in needles:
        assert needle in str(err.value)
    assert not (tmp_path / "hf").exists()
    with pytest.raises(UnsupportedExport):  # the same answer from the config alone (meta-device model)
        hf.check(model.config, model_tokenizer(run_dir))
    assert export_main([str(run_dir), "--format", "hf", "--out", str(tmp_path / "cli")]) == 1
    assert needles[0] in capsys.readouterr().err and not (tmp_path / "cli").exists()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_round_trip_export_read_export(make_run: Any, tmp_path: Path, variant: str) -> None:
    run_dir, model = tiny_pair(make_run, variant)
    first = export_run(run_dir, "hf", tmp_path / "first")
    assert export.detect_format(first) == "hf"  # what read_pretrained (--init-from) dispatches on
    imported = hf.read(first)
    assert imported.source.startswith("hf") and imported.config.text.pooling == "eos"
    rebuilt = create_model(config=imported.config, tokenizer=imported.tokenizer)
    rebuilt.load_state_dict(imported.state_dict)
    second = export_run(save_run(rebuilt, imported.tokenizer, tmp_path / "rebuilt"), "hf", tmp_path / "second")
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((second / "recipe_export.json").read_text())["token_id_swap"] is None
    configs = [json.loads((d / "config.json").read_text()) for d in (first, second)]
    for part in ("text_config", "vision_config"):
        assert {k: v for k, v in configs[0][part].items() if k != "transformers_version"} == \
               {k: v for k, v in configs[1][part].items() if k != "transformers_version"}
    # the rebuilt model, with the exported tokenizer, embeds as the original run did
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert (model.encode_image(pixels) - rebuilt.encode_image(pixels)).abs().max() <= TOL
        before = model.encode_text(**model_tokenizer(run_dir)(TEXTS))
        after = rebuilt.encode_text(**imported.tokenizer(TEXTS))
    assert (before - after).abs().max() <= TOL


def test_tokenizer_without_post_processor_gets_a_template(tmp_path: Path) -> None:
    """A tokenizer whose backend adds no bos/eos (GPT-2 style; the recipe adds them itself) is exported with
    a post-processor that does, so transformers' tokenizer gives the recipe's ids."""
    from tokenizers import Tokenizer as Backend

    from recipe.model.tokenizer import Tokenizer, train_tokenizer

    trained = train_tokenizer(CAPTIONS * 4, vocab_size=300, context_length=24)
    data = json.loads(trained.backend.to_str())
    data["post_processor"] = None
    bare = Tokenizer(Backend.from_str(json.dumps(data)), trained.special, 24)
    assert bare.backend.encode("a red circle").ids[0] != bare.bos_token_id
    torch.manual_seed(0)
    model = create_model(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny",
                         image_kwargs=TINY_VIT, embed_dim=32, tokenizer=bare).eval()
    out = export_run(save_run(model, bare, tmp_path / "run"), "hf", tmp_path / "hf")
    assert json.loads((out / "tokenizer.json").read_text())["post_processor"]["type"] == "TemplateProcessing"
    diffs = compare(model, bare, out)
    assert max(diffs.values()) <= TOL, diffs


def openai_style_directory(directory: Path, seed: int = 0) -> Path:
    """A CLIPModel saved by transformers itself in OpenAI's layout: QuickGELU, legacy text
    ``eos_token_id`` 2 (argmax pooling), a CLIPTokenizer whose eos is its largest id and pads with eos."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(chars)} | {c + "</w>": i + 256 for i, c in enumerate(chars)}
    vocab |= {"<|startoftext|>": 512, "<|endoftext|>": 513}
    tokenizer = CLIPTokenizer(vocab=vocab, merges=[])
    tokenizer.model_max_length = 16
    config = CLIPConfig(
        text_config=dict(vocab_size=514, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, max_position_embeddings=16, bos_token_id=0, pad_token_id=1,
                         eos_token_id=2),
        vision_config=dict(hidden_size=48, intermediate_size=192, num_hidden_layers=2, num_attention_heads=3,
                           image_size=32, patch_size=8),
        projection_dim=24)
    torch.manual_seed(seed)
    model = CLIPModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


def test_read_transformers_directory(tmp_path: Path) -> None:
    from transformers import AutoTokenizer, CLIPModel

    source = openai_style_directory(tmp_path / "openai")
    imported = hf.read(source)
    image = imported.config.image
    assert image.name == "vit_base_patch32_clip_quickgelu_224" and image.crop_pct == 1.0
    assert image.image_size == 32 and image.timm_kwargs == dict(patch_size=8, embed_dim=48, depth=2, num_heads=3)
    assert imported.config.text.name == "clip-text" and imported.config.text.overrides["eos_token_id"] == 513
    model = create_model(config=imported.config, tokenizer=imported.tokenizer).eval()
    model.load_state_dict(imported.state_dict)
    hf_model = CLIPModel.from_pretrained(source, dtype=torch.float32).eval()
    ours = imported.tokenizer(TEXTS)
    theirs = AutoTokenizer.from_pretrained(source)(TEXTS, padding="max_length", truncation=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    pixels = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        image_emb, text_emb = model.encode_image(pixels), model.encode_text(**ours)
    hf_image, hf_text = hf_features(hf_model, pixels, theirs)
    assert (image_emb - hf_image).abs().max() <= TOL and (text_emb - hf_text).abs().max() <= TOL
    assert torch.equal(model.logit_scale.reshape(()), hf_model.logit_scale)
    # and back: the recipe model exports to the very tensors transformers saved
    out = export_run(save_run(model, imported.tokenizer, tmp_path / "run"), "hf", tmp_path / "back")
    saved, original = load_file(out / "model.safetensors"), hf_model.state_dict()
    assert all(torch.equal(saved[k], original[k]) for k in saved) and set(saved) == set(original)


def test_read_refuses_what_timm_cannot_build(tmp_path: Path) -> None:
    source = openai_style_directory(tmp_path / "openai")
    config = json.loads((source / "config.json").read_text())
    config["vision_config"]["hidden_act"] = "relu"
    (source / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedExport, match="hidden_act 'relu'"):
        hf.read(source)


def test_vit_b_32_preset(make_run: Any, tmp_path: Path) -> None:
    run_dir, model = make_run("vitb32", preset="ViT-B-32")
    out = export_run(run_dir, "hf", tmp_path / "hf")
    diffs = compare(model, model_tokenizer(run_dir), out)
    assert max(diffs.values()) <= TOL, diffs
    config = json.loads((out / "config.json").read_text())
    assert config["vision_config"]["hidden_size"] == 768 and config["vision_config"]["patch_size"] == 32
    assert config["vision_config"]["hidden_act"] == "gelu" and config["text_config"]["num_hidden_layers"] == 12
    proc = json.loads((out / "preprocessor_config.json").read_text())
    assert proc["size"] == {"shortest_edge": 224} and proc["crop_size"] == {"height": 224, "width": 224}


def test_openai_vit_b_32_layout_maps_onto_the_recipe_model() -> None:
    """transformers' default CLIPConfig is OpenAI's ViT-B/32: its weights fit a recipe model built from
    what :func:`hf.read` makes of the config (checked on the meta device: shapes only, no memory)."""
    from transformers import CLIPConfig, CLIPModel

    from recipe.model import CLIPConfig as RecipeConfig
    from recipe.model import TextTowerConfig

    with torch.device("meta"):
        openai = CLIPModel(CLIPConfig())
    image = hf._image_config(openai.config.vision_config, {})
    assert (image.name, image.image_size, image.timm_kwargs, image.crop_pct) == \
           ("vit_base_patch32_clip_quickgelu_224", 224, {}, 1.0)
    text = openai.config.text_config
    overrides = {k: getattr(text, k) for k in hf._TEXT_FIELDS}
    config = RecipeConfig(image=image, text=TextTowerConfig("clip-text", pooling="eos", overrides=overrides),
                          embed_dim=512)
    with torch.device("meta"):
        model = create_model(config=config)
    mapped = hf._from_hf(openai.state_dict(), 12)
    assert {k: v.shape for k, v in mapped.items()} == {k: v.shape for k, v in model.state_dict().items()}
