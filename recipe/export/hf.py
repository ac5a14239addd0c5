"""Hugging Face ``transformers`` CLIP directories: :func:`write` exports a run, :func:`read` imports one.

:func:`write` produces ``config.json`` + ``model.safetensors`` (``transformers.CLIPModel``),
``tokenizer.json`` + ``tokenizer_config.json`` + ``special_tokens_map.json`` (``AutoTokenizer``,
a ``PreTrainedTokenizerFast``/``TokenizersBackend``, which ``CLIPProcessor`` accepts) and
``preprocessor_config.json`` (``CLIPImageProcessor``), so that ``CLIPModel``, ``CLIPProcessor`` and
``AutoTokenizer`` load the directory with ``from_pretrained`` offline.

What is exact (same normalised fp32 embeddings up to float rounding, same logit scale):

* Image towers: timm ``VisionTransformer`` s of the CLIP kind (``vit_*_clip_*``, also ``*_quickgelu_*``):
  class token, learned position embeddings covering it, pre-norm (``norm_pre`` = ``pre_layrnorm``),
  plain blocks (fused ``qkv`` is split into ``q_proj``/``k_proj``/``v_proj``), final norm on the class
  token (``norm`` = ``post_layernorm``), square input and patches, GELU / tanh-GELU / QuickGELU, one
  LayerNorm eps, no patch-embedding bias (timm's pre-norm ViTs have none); missing biases (e.g.
  ``qkv_bias=False``) or norm affines are written as zeros / ones.
* Text towers: the transformers ``CLIPTextModel`` (``clip-text``, ``clip-text-tiny``, CLIP config
  files) pooled at the first eos token; its weights map one to one.
* eos id 2: transformers' ``CLIPTextModel`` pools at ``argmax(input_ids)`` when ``eos_token_id == 2``
  (a legacy rule), which a tokenizer the recipe trains (pad 0, bos 1, eos 2) would break. The export
  then swaps token ids 2 and ``vocab - 1`` (the tokenizer's last id) everywhere: token-embedding rows,
  ``tokenizer.json`` (vocabulary, added tokens, post-processor) and the config's token ids. The
  exported model and tokenizer give the run's embeddings for every text; only the id numbers of those
  two tokens differ from the run's tokenizer (recorded in ``recipe_export.json``).
* Tokenizer: bos + tokens + eos, pad id, context length as ``model_max_length``; with
  ``padding="max_length", truncation=True`` the ids equal the recipe's (truncation keeps eos). A
  post-processor adding bos/eos is installed when the tokenizer has none.
* Preprocessing: ``CLIPImageProcessor`` with the run's mean, std, resample, resize of the shorter
  side to ``floor(size / crop_pct)`` and centre crop (timm's evaluation transform, ``crop_mode``
  ``center``). The parameters are the same; the resampling code differs (transformers resizes tensors,
  timm PIL images), so pixels may differ slightly, and transformers puts the crop at ``floor(margin / 2)``
  where timm rounds half to even: one pixel off for margins of 3 mod 4 (at ``crop_pct`` 0.9 a 32-pixel
  crop's shorter side: 35 - 32).

Refused (:class:`recipe.export.UnsupportedExport`, naming everything missing): non-ViT image towers
(ResNet, ConvNeXt, ...), ViTs without pre-norm (e.g. ``vit_tiny_patch16_224``, the ``tiny`` preset:
``pre_layrnorm`` is always applied and no LayerNorm is the identity), without class token or with
register tokens, other pooling (``avg``, ``map``), ``fc_norm``, layer scale, qk-norm, gated or
SwiGLU blocks, non-square inputs; text towers other than ``CLIPTextModel`` or not eos-pooled;
projection biases; preprocessing ``CLIPImageProcessor`` cannot express.

:func:`read` is the inverse for ``--init-from``: any ``CLIPModel`` directory whose vision tower is
representable by timm's ``vit_base_patch32_clip_224`` (or ``..._quickgelu_224``) with the recipe's
``image_size`` and timm's ``patch_size``/``embed_dim``/``depth``/``num_heads``/``mlp_ratio`` where they
differ from ViT-B/32 (``act_layer`` for tanh-GELU) and LayerNorm eps 1e-5, and the built-in ``clip-text``
tower with the HF text config's fields as overrides (so the run's ``model_config.json`` is self-contained).
The image processor's mean, std, crop fraction and ``resample`` (as the data pipeline's interpolation: PIL's
0-5, ``nearest`` ... ``hamming``) become the image tower's data config.
OpenAI's ViT-B/32 reads as ``vit_base_patch32_clip_quickgelu_224`` with no timm kwargs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..model.clip import CLIP, CLIPConfig, ImageTowerConfig, TextTowerConfig, create_model
from ..model.tokenizer import Tokenizer, load_tokenizer
from .atomic import MARKER
from .formats import Imported, UnsupportedExport
from .run import LoadedRun

logger = logging.getLogger(__name__)

__all__ = ["ExportPlan", "check", "read", "write"]

_V, _T = "visual.trunk.", "text.transformer."
_HV = "vision_model."
_PIL_RESAMPLE = {"nearest": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}
#: timm base names for :func:`read` and their defaults (kwargs that differ are written out).
_TIMM_GELU, _TIMM_QUICKGELU = "vit_base_patch32_clip_224", "vit_base_patch32_clip_quickgelu_224"
_TIMM_DEFAULTS = dict(patch_size=32, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0)
_TEXT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "max_position_embeddings", "hidden_act", "layer_norm_eps", "attention_dropout")
_PROBES = ["a red circle on a white background", "", "A Photo of 2 DOGS, running!", "x " * 200]


@dataclass
class ExportPlan:
    """What :func:`check` found: the transformers sub-configs and the id swap (``None`` or ``(2, last)``)."""

    vision: dict[str, Any] = field(default_factory=dict)
    text: dict[str, Any] = field(default_factory=dict)
    swap: tuple[int, int] | None = None
    add_template: bool = False
    processor: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------


def _activation(module: nn.Module) -> str | None:
    """transformers' name of an activation module, ``None`` when it has no exact counterpart."""
    from timm.layers.activations import GELU, GELUTanh, QuickGELU

    if isinstance(module, nn.GELU):
        return {"none": "gelu", "tanh": "gelu_pytorch_tanh"}.get(module.approximate)
    return {GELU: "gelu", GELUTanh: "gelu_pytorch_tanh", QuickGELU: "quick_gelu"}.get(type(module))


