"""open_clip format: a directory that ``open_clip.create_model_and_transforms("local-dir:DIR")`` and
``open_clip.get_tokenizer("local-dir:DIR")`` load offline (:func:`write`); the way back is
:func:`recipe.export.open_clip_read.read`.

``DIR`` holds ``open_clip_config.json`` (``model_cfg``, ``preprocess_cfg``, and ``recipe``: the run's model
config and export notes, which open_clip ignores), ``open_clip_model.safetensors`` (open_clip's parameter
names, the chosen dtype), the run's tokenizer (``tokenizer.json``, ``tokenizer_config.json``,
``recipe_tokenizer.json``) and, with a Hugging Face text tower, ``hf_text_model/config.json``.

Exact mappings (embeddings equal up to float rounding); anything else raises
:class:`~recipe.export.UnsupportedExport` naming what open_clip lacks:

* image, timm ``VisionTransformer`` (CLIP or plain ViTs, any kwargs) -> native ``VisionTransformer``:
  class token and ``token`` pool, affine LayerNorms of one eps (``norm_kwargs``), ``norm_pre`` or
  ``no_ln_pre``, GELU/tanh-GELU/QuickGELU, no layer scale, qk-norm, registers or projection bias. A
  patch-embedding bias is folded into the patch tokens' positional embedding; absent qkv/MLP biases are zeros.
  open_clip's ViT takes the exported input size only (a timm ``dynamic_img_size`` trunk agrees at that size).
* image, any other timm model -> ``TimmModel`` (``timm_pool`` '' keeps the model's own pool, linear
  projection with or without bias): open_clip calls ``timm.create_model(name)`` bare, so no timm kwargs
  (``drop_path_rate`` -> ``timm_drop_path``; ``img_size`` only at the default) and, for fixed-size models,
  the default input size. ``image_size`` is only the preprocessing size there.
* text, CLIP (``clip_text_model``) -> native ``TextTransformer``: pooling ``eos`` (``pool_type`` eos at the
  tokenizer's eos id; the causal mask and right padding make the padding mask irrelevant there; every row
  the recipe's tokenizer makes has an eos) or ``cls`` (``first``); ``mean`` and ``last`` (open_clip's 'last'
  is the final position, padding included) refused.
* text, BERT/RoBERTa/XLM-RoBERTa -> ``HFTextEncoder``: ``cls`` -> ``cls_last_hidden_state_pooler``, ``mean``
  -> ``mean_pooler`` (masked by ``input_ids != pad_token_id``, as the recipe's tokenizer masks),
  ``hf_proj_type`` linear; ``eos``/``last`` pooling, a projection bias and other model types (DistilBERT,
  GPT-2: not in open_clip's ``arch_dict``) refused. open_clip's ``quick_gelu`` is one switch for both
  native towers: QuickGELU in one of them only is refused unless the image tower can go through TimmModel.

Paths: under ``local-dir:`` open_clip reads the tokenizer from ``DIR`` itself (``hf_tokenizer_name`` is only
a switch, written as ``"."``), so such exports move freely. ``hf_model_name`` goes to
``transformers.AutoConfig.from_pretrained`` unchanged, which would resolve a relative path against the
working directory: it is written as the absolute path of ``DIR/hf_text_model`` where the export lands
(:func:`recipe.export.write_directory`'s rename target, from its temporary name); after moving such a
directory run :func:`relocate` (``python -m recipe.export.open_clip relocate DIR``); reading never needs it.

Tokenizer: the run's own, with a post-processor adding bos/eos where the recipe adds them itself, so
open_clip's ``HFTokenizer`` gives the recipe's ids, truncation included (bos, the first
``context_length - 2`` tokens, eos). It differs where open_clip cleans text first (``ftfy.fix_text``, HTML
unescaping, whitespace runs collapsed and stripped) and for captions holding the bos/eos strings themselves.

Preprocessing: mean, std, size and interpolation are carried with ``resize_mode`` ``shortest`` (resize the
shorter side, centre crop), timm's evaluation transform at ``crop_pct`` 1.0 as the presets use. open_clip
has no crop fraction: another ``crop_pct`` or crop mode (or an interpolation other than bicubic/bilinear)
is exported with a warning, also kept in ``recipe.notes``. The logit scale is carried (0-d in open_clip), and
``--patch-dropout`` as ``vision_cfg.patch_dropout`` (open_clip's native ViT and TimmModel drop patches in training
only, as the recipe's towers do; reading carries it back).

:func:`~recipe.export.open_clip_read.read` takes these directories and open_clip's own ones with native ViT /
timm image towers and native CLIP / HF text towers, and a Hugging Face tokenizer in the directory (open_clip's
built-in CLIP BPE is refused); weights come back fp32. The recorded recipe config is used when it still yields
``model_cfg``; otherwise a native ViT becomes ``vit_base_patch32_clip_224`` (LayerNorm eps 1e-5) or
``vit_base_patch16_224`` (1e-6) with size kwargs (a zero patch bias), a native text tower ``clip-text`` with
overrides, an HF tower the config in ``DIR`` (held in the recipe config itself, ``transformers:<model_type>`` with
overrides, as is a recorded config's HF tower: a run started from the directory never reads it again), ``crop_pct``
1.0, and the interpolation of ``preprocess_cfg`` (timm's default for the model where it has none).
"""

