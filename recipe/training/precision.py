"""Precision modes, read from the DeepSpeed JSON (which owns precision, batch size and ZeRO).

Three modes:

* **bf16** (``"bf16": {"enabled": true, ...}``, ZeRO 1/2/3): DeepSpeed casts the model to bf16.
  With ``bf16_master_weights_and_grads`` + ``bf16_optimizer_states`` the ZeRO partitions handed to
  SRAdamW are bf16: SR groups are updated in place with stochastic rounding and keep bf16 Adam
  states; mastered groups keep an fp32 master (and fp32 states) inside SRAdamW's state, sharded with
  the partition. Without those two flags DeepSpeed keeps its usual fp32 partitions.
* **fp16** (``"fp16": {"enabled": true, ...}`` with ZeRO stage 0): DeepSpeed offers fp16 master
  weights only with its CPU Adam and otherwise wraps a client optimizer in an fp32-master
  ``FP16_Optimizer``. This recipe therefore takes the ``fp16`` section (and ``gradient_clipping``)
  out of the config handed to DeepSpeed, casts the model to fp16 itself, and runs dynamic loss
  scaling with the section's own parameters; the inverse loss scale and the clipping factor reach
  SRAdamW as one gradient multiplier, applied in fp32 inside the update, and steps with inf/NaN
  gradients are skipped by SRAdamW and shrink the scale. There is no ZeRO sharding in this mode,
  and the recipe all-reduces the (scaled, fp16) gradients itself (:mod:`recipe.training.overlap`):
  DeepSpeed's own all-reduce refuses fp16 gradients on CPUs without native fp16 support.
* **bf16 at ZeRO-0** (``"bf16"`` with ``bf16_master_weights_and_grads`` and ZeRO stage 0,
  ``ds_configs/zero0_bf16_sr.json``): the same recipe-managed path as fp16 without loss scaling.
  DeepSpeed's bf16 at stage 0 wraps the client optimizer in an fp32-master ``BF16_Optimizer``, so
  the recipe takes the ``bf16`` section and ``gradient_clipping`` out of the config, casts the model to
  bf16, averages the gradients itself and clips by the multiplier; SRAdamW updates the module's own
  tensors. Replicated weights (DDP-style): it skips ZeRO's per-gradient hooks, flattening,
  bucketing, per-group norms and partition copies, and communicates once per optimizer step (one
  gradient all-reduce, overlapped with the last backward pass by :mod:`recipe.training.overlap`; no
  weight all-gather). The recipe's default for any number of GPUs.
* **The recipe's gradient all-reduce** (both routes above) sums in the JSON's top-level
  ``communication_data_type`` (DeepSpeed's key, taken over like ``gradient_clipping``): ``"bf16"``
  (``zero0_bf16_sr.json``: half the bytes of fp32; the sum is rounded to bf16 along the way, as in
  DeepSpeed's ZeRO-1/2 bf16 reduction), ``"fp32"`` (one rounding per element whatever the world
  size; twice the bytes) or ``"fp16"`` (the fp16 route). Without the key: fp32 for bf16 gradients,
  fp16 for the fp16 route.
* **fp32**: no precision section; everything fp32 (the reference).
"""

from __future__ import annotations

import copy
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "Precision",
    "DynamicLossScaler",
    "resolve_precision",
    "read_ds_config",
    "ConfigError",
    "sum_dtype",
]


class ConfigError(ValueError):
    """An invalid or unsupported configuration."""