def _identity(module: Any) -> bool:
    return module is None or isinstance(module, nn.Identity)


def _check_image(visual: nn.Module, problems: list[str]) -> dict[str, Any]:
    from timm.layers import Attention, Mlp
    from timm.models.vision_transformer import Block, VisionTransformer

    trunk, name = visual.trunk, f"image tower {visual.name!r}"
    if type(trunk) is not VisionTransformer:
        problems.append(f"{name} is a {type(trunk).__name__}, not a timm VisionTransformer: transformers' "
                        "CLIPVisionModel is a ViT (class token, pre-norm, final norm)")
        return {}
    before = len(problems)
    pe = trunk.patch_embed
    dim = int(trunk.embed_dim)
    if not trunk.has_class_token or trunk.num_prefix_tokens != 1:
        problems.append(f"{name} needs exactly one class token (no register tokens)")
    if trunk.no_embed_class or trunk.pos_embed is None:
        problems.append(f"{name} needs learned position embeddings that include the class token")
    if trunk.global_pool != "token" or trunk.attn_pool is not None or not _identity(trunk.fc_norm):
        problems.append(f"{name} pools {trunk.global_pool!r}: CLIPVisionModel takes the class token (global_pool "
                        "'token', no fc_norm/attention pool)")
    if not isinstance(trunk.norm_pre, nn.LayerNorm):
        problems.append(f"{name} has no pre-norm (timm pre_norm=False): CLIPVisionModel always applies its "
                        "pre_layrnorm; use a CLIP ViT (timm vit_*_clip_*)")
    if not isinstance(trunk.norm, nn.LayerNorm):
        problems.append(f"{name} has no final LayerNorm (CLIPVisionModel's post_layernorm)")
    if trunk.dynamic_img_size or getattr(pe, "dynamic_img_pad", False) or not _identity(getattr(pe, "norm", None)):
        problems.append(f"{name}: dynamic image size/padding or a patch-embedding norm")
    grid_ok = tuple(pe.img_size) == (pe.img_size[0],) * 2 and tuple(pe.patch_size) == (pe.patch_size[0],) * 2
    conv = pe.proj
    if not grid_ok or not isinstance(conv, nn.Conv2d) or tuple(conv.stride) != tuple(pe.patch_size) \
            or tuple(conv.kernel_size) != tuple(pe.patch_size) or any(conv.padding) or not getattr(pe, "flatten", 1):
        problems.append(f"{name}: CLIPVisionModel needs square images and square, non-overlapping patches")
    elif conv.bias is not None:  # timm gives pre-norm ViTs none; refused rather than folded into pos_embed
        problems.append(f"{name} has a patch-embedding bias, which CLIPVisionModel's patch_embedding lacks")
    acts, eps = set(), set()
    for norm in (trunk.norm_pre, trunk.norm):
        if isinstance(norm, nn.LayerNorm):
            eps.add(norm.eps)
    for i, blk in enumerate(trunk.blocks):
        attn, mlp = getattr(blk, "attn", None), getattr(blk, "mlp", None)
        if type(blk) is not Block or type(attn) is not Attention or type(mlp) is not Mlp:
            problems.append(f"{name} block {i} is not a plain pre-norm block (timm Block + Attention + Mlp)")
            break
        if not (_identity(blk.ls1) and _identity(blk.ls2)):
            problems.append(f"{name} uses layer scale, which CLIPEncoderLayer lacks")
            break
        if not (_identity(attn.q_norm) and _identity(attn.k_norm) and _identity(attn.norm) and attn.gate is None
                and _identity(mlp.norm)):
            problems.append(f"{name} uses qk-norm, attention/MLP inner norms or gating, which CLIPAttention lacks")
            break
        if attn.attn_dim != dim or attn.head_dim * attn.num_heads != dim or attn.proj.out_features != dim:
            problems.append(f"{name}: attention width differs from the embedding width")
            break
        if not (isinstance(blk.norm1, nn.LayerNorm) and isinstance(blk.norm2, nn.LayerNorm)):
            problems.append(f"{name}: block norms are not LayerNorms")
            break
        eps.update((blk.norm1.eps, blk.norm2.eps))
        acts.add(_activation(mlp.act))
    if None in acts or len(acts) > 1:
        problems.append(f"{name}: MLP activation must be one of GELU, tanh-GELU, QuickGELU for all blocks")
    if len(eps) > 1:
        problems.append(f"{name}: LayerNorm eps differ ({sorted(eps)}); CLIPVisionConfig has one layer_norm_eps")
    if len(problems) > before:
        return {}
    blk = trunk.blocks[0]
    return dict(hidden_size=dim, intermediate_size=int(blk.mlp.fc1.out_features), num_hidden_layers=len(trunk.blocks),
                num_attention_heads=int(blk.attn.num_heads), num_channels=int(conv.in_channels),
                image_size=int(pe.img_size[0]), patch_size=int(pe.patch_size[0]), hidden_act=acts.pop(),
                layer_norm_eps=float(eps.pop()), attention_dropout=0.0)