from __future__ import annotations

import copy
import json
import logging
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..model import encoders
from ..model.clip import CLIP, CLIPConfig, ImageTowerConfig, TextTowerConfig
from ..model.encoders import ImageTower, create_image_tower, default_pooling, resolve_text_config
from ..model.tokenizer import Tokenizer
from .formats import UnsupportedExport
from .run import LoadedRun

__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "HF_TEXT_DIR", "Plan", "check", "write", "relocate"]

logger = logging.getLogger(__name__)

CONFIG_FILE = "open_clip_config.json"
WEIGHTS_FILE = "open_clip_model.safetensors"
HF_TEXT_DIR = "hf_text_model"
#: Encoder model types open_clip's HFTextEncoder builds (``open_clip.hf_configs.arch_dict``).
HF_TEXT_TYPES = ("bert", "roberta", "xlm-roberta")
_HF_POOLERS = {"cls": "cls_last_hidden_state_pooler", "mean": "mean_pooler"}
_TEXT_POOLS = {"eos": "eos", "cls": "first"}
#: transformers ``hidden_act`` -> activation kind (``gelu``: exact GELU, ``tanh``: tanh-GELU, ``quick``).
_ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "quick_gelu": "quick"}
_TIMM_ACTS = {"gelu": None, "tanh": "gelu_tanh", "quick": "quick_gelu"}
_TIMM_MAPPED = ("drop_path_rate", "img_size")  # timm kwargs a TimmModel tower can still represent
#: open_clip options the recipe's towers have no counterpart for (read refuses them when set).
_NOT_IN_RECIPE = ("ls_init_value", "final_ln_after_pool", "qk_norm", "scaled_cosine_attn", "scale_heads",
                  "scale_attn_inner", "scale_attn", "scale_fc", "attentional_pool", "embed_cls", "no_causal_mask")
_WEIGHT_NAMES = ("open_clip_model.safetensors", "open_clip_pytorch_model.safetensors", "open_clip_pytorch_model.bin",
                 "open_clip_pytorch_model.pth", "model.safetensors", "pytorch_model.bin", "pytorch_model.pth")


@dataclass
class Plan:
    """How a recipe model maps to open_clip: ``vision`` ``native``/``timm``, ``text`` ``native``/``hf``,
    ``vit`` the native ViT's facts, ``pooling`` and ``act`` (activation kind) of the text tower."""

    vision: str
    text: str
    vit: dict[str, Any] | None
    pooling: str
    act: str | None


def _meta_image_tower(cfg: ImageTowerConfig) -> ImageTower:
    with torch.device("meta"):  # structure only: no memory, no initialisation
        return create_image_tower(cfg.name, image_size=cfg.image_size, mean=cfg.mean, std=cfg.std,
                                  crop_pct=cfg.crop_pct, **cfg.timm_kwargs)


def _text_config(text: TextTowerConfig) -> Any:
    config = encoders._text_submodel_config(resolve_text_config(text.name)[0])
    encoders._apply_overrides(config, dict(text.overrides))
    return config


def _act_kind(module: nn.Module) -> str | None:
    """``gelu``, ``tanh`` or ``quick`` for torch's and timm's GELU, tanh-GELU and QuickGELU modules."""
    from timm.layers import activations as acts

    if type(module) in (nn.GELU, acts.GELU):
        return "tanh" if getattr(module, "approximate", "none") == "tanh" else "gelu"
    return {acts.GELUTanh: "tanh", acts.QuickGELU: "quick"}.get(type(module))


