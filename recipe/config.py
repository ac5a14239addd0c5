"""The recipe's one typed configuration; it generates the command line.

Every leaf field of :class:`TrainConfig` is a flag (``--image-encoder``, ``--lr``, ``--workers``...)
whose help text and default come from the field itself, so nothing is described twice. Sections
(:class:`ModelConfig`, :class:`DataConfig`, :class:`OptimConfig`) are flattened: a leaf name is
unique across the tree. The data loaders read :class:`DataConfig` directly.

The DeepSpeed JSON (``--deepspeed_config``) owns batch size, gradient accumulation, precision,
gradient clipping and ZeRO; this config owns everything else. Nothing is set in both: micro-batch
and accumulation are read back from the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

__all__ = [
    "ModelChoice",
    "preset_option",
    "ModelConfig",
    "DataConfig",
    "OptimConfig",
    "TrainConfig",
    "LOSS_MODE_NAMES",
    "CONTRASTIVE_BATCH_NAMES",
    "DECODE_DEVICES",
    "SCHEDULES",
    "add_field_flags",
    "build_parser",
    "check_field_bounds",
    "check_model_names",
    "config_from_dict",
    "parse_args",
    "UsageError",
    "OneLineParser",
]

#: Names of :data:`recipe.loss.LOSS_MODES` (kept here so that the config imports no torch code).
LOSS_MODE_NAMES = ("plain", "chunked", "fused")
SCHEDULES = ("cosine", "constant")
#: Values of ``--loss``.
LOSS_NAMES = ("clip", "siglip")
#: Values of ``--contrastive-batch`` (:data:`recipe.training.passes.CONTRASTIVE_BATCHES`).
CONTRASTIVE_BATCH_NAMES = ("global", "micro")
#: Values of ``--decode-device`` (:func:`recipe.data.decode.build_train_pipeline`).
DECODE_DEVICES = ("cpu", "cuda")


_BOUNDS = {"ge": (">=", lambda v, b: v >= b), "gt": (">", lambda v, b: v > b), "le": ("<=", lambda v, b: v <= b),
           "lt": ("<", lambda v, b: v < b)}


def option(
    default: Any,
    help: str,
    names: Callable[[], Iterable[str]] | None = None,
    **bounds: float,
) -> Any:
    """A dataclass field with its command-line help (mutable defaults are copied per instance).

    ``names``, when given, returns the names a registry holds; they replace ``{names}`` in the help
    (read when the parser is built, so the registries' modules, which import torch, load lazily).
    ``bounds`` (``ge``, ``gt``, ``le``, ``lt``) is the field's range, checked by
    :meth:`TrainConfig.validate` (for each element of a tuple; an unset optional field passes).
    """
    unknown = set(bounds) - set(_BOUNDS)
    if unknown:
        raise TypeError(f"unknown bounds {sorted(unknown)}")
    metadata: dict[str, Any] = {"help": help, "bounds": bounds}
    if names is not None:
        metadata["names"] = names
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def preset_names() -> list[str]:
    """The model presets, from :data:`recipe.model.PRESETS`."""
    from .model.clip import PRESETS

    return list(PRESETS)


def text_tower_names() -> list[str]:
    """The built-in text towers, from :data:`recipe.model.encoders.TEXT_CONFIGS`."""
    from .model.encoders import TEXT_CONFIGS

    return list(TEXT_CONFIGS)


def check_model_names(
    preset: str | None, image_encoder: str | None, text_encoder: str | None, *, init_from: str | None = None
) -> None:
    """``ValueError`` naming an unknown preset or encoder and the valid names, before anything is built.

    The one check of model names: training (:meth:`TrainConfig.validate`), the planner
    (:mod:`recipe.plan`) and the preflight (:mod:`recipe.verify`) call it. Without a preset both
    encoders are required, unless ``init_from`` (a directory the towers are read from) is given. An
    image encoder is a timm model name; a text encoder is a built-in text tower
    (:data:`recipe.model.encoders.TEXT_CONFIGS`), a config JSON or a model directory.
    """
    if preset is None and not (image_encoder and text_encoder) and not init_from:
        raise ValueError("give a preset, or both an image encoder and a text encoder")
    if preset is not None and preset not in preset_names():
        raise ValueError(f"unknown preset {preset!r}; choose from {', '.join(preset_names())}")
    if image_encoder:
        import timm

        if not timm.is_model(image_encoder):
            raise ValueError(f"image encoder {image_encoder!r} is not a timm model name")
    if text_encoder and text_encoder not in text_tower_names() and not Path(text_encoder).exists():
        raise ValueError(
            f"text encoder {text_encoder!r} is neither a built-in text tower ({', '.join(text_tower_names())}) "
            "nor an existing config JSON or model directory"
        )


def preset_option(default: str) -> Any:
    """The ``preset`` field of a :class:`ModelChoice` with another default."""
    return option(default, "model preset, one of {names}; the encoder flags override its towers", names=preset_names)


@dataclass
class ModelChoice:
    """Which model: a preset, or encoders by name; the fields ``recipe.train``, ``recipe.plan`` and
    ``recipe.verify`` share (each may give ``preset`` another default with :func:`preset_option`)."""

    preset: str | None = preset_option("tiny")
    image_encoder: str | None = option(None, "timm image model name (replaces the preset's image tower)")
    text_encoder: str | None = option(
        None, "text tower: a built-in one ({names}), a config JSON or a local model directory", names=text_tower_names
    )
    image_size: int | None = option(
        None,
        "image side in pixels: the image tower's input and the data transforms' output (unset: the model's)",
        ge=1,
    )
    embed_dim: int | None = option(None, "shared embedding width (default: the preset's)", ge=1)


@dataclass
class ModelConfig(ModelChoice):
    """Model: a preset, or encoders by name (any timm image model, any transformers text model)."""

    image_weights: str | None = option(None, "local state-dict file for the image tower")
    init_from: str | None = option(
        None,
        "start from a pretrained model: an open_clip directory (open_clip_config.json), a Hugging Face CLIPModel "
        "directory or a recipe run directory; architecture and tokenizer are read from it",
    )
    grad_checkpointing: bool = option(False, "activation checkpointing in both towers")
    patch_dropout: float = option(
        0.0, "fraction of image patch tokens dropped in training (FLIP; timm ViT towers only, none at evaluation)",
        ge=0, lt=1,
    )
    lock_image: bool = option(False, "freeze the image tower (LiT): no gradients, no optimizer state")
    lock_image_unlocked_groups: int = option(
        0, "with --lock-image: leave the last N layer groups (blocks/stages) of the image tower trainable", ge=0
    )
    lock_text: bool = option(False, "freeze the text tower: no gradients, no optimizer state")
    init_logit_scale: float | None = option(
        None, "initial logit multiplier exp(logit_scale) (unset: 1/0.07 for --loss clip, 10 for siglip)", gt=0
    )
    init_logit_bias: float | None = option(None, "initial logit bias of --loss siglip (unset: -10)", le=100)
    compile: bool = option(False, "torch.compile both towers (under DeepSpeed, CPU too)")
    text_master_weights: bool = option(
        False, "keep an fp32 master for the text tower (default: SR half weights, as the CLIP paper)"
    )
    image_master_weights: bool = option(True, "keep an fp32 master for the image tower")


@dataclass
class DataConfig:
    """Data: training and validation sets, how they are read and augmented, tokenizer, prompts."""

    train_data: str | list[str] = option(
        "data/synthetic/train.csv",
        "training data: file, directory, glob, brace pattern (shards-{0000..0099}.tar) or '::'-separated list",
    )
    val_data: str | None = option(None, "held-out split for zero-shot classification and retrieval")
    data_format: str | None = option(
        None, "csv, tsv, json, parquet, imagefolder, disk (save_to_disk) or webdataset; detected when unset"
    )
    split: str = option("train", "split of a multi-split imagefolder/save_to_disk training directory")
    val_split: str = option("validation", "split of a multi-split imagefolder/save_to_disk validation directory")
    image_column: str | None = option(
        None, "image column (paths, bytes or datasets.Image); webdataset: extension(s), ';'-separated"
    )
    caption_column: str | None = option(
        None, "caption column (webdataset: extension, default txt); detected when unset"
    )
    label_column: str | None = option(
        "label", "class-label column of the validation set (webdataset: e.g. cls); '' for none"
    )
    image_root: str | None = option(
        None, "folder relative image paths resolve against (default: the folder of the file naming them)"
    )
    csv_separator: str | None = option(None, "CSV separator (sniffed from the header line when unset)")
    workers: int = option(
        2, "DataLoader worker processes of the training loader (0: load in the training process)", ge=0
    )
    eval_workers: int = option(0, "DataLoader worker processes of the evaluation loader", ge=0)
    prefetch_factor: int = option(2, "batches prefetched per worker", ge=1)
    pin_memory: bool = option(False, "pin batches in page-locked memory (CUDA training)")
    decode_device: str = option(
        "cpu",
        "where training images are decoded: cpu (the DataLoader workers decode, crop, resize and normalise) or "
        "cuda (the workers read JPEG bytes and tokenise; the training process decodes them with nvJPEG and crops, "
        "resizes, flips and normalises on its GPU)",
    )
    shuffle_buffer: int = option(1000, "shuffle buffer of streamed (webdataset) training data", ge=1)
    num_samples: int | None = option(
        None, "samples in the webdataset training shards (counted from the tar headers when unset)", ge=1
    )
    train_scale: tuple[float, float] = option(
        (0.9, 1.0), "area range of the random resized crop (OpenCLIP's CLIP recipe: 0.9 1.0)", gt=0
    )
    train_ratio: tuple[float, float] | None = option(
        None, "aspect-ratio range of the random resized crop (timm's default when unset)", gt=0
    )
    hflip: float = option(0.0, "horizontal flip probability in training (CLIP used none)", ge=0, le=1)
    color_jitter: float | None = option(None, "colour jitter strength in training (CLIP used none)", ge=0)
    cache_dir: str | None = option(None, "datasets cache directory for converted CSV/JSON/parquet files")
    log_bad_samples: int = option(10, "bad samples each worker logs individually per epoch (all are counted)", ge=0)
    zeroshot: str | None = option(
        None,
        "zero-shot classes: 'imagenet' (built-in ImageNet-1k names and the CLIP paper's 80 templates; "
        "the data is a folder DIR/<wnid>/*.JPEG) or a zeroshot.json with class names and templates "
        "(default: a zeroshot.json found next to the zero-shot data)",
    )
    zeroshot_data: str | None = option(
        None,
        "labelled images for zero-shot classification, e.g. an ImageNet folder DIR/<wnid>/*.JPEG, when they are "
        "not the validation data (which then gives retrieval only; default: zero-shot on the validation data)",
    )
    tokenizer: str | None = option(
        None, "local tokenizer directory (default: train a byte-level BPE on the training captions)"
    )
    vocab_size: int = option(2048, "vocabulary size of a trained tokenizer", ge=1)
    context_length: int | None = option(None, "token context length (default: the text tower's)", ge=1)


@dataclass
class OptimConfig:
    """SRAdamW and the learning-rate schedule (linear warmup, then cosine or constant)."""

    lr: float = option(5e-4, "peak learning rate", ge=0)
    weight_decay: float = option(0.2, "decoupled weight decay of weights (not gains, biases or the logit scale)", ge=0)
    beta1: float = option(0.9, "Adam beta1", ge=0, lt=1)
    beta2: float = option(0.98, "Adam beta2", ge=0, lt=1)
    eps: float = option(1e-6, "Adam epsilon", ge=0)
    warmup_steps: int = option(50, "linear warmup steps", ge=0)
    schedule: str = option("cosine", "after warmup: cosine (to --min-lr) or constant")
    min_lr: float = option(0.0, "final learning rate of the cosine schedule", ge=0)
    sr_seed: int = option(0, "seed of the stochastic-rounding noise", ge=0)
    image_lr: float | None = option(None, "peak learning rate of the image tower (unset: --lr)", ge=0)
    text_lr: float | None = option(None, "peak learning rate of the text tower (unset: --lr)", ge=0)
    layer_decay: float | None = option(
        None, "layer-wise lr decay of the image tower: block i of n gets lr x decay^(n-i) (ViT, ConvNeXt)", gt=0, le=1
    )
    ema_decay: float | None = option(
        None, "keep an exponential moving average of the weights (ema <- D ema + (1-D) w after every step)", ge=0, lt=1
    )
    ema_warmup: bool = option(False, "with --ema-decay: decay min(D, (1+t)/(10+t)) at step t")


@dataclass
class TrainConfig:
    """Everything a run needs besides the DeepSpeed JSON."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    deepspeed_config: str = option(
        "ds_configs/zero0_bf16_sr.json", "DeepSpeed JSON: batch size, accumulation, precision, clipping, ZeRO"
    )
    loss: str = option("clip", "contrastive loss: clip (softmax, InfoNCE) or siglip (sigmoid, with a learnable bias)")
    loss_mode: str = option("plain", "contrastive loss implementation: plain, chunked or fused (Triton)")
    chunk_size: int = option(4096, "tile edge of the chunked loss (caps the fused loss's tile)", ge=1)
    contrastive_batch: str = option(
        "global",
        "pairs one loss contrasts: global (all micro-batches x accumulation x ranks of an optimizer step, "
        "through an embedding cache: one extra forward per step) or micro (each micro-batch x ranks)",
    )
    steps: int | None = option(None, "optimizer steps (or give --epochs)", ge=1)
    epochs: float | None = option(
        None, "passes over the training data (1 when neither this nor --steps is given)", gt=0
    )
    eval_every: int = option(0, "evaluate every N steps (0: only at the end)", ge=0)
    eval_benchmark: str | None = option(
        None, "CLIP_benchmark datasets evaluated with the others, NAME[,NAME...] (wds/<name> or its names; "
        "needs --benchmark-root and the [eval] extra): benchmark_<dataset>_<metric> in the eval metrics"
    )
    benchmark_root: str | None = option(
        None, "folder of the --eval-benchmark datasets (wds_<name>/ as CLIP_benchmark's converter writes them)"
    )
    save_every: int = option(0, "checkpoint every N steps (0: only at the end)", ge=0)
    log_every: int = option(10, "log training metrics every N steps", ge=1)
    numerics_every: int | None = option(
        None,
        "numerics telemetry every N steps (SR updates below half an ulp, Adam-state underflow/saturation, fp16 "
        "state scales, logit-scale clamp; recipe/training/numerics.py); unset: every --log-every steps, 0: off",
        ge=0,
    )
    output_dir: str = option("runs/default", "run directory: config, logs, tokenizer, checkpoints")
    resume: str | None = option(None, "'latest' or a checkpoint directory to continue from")
    seed: int = option(0, "seed of initialisation, shuffling and augmentation", ge=0)
    max_nonfinite_in_row: int = option(5, "stop after this many consecutive steps with a non-finite loss", ge=1)
    eval_batch_size: int = option(256, "per-rank batch size of evaluation", ge=1)

    def validate(self) -> None:
        """Raises ``ValueError`` (or ``FileNotFoundError``) on contradictory or out-of-range settings.

        Every numeric field is checked against its declared range (:func:`option`'s bounds: sizes
        are >= 1), the names of a preset and a built-in text tower against their registries, and the
        DeepSpeed JSON is read and checked (:func:`recipe.training.precision.read_ds_config`: malformed JSON,
        non-positive or inconsistent batch sizes, contradictory precision settings), all before
        anything is built.
        """
        if self.loss_mode not in LOSS_MODE_NAMES:
            raise ValueError(f"--loss-mode must be one of {', '.join(LOSS_MODE_NAMES)}, got {self.loss_mode!r}")
        if self.loss not in LOSS_NAMES:
            raise ValueError(f"--loss must be one of {', '.join(LOSS_NAMES)}, got {self.loss!r}")
        if self.contrastive_batch not in CONTRASTIVE_BATCH_NAMES:
            raise ValueError(
                f"--contrastive-batch must be one of {', '.join(CONTRASTIVE_BATCH_NAMES)}, got {self.contrastive_batch!r}"
            )
        if self.data.decode_device not in DECODE_DEVICES:
            raise ValueError(f"--decode-device must be cpu or cuda, got {self.data.decode_device!r}")
        if self.optim.schedule not in SCHEDULES:
            raise ValueError(f"--schedule must be cosine or constant, got {self.optim.schedule!r}")
        for section, cls in _sections().items():
            values = getattr(self, section) if section else self
            for f, hint in _leaves(cls):
                _check_bounds(f, hint, getattr(values, f.name))
        if self.loss == "siglip" and self.loss_mode == "fused":
            raise ValueError("--loss-mode fused is the clip loss's Triton kernel; --loss siglip runs plain or chunked")
        if self.model.init_logit_bias is not None and self.loss != "siglip":
            raise ValueError("--init-logit-bias is for --loss siglip (the clip loss has no bias)")
        if self.model.lock_image_unlocked_groups and not self.model.lock_image:
            raise ValueError("--lock-image-unlocked-groups needs --lock-image")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("give --steps or --epochs, not both")
        for name in ("train_scale", "train_ratio"):
            value = getattr(self.data, name)
            if value is not None and value[0] > value[1]:
                raise ValueError(f"{_flag(name)} must be a range (low <= high), got {value[0]} {value[1]}")
        m = self.model
        check_model_names(m.preset, m.image_encoder, m.text_encoder, init_from=m.init_from)
        if self.model.init_from is not None:
            # read at a run's start only: a resumed run rebuilds it from its own files (the source may be gone)
            if not self.resume and not Path(self.model.init_from).is_dir():
                raise FileNotFoundError(f"--init-from directory not found: {self.model.init_from}")
            if self.data.tokenizer is not None:
                raise ValueError("--tokenizer contradicts --init-from: the tokenizer is read from the init directory")
            if self.model.image_weights is not None:
                raise ValueError("--image-weights contradicts --init-from: the weights come from the init directory")
        self._validate_zeroshot()
        if self.eval_benchmark:  # CLIP_benchmark's names and files, before anything is written
            from .benchmark.datasets import resolve_all  # imports nothing of the recipe: no import circle

            resolve_all(self.eval_benchmark, self.benchmark_root)
        if not Path(self.deepspeed_config).is_file():
            raise FileNotFoundError(f"DeepSpeed config not found: {self.deepspeed_config}")
        from .training.precision import read_ds_config  # imports torch: only once the cheap checks passed

        read_ds_config(self.deepspeed_config, world_size=_launcher_world_size())

    def _validate_zeroshot(self) -> None:
        d = self.data
        if d.zeroshot is not None and d.zeroshot != "imagenet" and not Path(d.zeroshot).is_file():
            raise ValueError(f"--zeroshot must be 'imagenet' or an existing zeroshot.json file, got {d.zeroshot!r}")
        if d.zeroshot is not None and not (d.val_data or d.zeroshot_data):
            raise ValueError(f"--zeroshot {d.zeroshot!r} needs images to classify: set --zeroshot-data or --val-data")
        for part in (d.zeroshot_data or "").split("::"):
            if part and not any(ch in part for ch in "*?[{") and not Path(part).expanduser().exists():
                raise ValueError(f"--zeroshot-data {part!r} does not exist")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------------------------------
