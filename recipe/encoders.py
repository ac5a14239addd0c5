"""Encoder towers for the two-tower CLIP model: timm image towers, transformers text towers, poolers.

Small factory functions keyed by name:

* :func:`create_image_tower` builds any timm model by name (``pretrained=False``, or weights from a
  local state-dict file) with its classifier removed, so it returns pooled features.
* :func:`create_text_tower` builds any transformers model from a built-in config name
  (:data:`TEXT_CONFIGS`), a config JSON file, or a local directory (``from_pretrained`` when weights
  are there, ``from_config`` otherwise), and pools its token states as the architecture expects.
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

import timm
import torch
from torch import nn
from transformers import AutoConfig, AutoModel, PretrainedConfig

logger = logging.getLogger(__name__)

__all__ = [
    "ImageTower",
    "TextTower",
    "TEXT_CONFIGS",
    "POOLERS",
    "create_image_tower",
    "create_text_tower",
    "resolve_text_config",
    "default_pooling",
]

# ---------------------------------------------------------------------------------------------
# Image towers (timm)
# ---------------------------------------------------------------------------------------------

_STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")


class ImageTower(nn.Module):
    """A timm model without its classifier: ``pixels [B, C, H, W] -> pooled features [B, width]``.

    Attributes:
        trunk: The timm model (created with ``num_classes=0``).
        name: The timm model name.
        width: Width of the pooled features (``trunk.num_features``).
        frozen_norms: Names (in ``trunk``) of BatchNorm layers that :meth:`train` leaves in evaluation
            mode (a locked tower's: see :meth:`recipe.model.CLIP.lock_image_tower`).
    """

    def __init__(self, trunk: nn.Module, name: str, data_config: dict[str, Any]) -> None:
        super().__init__()
        self.trunk = trunk
        self.name = name
        self.width = int(trunk.num_features)
        self._data_config = dict(data_config)
        self.frozen_norms: list[str] = []

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """Returns the pooled (pre-classifier) features of ``pixels``."""
        return self.trunk(pixels)

    def train(self, mode: bool = True) -> ImageTower:
        """Sets training mode, except for the :attr:`frozen_norms`: they stay in evaluation mode
        (normalising with, and keeping, their running statistics)."""
        super().train(mode)
        modules = dict(self.trunk.named_modules())
        for name in self.frozen_norms:
            modules[name].train(False)
        return self

    def data_config(self) -> dict[str, Any]:
        """The timm data config (``input_size``, ``interpolation``, ``mean``, ``std``, ``crop_pct``,
        ``crop_mode``) describing the images this tower expects; pass it to
        ``timm.data.create_transform(**cfg, is_training=...)``."""
        return dict(self._data_config)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Turns activation checkpointing of the timm trunk on or off."""
        if not hasattr(self.trunk, "set_grad_checkpointing"):
            raise ValueError(f"timm model {self.name!r} does not support gradient checkpointing")
        self.trunk.set_grad_checkpointing(enable)


def _image_data_config(
    trunk: nn.Module,
    timm_kwargs: dict[str, Any],
    image_size: int | tuple[int, int] | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
    crop_pct: float | None = None,
) -> dict[str, Any]:
    """Resolves timm's data config for ``trunk`` and applies the size/normalisation overrides."""
    from timm.data import resolve_model_data_config

    cfg = resolve_model_data_config(trunk)
    in_chans = int(timm_kwargs.get("in_chans", cfg["input_size"][0]))
    size = image_size if image_size is not None else timm_kwargs.get("img_size")
    if size is not None:
        h, w = (size, size) if isinstance(size, int) else tuple(size)
        cfg["input_size"] = (in_chans, int(h), int(w))
    elif in_chans != cfg["input_size"][0]:
        cfg["input_size"] = (in_chans, *cfg["input_size"][1:])
    for key, value in (("mean", mean), ("std", std)):
        if value is not None:
            value = tuple(float(v) for v in value)
            if len(value) != in_chans:
                raise ValueError(f"{key} has {len(value)} entries for {in_chans} input channels")
            cfg[key] = value
    if crop_pct is not None:
        if not 0.0 < crop_pct <= 1.0:
            raise ValueError(f"crop_pct must be in (0, 1], got {crop_pct}")
        cfg["crop_pct"] = float(crop_pct)
    return cfg


def _size_pair(size: Any, what: str) -> tuple[int, int]:
    h, w = (size, size) if isinstance(size, int) else tuple(size)
    if min(h, w) < 1:
        raise ValueError(f"{what} must be positive, got {size}")
    return int(h), int(w)


def _fixed_input_size(name: str) -> bool:
    """Whether the timm model's constructor fixes its input size (``img_size``), as timm records it."""
    from timm.models import get_pretrained_cfg

    cfg = get_pretrained_cfg(name) or get_pretrained_cfg(name.split(".")[0])
    return bool(cfg is not None and cfg.fixed_input_size)


def _has_patch_dropout(trunk: nn.Module, prob: float) -> bool:
    """Whether ``trunk`` drops patch tokens at ``prob`` (timm's PatchDropout modules)."""
    from timm.layers import PatchDropout, PatchDropoutWithIndices

    kinds = (PatchDropout, PatchDropoutWithIndices)
    return any(isinstance(m, kinds) and m.prob == prob for m in trunk.modules())


def create_image_tower(
    name: str,
    *,
    weights: str | os.PathLike | None = None,
    image_size: int | tuple[int, int] | None = None,
    mean: tuple[float, ...] | None = None,
    std: tuple[float, ...] | None = None,
    crop_pct: float | None = None,
    patch_dropout: float = 0.0,
    **timm_kwargs: Any,
) -> ImageTower:
    """Builds a timm image tower by model name.

    Args:
        name: Any name ``timm.create_model`` accepts (e.g. ``"vit_base_patch32_clip_224"``,
            ``"resnet50"``, ``"convnext_tiny"``).
        weights: Optional local state-dict file (safetensors or a torch pickle of a state dict, as
            timm writes them). Classifier weights in the file are dropped; every other tensor must
            match the model. Never downloads anything.
        image_size: Input resolution: recorded in the data config (the resolution the data
            pipeline produces) and, for models with a fixed input size (timm's
            ``fixed_input_size``: ViTs, Swin...), passed to the constructor as ``img_size``. A
            different ``img_size`` in ``timm_kwargs`` is an error.
        mean: Per-channel normalisation mean overriding timm's default for the model.
        std: Per-channel normalisation std overriding timm's default for the model.
        crop_pct: Evaluation centre-crop fraction overriding timm's (1.0: resize the shorter side
            to the input size and crop the centre, as CLIP evaluates).
        patch_dropout: Fraction of the patch tokens dropped in training (FLIP), none in evaluation
            mode; prefix tokens (class, registers) are always kept. timm's ``patch_drop_rate``: the
            tower keeps ``max(1, int(N * (1 - patch_dropout)))`` of its ``N`` patches, a new random
            subset per image and forward. Weightless: the state dict does not change. Only for
            towers with patch tokens (timm ViTs, EVA...).
        **timm_kwargs: Passed to ``timm.create_model`` (``img_size``, ``patch_size``, ``depth``,
            ``embed_dim``, ``layers``, ``channels``, ``dims``, ``depths``, ``drop_path_rate``...).

    Returns:
        The tower; ``tower.width`` is its feature width.

    Raises:
        FileNotFoundError: ``weights`` does not exist.
        ValueError: bad arguments, or patch dropout for a tower without patch tokens (an unknown
            model name raises timm's own error).
    """
    for reserved in ("pretrained", "num_classes", "pretrained_cfg_overlay", "pretrained_cfg"):
        if reserved in timm_kwargs:
            raise ValueError(f"{reserved!r} is set by create_image_tower; use weights= for a local file")
    if "patch_drop_rate" in timm_kwargs:  # a training setting, kept out of the architecture's kwargs
        raise ValueError("give patch dropout as patch_dropout=, not as timm's patch_drop_rate")
    create_kwargs: dict[str, Any] = dict(timm_kwargs)
    if image_size is not None:
        size = _size_pair(image_size, "image_size")
        if "img_size" in timm_kwargs:
            if _size_pair(timm_kwargs["img_size"], "img_size") != size:
                raise ValueError(f"image_size {image_size} contradicts timm img_size {timm_kwargs['img_size']}")
        elif _fixed_input_size(name):
            create_kwargs["img_size"] = image_size
    if weights is not None:
        path = Path(weights)
        if not path.is_file():
            raise FileNotFoundError(f"image tower weights not found: {path}")
        # timm loads a pretrained_cfg 'file' locally and drops the classifier when num_classes
        # differs from the checkpoint's.
        create_kwargs.update(pretrained=True, pretrained_cfg_overlay={"file": str(path)})
    else:
        create_kwargs["pretrained"] = False
    if not 0.0 <= patch_dropout < 1.0:
        raise ValueError(f"patch_dropout must be in [0, 1), got {patch_dropout}")
    if patch_dropout > 0:
        create_kwargs["patch_drop_rate"] = float(patch_dropout)
    no_patches = f"patch dropout needs an image tower with patch tokens (a timm ViT); {name!r} has none"
    try:
        trunk = timm.create_model(name, num_classes=0, **create_kwargs)
    except TypeError as e:  # ResNet, ConvNeXt...: the constructor takes no patch_drop_rate
        if "patch_drop_rate" in str(e):
            raise ValueError(f"{no_patches} ({e})") from None
        raise
    if patch_dropout > 0 and not _has_patch_dropout(trunk, patch_dropout):
        raise ValueError(f"{no_patches} (no PatchDropout module in its {type(trunk).__name__})")
    data_config = _image_data_config(trunk, timm_kwargs, image_size, mean, std, crop_pct)
    return ImageTower(trunk, name, data_config)


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


def _bert_config(width: int, layers: int, heads: int, context_length: int, vocab_size: int) -> PretrainedConfig:
    from transformers import BertConfig

    return BertConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=context_length,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )


