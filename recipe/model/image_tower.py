"""Image towers for the two-tower CLIP model: any timm model by name, without its classifier.

:func:`create_image_tower` builds a timm model (``pretrained=False``, or weights from a local
state-dict file) with ``num_classes=0``, so it returns pooled features, and resolves the timm data
config its images follow (input size, normalisation, crop fraction, interpolation). It takes FLIP's patch dropout
(``patch_dropout``); :class:`ImageTower` keeps the BatchNorm layers of a locked tower in evaluation
mode (``frozen_norms``, set by :meth:`recipe.model.CLIP.lock_image_tower`).

Nothing here touches the network: timm is always called with ``pretrained=False`` unless a local
weights file is given. Both names are importable from :mod:`recipe.model.encoders` too, next to the text
towers.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import timm
import torch
from torch import nn

__all__ = ["ImageTower", "create_image_tower"]

_STATE_DICT_SUFFIXES = (".safetensors", ".pth", ".pt", ".bin", ".ckpt")
#: The resampling filters timm's transforms take by name (PIL's, in PIL's order: ``Image.Resampling`` 0-5).
INTERPOLATIONS = ("nearest", "lanczos", "bilinear", "bicubic", "box", "hamming")


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
    interpolation: str | None = None,
) -> dict[str, Any]:
    """Resolves timm's data config for ``trunk`` and applies the size/normalisation/resampling overrides."""
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
    if interpolation is not None:
        if interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {', '.join(INTERPOLATIONS)}, got {interpolation!r}")
        cfg["interpolation"] = interpolation
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
    interpolation: str | None = None,
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
        interpolation: Resampling filter of the data pipeline's resizes overriding timm's for the model
            (:data:`INTERPOLATIONS`, e.g. ``"bilinear"``; a pretrained model's own preprocessing).
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
    data_config = _image_data_config(trunk, timm_kwargs, image_size, mean, std, crop_pct, interpolation)
    return ImageTower(trunk, name, data_config)