# the command line, generated from the dataclasses
# --------------------------------------------------------------------------------------------------


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _unwrap(tp: Any) -> tuple[Any, bool]:
    """``int | None`` -> ``(int, True)``; the first non-None member of a union."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(tp))
    return tp, False


def _sections() -> dict[str | None, type]:
    """``{None: TrainConfig, "model": ModelConfig, ...}``: every dataclass of the tree by its field."""
    hints = typing.get_type_hints(TrainConfig)
    subs = {f.name: hints[f.name] for f in dataclasses.fields(TrainConfig) if dataclasses.is_dataclass(hints[f.name])}
    return {None: TrainConfig, **subs}


def _leaves(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if not dataclasses.is_dataclass(hints[f.name])]


def _check_bounds(f: dataclasses.Field, hint: Any, value: Any) -> None:
    """``ValueError`` naming the field when ``value`` is outside the field's declared range."""
    bounds = f.metadata.get("bounds") or {}
    if value is None or not bounds:
        return
    tp, _ = _unwrap(hint)
    elem = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
    for v in value if isinstance(value, (tuple, list)) else (value,):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or (elem is int and not isinstance(v, int)):
            raise ValueError(f"{_flag(f.name)} must be {'an integer' if elem is int else 'a number'}, got {v!r}")
        for kind, bound in bounds.items():
            symbol, ok = _BOUNDS[kind]
            if not ok(v, bound):
                raise ValueError(f"{_flag(f.name)} must be {symbol} {bound}, got {v}")