def _encode_probe(backend: Any, text: str, add_special_tokens: bool = True) -> list[int]:
    return backend.encode(text, add_special_tokens=add_special_tokens).ids


def _check_text(model: CLIP, tokenizer: Tokenizer, problems: list[str], plan: ExportPlan) -> dict[str, Any]:
    from transformers import CLIPTextModel

    tower = model.text
    cfg = tower.config
    if type(tower.transformer) is not CLIPTextModel:
        problems.append(f"text tower is a {type(tower.transformer).__name__} ({getattr(cfg, 'model_type', '?')}): "
                        "transformers' CLIPModel needs a CLIP text transformer (clip_text_model)")
        return {}
    if tower.pooling != "eos":
        problems.append(f"text tower pools {tower.pooling!r}: CLIPTextModel pools at the first eos token")
    if tower.eos_token_id != tokenizer.eos_token_id:
        problems.append(f"text tower eos id {tower.eos_token_id} differs from the tokenizer's {tokenizer.eos_token_id}")
    if tokenizer.vocab_size > int(cfg.vocab_size) or tokenizer.context_length > int(cfg.max_position_embeddings):
        problems.append("the tokenizer's vocabulary or context is larger than the text tower's")
    # the post-processor must add bos ... eos (as the recipe does), or nothing (then a template is added)
    backend, bos, eos = tokenizer.backend, tokenizer.bos_token_id, tokenizer.eos_token_id
    adds = [_encode_probe(backend, t) != _encode_probe(backend, t, False) for t in _PROBES[:3]]
    wraps = all((ids := _encode_probe(backend, t))[:1] == [bos] and ids[-1:] == [eos] for t in _PROBES[:3])
    if any(adds) and not wraps:
        problems.append("the tokenizer's post-processor adds special tokens other than bos ... eos")
    plan.add_template = not any(adds)
    if tower.eos_token_id == 2:  # transformers' legacy argmax pooling: move eos to the last id
        last = tokenizer.vocab_size - 1
        if last <= 2 or backend.id_to_token(last) is None:
            problems.append("eos id is 2 (transformers pools at argmax(input_ids)) and no last id to swap it with")
        plan.swap = (2, last)
    ids = {k: getattr(tokenizer, f"{k}_token_id") for k in ("bos", "eos", "pad")}
    if plan.swap:
        ids = {k: _swap_id(v, plan.swap) for k, v in ids.items()}
    text = {k: getattr(cfg, k) for k in _TEXT_FIELDS}
    return dict(text, **{f"{k}_token_id": v for k, v in ids.items()})


