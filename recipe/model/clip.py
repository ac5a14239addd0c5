"""The two-tower CLIP model, its config dataclasses, presets and :func:`create_model`.

Usage::

    from recipe.model import create_model
    model = create_model("ViT-B-32")        # OpenCLIP ViT-B-32 layout, 151,277,313 parameters
    model = create_model("tiny")            # CPU-sized
    model = create_model(image_encoder="resnet50", text_encoder="bert-base", embed_dim=512)
    img = model.encode_image(pixels)        # [B, embed_dim], L2-normalised
    txt = model.encode_text(input_ids, attention_mask)
    img, txt, scale = model(pixels, input_ids, attention_mask)   # scale = logit_scale.exp()
    model = create_model("tiny", patch_dropout=0.5)   # FLIP: half the patches dropped in training
    model.lock_image_tower(unlocked_groups=1)         # LiT: only the last layer group and image_proj train
    model.lock_text_tower()
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from recipe.model.encoders import ImageTower, TextTower, create_image_tower, create_text_tower

__all__ = [
    "ImageTowerConfig",
    "TextTowerConfig",
    "CLIPConfig",
    "CLIP",
    "PRESETS",
    "create_model",
    "keep_batchnorm_fp32",
    "check_tokenizer_fits",
]

INIT_LOGIT_SCALE = math.log(1 / 0.07)
MAX_LOGIT_SCALE = 100.0
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass
class ImageTowerConfig:
    """Image tower settings (see :func:`recipe.model.encoders.create_image_tower`).

    Attributes:
        name: timm model name.
        weights: Optional local state-dict file.
        image_size: Input resolution for the data pipeline (defaults to the timm model's).
        mean: Normalisation mean override.
        std: Normalisation std override.
        crop_pct: Evaluation centre-crop fraction override (the presets use 1.0, as CLIP).
        timm_kwargs: Extra ``timm.create_model`` keyword arguments.
        patch_dropout: Fraction of patch tokens dropped in training (FLIP; timm ViTs only). A
            training setting without weights, kept apart from ``timm_kwargs`` (the architecture
            that evaluation and export rebuild): in evaluation mode the tower is the same model.
        interpolation: Resampling filter of the data pipeline overriding timm's for the model
            (``bilinear``, ``bicubic``...; e.g. an imported model's own preprocessing).
    """

    name: str
    weights: str | None = None
    image_size: int | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    crop_pct: float | None = None
    timm_kwargs: dict[str, Any] = field(default_factory=dict)
    patch_dropout: float = 0.0
    interpolation: str | None = None


@dataclass
class TextTowerConfig:
    """Text tower settings (see :func:`recipe.model.encoders.create_text_tower`).

    Attributes:
        name: Built-in config name, config JSON path or local model directory.
        pooling: ``eos``, ``cls``, ``mean`` or ``last``; ``None`` picks the architecture's default.
        overrides: transformers config attributes to set (vocab size, token ids...).
        context_length: Sequence length; ``None`` keeps the config's.
        load_weights: Load weights from a directory that has them.
    """

    name: str
    pooling: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)
    context_length: int | None = None
    load_weights: bool = True


@dataclass
class CLIPConfig:
    """Full model settings.

    Attributes:
        image: Image tower settings.
        text: Text tower settings.
        embed_dim: Shared embedding width.
        init_logit_scale: Initial log temperature, ``log(1/0.07)`` as in CLIP.
        max_logit_scale: Clamp for ``exp(logit_scale)``, 100 as in CLIP.
        init_logit_bias: Initial logit bias of the SigLIP loss (``None``: the model has no bias).
        proj_bias: Whether the projections have biases (CLIP's do not).
    """

    image: ImageTowerConfig
    text: TextTowerConfig
    embed_dim: int = 512
    init_logit_scale: float = INIT_LOGIT_SCALE
    max_logit_scale: float = MAX_LOGIT_SCALE
    init_logit_bias: float | None = None
    proj_bias: bool = False

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (for saving with a checkpoint)."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "CLIPConfig":
        """Inverse of :meth:`to_dict`."""
        data = dict(data)
        image = ImageTowerConfig(**data.pop("image"))
        text = TextTowerConfig(**data.pop("text"))
        for key in ("mean", "std"):
            value = getattr(image, key)
            if value is not None:
                setattr(image, key, tuple(value))
        return cls(image=image, text=text, **data)


# --------------------------------------------------------------------------------------------------
# BatchNorm in a half-precision model
# --------------------------------------------------------------------------------------------------

_HALF = (torch.float16, torch.bfloat16)
_STATS = ("running_mean", "running_var")


class _Fp32BatchNorm:
    """Put in front of a BatchNorm class by :func:`keep_batchnorm_fp32` (see there)."""

    def _stats_to_fp32(self) -> None:
        for name in _STATS:
            buf = self._buffers.get(name)  # type: ignore[attr-defined]
            if buf is not None and buf.dtype in _HALF:
                self._buffers[name] = buf.float()  # type: ignore[attr-defined]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        # ``.half()``/``.to(bf16)`` move the statistics but leave them in their (fp32) precision
        before = {n: b for n in _STATS if (b := self._buffers.get(n)) is not None and b.dtype not in _HALF}
        super()._apply(fn, recurse)  # type: ignore[misc]
        for name, old in before.items():
            new = self._buffers[name]  # type: ignore[attr-defined]
            if new.dtype in _HALF:
                self._buffers[name] = old.to(new.device)  # type: ignore[attr-defined]
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self._stats_to_fp32()  # buffers cast by other means (e.g. DeepSpeed's data_types.buffer_dtype)
        params = self._parameters  # type: ignore[attr-defined]
        half = {n: p for n, p in params.items() if p is not None and p.dtype in _HALF}
        if not half:
            return super().forward(x)  # type: ignore[misc]
        try:  # fp32 views of the affine parameters for this call (autograd casts their gradients back)
            params.update({n: p.float() for n, p in half.items()})
            return super().forward(x)  # type: ignore[misc]
        finally:
            params.update(half)


_FP32_BATCHNORM_CLASSES: dict[type, type] = {}


def keep_batchnorm_fp32(module: nn.Module) -> nn.Module:
    """Makes every BatchNorm layer of ``module`` work whatever dtype the module is cast to.

    DeepSpeed's bf16/fp16 modes cast parameters only and keep buffers in fp32, so a BatchNorm layer
    would see half-precision input, weight and bias next to fp32 running statistics, a combination
    ``torch.batch_norm`` rejects (``expected scalar type BFloat16 but found Float``). Every
    ``nn.modules.batchnorm._BatchNorm`` (timm's ``BatchNormAct2d`` included) is given a class that

    * computes with fp32 views of its affine parameters (the parameters themselves keep their
      dtype, so ZeRO's flat partitions and the optimizer groups are unchanged), and fp32 running
      statistics: torch's mixed-precision batch norm, which returns the input's dtype and updates
      the fp32 statistics;
    * keeps the running statistics fp32 under ``.half()``, ``.bfloat16()`` or ``.to(dtype)``
      (momentum updates of half statistics would be lost to rounding), and converts statistics that
      reach it in half precision otherwise.

    A full-precision model computes exactly as before. Returns ``module`` (changed in place).
    """
    for m in module.modules():
        if not isinstance(m, nn.modules.batchnorm._BatchNorm) or isinstance(m, _Fp32BatchNorm):
            continue
        cls = type(m)
        if cls not in _FP32_BATCHNORM_CLASSES:
            name = f"Fp32Stats{cls.__name__}"
            name += f"_{len(_FP32_BATCHNORM_CLASSES)}" if name in globals() else ""  # another module's namesake
            new = type(cls.__name__, (_Fp32BatchNorm, cls), {"__module__": __name__, "__qualname__": name})
            globals()[name] = _FP32_BATCHNORM_CLASSES[cls] = new  # found by pickle in this process
        m.__class__ = _FP32_BATCHNORM_CLASSES[cls]
        m._stats_to_fp32()
    return module


class CLIP(nn.Module):
    """Two towers, linear projections to a shared width, L2 normalisation and a learnable
    temperature stored in log space.

    Attributes:
        visual: The image tower.
        text: The text tower.
        image_proj: Linear map from ``visual.width`` to ``embed_dim``.
        text_proj: Linear map from ``text.width`` to ``embed_dim``.
        logit_scale: one-element parameter, ``log`` of the logit multiplier. Shape ``(1,)`` rather
            than OpenCLIP's 0-d: DeepSpeed's initial model broadcast views every parameter as bytes,
            which fails for a 0-d half-precision tensor.
        config: The :class:`CLIPConfig` the model was built from.
    """

    def __init__(self, visual: ImageTower, text: TextTower, config: CLIPConfig) -> None:
        super().__init__()
        self.config = config
        self.visual = visual
        self.text = text
        self.image_proj = nn.Linear(visual.width, config.embed_dim, bias=config.proj_bias)
        self.text_proj = nn.Linear(text.width, config.embed_dim, bias=config.proj_bias)
        # OpenCLIP's projection init: N(0, width^-1/2).
        nn.init.normal_(self.image_proj.weight, std=visual.width**-0.5)
        nn.init.normal_(self.text_proj.weight, std=text.width**-0.5)
        for proj in (self.image_proj, self.text_proj):
            if proj.bias is not None:
                nn.init.zeros_(proj.bias)
        self.logit_scale = nn.Parameter(torch.full((1,), float(config.init_logit_scale)))
        if config.init_logit_bias is not None:  # the SigLIP loss's learnable bias
            self.logit_bias = nn.Parameter(torch.full((1,), float(config.init_logit_bias)))
        else:
            self.logit_bias = None
        self.max_log_logit_scale = math.log(config.max_logit_scale)
        keep_batchnorm_fp32(self)  # BatchNorm towers train and evaluate on every precision route

    @property
    def embed_dim(self) -> int:
        """Width of the shared embedding space."""
        return self.config.embed_dim

    @property
    def context_length(self) -> int:
        """Longest token sequence the text tower takes."""
        return self.text.context_length

    def image_data_config(self) -> dict[str, Any]:
        """timm data config of the image tower (``input_size``, ``mean``, ``std``, ...)."""
        return self.visual.data_config()

    def encode_image(self, pixels: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        """Image embeddings ``[B, embed_dim]``, L2-normalised unless ``normalize=False``."""
        features = self.image_proj(self.visual(pixels))
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        normalize: bool = True,
    ) -> torch.Tensor:
        """Text embeddings ``[B, embed_dim]``, L2-normalised unless ``normalize=False``.

        ``attention_mask`` defaults to the non-pad tokens (see ``TextTower.default_attention_mask``).
        """
        features = self.text_proj(self.text(input_ids, attention_mask))
        return F.normalize(features, dim=-1) if normalize else features

    def forward(
        self,
        pixels: torch.Tensor,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, ...]:
        """Returns ``(image_features, text_features, logit_scale.exp())``, and ``logit_bias`` after them when
        the model has one (SigLIP): the loss takes them in this order. (The optimizer clamps ``logit_scale``
        to ``[0, log(max_logit_scale)]``: :func:`recipe.training.optimizer.build_optimizer`.)"""
        out = self.encode_image(pixels), self.encode_text(input_ids, attention_mask), self.logit_scale.exp()
        # the bias as a computed tensor, not the leaf parameter: DeepSpeed hooks the forward's outputs
        return out if self.logit_bias is None else (*out, self.logit_bias.clone())

    @torch.no_grad()
    def clamp_logit_scale_(self) -> None:
        """Clamps ``logit_scale`` in place to ``[0, log(max_logit_scale)]``; call after every step.

        Under ZeRO-3 the parameter is partitioned: gather it first (``deepspeed.zero.GatheredParameters``
        with ``modifier_rank``) or clamp the partition the optimizer owns.
        """
        self.logit_scale.clamp_(0.0, self.max_log_logit_scale)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing on both towers (the transformers tower only in training mode)."""
        self.visual.set_grad_checkpointing(enable)
        self.text.set_grad_checkpointing(enable)

    def image_layer_ids(self) -> tuple[dict[str, int], int]:
        """Layer id of every image parameter (``visual.trunk.*`` and ``image_proj.*``) and the number of ids.

        The ids are timm's fine parameter groups (``group_matcher(coarse=False)``, as OpenCLIP's
        ``TimmModel.lock`` and timm's layer-wise decay use them) numbered from 0, with ``image_proj`` in
        the last group. ViT: 0 = patch and position embeddings, class token, pre-norm; ``i + 1`` =
        ``blocks.i``; the final norm with the last block. ConvNeXt: 0 = stem, then one id per block (a
        stage's downsampling with its first block), then ``head.norm``. ResNet: the stem, then one id
        per block. Parameters the matcher leaves out get the last id.

        Raises:
            ValueError: the timm model defines no layer groups (``group_matcher``).
        """
        from timm.models import group_parameters

        trunk = self.visual.trunk
        if not hasattr(trunk, "group_matcher"):
            raise ValueError(f"timm model {self.visual.name!r} defines no layer groups (group_matcher)")
        ids = group_parameters(trunk, trunk.group_matcher(coarse=False), reverse=True)
        count = max(ids.values()) + 1
        out = {f"visual.trunk.{name}": i for name, i in ids.items()}
        out.update({f"image_proj.{name}": count - 1 for name, _ in self.image_proj.named_parameters()})
        return out, count

    def lock_image_tower(self, unlocked_groups: int = 0) -> None:
        """Freezes the image tower (LiT): ``requires_grad=False``, hence no gradients and no optimizer
        state, and its BatchNorm layers stay in evaluation mode (running statistics unchanged) whatever
        :meth:`train` sets.

        ``unlocked_groups`` leaves the last N layer groups of :meth:`image_layer_ids` trainable
        (OpenCLIP's convention for timm towers): 0 freezes the whole tower and ``image_proj``; 1 trains
        ``image_proj`` and the last group (a ViT's last block and final norm); 2 also the group before...
        A BatchNorm layer is kept in evaluation mode when its parameters are all frozen.

        Raises:
            ValueError: ``unlocked_groups`` is negative or exceeds the number of groups, or (N > 0) the
                tower has no layer groups.
        """
        image = [n for n, _ in self.named_parameters() if n.startswith(("visual.", "image_proj."))]
        if unlocked_groups < 0:
            raise ValueError(f"unlocked_groups must be >= 0, got {unlocked_groups}")
        frozen = set(image)
        if unlocked_groups:
            ids, count = self.image_layer_ids()
            if unlocked_groups > count:
                raise ValueError(f"image tower {self.visual.name!r} has {count} layer groups; cannot leave "
                                 f"{unlocked_groups} unlocked")
            frozen = {n for n in image if ids[n] < count - unlocked_groups}
        for name, p in self.named_parameters():
            if name in frozen:
                p.requires_grad_(False)
        norms = []
        for name, m in self.visual.trunk.named_modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                own = [f"visual.trunk.{name}.{k}" for k, _ in m.named_parameters(recurse=False)]
                if all(k in frozen for k in own) and (own or not unlocked_groups):
                    norms.append(name)
        self.visual.frozen_norms = norms
        self.visual.train(self.visual.training)

    def lock_text_tower(self) -> None:
        """Freezes the text tower and ``text_proj`` (no gradients, no optimizer state)."""
        for p in (*self.text.parameters(), *self.text_proj.parameters()):
            p.requires_grad_(False)


def _vit_b_32() -> CLIPConfig:
    return CLIPConfig(
        image=ImageTowerConfig(
            "vit_base_patch32_clip_224",
            mean=OPENAI_CLIP_MEAN,
            std=OPENAI_CLIP_STD,
            crop_pct=1.0,
        ),
        text=TextTowerConfig("clip-text"),
        embed_dim=512,
    )


def _tiny() -> CLIPConfig:
    return CLIPConfig(
        image=ImageTowerConfig(
            "vit_tiny_patch16_224",
            crop_pct=1.0,
            timm_kwargs=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2),
        ),
        text=TextTowerConfig("clip-text-tiny"),
        embed_dim=64,
    )


def _tiny_clip() -> CLIPConfig:
    """The ``tiny`` preset's sizes in CLIP's ViT layout (timm ``vit_*_clip_*``: pre-norm, no patch-embedding
    bias, LayerNorm eps 1e-5): exports exactly to open_clip and Hugging Face. It keeps ``tiny``'s pixel
    normalisation (mean and std 0.5): with CLIP's the demo trained measurably worse (final loss 3.16 against
    3.01, retrieval R@1 0.018 against 0.025, means of 4 seeds), with 0.5 as well as ``tiny``."""
    return CLIPConfig(
        image=ImageTowerConfig(
            "vit_base_patch32_clip_224",
            mean=(0.5, 0.5, 0.5),
            std=(0.5, 0.5, 0.5),
            crop_pct=1.0,
            timm_kwargs=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2),
        ),
        text=TextTowerConfig("clip-text-tiny"),
        embed_dim=64,
    )


def _tiny_cnn(image: str, text: str, **timm_kwargs: Any) -> CLIPConfig:
    """A CPU-sized preset with a 32-pixel CNN image tower (four one-block stages)."""
    image_cfg = ImageTowerConfig(image, image_size=32, crop_pct=1.0, timm_kwargs=timm_kwargs)
    return CLIPConfig(image=image_cfg, text=TextTowerConfig(text), embed_dim=64)


PRESETS: dict[str, Callable[[], CLIPConfig]] = {
    "ViT-B-32": _vit_b_32,
    "tiny": _tiny,
    "tiny-clip": _tiny_clip,
    "tiny-resnet": functools.partial(
        _tiny_cnn, "resnet18", "bert-tiny", layers=(1, 1, 1, 1), channels=(16, 32, 64, 128), stem_width=16
    ),
    "tiny-convnext": functools.partial(
        _tiny_cnn, "convnext_atto", "roberta-tiny", depths=(1, 1, 1, 1), dims=(16, 32, 64, 128)
    ),
}
"""Preset name -> function returning a fresh :class:`CLIPConfig`.

``ViT-B-32`` reproduces OpenCLIP's ViT-B-32 (timm ``vit_base_patch32_clip_224`` + a 12-layer,
width-512, 8-head, context-77, 49,408-token CLIP text transformer, embed 512). The ``tiny*`` presets
run on CPU: 32x32 images, 2-layer width-64 text towers with a 4,096-token vocabulary. ``tiny-clip`` (the
demo's, ``launch.sh``) is ``tiny`` with a CLIP-style ViT (pre-norm, no patch bias), so that it
exports to open_clip and Hugging Face alike; ``tiny``'s plain ViT exports to open_clip only. All presets
evaluate with ``crop_pct=1.0`` (resize the shorter side, centre crop), as CLIP does.
"""


def _builder_kwargs(settings: ImageTowerConfig | TextTowerConfig, *leave_out: str) -> dict[str, Any]:
    """A tower's settings as its builder's keyword arguments (every field but ``name`` and ``leave_out``:
    the fields are named as :func:`create_image_tower` / :func:`create_text_tower` name them)."""
    skip = ("name", *leave_out)
    return {f.name: getattr(settings, f.name) for f in dataclasses.fields(settings) if f.name not in skip}


def create_model(
    preset: str | None = None,
    *,
    config: CLIPConfig | None = None,
    image_encoder: str | None = None,
    text_encoder: str | os.PathLike | None = None,
    embed_dim: int | None = None,
    image_weights: str | os.PathLike | None = None,
    image_size: int | None = None,
    image_kwargs: dict[str, Any] | None = None,
    text_pooling: str | None = None,
    text_overrides: dict[str, Any] | None = None,
    context_length: int | None = None,
    text_load_weights: bool | None = None,
    tokenizer: Any | None = None,
    init_logit_scale: float | None = None,
    max_logit_scale: float | None = None,
    init_logit_bias: float | None = None,
    patch_dropout: float | None = None,
) -> CLIP:
    """Builds a :class:`CLIP` model from a preset, a config, or encoder names.

    Keyword arguments override the preset (or ``config``). Giving ``image_encoder`` or
    ``text_encoder`` replaces that tower's settings wholesale (the preset's timm kwargs or text
    overrides would not fit another architecture); ``image_kwargs``/``text_overrides`` then apply
    to the new tower. Without a preset or config both encoder names are required.

    Args:
        preset: A :data:`PRESETS` key.
        config: A full :class:`CLIPConfig` (e.g. from a checkpoint), instead of a preset.
        image_encoder: timm model name.
        text_encoder: Built-in text config name, config JSON path or local model directory.
        embed_dim: Shared embedding width.
        image_weights: Local state-dict file for the image tower.
        image_size: Input resolution of the image tower and its data config (replaces a preset's
            ``img_size``; see :func:`recipe.model.encoders.create_image_tower`).
        image_kwargs: Extra ``timm.create_model`` keyword arguments (merged into the preset's).
        text_pooling: ``eos``, ``cls``, ``mean`` or ``last``.
        text_overrides: transformers config attributes (merged into the preset's).
        context_length: Text context length.
        text_load_weights: Whether to load weights from a text directory that has them.
        tokenizer: A :class:`recipe.model.tokenizer.Tokenizer`: its vocabulary size and special-token ids
            are written into the text config (unless the tower loads pretrained weights, in which case
            they are checked against it) and its context length is used when none is given.
        init_logit_scale: Initial ``logit_scale`` (log space).
        max_logit_scale: Clamp of ``exp(logit_scale)``.
        init_logit_bias: Initial logit bias; gives the model a learnable ``logit_bias`` (SigLIP).
        patch_dropout: Fraction of image patch tokens dropped in training (FLIP; timm ViT towers only,
            ``ValueError`` for others); recorded in ``config.image.patch_dropout``.

    Returns:
        The model, with the resolved config in ``model.config``.
    """
    if config is not None and preset is not None:
        raise ValueError("give a preset or a config, not both")
    if config is not None:
        cfg = copy.deepcopy(config)
    elif preset is not None:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
        cfg = PRESETS[preset]()
    else:
        if image_encoder is None or text_encoder is None:
            raise ValueError("without a preset, give both image_encoder and text_encoder")
        cfg = CLIPConfig(image=ImageTowerConfig(image_encoder), text=TextTowerConfig(str(text_encoder)))
    if image_encoder is not None and image_encoder != cfg.image.name:
        cfg.image = ImageTowerConfig(image_encoder)
    if text_encoder is not None and str(text_encoder) != cfg.text.name:
        cfg.text = TextTowerConfig(str(text_encoder))
    if embed_dim is not None:
        cfg.embed_dim = int(embed_dim)
    if image_weights is not None:
        cfg.image.weights = str(image_weights)
    if image_size is not None:
        cfg.image.image_size = int(image_size)
        if "img_size" in cfg.image.timm_kwargs:  # a preset's fixed input size follows the new size
            cfg.image.timm_kwargs = {**cfg.image.timm_kwargs, "img_size": int(image_size)}
    if image_kwargs:
        cfg.image.timm_kwargs = {**cfg.image.timm_kwargs, **image_kwargs}
    if text_pooling is not None:
        cfg.text.pooling = text_pooling
    if text_overrides:
        cfg.text.overrides = {**cfg.text.overrides, **text_overrides}
    if text_load_weights is not None:
        cfg.text.load_weights = bool(text_load_weights)
    if context_length is not None:
        cfg.text.context_length = int(context_length)
    if init_logit_scale is not None:
        cfg.init_logit_scale = float(init_logit_scale)
    if max_logit_scale is not None:
        cfg.max_logit_scale = float(max_logit_scale)
    if init_logit_bias is not None:
        cfg.init_logit_bias = float(init_logit_bias)
    if patch_dropout is not None:
        cfg.image.patch_dropout = float(patch_dropout)

    if tokenizer is not None:
        _apply_tokenizer(cfg, tokenizer)
    sizes = {"embed_dim": cfg.embed_dim, "image_size": cfg.image.image_size, "context_length": cfg.text.context_length}
    for name, value in sizes.items():
        if value is not None and value < 1:  # embed_dim 0 would train at loss ln(batch), learning nothing
            raise ValueError(f"{name} must be >= 1, got {value}")

    visual = create_image_tower(cfg.image.name, **_builder_kwargs(cfg.image, "timm_kwargs"), **cfg.image.timm_kwargs)
    text = create_text_tower(cfg.text.name, **_builder_kwargs(cfg.text))
    if tokenizer is not None:
        check_tokenizer_fits(text, tokenizer)
    return CLIP(visual, text, cfg)


def _text_tower_has_weights(text: TextTowerConfig) -> bool:
    from recipe.model.encoders import resolve_text_config

    return text.load_weights and resolve_text_config(text.name)[1] is not None


def _apply_tokenizer(cfg: CLIPConfig, tokenizer: Any) -> None:
    if cfg.text.context_length is None:
        cfg.text.context_length = int(tokenizer.context_length)
    if not _text_tower_has_weights(cfg.text):
        cfg.text.overrides = {**cfg.text.overrides, **tokenizer.text_config_overrides()}


def check_tokenizer_fits(text: TextTower, tokenizer: Any) -> None:
    """Raises ``ValueError`` when ``tokenizer`` produces ids or lengths ``text`` cannot take."""
    vocab = int(text.config.vocab_size)
    if tokenizer.vocab_size > vocab:
        raise ValueError(f"tokenizer has {tokenizer.vocab_size} tokens but the text tower only {vocab}")
    if tokenizer.context_length > text.context_length:
        raise ValueError(
            f"tokenizer context length {tokenizer.context_length} exceeds the text tower's {text.context_length}"
        )
    if text.pooling == "eos" and text.eos_token_id != tokenizer.eos_token_id:
        raise ValueError(
            f"text tower pools at eos id {text.eos_token_id} but the tokenizer's eos id is {tokenizer.eos_token_id}"
        )