def _launcher_world_size() -> int | None:
    """``WORLD_SIZE`` of a launched rank (deepspeed, torchrun); ``None`` in a plain process."""
    value = os.environ.get("WORLD_SIZE", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def _default_text(f: dataclasses.Field) -> str:
    value = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
    if isinstance(value, tuple):
        return " ".join(str(v) for v in value)
    return "unset" if value is None else (str(value) or "none")


def _help_text(f: dataclasses.Field) -> str:
    text = f.metadata.get("help", "")
    names = f.metadata.get("names")
    return text.format(names=", ".join(names())) if names is not None else text


def _optional(tp: type) -> Any:
    """Argument type for an optional field: the empty string means None (e.g. ``--val-data ''``)."""

    def convert(text: str) -> Any:
        return None if text == "" else tp(text)

    convert.__name__ = tp.__name__  # argparse names the type in its error messages
    return convert


def add_field_flags(target: Any, cls: type, dest_prefix: str = "", aliases: dict[str, list[str]] | None = None) -> None:
    """Adds one flag per leaf field of dataclass ``cls`` to an argparse parser or group, with the field's
    help text and default (the one generator of ``recipe.train``'s, ``recipe.plan``'s and
    ``recipe.verify``'s command lines). Absent flags are left out of the namespace
    (``argparse.SUPPRESS``), so defaults and ``--config`` values stay; ``dest_prefix`` names a section
    (``model.embed_dim``); ``aliases`` adds further spellings of a field's flag."""
    for f, hint in _leaves(cls):
        tp, optional = _unwrap(hint)
        kw: dict[str, Any] = {
            "dest": f"{dest_prefix}.{f.name}" if dest_prefix else f.name,
            "default": argparse.SUPPRESS,
            "help": f"{_help_text(f)} (default: {_default_text(f)})",
        }
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is tuple:
            elem = typing.get_args(tp)[0]
            kw.update(nargs=len(typing.get_args(tp)), type=elem, metavar=elem.__name__.upper())
        else:
            kw.update(type=_optional(tp) if optional else tp, metavar=f.name.upper())
        target.add_argument(_flag(f.name), *(aliases or {}).get(f.name, []), **kw)


def check_field_bounds(obj: Any) -> None:
    """``ValueError`` naming the first field of dataclass instance ``obj`` outside its declared range
    (``option(..., ge=..., lt=...)``)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        _check_bounds(f, hints[f.name], getattr(obj, f.name))


class UsageError(ValueError):
    """A command line argparse cannot read (an unknown flag, a missing or malformed value)."""


class OneLineParser(argparse.ArgumentParser):
    """An argparse parser whose errors are one :class:`UsageError` line instead of the usage text on
    stderr and ``SystemExit``: the caller reports it once (a launch has one parser per rank), with the
    flag the user probably meant."""

    def error(self, message: str) -> typing.NoReturn:
        flags = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        guesses = []
        if message.startswith("unrecognized arguments"):
            for word in message.split(":", 1)[1].split():
                word = word.split("=")[0]
                if word.startswith("--") and word not in flags:
                    longer = [f for f in flags if f.startswith(word)]  # a prefix (abbreviations are off)
                    guesses += longer[:2] or difflib.get_close_matches(word, flags, n=1, cutoff=0.75)
        hint = f" (did you mean {' / '.join(dict.fromkeys(guesses))}?)" if guesses else ""
        raise UsageError(f"{message}{hint}; --help lists every flag")


class _NoHyphenBreaks(argparse.HelpFormatter):
    """argparse's help layout without line breaks at hyphens: names like ``tiny-resnet`` stay whole."""

    def _split_lines(self, text: str, width: int) -> list[str]:
        import textwrap

        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)