def _check_processor(data: dict[str, Any], image_size: int | None, problems: list[str]) -> dict[str, Any]:
    chans, h, w = data["input_size"]
    crop_pct, mode = float(data.get("crop_pct") or 0.875), data.get("crop_mode") or "center"
    interp = data["interpolation"]
    if mode != "center" or h != w or interp not in _PIL_RESAMPLE:
        problems.append(f"preprocessing crop_mode {mode!r}, size {h}x{w}, interpolation {interp!r}: "
                        "CLIPImageProcessor resizes the shorter side and centre-crops a square (PIL resample)")
        return {}
    if image_size is not None and h != image_size:
        problems.append(f"preprocessing size {h} differs from the image tower's input size {image_size}")
    return dict(do_resize=True, size={"shortest_edge": math.floor(h / crop_pct)}, resample=_PIL_RESAMPLE[interp],
                do_center_crop=True, crop_size={"height": h, "width": w}, do_rescale=True, rescale_factor=1 / 255,
                do_normalize=True, image_mean=[float(v) for v in data["mean"]],
                image_std=[float(v) for v in data["std"]], do_convert_rgb=chans == 3)


def check(config: CLIPConfig, tokenizer: Tokenizer, model: CLIP | None = None) -> ExportPlan:
    """What the export of a model of ``config`` (built on the meta device when ``model`` is not given)
    writes; raises :class:`UnsupportedExport` listing everything transformers' CLIP cannot represent."""
    if model is None:  # the architecture only: no weight files read, no memory used
        meta_config = dataclasses.replace(config, image=dataclasses.replace(config.image, weights=None))
        with torch.device("meta"):
            model = create_model(config=meta_config, tokenizer=tokenizer, text_load_weights=False)
    problems: list[str] = []
    plan = ExportPlan()
    if config.proj_bias:
        problems.append("the projections have biases; CLIPModel's visual/text_projection have none")
    plan.vision = _check_image(model.visual, problems)
    plan.text = _check_text(model, tokenizer, problems, plan)
    plan.processor = _check_processor(model.image_data_config(), plan.vision.get("image_size"), problems)
    if problems:
        raise UnsupportedExport("cannot export to Hugging Face CLIPModel exactly: " + "; ".join(problems))
    return plan


# ------------------------------------------------------------------------------------------------
# Weights
# ------------------------------------------------------------------------------------------------


def _swap_id(i: int, swap: tuple[int, int] | None) -> int:
    if swap is None:
        return i
    a, b = swap
    return b if i == a else a if i == b else i


def _take(state: dict[str, torch.Tensor], used: set[str], key: str,
          default: torch.Tensor | None = None) -> torch.Tensor:
    if key in state:
        used.add(key)
        return state[key]
    if default is None:
        raise UnsupportedExport(f"the model has no {key!r}")
    return default