@dataclass
class DynamicLossScaler:
    """Dynamic loss scaling with DeepSpeed's ``fp16`` section semantics.

    The scale starts at ``2**initial_scale_power``; an overflow (a skipped step) halves it once
    ``hysteresis`` overflows have been seen since the last change, never below ``min_loss_scale``;
    ``loss_scale_window`` steps without overflow double it.
    """

    scale: float = 2.0**16
    window: int = 1000
    hysteresis: int = 2
    min_scale: float = 1.0
    good_steps: int = 0
    overflows_left: int = 2

    @classmethod
    def from_section(cls, section: dict[str, Any]) -> "DynamicLossScaler":
        if section.get("loss_scale", 0) not in (0, 0.0):
            raise ConfigError("fp16.loss_scale (a static scale) is not supported by the SR fp16 route; use 0 (dynamic)")
        hysteresis = int(section.get("hysteresis", 2))
        return cls(
            scale=2.0 ** int(section.get("initial_scale_power", 16)),
            window=int(section.get("loss_scale_window", 1000)),
            hysteresis=hysteresis,
            min_scale=float(section.get("min_loss_scale", 1)),
            overflows_left=hysteresis,
        )

    def update(self, overflow: bool) -> None:
        if overflow:
            self.good_steps = 0
            self.overflows_left -= 1
            if self.overflows_left <= 0:
                self.scale = max(self.scale / 2, self.min_scale)
                self.overflows_left = self.hysteresis
            return
        self.good_steps += 1
        if self.good_steps % self.window == 0:
            self.scale *= 2
            self.overflows_left = self.hysteresis

    def state_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass
class Precision:
    """What the recipe must do for the precision the DeepSpeed JSON asks for."""

    mode: str  # "bf16" | "fp16" | "fp32"
    zero_stage: int
    param_dtype: torch.dtype
    sr_state_dtype: torch.dtype  # Adam state dtype of the SR (no-master) groups
    half_master_partitions: bool  # ZeRO hands SRAdamW half-precision partitions
    loss_scaler: DynamicLossScaler | None = None  # fp16 route only
    recipe_clip: float = 0.0  # gradient clipping done by the recipe (recipe-managed routes only)
    reduce_dtype: torch.dtype | None = None  # recipe-managed routes: the gradient all-reduce's dtype (None: default)

    @property
    def label(self) -> str:
        return f"{self.mode}/zero{self.zero_stage}"

    @property
    def recipe_managed(self) -> bool:
        """The fp16 and bf16 ZeRO-0 routes: the recipe casts the model, averages the gradients and
        clips them (by SRAdamW's gradient multiplier); DeepSpeed sees an fp32 config without ZeRO."""
        return self.zero_stage == 0 and self.half_master_partitions


def resolve_precision(ds_config: dict[str, Any]) -> tuple[Precision, dict[str, Any]]:
    """Reads the precision from a DeepSpeed config dict.

    Returns:
        The :class:`Precision` and the config to hand to ``deepspeed.initialize`` (unchanged except
        on the fp16 route, where the ``fp16`` section and ``gradient_clipping`` are taken over).

    Raises:
        ConfigError: On contradictory or unsupported settings.
    """
    cfg = copy.deepcopy(ds_config)
    bf16 = cfg.get("bf16", cfg.get("bfloat16", {})) or {}
    fp16 = cfg.get("fp16", {}) or {}
    stage = int((cfg.get("zero_optimization") or {}).get("stage", 0))
    if bf16.get("enabled") and fp16.get("enabled"):
        raise ConfigError("the DeepSpeed config enables both bf16 and fp16")
    if bf16.get("enabled"):
        half_master = bool(bf16.get("bf16_master_weights_and_grads"))
        half_states = bool(bf16.get("bf16_optimizer_states"))
        if half_states and not half_master:
            raise ConfigError("bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads")
        state_dtype = torch.bfloat16 if half_states else torch.float32
        if half_master and stage == 0:  # the recipe-managed bf16 route (module docstring)
            clip = _take_over_clipping(cfg)
            reduce = _take_over_reduce_dtype(cfg, torch.bfloat16)
            cfg.pop("bf16", None)
            cfg.pop("bfloat16", None)
            return Precision("bf16", 0, torch.bfloat16, state_dtype, True, None, clip, reduce), cfg
        return Precision("bf16", stage, torch.bfloat16, state_dtype, half_master), cfg
    if fp16.get("enabled"):
        if stage != 0:
            raise ConfigError(
                "fp16 SR weights need ZeRO stage 0: DeepSpeed's ZeRO keeps fp32 masters for fp16 "
                "unless its CPU Adam is used (see docs/precision.md)"
            )
        clip = _take_over_clipping(cfg)
        reduce = _take_over_reduce_dtype(cfg, torch.float16)
        scaler = DynamicLossScaler.from_section(fp16)
        cfg.pop("fp16")
        prec = Precision("fp16", 0, torch.float16, torch.float16, True, scaler, clip, reduce)
        return prec, cfg
    return Precision("fp32", stage, torch.float32, torch.float32, False), cfg