def _native_vit(trunk: nn.Module) -> tuple[dict[str, Any] | None, list[str]]:
    """Facts of a timm ViT that open_clip's native VisionTransformer computes exactly, or what it lacks."""
    from timm.layers import PatchEmbed
    from timm.models.vision_transformer import Attention, Block, Mlp, VisionTransformer

    if type(trunk) is not VisionTransformer:
        return None, [f"only timm VisionTransformer trunks (this is {type(trunk).__name__})"]
    lacks, pe = [], trunk.patch_embed
    if not (trunk.has_class_token and trunk.num_prefix_tokens == 1 and not trunk.no_embed_class
            and trunk.pos_embed is not None):
        lacks.append("no register tokens, no class-token-free or class-excluding position embeddings")
    if trunk.global_pool != "token" or trunk.attn_pool is not None or not isinstance(trunk.fc_norm, nn.Identity):
        lacks.append(f"no global_pool {trunk.global_pool!r} (only the class token after the final norm)")
    if (type(pe) is not PatchEmbed or not isinstance(pe.norm, nn.Identity) or pe.dynamic_img_pad
            or pe.proj.in_channels != 3 or pe.proj.kernel_size != pe.proj.stride):
        lacks.append("only a plain 3-channel patch convolution (no norm, padding or overlap)")
    norms = [trunk.norm_pre, trunk.norm] + [m for b in trunk.blocks for m in (b.norm1, b.norm2)]
    norms = [m for m in norms if not isinstance(m, nn.Identity)]
    if (isinstance(trunk.norm, nn.Identity) or len({m.eps for m in norms}) != 1
            or any(not isinstance(m, nn.LayerNorm) or m.weight is None or m.bias is None for m in norms)):
        lacks.append("only affine LayerNorms of one eps, with a final norm")
    acts = set()
    for b in trunk.blocks:
        if type(b) is not Block or type(b.attn) is not Attention or type(b.mlp) is not Mlp:
            lacks.append(f"no {type(b).__name__}/{type(b.mlp).__name__} blocks")
            break
        if not all(isinstance(m, nn.Identity) for m in (b.ls1, b.ls2, b.attn.q_norm, b.attn.k_norm, b.attn.norm,
                                                         b.mlp.norm)):
            lacks.append("no layer scale, qk-norm or inner norms")
            break
        acts.add(_act_kind(b.mlp.act))
    if None in acts or len(acts) > 1:
        lacks.append(f"no {type(trunk.blocks[0].mlp.act).__name__} activation (GELU, tanh-GELU, QuickGELU only)")
    if lacks:
        return None, lacks
    width, heads, hidden = trunk.embed_dim, trunk.blocks[0].attn.num_heads, trunk.blocks[0].mlp.fc1.out_features
    if width % heads or int(width * (hidden / width)) != hidden:
        return None, [f"no width {width} with {heads} heads and MLP width {hidden}"]
    return dict(width=width, layers=len(trunk.blocks), heads=heads, mlp_ratio=hidden / width,
                patch_size=_size(*pe.patch_size), image_size=_size(*pe.img_size), eps=norms[0].eps,
                ln_pre=not isinstance(trunk.norm_pre, nn.Identity), act=acts.pop()), []


def _timm_lacks(cfg: ImageTowerConfig, visual: ImageTower) -> list[str]:
    """What open_clip's TimmModel lacks to build ``visual``'s trunk (empty: nothing)."""
    import timm

    extra = sorted(k for k in cfg.timm_kwargs if k not in _TIMM_MAPPED)
    if extra:
        return [f"timm keyword arguments (it calls timm.create_model({cfg.name!r}) without {extra})"]
    kwargs = {k: v for k, v in cfg.timm_kwargs.items() if k == "drop_path_rate"}
    with torch.device("meta"):
        ref = timm.create_model(cfg.name, pretrained=False, **kwargs)
        ref.reset_classifier(0)
    if {k: v.shape for k, v in visual.trunk.state_dict().items()} != {k: v.shape for k, v in ref.state_dict().items()}:
        size = tuple(visual.data_config()["input_size"][1:])
        return [f"an input size for {cfg.name} ({size}; it builds the model at timm's default size)"]
    return []