def _to_hf(state: dict[str, torch.Tensor], plan: ExportPlan) -> dict[str, torch.Tensor]:
    """The recipe's state dict under CLIPModel's names (raises if a parameter has no place there)."""
    used: set[str] = set()
    dim, layers = plan.vision["hidden_size"], plan.vision["num_hidden_layers"]
    ones, zeros = torch.ones(dim), torch.zeros(dim)
    out: dict[str, torch.Tensor] = {}

    def norm(src: str, dst: str) -> None:
        out[dst + ".weight"] = _take(state, used, src + ".weight", ones)
        out[dst + ".bias"] = _take(state, used, src + ".bias", zeros)

    def linear(src: str, dst: str, width: int) -> None:
        out[dst + ".weight"] = _take(state, used, src + ".weight")
        out[dst + ".bias"] = _take(state, used, src + ".bias", torch.zeros(width))

    emb = _HV + "embeddings."
    out[emb + "class_embedding"] = _take(state, used, _V + "cls_token").reshape(dim)
    out[emb + "position_embedding.weight"] = _take(state, used, _V + "pos_embed").reshape(-1, dim)
    out[emb + "patch_embedding.weight"] = _take(state, used, _V + "patch_embed.proj.weight")
    norm(_V + "norm_pre", _HV + "pre_layrnorm")
    for i in range(layers):
        src, dst = f"{_V}blocks.{i}.", f"{_HV}encoder.layers.{i}."
        qkv_w = _take(state, used, src + "attn.qkv.weight")
        qkv_b = _take(state, used, src + "attn.qkv.bias", torch.zeros(3 * dim))
        for part, w, b in zip(("q", "k", "v"), qkv_w.chunk(3), qkv_b.chunk(3), strict=True):
            # copies: safetensors refuses tensors that share storage
            out[f"{dst}self_attn.{part}_proj.weight"], out[f"{dst}self_attn.{part}_proj.bias"] = w.clone(), b.clone()
        linear(src + "attn.proj", dst + "self_attn.out_proj", dim)
        norm(src + "norm1", dst + "layer_norm1")
        norm(src + "norm2", dst + "layer_norm2")
        linear(src + "mlp.fc1", dst + "mlp.fc1", plan.vision["intermediate_size"])
        linear(src + "mlp.fc2", dst + "mlp.fc2", dim)
    norm(_V + "norm", _HV + "post_layernorm")
    out["visual_projection.weight"] = _take(state, used, "image_proj.weight")
    out["text_projection.weight"] = _take(state, used, "text_proj.weight")
    out["logit_scale"] = _take(state, used, "logit_scale").reshape(())
    for key in [k for k in state if k.startswith(_T)]:
        out["text_model." + key[len(_T):]] = _take(state, used, key)
    if plan.swap:
        key = "text_model.embeddings.token_embedding.weight"
        rows = list(range(out[key].shape[0]))
        a, b = plan.swap
        rows[a], rows[b] = b, a
        out[key] = out[key][rows]
    left = sorted(set(state) - used)
    if left:
        raise UnsupportedExport(f"parameters with no place in transformers' CLIPModel: {left[:8]}")
    return out


def _from_hf(state: dict[str, torch.Tensor], layers: int) -> dict[str, torch.Tensor]:
    """CLIPModel's state dict under the recipe's names (the inverse of :func:`_to_hf` without swap)."""
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        return _take(state, used, key)

    emb = _HV + "embeddings."
    cls = take(emb + "class_embedding")
    out = {_V + "cls_token": cls.reshape(1, 1, -1), _V + "pos_embed": take(emb + "position_embedding.weight")[None],
           _V + "patch_embed.proj.weight": take(emb + "patch_embedding.weight")}
    pairs = [("norm_pre", "pre_layrnorm"), ("norm", "post_layernorm")]
    for i in range(layers):
        src, dst = f"{_HV}encoder.layers.{i}.", f"{_V}blocks.{i}."
        for suffix in ("weight", "bias"):
            out[f"{dst}attn.qkv.{suffix}"] = torch.cat([take(f"{src}self_attn.{p}_proj.{suffix}") for p in "qkv"])
        pairs += [(f"blocks.{i}.{a}", f"encoder.layers.{i}.{b}") for a, b in (
            ("attn.proj", "self_attn.out_proj"), ("norm1", "layer_norm1"), ("norm2", "layer_norm2"),
            ("mlp.fc1", "mlp.fc1"), ("mlp.fc2", "mlp.fc2"))]
    for a, b in pairs:
        for suffix in ("weight", "bias"):
            out[f"{_V}{a}.{suffix}"] = take(f"{_HV}{b}.{suffix}")
    out["image_proj.weight"] = take("visual_projection.weight")
    out["text_proj.weight"] = take("text_projection.weight")
    out["logit_scale"] = take("logit_scale").reshape(1)
    for key in [k for k in state if k.startswith("text_model.")]:
        if not key.endswith("position_ids"):
            out[_T + key[len("text_model."):]] = take(key)
    left = sorted(k for k in set(state) - used if not k.endswith("position_ids"))
    if left:
        raise UnsupportedExport(f"CLIPModel weights the recipe's model has no place for: {left[:8]}")
    return {k: v.detach().to(torch.float32).clone() for k, v in out.items()}