def _take_over_clipping(cfg: dict[str, Any]) -> float:
    """``gradient_clipping`` taken over from the config handed to DeepSpeed (the recipe clips): set to
    0 there, not removed, since DeepSpeed's default when the key is missing is to clip at 1.0 (its
    fp32 path would then clip the still loss-scaled gradients before the recipe's multiplier)."""
    clip = float(cfg.get("gradient_clipping", 0.0) or 0.0)
    if not math.isfinite(clip) or clip < 0:
        raise ConfigError(f"gradient_clipping must be a finite number >= 0, got {clip}")
    cfg["gradient_clipping"] = 0.0
    return clip


_REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _take_over_reduce_dtype(cfg: dict[str, Any], grad_dtype: torch.dtype) -> torch.dtype | None:
    """``communication_data_type`` taken over from the config handed to DeepSpeed (the recipe all-reduces
    the gradients, :mod:`recipe.training.overlap`): fp32 or the gradients' own dtype; None when absent."""
    value = cfg.pop("communication_data_type", None)
    if value is None:
        return None
    dtype = _REDUCE_DTYPES.get(str(value).lower())
    allowed = [k for k, v in _REDUCE_DTYPES.items() if v in (torch.float32, grad_dtype)]
    if dtype not in (torch.float32, grad_dtype):
        route = "bf16" if grad_dtype == torch.bfloat16 else "fp16"
        raise ConfigError(f"communication_data_type {value!r}: the {route} route all-reduces its gradients in "
                          f"{' or '.join(allowed)}")
    return dtype


def sum_dtype(grad_dtype: torch.dtype, reduce_dtype: torch.dtype | None) -> torch.dtype:
    """The dtype the recipe's gradient all-reduce sums ``grad_dtype`` gradients in: ``reduce_dtype``
    (:attr:`Precision.reduce_dtype`) when given, else fp32 for bf16 gradients (rounded once) and the
    gradients' own dtype otherwise (fp16: an overflow of the scaled sum is the loss scaler's signal)."""
    return reduce_dtype or (torch.float32 if grad_dtype == torch.bfloat16 else grad_dtype)


_BATCH_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")