def _distilbert_config(width: int, layers: int, heads: int, context_length: int, vocab_size: int) -> PretrainedConfig:
    from transformers import DistilBertConfig

    return DistilBertConfig(
        vocab_size=vocab_size,
        dim=width,
        n_layers=layers,
        n_heads=heads,
        hidden_dim=4 * width,
        max_position_embeddings=context_length,
        dropout=0.0,
        attention_dropout=0.0,
        pad_token_id=0,
        bos_token_id=2,
        eos_token_id=3,
    )


def _roberta_config(width: int, layers: int, heads: int, context_length: int, vocab_size: int) -> PretrainedConfig:
    from transformers import RobertaConfig

    # RoBERTa numbers positions from pad_token_id + 1.
    return RobertaConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=4 * width,
        max_position_embeddings=context_length + 2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
    )


TEXT_CONFIGS: dict[str, Callable[[], PretrainedConfig]] = {
    # OpenCLIP ViT-B-32's text transformer.
    "clip-text": lambda: clip_text_config(),
    "clip-text-tiny": lambda: clip_text_config(width=64, layers=2, heads=2, context_length=32, vocab_size=4096,
                                               bos_token_id=1, eos_token_id=2),
    "bert-base": lambda: _bert_config(768, 12, 12, 512, 30522),
    "bert-tiny": lambda: _bert_config(64, 2, 2, 32, 4096),
    "distilbert-tiny": lambda: _distilbert_config(64, 2, 2, 32, 4096),
    "roberta-tiny": lambda: _roberta_config(64, 2, 2, 32, 4096),
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
            directory, or a ``PretrainedConfig``.

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