# ------------------------------------------------------------------------------------------------
# Tokenizer
# ------------------------------------------------------------------------------------------------


def _permute_tokenizer_json(data: dict[str, Any], swap: tuple[int, int]) -> None:
    """Swaps two token ids everywhere a ``tokenizer.json`` records ids (in place)."""
    model = data["model"]
    vocab = model.get("vocab")
    if isinstance(vocab, dict):
        model["vocab"] = {tok: _swap_id(i, swap) for tok, i in vocab.items()}
    elif isinstance(vocab, list):  # Unigram: position is the id
        a, b = swap
        if max(a, b) >= len(vocab):
            raise UnsupportedExport("cannot move the eos id: an added token outside a Unigram vocabulary")
        vocab[a], vocab[b] = vocab[b], vocab[a]
        if model.get("unk_id") is not None:
            model["unk_id"] = _swap_id(model["unk_id"], swap)
    else:
        raise UnsupportedExport(f"cannot move the eos id in a {model.get('type')} tokenizer model")
    for token in data.get("added_tokens") or []:
        token["id"] = _swap_id(token["id"], swap)
    if data.get("padding"):
        data["padding"]["pad_id"] = _swap_id(data["padding"]["pad_id"], swap)

    def processor(p: dict[str, Any] | None) -> None:
        if p is None or p["type"] == "ByteLevel":
            return
        if p["type"] == "Sequence":
            for q in p["processors"]:
                processor(q)
        elif p["type"] == "TemplateProcessing":
            for special in p["special_tokens"].values():
                special["ids"] = [_swap_id(i, swap) for i in special["ids"]]
        elif p["type"] in ("BertProcessing", "RobertaProcessing"):
            for key in ("sep", "cls"):
                p[key] = [p[key][0], _swap_id(p[key][1], swap)]
        else:
            raise UnsupportedExport(f"cannot move the eos id in a {p['type']} post-processor")

    processor(data.get("post_processor"))


def _export_backend(tokenizer: Tokenizer, plan: ExportPlan) -> Any:
    """The ``tokenizers.Tokenizer`` to write: bos/eos template where missing, eos moved off id 2."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(tokenizer.backend.to_str())
    if plan.add_template:
        sp = tokenizer.special
        template = processors.TemplateProcessing(
            single=f"{sp.bos} $A {sp.eos}", pair=f"{sp.bos} $A {sp.eos} $B:1 {sp.eos}:1",
            special_tokens=[(sp.bos, tokenizer.bos_token_id), (sp.eos, tokenizer.eos_token_id)])
        old = backend.post_processor
        backend.post_processor = template if old is None else processors.Sequence([old, template])
    if plan.swap:
        data = json.loads(backend.to_str())
        _permute_tokenizer_json(data, plan.swap)
        backend = Backend.from_str(json.dumps(data))
    return backend


def _write_tokenizer(tokenizer: Tokenizer, plan: ExportPlan, out: Path) -> None:
    backend = _export_backend(tokenizer, plan)
    backend.no_padding()
    backend.no_truncation()
    backend.save(str(out / "tokenizer.json"))
    sp = tokenizer.special
    specials = {"bos_token": sp.bos, "eos_token": sp.eos, "pad_token": sp.pad}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **specials, "model_max_length": tokenizer.context_length,
              "model_input_names": ["input_ids", "attention_mask"], "clean_up_tokenization_spaces": False,
              "processor_class": "CLIPProcessor"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps(specials, indent=2) + "\n")


def _verify_tokenizer(tokenizer: Tokenizer, plan: ExportPlan, out: Path) -> None:
    """The exported tokenizer, loaded by ``AutoTokenizer``, must give the run's ids (after the swap)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    got = hf(_PROBES, padding="max_length", truncation=True, return_tensors="pt")
    want = tokenizer(_PROBES)
    ids = want["input_ids"].clone()
    if plan.swap:
        a, b = plan.swap
        ids[want["input_ids"] == a], ids[want["input_ids"] == b] = b, a
    if not (torch.equal(got["input_ids"], ids) and torch.equal(got["attention_mask"], want["attention_mask"])):
        raise UnsupportedExport("the exported tokenizer does not reproduce the run's token ids "
                                f"(e.g. {got['input_ids'][0][:8].tolist()} vs {ids[0][:8].tolist()})")


