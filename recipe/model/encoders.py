"""Encoder towers for the two-tower CLIP model: timm image towers, transformers text towers, poolers.

Small factory functions keyed by name:

* :func:`create_image_tower` builds any timm model by name (``pretrained=False``, or weights from a
  local state-dict file) with its classifier removed, so it returns pooled features (defined in
  :mod:`recipe.model.image_tower`, with :class:`ImageTower`).
* :func:`create_text_tower` builds any transformers model from a built-in config name
  (:data:`TEXT_CONFIGS`), a config JSON file, a local directory (``from_pretrained`` when weights
  are there, ``from_config`` otherwise) or ``transformers:<model_type>`` (that type's default config;
  :func:`self_contained_text_config` turns a directory's config into such a spec plus overrides), and
  pools its token states as the architecture expects.
* :data:`POOLERS` maps a pooling name (``eos``, ``cls``, ``mean``, ``last``) to a function.

Image towers take FLIP's patch dropout (``patch_dropout``) and keep the BatchNorm layers of a locked
tower in evaluation mode (``ImageTower.frozen_norms``, set by :meth:`recipe.model.CLIP.lock_image_tower`).

Nothing here touches the network: timm is always called with ``pretrained=False`` unless a local
weights file is given, and transformers with ``local_files_only=True``.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

from .image_tower import ImageTower, create_image_tower

logger = logging.getLogger(__name__)

__all__ = [
    "ImageTower",
    "TextTower",
    "TEXT_CONFIGS",
    "POOLERS",
    "create_image_tower",
    "create_text_tower",
    "resolve_text_config",
    "self_contained_text_config",
    "default_pooling",
]

# ---------------------------------------------------------------------------------------------
# Poolers
# ---------------------------------------------------------------------------------------------


def _last_real_position(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Index of the last attended token in each row (the last column without a mask)."""
    if attention_mask is None:
        return torch.full(input_ids.shape[:1], input_ids.shape[1] - 1, device=input_ids.device)
    positions = torch.arange(attention_mask.shape[1], device=attention_mask.device)
    # Largest attended position, robust to left padding.
    return (positions * (attention_mask > 0)).amax(dim=1)


def pool_eos(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | None,
) -> torch.Tensor:
    """State at the first end-of-text token of each row (CLIP's text pooling).

    Rows without ``eos_token_id`` (or when it is ``None``) use the last attended position.
    """
    fallback = _last_real_position(input_ids, attention_mask)
    if eos_token_id is None:
        index = fallback
    else:
        is_eos = input_ids == eos_token_id
        first = is_eos.int().argmax(dim=1)
        index = torch.where(is_eos.any(dim=1), first, fallback)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def pool_last(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """State at the last attended position of each row (decoder-style models)."""
    index = _last_real_position(input_ids, attention_mask)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), index]