def _text_lacks(tcfg: Any, pooling: str, proj_bias: bool, tokenizer: Tokenizer | None) -> tuple[str, list[str]]:
    kind = getattr(tcfg, "model_type", "")
    lacks = []
    if kind == "clip_text_model":
        if tcfg.hidden_act not in _ACTS:
            lacks.append(f"the activation {tcfg.hidden_act!r} in its native text tower (GELU, tanh-GELU, QuickGELU)")
        if pooling not in _TEXT_POOLS:
            lacks.append(f"{pooling!r} pooling in its native text tower (it pools the first eos token or position 0; "
                         "its 'last' takes the final position, padding included)")
        if int(tcfg.hidden_size * (tcfg.intermediate_size / tcfg.hidden_size)) != tcfg.intermediate_size:
            lacks.append(f"MLP width {tcfg.intermediate_size} for width {tcfg.hidden_size}")
        return "native", lacks
    if kind in HF_TEXT_TYPES:
        if pooling not in _HF_POOLERS:
            lacks.append(f"{pooling!r} pooling in its Hugging Face text towers (they pool cls with "
                         "cls_last_hidden_state_pooler or mean with mean_pooler; no eos or last)")
        if proj_bias:
            lacks.append("a text projection bias in its Hugging Face text towers (HFTextEncoder's linear has none)")
        pad = tcfg.pad_token_id
        if tokenizer is not None and (pad != tokenizer.pad_token_id or pad in (tokenizer.bos_token_id,
                                                                               tokenizer.eos_token_id)):
            lacks.append(f"an attention mask other than input_ids != pad_token_id ({pad}; the tokenizer pads with "
                         f"{tokenizer.pad_token_id})")
        return "hf", lacks
    return "", [f"text towers of model type {kind!r} (it has native CLIP text towers and Hugging Face towers of "
                f"types {', '.join(HF_TEXT_TYPES)})"]


def check(config: CLIPConfig, tokenizer: Tokenizer | None = None, *, visual: ImageTower | None = None) -> Plan:
    """How ``config`` maps to open_clip (see the module docstring); call before writing anything.

    Args:
        config: The recipe model config.
        tokenizer: The run's tokenizer (checks the Hugging Face towers' padding mask).
        visual: The built image tower, if at hand (else a meta-device one is built).

    Raises:
        UnsupportedExport: A tower pair open_clip cannot represent exactly; the message names what it lacks.
    """
    visual = visual if visual is not None else _meta_image_tower(config.image)
    tcfg = _text_config(config.text)
    pooling = config.text.pooling or default_pooling(tcfg)
    text, text_lacks = _text_lacks(tcfg, pooling, config.proj_bias, tokenizer)
    act = _ACTS.get(tcfg.hidden_act) if text == "native" else None
    vit, vit_lacks = _native_vit(visual.trunk)
    if vit is not None and config.proj_bias:
        vit_lacks.append("no image projection bias (proj_bias=True)")
    if vit is not None and text == "native" and (vit["act"] == "quick") != (act == "quick"):
        vit_lacks.append("no QuickGELU in one tower only (quick_gelu is one switch for both native towers)")
    timm_lacks = _timm_lacks(config.image, visual)
    problems = []
    if vit_lacks and timm_lacks:
        problems.append(f"image tower {config.image.name}: open_clip's native VisionTransformer has "
                        f"{'; '.join(vit_lacks)}, and its TimmModel lacks {'; '.join(timm_lacks)}")
    if text_lacks:
        problems.append(f"text tower {config.text.name} ({getattr(tcfg, 'model_type', '?')}, pooling {pooling}): "
                        f"open_clip lacks {'; '.join(text_lacks)}")
    if problems:
        raise UnsupportedExport("cannot export to open_clip exactly: " + " | ".join(problems))
    return Plan("timm" if vit_lacks else "native", text, None if vit_lacks else vit, pooling, act)


def _size(h: int, w: int) -> int | list[int]:
    return int(h) if h == w else [int(h), int(w)]