def read_ds_config(path: str | os.PathLike, world_size: int | None = None) -> dict[str, Any]:
    """Reads and checks a DeepSpeed JSON before anything is built; returns it as read.

    Checked: valid JSON holding an object; ``train_batch_size``, ``train_micro_batch_size_per_gpu``
    and ``gradient_accumulation_steps`` are positive integers where given, at least one of the
    first two is given, and those given agree (``train_batch_size = micro x accumulation x
    world_size``; without ``world_size`` the divisibility that any world size needs); ZeRO stage
    0-3; ``gradient_clipping`` finite and >= 0; and everything :func:`resolve_precision` checks.

    Args:
        path: The JSON file.
        world_size: Data-parallel ranks, when known (the batch-size equation is then exact).

    Raises:
        FileNotFoundError: No such file.
        ConfigError: Anything else; the message starts with the path (and gives line and column
            of malformed JSON).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"DeepSpeed config not found: {path}")
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from e
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot be read: {e}") from e
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a DeepSpeed config is a JSON object, got {type(cfg).__name__}")
    try:
        _check_batch_sizes(cfg, world_size)
        _check_zero_and_clipping(cfg)
        resolve_precision(cfg)
    except (ValueError, TypeError) as e:  # ConfigError, or int()/float() of a malformed entry
        raise ConfigError(f"{path}: {e}") from e
    return cfg


def _check_batch_sizes(cfg: dict[str, Any], world_size: int | None) -> None:
    given = {k: cfg[k] for k in _BATCH_KEYS if cfg.get(k) is not None}
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be a positive integer, got {value!r}")
    total = given.get("train_batch_size")
    micro = given.get("train_micro_batch_size_per_gpu")
    accum = given.get("gradient_accumulation_steps")
    if total is None and micro is None:
        raise ConfigError("give train_micro_batch_size_per_gpu (or train_batch_size)")
    if total is None:
        return
    # the part of train_batch_size the other entries fix; DeepSpeed derives the rest
    fixed = (micro or 1) * (accum or 1) * (world_size or 1)
    exact = micro is not None and accum is not None and world_size is not None
    if (exact and total != fixed) or total % fixed:
        parts = [f"{k} {v}" for k, v in given.items() if k != "train_batch_size"]
        parts += [f"world size {world_size}"] if world_size is not None else []
        relation = "!=" if exact else "is not a multiple of"
        product = " x ".join(parts) + (f" = {fixed}" if len(parts) > 1 else "")
        raise ConfigError(f"train_batch_size {total} {relation} {product}")


def _check_zero_and_clipping(cfg: dict[str, Any]) -> None:
    zero = cfg.get("zero_optimization") or {}
    if not isinstance(zero, dict):
        raise ConfigError(f"zero_optimization must be an object, got {zero!r}")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    clip = cfg.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)) or not math.isfinite(clip) or clip < 0:
        raise ConfigError(f"gradient_clipping must be a finite number >= 0, got {clip!r}")


def cpu_has_bf16() -> bool:
    """Whether this CPU has bf16 instructions (AVX512-BF16 or AMX-BF16), which the CPU kernels of
    bf16 convolutions and normalisations need to be fast (torch's CPU feature table; else
    ``/proc/cpuinfo``; unknown counts as present)."""
    try:
        caps = torch._C._cpu._get_cpu_capability()
        return bool(caps.get("avx512_bf16") or caps.get("amx_bf16"))
    except (AttributeError, RuntimeError):
        pass
    try:
        flags = open("/proc/cpuinfo").read()
    except OSError:
        return True
    return "avx512_bf16" in flags or "amx_bf16" in flags


def slow_bf16_on_cpu(model: torch.nn.Module, prec: Precision, on_cpu: bool, has_bf16: bool | None = None) -> str | None:
    """A note for the start of a CPU run whose bf16 weights would run 20-200x slower than fp32: a CPU
    without bf16 instructions (:func:`cpu_has_bf16`) and a model with BatchNorm or convolutions other
    than a patch embedding (kernel = stride: ViT towers keep their speed). ``None`` when that is not so."""
    if not on_cpu or prec.param_dtype != torch.bfloat16:
        return None
    if has_bf16 if has_bf16 is not None else cpu_has_bf16():
        return None
    slow: dict[str, int] = {}
    for m in model.modules():
        patchify = isinstance(m, torch.nn.Conv2d) and tuple(m.kernel_size) == tuple(m.stride)
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) or (isinstance(m, torch.nn.modules.conv._ConvNd)
                                                                    and not patchify):
            slow[type(m).__name__] = slow.get(type(m).__name__, 0) + 1
    if not slow:
        return None
    what = ", ".join(f"{n} {name}" for name, n in sorted(slow.items()))
    return (f"note: this CPU has no bf16 instructions (AVX512-BF16 or AMX): in bf16 the model's {what} layers "
            "run 20-200x slower here than in fp32; DS_CONFIG=ds_configs/zero2_fp32.json is the fast route on "
            "this machine")