def pool_cls(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """State at position 0 (BERT's [CLS])."""
    return hidden[:, 0]


def pool_mean(
    hidden: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    eos_token_id: int | None = None,
) -> torch.Tensor:
    """Mean of the attended token states (sentence-transformers' mean pooling)."""
    if attention_mask is None:
        return hidden.mean(dim=1)
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp_min(1e-9)


Pooler = Callable[[torch.Tensor, torch.Tensor, "torch.Tensor | None", "int | None"], torch.Tensor]

POOLERS: dict[str, Pooler] = {
    "eos": pool_eos,
    "last": pool_last,
    "cls": pool_cls,
    "mean": pool_mean,
}

# Model types whose sequence summary is the end-of-text token, and decoder-only types (last token).
_EOS_POOLED = {"clip_text_model", "clip", "metaclip_2_text_model", "altclip_text_model"}
_LAST_POOLED = {"gpt2", "gpt_neo", "gpt_neox", "gptj", "llama", "mistral", "qwen2", "qwen3", "phi", "opt"}


def default_pooling(config: PretrainedConfig) -> str:
    """The pooling an architecture expects: ``eos`` for CLIP text, ``last`` for decoder-only
    language models, ``cls`` for BERT-like encoders."""
    model_type = getattr(config, "model_type", "")
    if model_type in _EOS_POOLED:
        return "eos"
    if model_type in _LAST_POOLED or getattr(config, "is_decoder", False):
        return "last"
    return "cls"


# ---------------------------------------------------------------------------------------------
# Built-in text configs
# ---------------------------------------------------------------------------------------------


def clip_text_config(
    width: int = 512,
    layers: int = 12,
    heads: int = 8,
    context_length: int = 77,
    vocab_size: int = 49408,
    mlp_ratio: float = 4.0,
    hidden_act: str = "gelu",
    pad_token_id: int = 0,
    bos_token_id: int = 49406,
    eos_token_id: int = 49407,
) -> PretrainedConfig:
    """A ``CLIPTextConfig``; the defaults are OpenCLIP ViT-B-32's text tower (GELU, pad id 0)."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=int(width * mlp_ratio),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=context_length,
        hidden_act=hidden_act,
        layer_norm_eps=1e-5,
        attention_dropout=0.0,
        pad_token_id=pad_token_id,
        bos_token_id=bos_token_id,
        eos_token_id=eos_token_id,
    )


# BERT-like encoders' config field names for (width, layers, heads, MLP width, dropout, attention dropout),
# and their (pad, bos, eos) token ids.
_BERT_FIELDS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "hidden_dropout_prob", "attention_probs_dropout_prob")
_ENCODERS: dict[str, tuple[tuple[str, ...], tuple[int, int, int]]] = {
    "bert": (_BERT_FIELDS, (0, 2, 3)),
    "distilbert": (("dim", "n_layers", "n_heads", "hidden_dim", "dropout", "attention_dropout"), (0, 2, 3)),
    "roberta": (_BERT_FIELDS, (1, 0, 2)),
}


def _encoder_config(model_type: str, width: int, layers: int, heads: int, context_length: int,
                    vocab_size: int) -> PretrainedConfig:
    """A BERT-like encoder's config (:data:`_ENCODERS`): MLP width 4x, no dropout."""
    fields, (pad, bos, eos) = _ENCODERS[model_type]
    # RoBERTa numbers positions from pad_token_id + 1.
    offset = pad + 1 if model_type in _POSITION_OFFSET_BY_PAD else 0
    return AutoConfig.for_model(
        model_type, vocab_size=vocab_size, max_position_embeddings=context_length + offset,
        pad_token_id=pad, bos_token_id=bos, eos_token_id=eos,
        **dict(zip(fields, (width, layers, heads, 4 * width, 0.0, 0.0))),
    )


TEXT_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # OpenCLIP ViT-B-32's text transformer.
    "clip-text": lambda: clip_text_config(),
    "clip-text-tiny": lambda: clip_text_config(width=64, layers=2, heads=2, context_length=32, vocab_size=4096,
                                               bos_token_id=1, eos_token_id=2),
    "bert-base": lambda: _encoder_config("bert", 768, 12, 12, 512, 30522),
    "bert-tiny": lambda: _encoder_config("bert", 64, 2, 2, 32, 4096),
    "distilbert-tiny": lambda: _encoder_config("distilbert", 64, 2, 2, 32, 4096),
    "roberta-tiny": lambda: _encoder_config("roberta", 64, 2, 2, 32, 4096),
}
"""Built-in text tower configs by name. Dropout is 0 (CLIP trains without it)."""

# ---------------------------------------------------------------------------------------------
# Text towers (transformers)
# ---------------------------------------------------------------------------------------------

_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)

# Model types whose position ids start after the padding index.
_POSITION_OFFSET_BY_PAD = {"roberta", "xlm-roberta", "camembert", "xlm-roberta-xl", "longformer"}


def _position_offset(config: PretrainedConfig) -> int:
    if getattr(config, "model_type", "") in _POSITION_OFFSET_BY_PAD:
        return int(config.pad_token_id or 0) + 1
    return 0