def _model_cfg(plan: Plan, model: CLIP, context_length: int) -> dict[str, Any]:
    """open_clip ``model_cfg`` (without ``hf_model_name``) of ``model`` under ``plan``."""
    cfg = model.config
    if plan.vision == "native":
        v = plan.vit
        vision = dict(image_size=v["image_size"], layers=v["layers"], width=v["width"],
                      head_width=v["width"] // v["heads"], mlp_ratio=v["mlp_ratio"], patch_size=v["patch_size"],
                      no_ln_pre=not v["ln_pre"], pool_type="tok", norm_kwargs={"eps": v["eps"]})
        if v["act"] == "tanh":
            vision["act_kwargs"] = {"approximate": "tanh"}
    else:
        vision = dict(timm_model_name=cfg.image.name, timm_model_pretrained=False, timm_pool="", timm_proj="linear",
                      timm_proj_bias=cfg.proj_bias, image_size=_size(*model.image_data_config()["input_size"][1:]))
        if "drop_path_rate" in cfg.image.timm_kwargs:
            vision["timm_drop_path"] = cfg.image.timm_kwargs["drop_path_rate"]
    if cfg.image.patch_dropout:  # --patch-dropout: open_clip's ViT and TimmModel take it (FLIP), in training only
        vision["patch_dropout"] = cfg.image.patch_dropout
    tcfg = model.text.config
    text: dict[str, Any] = dict(context_length=context_length, vocab_size=tcfg.vocab_size, hf_tokenizer_name=".")
    if plan.text == "native":
        text.update(width=tcfg.hidden_size, heads=tcfg.num_attention_heads, layers=tcfg.num_hidden_layers,
                    mlp_ratio=tcfg.intermediate_size / tcfg.hidden_size, pool_type=_TEXT_POOLS[plan.pooling],
                    eos_id=model.text.eos_token_id, pad_id=tcfg.pad_token_id, proj_bias=cfg.proj_bias,
                    norm_kwargs={"eps": tcfg.layer_norm_eps})
        if plan.act == "tanh":
            text["act_kwargs"] = {"approximate": "tanh"}
    else:
        text.update(hf_proj_type="linear", hf_pooler_type=_HF_POOLERS[plan.pooling], hf_model_pretrained=False)
    quick = (plan.vit or {}).get("act") == "quick" or plan.act == "quick"
    return dict(embed_dim=cfg.embed_dim, quick_gelu=quick, init_logit_scale=cfg.init_logit_scale,
                vision_cfg=vision, text_cfg=text)


def _text_prefix(keys: Any) -> str:
    """Prefix of the CLIP text model inside ``text.transformer.`` (``text_model.`` on older transformers)."""
    for k in keys:
        m = re.fullmatch(r"(text\.transformer\.(?:.*\.)?)embeddings\.token_embedding\.weight", k)
        if m:
            return m.group(1)
    raise KeyError("no CLIP text embeddings in the state dict")


def _table(plan: Plan, keys: Any, context_length: int) -> list[tuple[str, list[str], str]]:
    """``(open_clip key, recipe keys, op)`` for every open_clip tensor, ``keys`` being the recipe's. Ops: copy,
    T (transpose), cat (q, k, v), flat, pos (patch bias folded into positions), rows:N, scalar."""
    keys = list(keys)
    rows: list[tuple[str, list[str], str]] = [("logit_scale", ["logit_scale"], "scalar")]

    def pair(oc: str, rec: str, names: tuple[str, str] = ("weight", "bias")) -> None:
        rows.extend((f"{oc}{a}", [f"{rec}{b}"], "copy") for a, b in zip(names, ("weight", "bias"), strict=True))

    if plan.vision == "native":
        t, v = "visual.trunk.", "visual."
        rows += [(v + "conv1.weight", [t + "patch_embed.proj.weight"], "copy"),
                 (v + "class_embedding", [t + "cls_token"], "flat"),
                 (v + "positional_embedding", [t + "pos_embed", t + "patch_embed.proj.bias"], "pos"),
                 (v + "proj", ["image_proj.weight"], "T")]
        if plan.vit["ln_pre"]:
            pair(v + "ln_pre.", t + "norm_pre.")
        pair(v + "ln_post.", t + "norm.")
        for i in range(plan.vit["layers"]):
            oc, rec = f"{v}transformer.resblocks.{i}.", f"{t}blocks.{i}."
            pair(oc + "attn.in_proj_", rec + "attn.qkv.", ("weight", "bias"))
            for a, b in (("ln_1", "norm1"), ("attn.out_proj", "attn.proj"), ("ln_2", "norm2"), ("mlp.c_fc", "mlp.fc1"),
                         ("mlp.c_proj", "mlp.fc2")):
                pair(f"{oc}{a}.", f"{rec}{b}.")
    else:
        rows += [(k, [k], "copy") for k in keys if k.startswith("visual.trunk.")]
        rows += [(f"visual.head.proj.{n}", [f"image_proj.{n}"], "copy") for n in ("weight", "bias")
                 if f"image_proj.{n}" in keys]
    if plan.text == "hf":
        rows += [(k, [k], "copy") for k in keys if k.startswith("text.transformer.")]
        rows.append(("text.proj.weight", ["text_proj.weight"], "copy"))
        return rows
    p = _text_prefix(keys)
    rows += [("token_embedding.weight", [p + "embeddings.token_embedding.weight"], "copy"),
             ("positional_embedding", [p + "embeddings.position_embedding.weight"], f"rows:{context_length}")]
    pair("ln_final.", p + "final_layer_norm.")
    if "text_proj.bias" in keys:
        pair("text_projection.", "text_proj.")
    else:
        rows.append(("text_projection", ["text_proj.weight"], "T"))
    n = sum(1 for k in keys if re.fullmatch(re.escape(p) + r"encoder\.layers\.\d+\.layer_norm1\.weight", k))
    for i in range(n):
        oc, rec = f"transformer.resblocks.{i}.", f"{p}encoder.layers.{i}."
        for s in ("weight", "bias"):
            rows.append((f"{oc}attn.in_proj_{s}", [f"{rec}self_attn.{x}_proj.{s}" for x in "qkv"], "cat"))
        for a, b in (("ln_1", "layer_norm1"), ("attn.out_proj", "self_attn.out_proj"), ("ln_2", "layer_norm2"),
                     ("mlp.c_fc", "mlp.fc1"), ("mlp.c_proj", "mlp.fc2")):
            pair(f"{oc}{a}.", f"{rec}{b}.")
    return rows


