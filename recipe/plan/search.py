"""Memory per GPU of one configuration (:func:`predict_memory`) and the search for a plan (:func:`plan`).

Peak bytes on the fullest GPU, in the order a step allocates them (``recipe/training/passes.py``):

* model states (:mod:`recipe.plan.states`): weights, partitions, gradients, optimizer state and
  ZeRO-3's reduce bucket, as the census reads them after backward;
* with ``--contrastive-batch global`` and accumulation k > 1: the embedding cache of m·k pairs (both
  towers, and its gradient: 4·m·k·D values), then the larger of the activation phase (one
  micro-batch's activations and ZeRO-1/2's reduce buckets, which exist during backward only) and the
  loss phase (gathered embeddings and their gradients, 4·N·m·k·D values, plus the loss's own memory
  for m·k rows against N·m·k columns);
* otherwise (k = 1, or ``micro``): activations, buckets, gathered embeddings and loss together.

Activations and loss memory are measured (:mod:`recipe.plan.activations`), never assumed.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from recipe.config import check_model_names
from recipe.training.engine import engine_config
from recipe.training.precision import read_ds_config, resolve_precision

from .activations import ActivationBytes, measure_activations, measure_loss
from .states import ModelLayout, ModelSpec, build_meta_model, model_layout, state_bytes
from .vocab import vocabulary_note

__all__ = [
    "REPO",
    "MemoryPrediction",
    "Plan",
    "PlanError",
    "ds_configs",
    "format_bytes",
    "parse_memory",
    "plan",
    "predict_memory",
]

REPO = Path(__file__).resolve().parents[2]
#: Preference between equally good candidates: the recipe's default first, the fp32 reference last.
#: bf16 at ZeRO-0 leads on any number of GPUs: ZeRO-1/2's per-step machinery (per-gradient hooks, bucket
#: copies, per-gradient norms, the clip pass, the partition copy and weight all-gather) cost 1.07-1.3x
#: its step time at one rank (CPU, benchmarks/RESULTS.md; 1.29x measured on an H200), and its one bf16
#: gradient all-reduce per step moves 2/3 of ZeRO-1/2's bytes (docs/precision.md, "Which route for several GPUs").
#: ZeRO-1/2/3 come next: they win where the replicated optimizer state does not fit (fewer accumulation
#: steps or no checkpointing first, see :func:`plan`).
_CONFIG_ORDER = ("zero0_bf16_sr", "zero2_bf16_halfmaster", "zero1_bf16_halfmaster", "zero3_bf16_halfmaster",
                 "zero0_fp16_sr_lossscale", "zero2_fp32")


class PlanError(ValueError):
    """Bad input to the planner (the message names what is wrong)."""


_UNITS = {"": None, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """``"80GiB"`` -> bytes. Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB, TB) units, any case;
    a number without a unit is refused (bytes and GiB are both plausible readings)."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise PlanError(f"gpu memory {text!r}: expected a number and a unit, e.g. 80GiB, 80GB or 81920MiB")
    if _UNITS[unit] is None:
        raise PlanError(f"gpu memory {text!r} has no unit: write e.g. {text}GiB or {text}GB")
    value = float(m.group(1)) * _UNITS[unit]
    if value <= 0:
        raise PlanError(f"gpu memory {text!r} must be positive")
    return int(value)


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def ds_configs(gpus: int | None = None) -> list[Path]:
    """The DeepSpeed JSONs the planner chooses from (``ds_configs/*.json``), preferred first (the same
    order for any number of GPUs; ``gpus`` is accepted for callers that pass it)."""
    found = sorted((REPO / "ds_configs").glob("*.json"))
    rank = {name: i for i, name in enumerate(_CONFIG_ORDER)}
    return sorted(found, key=lambda p: (rank.get(p.stem, len(rank)), p.stem))