def resolve_text_config(spec: str | os.PathLike | PretrainedConfig) -> tuple[PretrainedConfig, Path | None]:
    """Turns a text-tower spec into a config and, where weights exist, the directory holding them.

    Args:
        spec: A :data:`TEXT_CONFIGS` name, a config JSON file (with ``model_type``), a local model
            directory, ``transformers:<model_type>`` (:data:`MODEL_TYPE_PREFIX`: that type's default
            config), or a ``PretrainedConfig``.

    Returns:
        ``(config, weights_dir)``; ``weights_dir`` is ``None`` when the model is built from config.

    Raises:
        FileNotFoundError: a path-like spec that does not exist.
        ValueError: an unknown name or a JSON file without ``model_type``.
    """
    if isinstance(spec, PretrainedConfig):
        return spec, None
    text = str(spec)
    if text in TEXT_CONFIGS:
        return TEXT_CONFIGS[text](), None
    if text.startswith(MODEL_TYPE_PREFIX):  # a model type's defaults (the overrides give the rest)
        try:
            return AutoConfig.for_model(text[len(MODEL_TYPE_PREFIX):]), None
        except ValueError:
            raise ValueError(f"text tower {text!r}: {text[len(MODEL_TYPE_PREFIX):]!r} is no transformers model type "
                             "of this transformers version") from None
    path = Path(text)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"text tower directory {path} has no config.json")
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        has_weights = any((path / f).is_file() for f in _WEIGHT_FILES)
        return config, (path if has_weights else None)
    if path.is_file():
        with open(path) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "model_type" not in data:
            raise ValueError(f"{path}: a text config JSON needs a 'model_type' entry")
        data = dict(data)
        return AutoConfig.for_model(data.pop("model_type"), **data), None
    if path.suffix == ".json" or os.sep in text:
        raise FileNotFoundError(f"text tower config not found: {path}")
    raise ValueError(f"unknown text tower {text!r}; built-in names: {sorted(TEXT_CONFIGS)}, or give a path")


#: Text-tower spec prefix of a transformers model type's default config (``transformers:bert``).
MODEL_TYPE_PREFIX = "transformers:"
#: Config entries that describe where a config came from, not the model.
_PROVENANCE_KEYS = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype")


def self_contained_text_config(config: PretrainedConfig) -> tuple[str, dict[str, Any]]:
    """``(spec, overrides)`` that rebuild ``config`` (e.g. a local directory's) without reading any file:
    ``transformers:<model_type>`` and every entry of the config class that differs from its default.
    Entries the class does not declare (legacy keys of older transformers versions, such as
    ``gradient_checkpointing``) are not carried: the model classes of this version do not read them.

    Raises:
        ValueError: The config's model type is unknown to this transformers version, or the spec does not
            rebuild it.
    """
    model_type = getattr(config, "model_type", "")
    spec = f"{MODEL_TYPE_PREFIX}{model_type}"
    base = resolve_text_config(spec)[0]
    wanted, defaults = config.to_dict(), base.to_dict()
    overrides = {k: v for k, v in wanted.items()
                 if k not in _PROVENANCE_KEYS and k != "model_type" and hasattr(base, k) and defaults.get(k) != v}
    _apply_overrides(base, overrides)
    rebuilt = base.to_dict()
    differ = sorted(k for k in rebuilt if k not in _PROVENANCE_KEYS and wanted.get(k, rebuilt[k]) != rebuilt[k])
    if differ:
        raise ValueError(f"{spec} with overrides does not rebuild the config: {differ}")
    return spec, overrides


def _text_submodel_config(config: PretrainedConfig) -> PretrainedConfig:
    """A full CLIP config (text + vision) reduces to its text part."""
    if getattr(config, "model_type", "") == "clip":
        return config.text_config
    return config


def _apply_overrides(config: PretrainedConfig, overrides: dict[str, Any]) -> None:
    for key, value in overrides.items():
        if not hasattr(config, key):
            raise ValueError(f"{type(config).__name__} has no attribute {key!r}")
        setattr(config, key, value)