def _fold_patch_bias(pos_embed: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    pos = pos_embed[0].clone()
    pos[1:] += bias  # conv(x) + b + pos == conv(x) + (pos + b) for every patch token
    return pos


_FORWARD = {"copy": lambda x: x[0], "T": lambda x: x[0].t(), "cat": torch.cat, "flat": lambda x: x[0].reshape(-1),
            "pos": lambda x: _fold_patch_bias(*x), "scalar": lambda x: x[0].reshape(())}


def _to_open_clip(table: list, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    def get(k: str) -> torch.Tensor:
        if k in state:
            return state[k]
        weight = state[k[: -len("bias")] + "weight"]  # a layer without bias: open_clip's has one, zero
        return weight.new_zeros(weight.shape[0])

    out = {}
    for oc, rec, op in table:
        x = [get(k) for k in rec]
        out[oc] = x[0][: int(op[5:])] if op.startswith("rows:") else _FORWARD[op](x)
    return out


def _from_open_clip(table: list, tensors: dict[str, torch.Tensor], shapes: dict[str, tuple]) -> dict[str, Any]:
    out: dict[str, torch.Tensor] = {}
    for oc, rec, op in table:
        if oc not in tensors:
            continue  # reported as missing by the caller
        t = tensors[oc]
        if op == "T":
            out[rec[0]] = t.t()
        elif op == "cat":
            out.update(zip(rec, t.chunk(3), strict=True))
        elif op == "pos":
            out[rec[0]], out[rec[1]] = t[None], torch.zeros(t.shape[-1], dtype=t.dtype)
        elif op in ("flat", "scalar"):
            out[rec[0]] = t.reshape(shapes.get(rec[0], (1,) * (3 if op == "flat" else 1)))
        else:
            out[rec[0]] = t
    return out


def _preprocess(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    size = data["input_size"][1:]
    notes = []
    interp = data.get("interpolation", "bicubic")
    if interp not in ("bicubic", "bilinear"):
        notes.append(f"interpolation {interp!r} is not open_clip's (bicubic or bilinear); bicubic written")
        interp = "bicubic"
    crop_pct, crop_mode = float(data.get("crop_pct", 1.0)), data.get("crop_mode", "center")
    if crop_pct != 1.0 or crop_mode != "center":
        notes.append(f"the recipe evaluates with crop_pct {crop_pct} ({crop_mode}); open_clip has no crop fraction "
                     f"and resizes the shorter side to {tuple(size)} and crops the centre (crop_pct 1.0)")
    cfg = dict(size=_size(*size), mode="RGB", mean=list(data["mean"]), std=list(data["std"]),
               interpolation=interp, resize_mode="shortest", fill_color=0)
    return cfg, notes


def _export_tokenizer(tokenizer: Tokenizer) -> Tokenizer:
    """The run's tokenizer with bos/eos added by its ``tokenizers`` post-processor (HF tokenizers add none else)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors

    backend = Backend.from_str(tokenizer.backend.to_str())
    ids = backend.encode("a").ids
    bos, eos = tokenizer.special.bos, tokenizer.special.eos
    head = "" if ids[:1] == [tokenizer.bos_token_id] else f"{bos} "
    tail = "" if ids[-1:] == [tokenizer.eos_token_id] else f" {eos}"
    if head or tail:
        template = processors.TemplateProcessing(
            single=f"{head}$A{tail}", special_tokens=[(bos, tokenizer.bos_token_id), (eos, tokenizer.eos_token_id)])
        old = backend.post_processor
        backend.post_processor = template if old is None else processors.Sequence([old, template])
    out = Tokenizer(backend, tokenizer.special, tokenizer.context_length)
    for probe in ("", "a photo of a cat", "A  Caption, with punctuation!"):
        if out.backend.encode(probe).ids != tokenizer.encode(probe):
            raise UnsupportedExport(f"a tokenizer post-processor giving the recipe's special tokens ({probe!r})")
    return out


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (t.to(dtype) if t.is_floating_point() else t).detach().contiguous().clone()


def write(run: LoadedRun, out: Path, dtype: torch.dtype, final: Path | None = None) -> None:
    """Writes ``run`` into the empty directory ``out`` as an open_clip ``local-dir:`` directory, weights in
    ``dtype`` (floating tensors; integer buffers keep theirs). ``final`` is where ``out`` will be renamed
    to (:func:`recipe.export.write_directory`; default ``out``): an HF text tower's absolute
    ``hf_model_name`` points there.

    Raises:
        UnsupportedExport: :func:`check` refuses the tower pair (nothing is written then).
    """
    from safetensors.torch import save_file

    model, tokenizer, out = run.model, run.tokenizer, Path(out)
    plan = check(model.config, tokenizer, visual=model.visual)
    tok = _export_tokenizer(tokenizer)
    ctx = tokenizer.context_length
    state = {k: v.detach() for k, v in model.state_dict().items()}
    tensors = _to_open_clip(_table(plan, state, ctx), state)
    model_cfg = _model_cfg(plan, model, ctx)
    preprocess, notes = _preprocess(model.image_data_config())
    if plan.text == "hf":
        model.text.config.save_pretrained(str(out / HF_TEXT_DIR))
        model_cfg["text_cfg"]["hf_model_name"] = str(Path(final or out).absolute() / HF_TEXT_DIR)
    tok.save(out)
    save_file({k: _cast(v, dtype) for k, v in tensors.items()}, str(out / WEIGHTS_FILE), metadata={"format": "pt"})
    stored = copy.deepcopy(model.config)
    stored.image.weights = None  # the weights are in the safetensors file
    recipe = dict(format=1, model_config=stored.to_dict(), hf_text_dir=HF_TEXT_DIR if plan.text == "hf" else None,
                  step=run.step, dtype=str(dtype).replace("torch.", ""), weights=run.provenance(), notes=notes)
    doc = dict(model_cfg=model_cfg, preprocess_cfg=preprocess, recipe=recipe)
    (out / CONFIG_FILE).write_text(json.dumps(doc, indent=2) + "\n")
    for path in out.rglob("*"):  # safetensors writes owner-only files; an export is for others to read
        path.chmod(0o755 if path.is_dir() else 0o644)
    for note in notes:
        warnings.warn(f"open_clip export: {note}", stacklevel=2)


def relocate(directory: str | Path) -> Path:
    """Points ``hf_model_name`` of an exported directory at its current place (after moving or copying it)."""
    directory = Path(directory).absolute()
    path = directory / CONFIG_FILE
    doc = json.loads(path.read_text())
    sub = (doc.get("recipe") or {}).get("hf_text_dir")
    if sub and "hf_model_name" in doc["model_cfg"].get("text_cfg", {}):
        doc["model_cfg"]["text_cfg"]["hf_model_name"] = str(directory / sub)
        path.write_text(json.dumps(doc, indent=2) + "\n")
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "relocate":
        sys.exit("usage: python -m recipe.export.open_clip relocate DIR")
    print(f"hf_model_name now points into {relocate(sys.argv[2])}")