@dataclass(frozen=True)
class MemoryPrediction:
    """Predicted peak bytes on the fullest GPU for one configuration.

    ``bytes_per_param`` holds the census's kinds per model parameter (``weights``, ``partitions``,
    ``grads``, ``optimizer_state``, ``buffers``: ZeRO's reduce buckets, fixed-size, divided by the
    parameter count for comparison); the ``*_bytes`` fields are absolute. ``buffer_bytes`` are all
    reduce buckets, ``backward_buffer_bytes`` the part of them that exists during backward only
    (ZeRO-1/2's); :meth:`peak_terms` says how ``total_bytes`` is made of the others.
    """

    model: str
    ds_config: str
    route: str
    zero_stage: int
    world: int
    micro_batch: int
    accumulation: int
    checkpointing: bool
    loss_mode: str
    contrastive_batch: str
    params: int
    bytes_per_param: dict[str, float]
    model_state_bytes: int
    buffer_bytes: int
    activation_bytes: int
    activation_bytes_per_sample: float
    cache_bytes: int
    gathered_bytes: int
    loss_bytes: int
    total_bytes: int
    per_group: dict[str, dict[str, int]] = field(default_factory=dict)
    backward_buffer_bytes: int = 0

    def phased(self) -> bool:
        """Whether the micro-batches' backward and the loss are separate phases (the global contrastive
        batch over k > 1 accumulation steps: the loss runs once over the cached embeddings)."""
        return self.contrastive_batch == "global" and self.accumulation > 1

    def peak_terms(self) -> dict[str, int]:
        """``total_bytes`` by term: what stays for the whole step (``model states``, ZeRO-3's bucket
        included; ``embedding cache``), then ``backward`` (one micro-batch's activations and the
        buckets of backward) and ``loss`` (gathered embeddings and the loss's own memory). The peak is
        their sum, except where :meth:`phased`: then only the larger of ``backward`` and ``loss`` counts."""
        return {
            "model states": self.model_state_bytes + self.buffer_bytes - self.backward_buffer_bytes,
            "embedding cache": self.cache_bytes,
            "backward": self.activation_bytes + self.backward_buffer_bytes,
            "loss": self.gathered_bytes + self.loss_bytes,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Plan:
    """The chosen configuration and how to launch it.

    ``ds_config`` is the JSON of ``ds_configs/`` the plan starts from; ``ds_config_json`` is that
    JSON with the batch sizes set (DeepSpeed owns micro-batch and accumulation, ``recipe.train``
    reads them back), to be written to ``ds_config_out`` (:meth:`write_ds_config`), which the
    ``launch_command`` names. ``headroom`` is the share of ``gpu_memory`` left unplanned for what
    the prediction does not see (allocator fragmentation, transient peaks, the CUDA context).
    ``vocabulary`` says how many tokens the text tower was planned with and whether that is exact
    (:func:`recipe.plan.vocab.vocabulary_note`).
    """

    micro_batch: int
    accumulation: int
    checkpointing: bool
    zero_stage: int
    ds_config: str
    precision_route: str
    bytes_per_param: dict[str, float]
    activation_bytes: int
    loss_bytes: int
    total_bytes_per_gpu: int
    gpu_memory: int
    headroom: float
    usable_bytes: int
    gpus: int
    global_batch: int
    launch_command: str
    ds_config_out: str
    ds_config_json: dict[str, Any]
    prediction: MemoryPrediction
    runner_ups: tuple[MemoryPrediction, ...] = ()
    vocabulary: str = ""

    def write_ds_config(self, path: str | Path | None = None) -> Path:
        out = Path(path or self.ds_config_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(self.ds_config_json, indent=2) + "\n")
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# measurements, cached per model (the meta model is built once per spec)
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _meta_model(spec: ModelSpec) -> torch.nn.Module:
    try:
        return build_meta_model(spec)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise PlanError(f"cannot build the model {spec.label()!r}: {e}") from e


@functools.lru_cache(maxsize=16)
def _layout(spec: ModelSpec) -> ModelLayout:
    return model_layout(spec, _meta_model(spec))


@functools.lru_cache(maxsize=64)
def _activations(spec: ModelSpec, dtype: torch.dtype, checkpointing: bool) -> ActivationBytes:
    return measure_activations(_meta_model(spec), dtype, checkpointing)


@functools.lru_cache(maxsize=256)
def _loss(mode: str, rows: int, world: int, dim: int, dtype: torch.dtype, chunk: int) -> float:
    return measure_loss(mode, rows, world, dim, dtype, chunk)


def _spec(model: ModelSpec | str) -> ModelSpec:
    """The model as a :class:`ModelSpec`, its names checked (``PlanError``) before anything is built."""
    spec = ModelSpec(preset=model) if isinstance(model, str) else model
    try:
        check_model_names(spec.preset, spec.image_encoder, spec.text_encoder)
    except ValueError as e:
        raise PlanError(str(e)) from e
    return spec


def _read_config(ds_config: str | Path | dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if isinstance(ds_config, dict):
        return "<dict>", ds_config
    path = Path(ds_config)
    if not path.is_file() and (REPO / "ds_configs" / path.name).is_file() and not path.parent.parts:
        path = REPO / "ds_configs" / path.name
    try:
        return str(path), read_ds_config(path)
    except (FileNotFoundError, ValueError) as e:
        raise PlanError(str(e)) from e


def predict_memory(
    model: ModelSpec | str,
    ds_config: str | Path | dict[str, Any],
    world: int,
    micro_batch: int,
    checkpointing: bool = False,
    accumulation: int = 1,
    loss_mode: str = "plain",
    contrastive_batch: str = "global",
    chunk_size: int = 4096,
) -> MemoryPrediction:
    """Predicted peak bytes on the fullest GPU (see the module docstring for the terms).

    Args:
        model: A preset name or a :class:`ModelSpec` (encoders, master-weight choices...).
        ds_config: A DeepSpeed JSON (path, a name in ``ds_configs/``, or a dict): ZeRO stage and
            precision route (its batch sizes are ignored: ``micro_batch``/``accumulation`` decide).
        world: Data-parallel ranks (GPUs).
        micro_batch: Pairs per GPU per forward.
        checkpointing: Gradient checkpointing in both towers (``--grad-checkpointing``).
        accumulation: Gradient accumulation steps.
        loss_mode, contrastive_batch, chunk_size: As ``recipe.train``'s flags of the same names.
    """
    from recipe.config import CONTRASTIVE_BATCH_NAMES, LOSS_MODE_NAMES

    for name, value in (("world", world), ("micro_batch", micro_batch), ("accumulation", accumulation),
                        ("chunk_size", chunk_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise PlanError(f"{name} must be a positive integer, got {value!r}")
    if loss_mode not in LOSS_MODE_NAMES:
        raise PlanError(f"loss mode must be one of {', '.join(LOSS_MODE_NAMES)}, got {loss_mode!r}")
    if contrastive_batch not in CONTRASTIVE_BATCH_NAMES:
        raise PlanError(f"contrastive batch must be one of {', '.join(CONTRASTIVE_BATCH_NAMES)}, got {contrastive_batch!r}")
    spec = _spec(model)
    path, cfg = _read_config(ds_config)
    prec, _ = resolve_precision(cfg)
    layout = _layout(spec)
    # the settings the engine is built with at this world size (recipe.training.engine.engine_config: e.g. no
    # contiguous gradient buckets at one rank), as the census measures them
    sb = state_bytes(layout, prec, engine_config(cfg, world, None), world)
    n = layout.params
    dtype, b = prec.param_dtype, prec.param_dtype.itemsize
    dim = int(_meta_model(spec).embed_dim)
    act_model = _activations(spec, dtype, checkpointing)
    act = int(act_model.at(micro_batch))
    rows = micro_batch * (accumulation if contrastive_batch == "global" else 1)
    gathered = 4 * world * rows * dim * b if world > 1 else 0  # both towers' gathered copies + gradients
    loss = int(_loss(loss_mode, rows, world, dim, dtype, chunk_size))
    states = sb.census_total + sb.buffers
    if contrastive_batch == "global" and accumulation > 1:
        cache = 4 * rows * dim * b  # both towers' cached embeddings and their gradients
        total = states + cache + max(act + sb.backward_buffers, gathered + loss)
    else:
        cache = 0
        total = states + act + sb.backward_buffers + gathered + loss
    bpp = {
        "weights": sb.weights / n, "partitions": sb.partitions / n, "grads": sb.grads / n,
        "optimizer_state": sb.optimizer_state / n, "buffers": (sb.buffers + sb.backward_buffers) / n,
    }
    return MemoryPrediction(
        model=spec.label(), ds_config=path, route=_route(prec), zero_stage=prec.zero_stage, world=world,
        micro_batch=micro_batch, accumulation=accumulation, checkpointing=checkpointing, loss_mode=loss_mode,
        contrastive_batch=contrastive_batch, params=n, bytes_per_param=bpp, model_state_bytes=sb.census_total,
        buffer_bytes=sb.buffers + sb.backward_buffers, activation_bytes=act,
        activation_bytes_per_sample=act_model.per_sample + act_model.recompute_per_sample, cache_bytes=cache,
        gathered_bytes=gathered, loss_bytes=loss, total_bytes=int(total), per_group=sb.per_group,
        backward_buffer_bytes=sb.backward_buffers,
    )


def _route(prec: Any) -> str:
    if prec.mode == "bf16" and prec.recipe_managed:
        return "bf16 SR, ZeRO-0 (replicated)"
    if prec.mode == "bf16":
        return "bf16 halfmaster (SR bf16 partitions)" if prec.half_master_partitions else "bf16 (fp32 partitions)"
    if prec.mode == "fp16":
        return "fp16 SR + loss scaling"
    return "fp32"


def _divisors_desc(n: int) -> list[int]:
    return sorted({d for i in range(1, int(n**0.5) + 1) if n % i == 0 for d in (i, n // i)}, reverse=True)


def plan(
    model: ModelSpec | str,
    gpus: int,
    gpu_memory: int | str,
    global_batch: int,
    *,
    headroom: float = 0.1,
    ds_config: str | Path | None = None,
    checkpointing: bool | None = None,
    loss_mode: str = "plain",
    contrastive_batch: str = "global",
    chunk_size: int = 4096,
    max_micro_batch: int | None = None,
    runner_ups: int = 5,
    ds_config_out: str | None = None,
    extra_args: tuple[str, ...] = (),
) -> Plan:
    """The configuration that fits ``gpu_memory`` (less ``headroom``) on each of ``gpus`` GPUs.

    Candidates: every ``ds_configs/*.json`` (or only ``ds_config``), gradient checkpointing off and
    on (or as given), every micro-batch dividing ``global_batch / gpus`` (accumulation = the
    quotient). Among those that fit: no checkpointing first, then the fewest accumulation steps, then
    the preferred JSON (the recipe's default ``zero0_bf16_sr`` first, then ZeRO-2, 1, 3), then the
    least memory.

    Raises:
        PlanError: Bad input, or nothing fits (the message names the term that is too big).
    """
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise PlanError(f"gpus must be a positive integer, got {gpus!r}")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlanError(f"global batch must be a positive integer, got {global_batch!r}")
    if global_batch % gpus:
        raise PlanError(f"global batch {global_batch} is not divisible by {gpus} GPUs")
    if not 0 <= headroom < 1:
        raise PlanError(f"headroom must be a fraction in [0, 1), got {headroom}")
    memory = parse_memory(gpu_memory) if isinstance(gpu_memory, str) else int(gpu_memory)
    usable = int(memory * (1 - headroom))
    spec = _spec(model)
    configs = [ds_config] if ds_config is not None else ds_configs(gpus)
    ckpts = (False, True) if checkpointing is None else (bool(checkpointing),)
    per_gpu = global_batch // gpus
    micros = [m for m in _divisors_desc(per_gpu) if max_micro_batch is None or m <= max_micro_batch]
    fitting: list[tuple[tuple, MemoryPrediction]] = []
    smallest: MemoryPrediction | None = None
    for ci, cfg in enumerate(configs):
        for ck in ckpts:
            for m in micros:  # descending: the first that fits is this (config, ckpt)'s best
                p = predict_memory(spec, cfg, gpus, m, ck, per_gpu // m, loss_mode, contrastive_batch, chunk_size)
                if smallest is None or p.total_bytes < smallest.total_bytes:
                    smallest = p
                if p.total_bytes <= usable:
                    fitting.append(((ck, p.accumulation, ci, p.total_bytes), p))
                    break
    if not fitting:
        raise PlanError(_nothing_fits(smallest, memory, usable, headroom))
    fitting.sort(key=lambda item: item[0])
    best = fitting[0][1]
    base_path, base = _read_config(best.ds_config)
    derived = dict(base)
    derived.update(train_micro_batch_size_per_gpu=best.micro_batch, gradient_accumulation_steps=best.accumulation,
                   train_batch_size=global_batch)
    out = ds_config_out or f"runs/plans/{Path(base_path).stem}_m{best.micro_batch}_k{best.accumulation}.json"
    return Plan(
        micro_batch=best.micro_batch, accumulation=best.accumulation, checkpointing=best.checkpointing,
        zero_stage=best.zero_stage, ds_config=_relative(base_path), precision_route=best.route,
        bytes_per_param=best.bytes_per_param, activation_bytes=best.activation_bytes, loss_bytes=best.loss_bytes,
        total_bytes_per_gpu=best.total_bytes, gpu_memory=memory, headroom=headroom, usable_bytes=usable, gpus=gpus,
        global_batch=global_batch,
        launch_command=launch_command(spec, gpus, out, best, extra_args),
        ds_config_out=out, ds_config_json=derived, prediction=best,
        runner_ups=tuple(p for _, p in fitting[1:1 + runner_ups]),
        vocabulary=vocabulary_note(spec.tokenizer, int(_meta_model(spec).text.config.vocab_size), spec.vocab_size),
    )


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def _nothing_fits(p: MemoryPrediction | None, memory: int, usable: int, headroom: float) -> str:
    if p is None:
        return "nothing to try: no DeepSpeed config and micro-batch candidates"
    terms = {
        "model states (weights, partitions, grads, optimizer state)": p.model_state_bytes,
        "reduce buckets": p.buffer_bytes,
        f"activations of micro-batch {p.micro_batch}": p.activation_bytes,
        "embedding cache": p.cache_bytes,
        "gathered embeddings": p.gathered_bytes,
        f"{p.loss_mode} loss": p.loss_bytes,
    }
    name, size = max(terms.items(), key=lambda kv: kv[1])
    return (f"nothing fits in {format_bytes(usable)} per GPU ({format_bytes(memory)} less {headroom:.0%} headroom): "
            f"the smallest candidate ({Path(p.ds_config).stem}, micro-batch {p.micro_batch} x accumulation "
            f"{p.accumulation}, checkpointing {'on' if p.checkpointing else 'off'}) needs {format_bytes(p.total_bytes)}; "
            f"its largest term is {name}: {format_bytes(size)}"
            + ("; the chunked loss keeps tiles only (--loss-mode chunked)" if p.loss_mode == "plain"
               and name.endswith("loss") else ""))


def launch_command(spec: ModelSpec, gpus: int, ds_path: str, p: MemoryPrediction, extra: tuple[str, ...] = ()) -> str:
    """The ``launch.sh`` command of a plan; every flag is one of ``recipe.train``'s."""
    args: list[str] = []
    for flag, value in (("--preset", spec.preset), ("--image-encoder", spec.image_encoder),
                        ("--text-encoder", spec.text_encoder), ("--embed-dim", spec.embed_dim),
                        ("--image-size", spec.image_size), ("--vocab-size", spec.vocab_size),
                        ("--context-length", spec.context_length)):
        if value is not None:
            args += [flag, str(value)]
    if not spec.image_master_weights:
        args.append("--no-image-master-weights")
    if spec.text_master_weights:
        args.append("--text-master-weights")
    if p.checkpointing:
        args.append("--grad-checkpointing")
    args += ["--loss-mode", p.loss_mode, "--contrastive-batch", p.contrastive_batch, *extra]
    import shlex

    return f"NUM_GPUS={gpus} DS_CONFIG={shlex.quote(ds_path)} bash launch.sh " + " ".join(shlex.quote(a) for a in args)
