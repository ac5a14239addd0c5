"""Optimizer parameter groups for the CLIP model, following the CLIP paper's training details.

Weight decay ("decoupled weight decay regularization ... to all weights that are not gains or
biases", Radford et al. 2021) applies to:

* every weight matrix and convolution kernel (projections included),
* embedding tables: token, position and type embeddings, timm's ``pos_embed``/``cls_token``
  (they are weights, neither gains nor biases; ``decay_embeddings=False`` exempts them).

No decay for:

* gains: the parameters of normalisation layers (LayerNorm, BatchNorm, GroupNorm, RMSNorm, ...)
  and layer-scale factors (any parameter with fewer than 2 dimensions that is not a bias),
* biases (names ending in ``bias``),
* the logit scale.

Precision: the text tower is marked ``master_weights=False`` (half-precision weights updated with
stochastic rounding), the image tower ``master_weights=True`` (an fp32 master copy), the logit scale
``master_weights=True``. All of this is configurable. The groups carry the keys
``optim.SRAdamW`` reads (``weight_decay``, ``master_weights``, optionally ``lr`` and
``state_dtype``) plus a ``name`` and an ``lr_scale``; torch optimizers keep unknown keys, so the
groups also work with ``torch.optim.AdamW``.

Learning rates: ``lr_scale`` is the group's multiplier of the schedule's learning rate (the training
loop sets ``lr = lr_at(step) * lr_scale``): the tower's scale (``image_lr_scale``, ``text_lr_scale``;
``--image-lr``/``--text-lr`` over ``--lr``) times, with ``layer_decay`` d, the layer-wise decay of the
image tower: its parameters are split by layer id ``l`` of ``L`` (:meth:`recipe.model.CLIP.image_layer_ids`,
timm's fine layer groups: 0 = a ViT's patch/position embeddings and class token, ``i + 1`` = block
``i``, the last block with the final norm and ``image_proj``) into groups ``image.layer<l>.decay`` /
``image.layer<l>.no_decay`` with scale ``d ** (L - 1 - l)``: the last group (last block, head and
projection) learns at the tower's rate, each group before it ``d`` times slower (timm's, BEiT's
convention). A ViT with 2 blocks and d = 0.5: block 1 (+ norm, projection) x1, block 0 x0.5, the
embeddings x0.25.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["param_groups", "tower_of", "is_no_decay", "locked_parameters", "group_layout"]

_TOWER_PREFIXES = {
    "visual.": "image",
    "image_proj.": "image",
    "text.": "text",
    "text_proj.": "text",
}


def tower_of(name: str) -> str:
    """``"image"``, ``"text"``, ``"logit_scale"`` or ``"logit_bias"`` for a :class:`recipe.model.CLIP` parameter name.

    Raises:
        ValueError: a parameter outside the known parts (so none is silently dropped).
    """
    if name in ("logit_scale", "logit_bias"):  # the loss's temperature, SigLIP's bias: a group each
        return name
    for prefix, tower in _TOWER_PREFIXES.items():
        if name.startswith(prefix):
            return tower
    raise ValueError(f"parameter {name!r} belongs to no known part of the CLIP model")


def _is_norm(module: nn.Module) -> bool:
    if isinstance(module, (nn.LayerNorm, nn.GroupNorm, nn.LocalResponseNorm, nn.modules.batchnorm._NormBase)):
        return True
    # Norms outside torch (e.g. LlamaRMSNorm, T5LayerNorm) own 1-d gains, caught by the ndim rule.
    return hasattr(nn, "RMSNorm") and isinstance(module, nn.RMSNorm)


def _is_embedding(module: nn.Module, local_name: str, param: torch.Tensor) -> bool:
    if isinstance(module, nn.Embedding):
        return True
    # Free-standing learned tokens/tables, e.g. timm's pos_embed, cls_token, reg_token.
    if isinstance(module, (nn.Linear, nn.modules.conv._ConvNd)) or _is_norm(module):
        return False
    return param.ndim >= 2 and ("embed" in local_name or "token" in local_name)


def is_no_decay(module: nn.Module, local_name: str, param: torch.Tensor, decay_embeddings: bool = True) -> bool:
    """Whether a parameter is exempt from weight decay (gain, bias, or embedding when asked).

    Args:
        module: The module that owns the parameter directly.
        local_name: The parameter's name within ``module`` (e.g. ``"weight"``).
        param: The parameter.
        decay_embeddings: When ``False``, embedding tables are exempt too.
    """
    if local_name.endswith("bias"):
        return True
    if _is_norm(module) or param.ndim < 2:
        return True
    if not decay_embeddings and _is_embedding(module, local_name, param):
        return True
    return False


def param_groups(
    model: nn.Module,
    weight_decay: float,
    *,
    text_master_weights: bool = False,
    image_master_weights: bool = True,
    logit_scale_master_weights: bool = True,
    decay_embeddings: bool = True,
    image_lr: float | None = None,
    text_lr: float | None = None,
    logit_scale_lr: float | None = None,
    text_state_dtype: torch.dtype | None = None,
    image_state_dtype: torch.dtype | None = None,
    image_lr_scale: float = 1.0,
    text_lr_scale: float = 1.0,
    layer_decay: float | None = None,
    trainable: set[str] | None = None,
) -> list[dict[str, Any]]:
    """Splits a :class:`recipe.model.CLIP` model's trainable parameters into optimizer groups.

    Groups (empty ones are left out), each with ``name``, ``params``, ``weight_decay``,
    ``master_weights`` and ``lr_scale``, and ``lr`` / ``state_dtype`` when given:

    * ``image.decay`` / ``image.no_decay``: image tower and ``image_proj`` (with ``layer_decay``:
      ``image.layer<l>.decay`` / ``image.layer<l>.no_decay`` for each layer id ``l``, in order),
    * ``text.decay`` / ``text.no_decay``: text tower and ``text_proj``,
    * ``logit_scale``: never decayed (the logit scale, and SigLIP's logit bias).

    Parameters with ``requires_grad=False`` (a locked tower) are left out: no optimizer state.
    ``trainable`` (parameter names) replaces that test: the groups another lock setting gives, e.g. a
    checkpoint's (:func:`locked_parameters`).

    Args:
        model: The CLIP model.
        weight_decay: Decay of the decayed groups.
        text_master_weights: fp32 master copy for the text tower (default ``False``: its weights
            are kept in half precision and updated with stochastic rounding).
        image_master_weights: fp32 master copy for the image tower (default ``True``).
        logit_scale_master_weights: fp32 master copy for the logit scale.
        decay_embeddings: Decay embedding tables (CLIP: yes, they are weights).
        image_lr: Learning rate of the image groups (default: the optimizer's).
        text_lr: Learning rate of the text groups.
        logit_scale_lr: Learning rate of the logit-scale group.
        text_state_dtype: Optimizer state dtype of the text groups (``state_dtype`` key).
        image_state_dtype: Optimizer state dtype of the image groups.
        image_lr_scale: ``lr_scale`` of the image groups (before layer decay).
        text_lr_scale: ``lr_scale`` of the text groups.
        layer_decay: Layer-wise decay of the image tower's ``lr_scale`` (see the module), ``None``
            for none (one pair of image groups).
        trainable: Names of the parameters to group (default: those with ``requires_grad``).

    Returns:
        The list of group dicts, each trainable parameter in exactly one.

    Raises:
        ValueError: a parameter outside the image tower, text tower, projections and logit scale; a
            ``layer_decay`` outside ``(0, 1]`` or for an image tower without layer groups.
    """
    settings = {
        "image": dict(master_weights=image_master_weights, lr=image_lr, state_dtype=image_state_dtype),
        "text": dict(master_weights=text_master_weights, lr=text_lr, state_dtype=text_state_dtype),
        "logit_scale": dict(master_weights=logit_scale_master_weights, lr=logit_scale_lr, state_dtype=None),
    }
    settings["logit_bias"] = settings["logit_scale"]  # its own group: the optimizer clamps the scale's only
    scales = {"image": float(image_lr_scale), "text": float(text_lr_scale), "logit_scale": 1.0, "logit_bias": 1.0}
    image_keys = ["image.decay", "image.no_decay"]
    layer_of: dict[str, int] = {}
    if layer_decay is not None:
        if not 0.0 < layer_decay <= 1.0:
            raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
        layer_of, count = model.image_layer_ids()  # type: ignore[operator]
        image_keys = [f"image.layer{i}.{kind}" for i in range(count) for kind in ("decay", "no_decay")]
        scales.update({f"image.layer{i}": image_lr_scale * layer_decay ** (count - 1 - i) for i in range(count)})
    buckets: dict[str, list[torch.Tensor]] = {}
    seen: set[int] = set()
    for module_name, module in model.named_modules():
        for local_name, param in module.named_parameters(recurse=False):
            full_name = f"{module_name}.{local_name}" if module_name else local_name
            if id(param) in seen or not (param.requires_grad if trainable is None else full_name in trainable):
                continue
            seen.add(id(param))
            tower = tower_of(full_name)
            part = f"image.layer{layer_of[full_name]}" if tower == "image" and layer_of else tower
            if tower in ("logit_scale", "logit_bias"):
                key = tower
            elif is_no_decay(module, local_name, param, decay_embeddings):
                key = f"{part}.no_decay"
            else:
                key = f"{part}.decay"
            buckets.setdefault(key, []).append(param)

    groups = []
    for key in (*image_keys, "text.decay", "text.no_decay", "logit_scale", "logit_bias"):
        if key not in buckets:
            continue
        tower = key.split(".")[0]
        group: dict[str, Any] = {
            "name": key,
            "params": buckets[key],
            "weight_decay": float(weight_decay) if key.endswith(".decay") else 0.0,
            "master_weights": bool(settings[tower]["master_weights"]),
            "lr_scale": float(scales[key.rpartition(".")[0] if "." in key else key]),
        }
        if settings[tower]["lr"] is not None:
            group["lr"] = float(settings[tower]["lr"])
        if settings[tower]["state_dtype"] is not None:
            group["state_dtype"] = settings[tower]["state_dtype"]
        groups.append(group)
    return groups


def locked_parameters(model: nn.Module, lock_image: bool, unlocked_groups: int = 0, lock_text: bool = False) -> set[str]:
    """Names of the parameters ``--lock-image`` (with ``--lock-image-unlocked-groups`` N) and ``--lock-text``
    freeze in a :class:`recipe.model.CLIP` model, without freezing them: what
    :meth:`recipe.model.CLIP.lock_image_tower` and :meth:`recipe.model.CLIP.lock_text_tower` select (the
    image tower and ``image_proj`` but for the last N layer groups of :meth:`recipe.model.CLIP.image_layer_ids`;
    the text tower and ``text_proj``). A resume whose lock flags differ from its checkpoint's rebuilds the
    checkpoint's groups from it (:mod:`recipe.run.regroup`).

    Raises:
        ValueError: ``unlocked_groups`` negative or beyond the tower's layer groups.
    """
    names = [n for n, _ in model.named_parameters()]
    out: set[str] = set()
    if lock_image:
        image = [n for n in names if tower_of(n) == "image"]
        if unlocked_groups < 0:
            raise ValueError(f"unlocked_groups must be >= 0, got {unlocked_groups}")
        if unlocked_groups:
            ids, count = model.image_layer_ids()  # type: ignore[operator]
            if unlocked_groups > count:
                raise ValueError(f"the image tower has {count} layer groups; cannot leave {unlocked_groups} unlocked")
            image = [n for n in image if ids[n] < count - unlocked_groups]
        out.update(image)
    if lock_text:
        out.update(n for n in names if tower_of(n) == "text")
    return out


def group_layout(groups: list[dict[str, Any]], model: nn.Module) -> list[tuple[str, list[str]]]:
    """``[(group name, [parameter names in the group's order]), ...]`` of optimizer groups holding
    ``model``'s own parameters (as :func:`param_groups` returns them, or a ZeRO-0 optimizer's groups)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [(str(g.get("name", i)), [names[id(p)] for p in g["params"]]) for i, g in enumerate(groups)]