# ------------------------------------------------------------------------------------------------
# Write and read
# ------------------------------------------------------------------------------------------------


def write(run: LoadedRun, out: Path, dtype: torch.dtype, final: Path | None = None) -> None:
    """Writes ``run`` as a transformers CLIPModel directory into ``out`` (existing, empty), weights in ``dtype``
    (``final``, the directory ``out`` becomes, is not needed: nothing in the export names a path).

    Raises:
        UnsupportedExport: The model cannot be represented exactly (see the module docstring).
    """
    from safetensors.torch import save_file
    from transformers import CLIPConfig as HFConfig
    from transformers import CLIPImageProcessor

    out = Path(out)
    plan = check(run.config, run.tokenizer, run.model)
    state = {k: v.detach().to("cpu") for k, v in run.model.state_dict().items()}
    tensors = {k: v.to(dtype).contiguous() for k, v in _to_hf(state, plan).items()}
    embed = int(run.config.embed_dim)
    hf_config = HFConfig(text_config=dict(plan.text, projection_dim=embed),
                         vision_config=dict(plan.vision, projection_dim=embed), projection_dim=embed,
                         logit_scale_init_value=float(state["logit_scale"].reshape(())))
    hf_config.architectures = ["CLIPModel"]
    hf_config.dtype = dtype
    hf_config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    _write_tokenizer(run.tokenizer, plan, out)
    processor = CLIPImageProcessor(**plan.processor).to_dict()
    processor.update(image_processor_type="CLIPImageProcessor", processor_class="CLIPProcessor")
    (out / "preprocessor_config.json").write_text(json.dumps(processor, indent=2, sort_keys=True) + "\n")
    # the Hugging Face particulars; recipe.export.write_directory adds the source, dtype, weights... to MARKER
    note = {"token_id_swap": list(plan.swap) if plan.swap else None,
            "note": "token ids in token_id_swap are exchanged relative to the run's tokenizer "
                    "(transformers pools CLIP text at argmax(input_ids) when eos_token_id == 2)"}
    (out / MARKER).write_text(json.dumps(note, indent=2) + "\n")
    _verify_tokenizer(run.tokenizer, plan, out)