def build_parser() -> argparse.ArgumentParser:
    """One flag per leaf field, with the field's help text and default; plus ``--config``."""
    ap = OneLineParser(
        prog="python -m recipe.train",
        description="Train a CLIP model under DeepSpeed (see docs/training.md).",
        allow_abbrev=False,  # a prefix of one flag must never silently set another
        formatter_class=_NoHyphenBreaks,
    )
    seen: dict[str, str] = {}
    for section, cls in _sections().items():
        for f, _ in _leaves(cls):
            if f.name in seen:
                raise TypeError(
                    f"config field {f.name!r} appears in both {seen[f.name]} and {section}: flags must be unique"
                )
            seen[f.name] = section or "run"
        group = ap.add_argument_group(section or "run", (cls.__doc__ or "").strip().splitlines()[0])
        add_field_flags(group, cls, section or "", {"deepspeed_config": ["--deepspeed_config", "--ds-config"]})  # DeepSpeed's, the benchmarks'
    ap.add_argument(
        "--config", default=None, help="JSON file of a TrainConfig (e.g. a run's config.json); flags override it"
    )
    ap.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return ap


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    bad = sorted(set(data) - names)
    if bad:
        raise ValueError(f"unknown config keys {where}{bad}")
    kwargs = {}
    for key, value in data.items():
        tp, _ = _unwrap(hints[key])
        if dataclasses.is_dataclass(tp):
            kwargs[key] = _build(tp, dict(value), f"in {key}: ")
        elif typing.get_origin(tp) is tuple and isinstance(value, list):
            kwargs[key] = tuple(value)  # JSON has no tuples
        else:
            kwargs[key] = value
    return cls(**kwargs)


def config_from_dict(data: dict[str, Any]) -> TrainConfig:
    """Builds a :class:`TrainConfig` from a (possibly partial) nested dict; unknown keys raise."""
    return _build(TrainConfig, dict(data), "")


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    """Parses the command line into a validated :class:`TrainConfig`."""
    args = build_parser().parse_args(argv)
    base = config_from_dict(json.loads(Path(args.config).read_text())) if args.config else TrainConfig()
    data = base.to_dict()
    for dest, value in vars(args).items():
        if dest in ("config", "local_rank"):
            continue
        section, _, name = dest.rpartition(".")
        (data[section] if section else data)[name] = tuple(value) if isinstance(value, list) else value
    cfg = config_from_dict(data)
    if cfg.model.init_from and getattr(args, "model.preset", None):
        raise ValueError(
            f"--preset {cfg.model.preset} contradicts --init-from: the architecture is read from {cfg.model.init_from}"
        )
    cfg.validate()
    return cfg
