"""The recipe's one typed configuration, and its command line.

The DeepSpeed JSON (``--deepspeed_config``) owns batch size, gradient accumulation, precision,
gradient clipping and ZeRO; this config owns everything else. Nothing is set in both: micro-batch
and accumulation are read back from the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ModelArgs", "DataArgs", "OptimArgs", "TrainConfig", "parse_args", "build_parser", "config_from_dict"]


@dataclass
class ModelArgs:
    """Model: a preset, or encoders by name (any timm image model, any transformers text model)."""

    preset: str | None = "tiny"  # recipe.model.PRESETS key; encoders below override its towers
    image_encoder: str | None = None  # timm model name
    text_encoder: str | None = None  # built-in text config name, config JSON or local directory
    embed_dim: int | None = None
    image_weights: str | None = None  # local state-dict file for the image tower
    grad_checkpointing: bool = False
    text_master_weights: bool = False  # False: SR half weights for the text tower (CLIP paper)
    image_master_weights: bool = True  # True: fp32 master for the image tower


@dataclass
class DataArgs:
    """Data: training and validation sets, tokenizer, zero-shot prompts."""

    train_data: str = "data/synthetic/train.csv"
    val_data: str | None = None  # held-out split with labels for zero-shot and retrieval
    data_format: str | None = None  # csv|tsv|json|parquet|imagefolder|disk|webdataset (auto)
    image_column: str | None = None
    caption_column: str | None = None
    label_column: str | None = "label"  # of the validation set
    zeroshot: str | None = None  # zeroshot.json (class names + templates); found next to val data
    workers: int = 2
    tokenizer: str | None = None  # local tokenizer directory; None: train a BPE on the captions
    vocab_size: int = 2048  # of a trained tokenizer
    context_length: int | None = None  # default: the text tower's


@dataclass
class OptimArgs:
    """SRAdamW and the learning-rate schedule (linear warmup, then cosine or constant)."""

    lr: float = 5e-4
    weight_decay: float = 0.2
    beta1: float = 0.9
    beta2: float = 0.98
    eps: float = 1e-6
    warmup_steps: int = 50
    schedule: str = "cosine"  # cosine | constant
    min_lr: float = 0.0
    sr_seed: int = 0  # seed of the stochastic rounding noise


@dataclass
class TrainConfig:
    """Everything a run needs besides the DeepSpeed JSON."""

    model: ModelArgs = field(default_factory=ModelArgs)
    data: DataArgs = field(default_factory=DataArgs)
    optim: OptimArgs = field(default_factory=OptimArgs)
    deepspeed_config: str = "ds_configs/zero2_bf16_halfmaster.json"
    loss_mode: str = "plain"  # plain | chunked (recipe.loss.ClipLoss modes)
    chunk_size: int = 4096
    steps: int | None = None  # optimizer steps; or
    epochs: float | None = None  # passes over the training data (default 1 when steps is unset)
    eval_every: int = 0  # steps; 0: only at the end
    save_every: int = 0  # steps; 0: only at the end
    log_every: int = 10
    output_dir: str = "runs/default"
    resume: str | None = None  # latest | checkpoint directory
    seed: int = 0
    max_nonfinite_in_row: int = 5  # stop after this many consecutive non-finite steps
    eval_batch_size: int = 256

    def validate(self) -> None:
        """Raises ``ValueError`` on contradictory or out-of-range settings."""
        if self.loss_mode not in ("plain", "chunked", "fused"):
            raise ValueError(f"loss_mode must be plain, chunked or fused, got {self.loss_mode!r}")
        if self.optim.schedule not in ("cosine", "constant"):
            raise ValueError(f"schedule must be cosine or constant, got {self.optim.schedule!r}")
        if self.steps is not None and self.steps < 1:
            raise ValueError(f"steps must be >= 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ValueError(f"epochs must be > 0, got {self.epochs}")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give steps or epochs, not both")
        for name in ("lr", "weight_decay", "eps", "min_lr"):
            if getattr(self.optim, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.optim.warmup_steps < 0 or self.eval_every < 0 or self.save_every < 0:
            raise ValueError("warmup_steps, eval_every and save_every must be >= 0")
        if not Path(self.deepspeed_config).is_file():
            raise FileNotFoundError(f"DeepSpeed config not found: {self.deepspeed_config}")
        if self.model.preset is None and not (self.model.image_encoder and self.model.text_encoder):
            raise ValueError("without a preset both image_encoder and text_encoder are required")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    """``int | None`` -> ``int``."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _leaf_fields(cls: type) -> list[tuple[str | None, dataclasses.Field]]:
    hints = typing.get_type_hints(cls)
    out: list[tuple[str | None, dataclasses.Field]] = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += [(f.name, sub) for sub in dataclasses.fields(hints[f.name])]
        else:
            out.append((None, f))
    return out


def build_parser() -> argparse.ArgumentParser:
    """One flag per leaf field (``--image-encoder``, ``--lr``, ...), plus ``--deepspeed_config``."""
    ap = argparse.ArgumentParser(prog="python -m recipe.train", description="Train a CLIP model under DeepSpeed.")
    for section, f in _leaf_fields(TrainConfig):
        owner = {None: TrainConfig, "model": ModelArgs, "data": DataArgs, "optim": OptimArgs}[section]
        tp = _base_type(typing.get_type_hints(owner)[f.name])
        flags = [_flag(f.name)]
        if f.name == "deepspeed_config":
            flags.append("--deepspeed_config")
        kw: dict[str, Any] = {"dest": f"{section}.{f.name}" if section else f.name, "default": None}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        else:
            kw["type"] = tp
        ap.add_argument(*flags, **kw)
    ap.add_argument("--config", default=None, help="JSON file of a TrainConfig (e.g. a run's config.json); flags override it")
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Builds a :class:`TrainConfig` from a (possibly partial) nested dict; unknown keys raise."""
    data = dict(data)
    subs = {"model": ModelArgs, "data": DataArgs, "optim": OptimArgs}
    kwargs: dict[str, Any] = {}
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    for key, value in data.items():
        if key not in names:
            raise ValueError(f"unknown config key {key!r}")
        if key in subs:
            sub_names = {f.name for f in dataclasses.fields(subs[key])}
            bad = set(value) - sub_names
            if bad:
                raise ValueError(f"unknown config keys in {key}: {sorted(bad)}")
            kwargs[key] = subs[key](**value)
        else:
            kwargs[key] = value
    return TrainConfig(**kwargs)


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parses the command line into a validated :class:`TrainConfig`."""
    args = build_parser().parse_args(argv)
    base = config_from_dict(json.loads(Path(args.config).read_text())) if args.config else TrainConfig()
    data = base.to_dict()
    for dest, value in vars(args).items():
        if value is None or dest in ("config", "local_rank"):
            continue
        if "." in dest:
            section, name = dest.split(".")
            data[section][name] = value
        else:
            data[dest] = value
    cfg = config_from_dict(data)
    cfg.validate()
    return cfg