def _image_config(vision: Any, processor: dict[str, Any]) -> ImageTowerConfig:
    """The timm tower reproducing a CLIPVisionConfig (and the data config of its image processor)."""
    act = vision.hidden_act
    size, patch = vision.image_size, vision.patch_size
    problems = []
    if not isinstance(size, int) or not isinstance(patch, int):
        problems.append(f"image_size {size} / patch_size {patch} must be integers")
    if act not in ("gelu", "quick_gelu", "gelu_pytorch_tanh"):
        problems.append(f"vision hidden_act {act!r} has no timm counterpart (gelu, quick_gelu, gelu_pytorch_tanh)")
    if vision.layer_norm_eps != 1e-5:
        problems.append(f"vision layer_norm_eps {vision.layer_norm_eps} (timm's CLIP ViTs use 1e-5)")
    ratio = vision.intermediate_size / vision.hidden_size
    if int(vision.hidden_size * ratio) != vision.intermediate_size:
        problems.append(f"intermediate_size {vision.intermediate_size} is not a timm mlp_ratio of {vision.hidden_size}")
    if problems:
        raise UnsupportedExport("cannot read the CLIP vision tower as a timm ViT: " + "; ".join(problems))
    values = dict(patch_size=patch, embed_dim=vision.hidden_size, depth=vision.num_hidden_layers,
                  num_heads=vision.num_attention_heads, mlp_ratio=ratio)
    kwargs: dict[str, Any] = {k: v for k, v in values.items() if v != _TIMM_DEFAULTS[k]}
    if vision.num_channels != 3:
        kwargs["in_chans"] = vision.num_channels
    if act == "gelu_pytorch_tanh":
        kwargs["act_layer"] = "gelu_tanh"
    # CLIPImageProcessor's defaults (OpenAI mean/std, shorter side = crop = 224) where the file is silent
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    mean, std = processor.get("image_mean", OPENAI_CLIP_MEAN), processor.get("image_std", OPENAI_CLIP_STD)
    short, crop = processor.get("size", {"shortest_edge": 224}), processor.get("crop_size", {"height": 224})
    short = short.get("shortest_edge") if isinstance(short, dict) else short
    crop = crop.get("height") if isinstance(crop, dict) else crop
    crop_pct = 1.0
    if processor.get("do_center_crop", True) and short and crop and crop <= short:
        crop_pct = crop / short
        while math.floor(crop / crop_pct) < short:  # timm resizes to floor(size / crop_pct)
            crop_pct = math.nextafter(crop_pct, 0.0)
    if not short or crop != size or not processor.get("do_center_crop", True):
        logger.warning("the image processor (crop %s) differs from the recipe's evaluation transform (centre crop of "
                       "%s); the recipe uses its own", crop, size)
    # the processor's PIL filter (CLIPImageProcessor's default: bicubic) resizes the recipe's images too
    resample = processor.get("resample", _PIL_RESAMPLE["bicubic"])
    interpolation = {v: k for k, v in _PIL_RESAMPLE.items()}.get(resample)
    if interpolation is None:
        logger.warning("the image processor's resample %r is no PIL filter (0-5): the recipe resizes bicubic", resample)
        interpolation = "bicubic"
    # image_size (not timm's img_size) so that ``--image-size`` agrees; timm gets it as img_size
    return ImageTowerConfig(_TIMM_QUICKGELU if act == "quick_gelu" else _TIMM_GELU, image_size=size,
                            mean=tuple(mean), std=tuple(std), crop_pct=crop_pct, timm_kwargs=kwargs,
                            interpolation=interpolation)


def read(directory: Path) -> Imported:
    """Reads a transformers CLIPModel directory (ours or OpenAI's layout) into the recipe's terms.

    Raises:
        UnsupportedExport: A tower the recipe cannot reproduce exactly (the message says what).
        FileNotFoundError: No tokenizer in the directory.
    """
    from transformers import CLIPModel

    directory = Path(directory)
    model, info = CLIPModel.from_pretrained(str(directory), local_files_only=True, dtype=torch.float32,
                                            output_loading_info=True)
    missing = [k for k in info.get("missing_keys", []) if not k.endswith("position_ids")]
    if missing:
        raise UnsupportedExport(f"{directory}: weights missing from the checkpoint: {sorted(missing)[:8]}")
    hf = model.config
    text = hf.text_config
    context = int(text.max_position_embeddings)
    tok_config = directory / "tokenizer_config.json"
    saved = json.loads(tok_config.read_text()).get("model_max_length") if tok_config.is_file() else None
    if isinstance(saved, int) and 2 <= saved < context:  # a tokenizer made for a shorter context keeps it
        context = saved
    tokenizer = load_tokenizer(directory, context_length=context)
    eos = tokenizer.eos_token_id
    if text.eos_token_id == 2 and eos != tokenizer.vocab_size - 1:
        raise UnsupportedExport(f"{directory}: the text model pools at argmax(input_ids) (eos_token_id 2) but the "
                                f"tokenizer's eos id {eos} is not its largest id, so no eos pooling reproduces it")
    if text.eos_token_id != 2 and text.eos_token_id != eos:
        raise UnsupportedExport(f"{directory}: the text model pools at token {text.eos_token_id} but the tokenizer "
                                f"ends texts with {eos}")
    processor_file = directory / "preprocessor_config.json"
    processor = json.loads(processor_file.read_text()) if processor_file.is_file() else {}
    overrides = {k: getattr(text, k) for k in _TEXT_FIELDS}
    overrides.update(bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
    config = CLIPConfig(
        image=_image_config(hf.vision_config, processor),
        text=TextTowerConfig("clip-text", pooling="eos", overrides=overrides,
                             context_length=int(text.max_position_embeddings)),
        embed_dim=int(hf.projection_dim),
        init_logit_scale=float(model.logit_scale.detach().reshape(())),
    )
    state = _from_hf(model.state_dict(), int(hf.vision_config.num_hidden_layers))
    return Imported(config, state, tokenizer, f"hf {directory}")
