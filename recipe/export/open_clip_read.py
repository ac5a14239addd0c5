"""The way back from the open_clip format (:func:`read`): an open_clip ``local-dir:`` directory into the
recipe's model config, weights and tokenizer, for ``--init-from``. What is exact and what is refused:
:mod:`recipe.export.open_clip`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch

from ..model import encoders
from ..model.clip import (
    CLIP, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD, CLIPConfig, ImageTowerConfig, TextTowerConfig, create_model,
)
from ..model.encoders import TEXT_CONFIGS
from ..model.image_tower import INTERPOLATIONS
from ..model.tokenizer import Tokenizer, load_tokenizer
from .formats import Imported, UnsupportedExport
from .open_clip import (
    _HF_POOLERS, _NOT_IN_RECIPE, _TIMM_ACTS, _WEIGHT_NAMES, CONFIG_FILE, HF_TEXT_TYPES, Plan, _from_open_clip,
    _model_cfg, _table, check,
)

__all__ = ["read"]

logger = logging.getLogger(__name__)


def _load_tensors(directory: Path) -> dict[str, torch.Tensor]:
    paths = [directory / n for n in _WEIGHT_NAMES if (directory / n).is_file()]
    paths = paths or sorted(directory.glob("*.safetensors"))
    if not paths:
        raise UnsupportedExport(f"{directory} holds no open_clip weights ({', '.join(_WEIGHT_NAMES[:2])}...)")
    if paths[0].suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(paths[0]))
    else:
        state = torch.load(paths[0], map_location="cpu", weights_only=True)
        state = state.get("state_dict", state)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    if "text.positional_embedding" in state:  # CustomTextCLIP with a native text tower
        state = {k.removeprefix("text."): v for k, v in state.items()}
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def _refuse(what: str) -> UnsupportedExport:
    return UnsupportedExport(f"cannot read this open_clip model exactly: the recipe lacks {what}")


def _derive_image(vc: dict[str, Any], quick: bool, pre: dict[str, Any]) -> tuple[ImageTowerConfig, bool]:
    mean, std = tuple(pre.get("mean", OPENAI_CLIP_MEAN)), tuple(pre.get("std", OPENAI_CLIP_STD))  # open_clip's defaults
    # the preprocessing's filter (timm's default for the model where none is named) and the training setting
    # --patch-dropout records (both towers of open_clip take it)
    interpolation = pre.get("interpolation") if pre.get("interpolation") in INTERPOLATIONS else None
    extra = dict(interpolation=interpolation, patch_dropout=float(vc.get("patch_dropout") or 0.0))
    if vc.get("timm_model_name"):
        if vc.get("timm_proj", "linear") != "linear":
            raise _refuse(f"timm_proj {vc['timm_proj']!r} (the recipe projects linearly)")
        kwargs = {"drop_path_rate": vc["timm_drop_path"]} if vc.get("timm_drop_path") is not None else {}
        size = vc.get("image_size", 224)
        size = size if isinstance(size, int) else tuple(size)
        return ImageTowerConfig(vc["timm_model_name"], image_size=size, mean=mean, std=std, crop_pct=1.0,
                                timm_kwargs=kwargs, **extra), bool(vc.get("timm_proj_bias", False))
    defaults = dict(layers=12, width=768, head_width=64, mlp_ratio=4.0, patch_size=16, image_size=224, pool_type="tok")
    vc = {**defaults, **vc}
    for key in _NOT_IN_RECIPE:
        if vc.get(key):
            raise _refuse(f"the native vision option {key}")
    if isinstance(vc["layers"], (list, tuple)) or vc["pool_type"] != "tok" or vc.get("pos_embed_type", "learnable") \
            != "learnable" or vc.get("block_type") not in (None, "default"):
        raise _refuse("this vision tower (modified ResNet, non-token pooling or fixed position embeddings)")
    eps = (vc.get("norm_kwargs") or {}).get("eps", 1e-5)
    act = "quick" if quick else "tanh" if (vc.get("act_kwargs") or {}).get("approximate") == "tanh" else "gelu"
    names = {1e-5: "vit_base_patch32_clip_224", 1e-6: "vit_base_patch16_224"}  # their LayerNorm eps
    if eps not in names:
        raise _refuse(f"a timm ViT with LayerNorm eps {eps}")
    kwargs = dict(img_size=vc["image_size"], patch_size=vc["patch_size"], embed_dim=vc["width"], depth=vc["layers"],
                  num_heads=vc["width"] // vc["head_width"], mlp_ratio=vc["mlp_ratio"],
                  pre_norm=not vc.get("no_ln_pre", False))
    if _TIMM_ACTS[act]:
        kwargs["act_layer"] = _TIMM_ACTS[act]
    return ImageTowerConfig(names[eps], mean=mean, std=std, crop_pct=1.0, timm_kwargs=kwargs, **extra), False


def _derive_text(tc: dict[str, Any], quick: bool, hf_dir: Path | None, tok: Tokenizer) -> tuple[TextTowerConfig, bool]:
    if tc.get("hf_model_name"):
        if hf_dir is None or not (hf_dir / "config.json").is_file():
            raise UnsupportedExport(f"hf_model_name {tc['hf_model_name']!r} is no local directory with a config.json "
                                    "(reading needs the Hugging Face text tower's config offline)")
        from transformers import AutoConfig

        hcfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
        pooling = {v: k for k, v in _HF_POOLERS.items()}.get(tc.get("hf_pooler_type", "mean_pooler"))
        if hcfg.model_type not in HF_TEXT_TYPES or pooling is None or tc.get("hf_proj_type", "mlp") != "linear":
            raise _refuse(f"{hcfg.model_type} with {tc.get('hf_pooler_type')} and {tc.get('hf_proj_type', 'mlp')} "
                          "projection (it reads cls_last_hidden_state/mean poolers with a linear projection)")
        ctx = int(hcfg.max_position_embeddings) - encoders._position_offset(hcfg)
        # the config itself, not its directory: a run started from it needs the directory no more
        name, overrides = encoders.self_contained_text_config(hcfg)
        return TextTowerConfig(name, pooling=pooling, overrides=overrides, context_length=ctx), False
    tc = {**dict(context_length=77, vocab_size=49408, width=512, heads=8, layers=12, mlp_ratio=4.0,
                 pool_type="argmax", eos_id=2, pad_id=0), **tc}
    for key in _NOT_IN_RECIPE:
        if tc.get(key):
            raise _refuse(f"the native text option {key}")
    pools = {"eos": "eos", "first": "cls", "argmax": "eos"}
    if tc["pool_type"] not in pools or tc.get("proj_type", "linear") != "linear":
        raise _refuse(f"text pool_type {tc['pool_type']!r} / proj_type {tc.get('proj_type')!r}")
    eos = tc["eos_id"] if tc["pool_type"] == "eos" else tok.eos_token_id
    if tc["pool_type"] == "argmax" and tok.eos_token_id != tok.vocab_size - 1:
        raise _refuse("argmax pooling with an eos token that is not the highest id")
    if eos != tok.eos_token_id:
        raise _refuse(f"a text tower pooling at eos id {eos} with a tokenizer whose eos id is {tok.eos_token_id}")
    tanh = (tc.get("act_kwargs") or {}).get("approximate") == "tanh"
    act = "quick_gelu" if quick else "gelu_pytorch_tanh" if tanh else "gelu"
    width, ctx = int(tc["width"]), int(tc["context_length"])
    overrides = dict(vocab_size=tc["vocab_size"], hidden_size=width, intermediate_size=int(width * tc["mlp_ratio"]),
                     num_hidden_layers=tc["layers"], num_attention_heads=tc["heads"], max_position_embeddings=ctx,
                     hidden_act=act, layer_norm_eps=(tc.get("norm_kwargs") or {}).get("eps", 1e-5),
                     bos_token_id=tok.bos_token_id, eos_token_id=eos, pad_token_id=tok.pad_token_id)
    return TextTowerConfig("clip-text", pooling=pools[tc["pool_type"]], overrides=overrides,
                           context_length=ctx), bool(tc.get("proj_bias", False))


def _strip_paths(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg = json.loads(json.dumps(cfg))
    cfg.get("text_cfg", {}).pop("hf_model_name", None)
    return cfg


def _stored_config(doc: dict[str, Any], hf_dir: Path | None, tok: Tokenizer) -> tuple[CLIPConfig, CLIP] | None:
    """The recipe config a recipe export recorded (and its meta-device model), if it still gives ``model_cfg``."""
    stored = (doc.get("recipe") or {}).get("model_config")
    if not stored:
        return None
    try:
        config = CLIPConfig.from_dict(stored)
        if config.text.name not in TEXT_CONFIGS and not config.text.name.startswith(encoders.MODEL_TYPE_PREFIX):
            if hf_dir is None:
                return None
            # the exported tower's config (overrides applied), held in the config itself: see _derive_text
            from transformers import AutoConfig

            hcfg = AutoConfig.from_pretrained(str(hf_dir), local_files_only=True)
            config.text.name, config.text.overrides = encoders.self_contained_text_config(hcfg)
        with torch.device("meta"):
            model = create_model(config=config, text_load_weights=False)
        plan = check(config, tok, visual=model.visual)
        ctx = doc["model_cfg"]["text_cfg"].get("context_length", tok.context_length)
        if _strip_paths(_model_cfg(plan, model, ctx)) != _strip_paths(doc["model_cfg"]):
            return None
    except (ValueError, KeyError, TypeError, OSError) as e:
        logger.info("recorded recipe config not used: %s", e)
        return None
    return config, model


def read(directory: Path) -> Imported:
    """Reads an open_clip ``local-dir`` directory (this module's exports, or native/timm + CLIP/HF text models
    open_clip writes itself, with a Hugging Face tokenizer in the directory) into the recipe's terms.

    Raises:
        UnsupportedExport: What the recipe cannot represent exactly (or a tokenizer it cannot use).
        FileNotFoundError: No ``open_clip_config.json``.
    """
    directory = Path(directory)
    doc = json.loads((directory / CONFIG_FILE).read_text())
    mc = doc.get("model_cfg")
    if not mc:
        raise UnsupportedExport(f"{directory / CONFIG_FILE} has no model_cfg")
    vc, tc = mc.get("vision_cfg", {}), mc.get("text_cfg", {})
    if mc.get("init_logit_bias") is not None or "multimodal_cfg" in mc:
        raise _refuse("a logit bias (sigmoid loss) or a multimodal decoder (CoCa)")
    if not tc.get("hf_tokenizer_name"):
        raise UnsupportedExport("the directory uses open_clip's built-in CLIP tokenizer (no hf_tokenizer_name); "
                                "the recipe needs a Hugging Face tokenizer (tokenizer.json) in the directory")
    tok = load_tokenizer(directory, context_length=int(tc.get("context_length", 77)))
    sub = (doc.get("recipe") or {}).get("hf_text_dir")
    hf_dir = directory / sub if sub else Path(tc["hf_model_name"]) if tc.get("hf_model_name") else None
    found = _stored_config(doc, hf_dir, tok)
    if found is not None:
        config, model = found
    else:
        quick = bool(mc.get("quick_gelu", False))
        image, image_bias = _derive_image(vc, quick, doc.get("preprocess_cfg") or {})
        text, text_bias = _derive_text(tc, quick, hf_dir, tok)
        if image_bias != text_bias:
            raise _refuse("a projection bias on one tower only (proj_bias covers both projections)")
        config = CLIPConfig(image=image, text=text, embed_dim=int(mc["embed_dim"]), proj_bias=image_bias,
                            init_logit_scale=float(mc.get("init_logit_scale", CLIPConfig.init_logit_scale)))
        with torch.device("meta"):
            model = create_model(config=config, text_load_weights=False)
    trunk = model.visual.trunk
    if vc.get("timm_model_name") and vc.get("timm_pool", "avg") != "":
        gp = getattr(trunk, "global_pool", None) or getattr(getattr(trunk, "head", None), "global_pool", None)
        gp = gp if isinstance(gp, str) or gp is None else getattr(gp, "pool_type", None)
        if vc.get("timm_pool", "avg") != gp:
            raise _refuse(f"timm_pool {vc.get('timm_pool', 'avg')!r} on {vc['timm_model_name']} (its own: {gp!r})")
    vit = {"layers": len(getattr(trunk, "blocks", ())), "ln_pre": not vc.get("no_ln_pre", False)}
    plan = Plan("timm" if vc.get("timm_model_name") else "native", "hf" if tc.get("hf_model_name") else "native",
                vit, config.text.pooling or "cls", None)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    table = _table(plan, shapes, int(tc.get("context_length", 77)))
    tensors = _load_tensors(directory)
    state = _from_open_clip(table, tensors, shapes)
    missing = sorted({oc for oc, _, _ in table} - set(tensors))
    unexpected = sorted(set(tensors) - {oc for oc, _, _ in table})
    for k in [k for k in state if k not in shapes]:  # biases the recipe layer lacks must be zero
        if state.pop(k).abs().max() > 0:
            raise _refuse(f"a bias for {k.rsplit('.', 1)[0]} (nonzero in the open_clip weights)")
    wrong = sorted(k for k in shapes if k not in state or tuple(state[k].shape) != shapes[k])
    if missing or unexpected or wrong:
        raise UnsupportedExport(f"{directory} does not fit the recipe model read from its config: missing "
                                f"{missing[:5]}, unexpected {unexpected[:5]}, mismatched {wrong[:5]}")
    state = {k: state[k].detach().clone().contiguous() for k in shapes}
    return Imported(config, state, tok, f"open_clip {directory}")
