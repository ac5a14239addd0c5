"""Model-state bytes per GPU (weights, partitions, gradients, optimizer state, buffers) for a ZeRO
stage and precision route, derived from the same accounting as the census.

:func:`benchmarks.bench_memory.measure_engine` reads, between backward and the optimizer step, the
module's weights, the flat partitions DeepSpeed hands the client optimizer, the gradients DeepSpeed
holds, SRAdamW's state and ZeRO's reduce buckets. This module predicts each of those from the
model's parameter layout (a ``meta``-device model: no memory, no time) without running DeepSpeed:

* the parameter groups are the recipe's own (:func:`recipe.training.param_groups.param_groups`, in the order
  DeepSpeed flattens them), with the state dtypes :func:`recipe.training.optimizer.build_optimizer` gives;
* the optimizer state is whatever ``SRAdamW._init_state`` creates on a ``meta`` partition of the
  route's dtype, so a change to the optimizer's state (e.g. how a master is stored) changes the
  prediction with it instead of silently contradicting a constant written here;
* ZeRO-1/2 (``stage_1_and_2.py``): each group is one flat buffer padded to a multiple of
  ``2 x world`` elements (DeepSpeed's ``nccl_start_alignment_factor``) and split into ``world`` equal
  partitions; after backward a rank holds the *whole* gradient of every parameter that touches its
  partition (the census shows it: 1.02 rather than 1.00 B/param for ViT-B-32 at N = 2);
* ZeRO-3 (``stage3.py``): every parameter is partitioned on its own (``ceil(numel / world)``);
  parameters of at most ``param_persistence_threshold`` elements stay gathered on every rank;
  the reduce bucket (``reduce_bucket_size`` elements) stays allocated;
* ZeRO-0 (the fp16 and bf16 ZeRO-0 routes): the optimizer updates the module's own weights, gradients are whole;
  on several ranks the overlapped all-reduce holds the sums in the reduction dtype in place of the gradients
  from the last backward to the step (no more memory when it is the gradients' dtype, the shipped JSON's).

Everything is the largest value over ranks (ranks differ by what touches their partition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from recipe.training.precision import Precision, sum_dtype

if TYPE_CHECKING:
    from .vocab import TokenizerShape

__all__ = ["GroupLayout", "ModelLayout", "ModelSpec", "StateBytes", "model_layout", "state_bytes", "zero_settings"]


@dataclass(frozen=True)
class ModelSpec:
    """Which model: a preset, or encoders by name (the flags of ``recipe.train`` with the same names).

    ``tokenizer`` is the run's tokenizer (:func:`recipe.plan.vocab.run_tokenizer`): as in the run, its
    vocabulary, special-token ids and context length size the text tower (``python -m recipe.plan``
    always gives one). Without it ``vocab_size`` sets the vocabulary; both ``None`` keep the text
    tower's own (e.g. CLIP's 49,408 tokens). ``vocab_size`` is also the launch command's ``--vocab-size``.
    """

    preset: str | None = "tiny"
    image_encoder: str | None = None
    text_encoder: str | None = None
    embed_dim: int | None = None
    image_size: int | None = None
    vocab_size: int | None = None
    context_length: int | None = None
    image_master_weights: bool = True
    text_master_weights: bool = False
    tokenizer: TokenizerShape | None = None

    def label(self) -> str:
        parts = [self.preset] if self.preset else []
        parts += [p for p in (self.image_encoder, self.text_encoder) if p]
        return " + ".join(parts)


@dataclass(frozen=True)
class GroupLayout:
    """One optimizer group as DeepSpeed flattens it: parameter sizes in order."""

    name: str
    numels: tuple[int, ...]
    master_weights: bool
    state_dtype: torch.dtype | None  # None: the group takes the route's SR state dtype


@dataclass(frozen=True)
class ModelLayout:
    """The parameter layout of a model (trainable parameters in optimizer-group order)."""

    spec: ModelSpec
    groups: tuple[GroupLayout, ...]
    params: int


def build_meta_model(spec: ModelSpec) -> torch.nn.Module:
    """The model on the ``meta`` device (shapes only), built by :func:`recipe.model.create_model` from
    the same arguments ``recipe.train`` passes (the tokenizer's shape standing in for the tokenizer)."""
    from recipe.model.clip import create_model

    tokenizer, context_length = spec.tokenizer, spec.context_length
    if tokenizer is not None and _pretrained_text(spec):
        # recipe.model: a tower with weights keeps its vocabulary and ids, only its context length follows the
        # tokenizer; built here without weights, create_model cannot tell, so it is told
        tokenizer, context_length = None, context_length or tokenizer.context_length
    overrides = {"vocab_size": spec.vocab_size} if spec.vocab_size and spec.tokenizer is None else None
    with torch.device("meta"):
        return create_model(
            spec.preset,
            image_encoder=spec.image_encoder,
            text_encoder=spec.text_encoder,
            embed_dim=spec.embed_dim,
            image_size=spec.image_size,
            text_overrides=overrides,
            context_length=context_length,
            text_load_weights=False,  # a local directory's weights are not needed for shapes
            tokenizer=tokenizer,
        )


def _pretrained_text(spec: ModelSpec) -> bool:
    """Whether ``recipe.train`` would load ``spec``'s text tower with weights (a local model directory)."""
    from recipe.model.clip import PRESETS
    from recipe.model.encoders import resolve_text_config

    name = spec.text_encoder or (PRESETS[spec.preset]().text.name if spec.preset in PRESETS else None)
    return name is not None and resolve_text_config(name)[1] is not None


def model_layout(spec: ModelSpec, model: torch.nn.Module | None = None) -> ModelLayout:
    """The recipe's optimizer groups of ``spec``'s model with their parameter sizes, in order."""
    from recipe.training.param_groups import param_groups

    model = model if model is not None else build_meta_model(spec)
    groups = []
    for g in param_groups(
        model, 0.2, text_master_weights=spec.text_master_weights, image_master_weights=spec.image_master_weights
    ):
        tower = g["name"].split(".")[0]
        mastered = bool(g["master_weights"])
        # recipe.training.optimizer.build_optimizer: mastered groups and the logit scale keep fp32 states
        dtype = torch.float32 if (mastered or tower in ("logit_scale", "logit_bias")) else None
        groups.append(GroupLayout(g["name"], tuple(int(p.numel()) for p in g["params"]), mastered, dtype))
    return ModelLayout(spec, tuple(groups), sum(sum(g.numels) for g in groups))


def zero_settings(ds_config: dict[str, Any]) -> Any:
    """DeepSpeed's own ZeRO config object for the JSON (its defaults: reduce_bucket_size, overlap_comm...)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    return DeepSpeedZeroConfig(**(ds_config.get("zero_optimization") or {}))


@dataclass
class StateBytes:
    """Bytes on the fullest rank, by kind (the census's columns)."""

    weights: int = 0
    partitions: int = 0
    grads: int = 0
    optimizer_state: int = 0
    buffers: int = 0  # ZeRO-3's reduce bucket (alive after backward, as the census shows)
    backward_buffers: int = 0  # ZeRO-1/2 reduce buckets: allocated during backward only
    per_group: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def census_total(self) -> int:
        """What the census's ``total`` column sums (weights, partitions, state, grads)."""
        return self.weights + self.partitions + self.grads + self.optimizer_state


def _state_bytes_per_element(partition_dtype: torch.dtype, group: GroupLayout, sr_state_dtype: torch.dtype) -> int:
    """Bytes of SRAdamW state per partition element, from the optimizer's own state initialisation
    on a one-element-wide ``meta`` tensor (tensors of one element, e.g. step counters, are left out,
    as the census leaves them out)."""
    from optim import SRAdamW

    p = torch.nn.Parameter(torch.empty(16, dtype=partition_dtype, device="meta"))
    dtype = group.state_dtype or sr_state_dtype
    opt = SRAdamW([{"params": [p], "master_weights": group.master_weights, "state_dtype": dtype}], lr=1e-3)
    state = opt._init_state(p, opt.param_groups[0])  # private, on purpose: the optimizer decides what exists
    total = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.numel() > 1)
    return total // 16


def state_bytes(layout: ModelLayout, prec: Precision, ds_config: dict[str, Any], world: int) -> StateBytes:
    """Model-state bytes on the fullest of ``world`` ranks for the precision route ``prec`` of
    ``ds_config`` (see the module docstring for which tensors exist)."""
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    stage = prec.zero_stage
    pdt = prec.param_dtype
    pb = pdt.itemsize
    part_dtype = pdt if prec.half_master_partitions else torch.float32
    zero = zero_settings(ds_config)
    if stage == 0:
        # module weights and whole gradients; the optimizer's state sits on the module's own weights
        out = StateBytes(weights=layout.params * pb, grads=layout.params * pb)
        for g in layout.groups:
            n = sum(g.numels)
            s = n * _state_bytes_per_element(pdt, g, prec.sr_state_dtype)
            out.optimizer_state += s
            out.per_group[g.name] = {"params": n, "partition": 0, "state": s}
        if world > 1 and prec.recipe_managed:
            # the overlapped all-reduce (recipe.training.overlap) holds the sums in the reduction dtype in
            # place of the gradients until the step: the difference when that dtype is the wider one
            out.backward_buffers = layout.params * max(0, sum_dtype(pdt, prec.reduce_dtype).itemsize - pb)
        return out
    if stage == 3:
        return _stage3(layout, prec, zero, world, part_dtype)
    return _stage12(layout, prec, zero, world, part_dtype)


def _stage12(layout: ModelLayout, prec: Precision, zero: Any, world: int, part_dtype: torch.dtype) -> StateBytes:
    pb = prec.param_dtype.itemsize
    align = 2 * world  # stage_1_and_2.py: nccl_start_alignment_factor (2) x world size
    per_rank = [StateBytes(weights=layout.params * pb) for _ in range(world)]
    for g in layout.groups:
        n = sum(g.numels)
        size = math.ceil(n / align) * align // world  # one rank's partition, padding included
        per_elem = _state_bytes_per_element(part_dtype, g, prec.sr_state_dtype)
        for r, sb in enumerate(per_rank):
            lo, hi, start, touched = r * size, (r + 1) * size, 0, 0
            for k in g.numels:  # whole gradients of every parameter touching [lo, hi)
                if start < hi and start + k > lo:
                    touched += k
                start += k
            sb.partitions += size * part_dtype.itemsize
            sb.optimizer_state += size * per_elem
            sb.grads += touched * pb
            sb.per_group[g.name] = {"params": n, "partition": size * part_dtype.itemsize, "state": size * per_elem}
    out = max(per_rank, key=lambda s: s.census_total)
    if zero.contiguous_gradients:  # setup_buckets(): one bucket (two with overlap_comm) during backward
        out.backward_buffers = int(zero.reduce_bucket_size) * pb * (2 if zero.overlap_comm else 1)
    return out


def _stage3(layout: ModelLayout, prec: Precision, zero: Any, world: int, part_dtype: torch.dtype) -> StateBytes:
    pb = prec.param_dtype.itemsize
    out = StateBytes()
    keep = int(zero.param_persistence_threshold)
    for g in layout.groups:
        shard = sum(math.ceil(k / world) for k in g.numels)
        per_elem = _state_bytes_per_element(part_dtype, g, prec.sr_state_dtype)
        # each parameter's own partition; small ("persistent") parameters also stay whole on every rank
        out.weights += shard * pb + sum(k * pb for k in g.numels if k <= keep and world > 1)
        out.partitions += shard * part_dtype.itemsize
        out.optimizer_state += shard * per_elem
        out.grads += shard * pb
        out.per_group[g.name] = {
            "params": sum(g.numels), "partition": shard * part_dtype.itemsize, "state": shard * per_elem
        }
    out.buffers = int(zero.reduce_bucket_size) * pb  # the census finds it alive after backward
    return out