class TextTower(nn.Module):
    """A transformers model plus a pooler: ``(input_ids, attention_mask) -> pooled [B, width]``.

    Attributes:
        transformer: The transformers model (e.g. ``CLIPTextModel``, ``BertModel``).
        pooling: Pooling name, a key of :data:`POOLERS`.
        width: Hidden width of the pooled states.
        context_length: The longest sequence the tower takes.
        eos_token_id, pad_token_id: Token ids from the config (``None`` when absent).
    """

    def __init__(self, transformer: nn.Module, pooling: str, context_length: int) -> None:
        super().__init__()
        if pooling not in POOLERS:
            raise ValueError(f"unknown pooling {pooling!r}; choose from {sorted(POOLERS)}")
        self.transformer = transformer
        self.pooling = pooling
        self.context_length = int(context_length)
        config = transformer.config
        self.width = int(config.hidden_size)
        eos = getattr(config, "eos_token_id", None)
        self.eos_token_id = eos[0] if isinstance(eos, (list, tuple)) else eos
        self.pad_token_id = getattr(config, "pad_token_id", None)

    @property
    def config(self) -> PretrainedConfig:
        """The transformers config of the tower."""
        return self.transformer.config

    def default_attention_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Mask of non-pad tokens; all ones when the pad id is unknown or equals the eos id."""
        if self.pad_token_id is None or self.pad_token_id == self.eos_token_id:
            return torch.ones_like(input_ids)
        return (input_ids != self.pad_token_id).long()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled states of ``input_ids`` ``[B, L]`` (``L <= context_length``)."""
        if input_ids.shape[1] > self.context_length:
            raise ValueError(f"sequence length {input_ids.shape[1]} exceeds context length {self.context_length}")
        if attention_mask is None:
            attention_mask = self.default_attention_mask(input_ids)
        out = self.transformer(input_ids=input_ids, attention_mask=attention_mask)
        return POOLERS[self.pooling](out.last_hidden_state, input_ids, attention_mask, self.eos_token_id)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Turns transformers' activation checkpointing on or off (effective in training mode)."""
        model = self.transformer
        if enable:
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable()
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        elif hasattr(model, "activation_checkpointing_disable"):
            model.activation_checkpointing_disable()
        else:
            model.gradient_checkpointing_disable()


def create_text_tower(
    spec: str | os.PathLike | PretrainedConfig,
    *,
    pooling: str | None = None,
    overrides: dict[str, Any] | None = None,
    context_length: int | None = None,
    load_weights: bool = True,
    dtype: torch.dtype = torch.float32,
) -> TextTower:
    """Builds a transformers text tower.

    Args:
        spec: A :data:`TEXT_CONFIGS` name, a config JSON file, a local model directory, or a config.
        pooling: A :data:`POOLERS` key; defaults to :func:`default_pooling` of the config.
        overrides: Config attributes to set before building (e.g. ``vocab_size``,
            ``eos_token_id`` from the tokenizer). Unknown attributes are an error.
        context_length: Sequence length the tower must take. When built from a config the position
            table is sized to it; with pretrained weights it must fit the existing table.
        load_weights: Load weights when ``spec`` is a directory holding them; ``False`` builds the
            same architecture randomly initialised.
        dtype: Parameter dtype.

    Returns:
        The tower.

    Raises:
        ValueError: bad pooling, unknown override key, or a context longer than pretrained weights allow.
    """
    config, weights_dir = resolve_text_config(spec)
    config = _text_submodel_config(config)
    _apply_overrides(config, dict(overrides or {}))
    from_weights = weights_dir is not None and load_weights

    offset = _position_offset(config)
    capacity = int(config.max_position_embeddings) - offset
    if context_length is None:
        context_length = capacity
    elif from_weights:
        if context_length > capacity:
            raise ValueError(f"context_length {context_length} exceeds the pretrained tower's {capacity} positions")
    else:
        config.max_position_embeddings = int(context_length) + offset

    if from_weights:
        model_cls = AutoModel
        if getattr(config, "model_type", "") == "clip_text_model":
            from transformers import CLIPTextModel

            model_cls = CLIPTextModel
        transformer = model_cls.from_pretrained(str(weights_dir), config=config, local_files_only=True, dtype=dtype)
    else:
        transformer = AutoModel.from_config(config, dtype=dtype)
    pooling = pooling or default_pooling(config)
    # BERT-style pooler heads (dense + tanh on [CLS]) are unused by our poolers; drop them so
    # every parameter gets a gradient (ZeRO and DDP expect that).
    if getattr(transformer, "pooler", None) is not None:
        transformer.pooler = None
    return TextTower(transformer, pooling, context_length)
