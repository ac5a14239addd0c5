"""The exact fp32 weights a checkpoint's optimizer keeps: :func:`read_masters`.

``model_weights.pt`` holds the module's weights in the training dtype. SRAdamW keeps, for its
mastered groups (the image tower and the logit scale by default, :mod:`recipe.training.param_groups`), a
float32 master of which the module weight is only the rounding: either a float32 ``master`` state
(the fp16 route, ``master_format="fp32"``) or the split form, where the bf16 weight is the master's
high half and an int16 ``master_low`` state its low 16 bits (:func:`optim.master16.join_master`).
This module reads those masters out of the sharded optimizer files, bit for bit, whatever the ZeRO
stage and the world size the checkpoint was saved with:

* **ZeRO-1/2** (``[bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt``, one per saved rank): each
  optimizer group is one flat tensor partitioned over the ranks. The saved partitions of the weights
  (``single_partition_of_fp32_groups``, without DeepSpeed's end padding) are joined in rank order, and
  each per-element state is cut to its rank's partition length and joined the same way. The flat order
  is ``param_shapes`` of ``mp_rank_00_model_states.pt`` (per group, names and shapes; DeepSpeed's
  round-robin order when that is on), with ``param_alignment_paddings`` elements after each parameter.
* **ZeRO-3** (same file names; ``zero_pp_rank_0_mp_rank_00_model_states.pt`` holds ``param_shapes``
  per sub-group): each parameter is split into ``ceil(numel / world)`` elements per rank; a rank's flat
  tensor of a sub-group is its pieces of the sub-group's parameters in order. The weights
  (``fp32_flat_groups``) and the states are joined parameter by parameter
  (:func:`recipe.run.elastic.join_pieces`). The optimizer's state ids are the sub-groups in order (DeepSpeed
  appends each group's sub-groups to it in sub-group order, and sub-groups are made group by group).
* **ZeRO-0** (the fp16 and bf16 recipe-managed routes): SRAdamW's full state dict is in
  ``mp_rank_00_model_states.pt`` (key ``optimizer``) next to the module; its parameter indices follow
  SRAdamW's group order, which :func:`recipe.training.param_groups.param_groups` makes from the model. The groups
  are rebuilt from the run's model (``model_config.json``) and ``config.json`` (``--lock-image``,
  ``--lock-text``, ``--layer-decay``: what decides which parameters a group holds) and matched by group
  name; every parameter's state must have the parameter's shape.

Where DeepSpeed itself keeps float32 partitions under half-precision module weights (ZeRO-1/2/3 bf16
without ``bf16_master_weights_and_grads``), those partitions are the masters of every parameter of
the group, and are returned as such. Parameters whose optimizer keeps no float32 copy (SR groups: the
bf16/fp16 weight is all there is, and its float32 upcast is exact), or no state yet (a checkpoint
before the first optimizer step, or whose every step was skipped), are absent from the result.

Every layout mismatch or unreadable file is a :class:`recipe.run.checkpoint.CheckpointError` naming the
file. The files are memory-mapped, so the optimizer state is not read into memory all at once.

The other direction, into a live engine: :func:`set_live_masters` gives the optimizer of a run that
starts from fp32 weights (``--init-from``) those weights as its exact masters, so that an export read
back by ``--init-from`` and exported again is the same bit for bit.
"""

from __future__ import annotations

import json
import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from optim.master16 import join_master, split_master

from ..run.elastic import base_states, cut_pieces, join_pieces, saved_world_size, zero_files
from ..run.files import COMPLETE, CheckpointError, read_file
from ..training.param_groups import param_groups, tower_of

__all__ = ["read_masters", "has_optimizer_state", "set_live_masters", "LiveMasters", "MODEL_STATES",
           "ZERO3_MODEL_STATES"]

#: DeepSpeed's module file under ZeRO 0-2 (ZeRO-0: also the client optimizer's full state).
MODEL_STATES = "mp_rank_00_model_states.pt"
#: DeepSpeed's module file of rank 0 under ZeRO-3 (``param_shapes`` per sub-group).
ZERO3_MODEL_STATES = "zero_pp_rank_0_mp_rank_00_model_states.pt"

_MASTER_KEYS = ("master_low", "master")


def has_optimizer_state(tag_dir: str | Path) -> bool:
    """Whether checkpoint ``tag_dir`` is one that training saved whole, whose optimizer state
    :func:`read_masters` must find: it holds DeepSpeed's files or the per-rank client states
    (``rankNNNNN.pt``). False for a checkpoint reduced to ``model_weights.pt`` (copied for inference):
    it has no masters to read."""
    tag_dir = Path(tag_dir)
    return (bool(zero_files(tag_dir)) or (tag_dir / MODEL_STATES).is_file() or (tag_dir / ZERO3_MODEL_STATES).is_file()
            or any(tag_dir.glob("rank[0-9][0-9][0-9][0-9][0-9].pt")))


def read_masters(tag_dir: str | Path, model: torch.nn.Module | None = None) -> dict[str, torch.Tensor]:
    """``{parameter name: float32 master}`` of every parameter the checkpoint's optimizer keeps an exact
    float32 copy of (module docstring), in the parameter's shape, bit for bit; others are absent.

    Args:
        tag_dir: A complete checkpoint tag directory (``<run>/checkpoints/stepNNNNNNNN``).
        model: The run's model (any dtype; its parameter names, shapes and modules are read, its values
            are not). Needed only for ZeRO-0 checkpoints, to map the optimizer's parameter indices to
            names; built from the run directory (``model_config.json``, ``tokenizer``) when omitted.

    Raises:
        CheckpointError: A missing or unreadable file, or a layout that does not fit (named).
    """
    tag_dir = Path(tag_dir)
    if not (tag_dir / COMPLETE).is_file():
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {COMPLETE} marker)")
    files = zero_files(tag_dir)
    if not files:
        return _zero0(tag_dir, model)
    world = saved_world_size(tag_dir) or len(files)
    if sorted(files) != list(range(world)):
        some = files[min(files)].name.replace(f"rank_{min(files)}_", "rank_<R>_")
        missing = sorted(set(range(world)) - set(files))
        raise CheckpointError(f"checkpoint {tag_dir} was saved by {world} ranks ({COMPLETE}) but holds the ZeRO "
                              f"optimizer files ({some}) of ranks {sorted(files)}; missing: ranks {missing}")
    saved = [_load(files[r], "optimizer_state_dict") for r in range(world)]
    if int(saved[0].get("zero_stage", 2)) >= 3:
        return _zero3(tag_dir, files, saved)
    return _zero12(tag_dir, files, saved)


# --------------------------------------------------------------------------------------------------
# files
# --------------------------------------------------------------------------------------------------


def _load(path: Path, key: str | None = None) -> Any:
    """A checkpoint file (memory-mapped; ``key`` of it), or a CheckpointError naming the file."""
    _import_deepspeed_quietly()
    return read_file(path, key, mmap=True)


def _import_deepspeed_quietly() -> None:
    """DeepSpeed's files pickle its classes, so reading them imports DeepSpeed, which on a machine without
    an accelerator logs "Setting accelerator to CPU...": nothing about an export, so not shown."""
    if "deepspeed" in sys.modules:
        return
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        pass  # unpickling then names what is missing
    finally:
        logging.disable(before)


def _layout(path: Path) -> list[list[tuple[str, tuple[int, ...]]]]:
    """``param_shapes`` of a DeepSpeed model-states file: per (sub-)group the names and shapes in flat order."""
    shapes = _load(path).get("param_shapes")
    if not shapes:
        raise CheckpointError(f"{path} holds no param_shapes (the flat order of the ZeRO optimizer's groups)")
    return [[(name, tuple(shape)) for name, shape in group.items()] for group in shapes]


def _check_towers(group: str, names: list[str], where: str) -> None:
    """A recipe optimizer group (``image.*``, ``text.*``, ``logit_scale``...) holds parameters of its part
    of the model only: a layout read in another order than the optimizer's fails here, not silently."""
    part = group.split(".")[0]
    if part not in ("image", "text", "logit_scale", "logit_bias"):
        return  # not a recipe group name (another optimizer's): nothing to compare
    wrong = [n for n in names if _tower(n) != part]
    if wrong:
        raise CheckpointError(f"{where}: optimizer group {group!r} would hold {wrong[:3]}, which belong to "
                              f"another part of the model: the parameter layout does not fit the optimizer state")


def _tower(name: str) -> str | None:
    try:
        return tower_of(name)
    except ValueError:
        return None


def _masters_of_flat(weights: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor | None:
    """The float32 masters of one flat group: DeepSpeed's float32 partitions, or SRAdamW's split or
    float32 master state; None when the group keeps none."""
    if weights.dtype == torch.float32:
        return weights
    if "master_low" in state:
        return join_master(weights, state["master_low"])
    if "master" in state:
        return state["master"].to(torch.float32)
    return None


# --------------------------------------------------------------------------------------------------
# ZeRO-1/2
# --------------------------------------------------------------------------------------------------


def _zero12(tag_dir: Path, files: dict[int, Path], saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    module_file = tag_dir / MODEL_STATES
    layout = _layout(module_file)
    where = f"{files[0]} (+ {len(files) - 1} more ranks) with {module_file.name}"
    per_rank = []
    for r, sd in enumerate(saved):
        try:
            parts = list(sd["single_partition_of_fp32_groups"])
            states, _, groups = base_states(sd)
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{files[r]} is not a ZeRO-1/2 optimizer file: no {e}") from e
        if len(parts) != len(layout) or len(states) != len(layout):
            raise CheckpointError(f"{files[r]} holds {len(parts)} weight partitions and {len(states)} optimizer "
                                  f"groups, {module_file} lists {len(layout)} groups")
        per_rank.append((parts, states, groups))
    # DeepSpeed's alignment padding after each parameter (zero_optimization.parameter_alignment)
    paddings = saved[0].get("param_alignment_paddings") or [[0] * len(g) for g in layout]
    groups = per_rank[0][2]
    out: dict[str, torch.Tensor] = {}
    for g, params in enumerate(layout):
        name = groups[g].get("name", str(g)) if groups else str(g)
        pads = list(paddings[g]) if g < len(paddings) else []
        if len(pads) != len(params):
            raise CheckpointError(f"{where}: optimizer group {name!r} has {len(params)} parameters in param_shapes, "
                                  f"{len(pads)} in param_alignment_paddings")
        numel = sum(math.prod(s) for _, s in params) + sum(pads)
        lengths = [per_rank[r][0][g].numel() for r in range(len(saved))]  # saved without DeepSpeed's end padding
        weights = torch.cat([per_rank[r][0][g].reshape(-1) for r in range(len(saved))])
        if weights.numel() != numel:
            raise CheckpointError(f"{where}: optimizer group {name!r} holds {weights.numel()} elements, its "
                                  f"param_shapes {numel}")
        keys = [k for k in _MASTER_KEYS if k in per_rank[0][1][g]]
        state = {}
        for key in keys:
            pieces = []
            for r in range(len(saved)):
                t = per_rank[r][1][g].get(key)
                if t is None or t.numel() < lengths[r]:
                    raise CheckpointError(f"{files[r]}: optimizer group {name!r} state {key!r} is missing or shorter "
                                          f"({None if t is None else t.numel()}) than its partition ({lengths[r]})")
                pieces.append(t.reshape(-1)[: lengths[r]])
            state[key] = torch.cat(pieces)
        _check_towers(name, [n for n, _ in params], where)
        masters = _masters_of_flat(weights, state)
        if masters is None:
            continue
        offset = 0
        for (pname, shape), pad in zip(params, pads):
            n = math.prod(shape)
            out[pname] = masters[offset : offset + n].reshape(shape).clone()
            offset += n + pad
    return out


# --------------------------------------------------------------------------------------------------
# ZeRO-3
# --------------------------------------------------------------------------------------------------


def _zero3(tag_dir: Path, files: dict[int, Path], saved: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    module_file = tag_dir / ZERO3_MODEL_STATES
    layout = _layout(module_file)
    where = f"{files[0]} (+ {len(files) - 1} more ranks) with {module_file.name}"
    try:
        flats = [list(sd["fp32_flat_groups"]) for sd in saved]
        bases = [sd["optimizer_state_dict"] for sd in saved]
        groups = bases[0]["param_groups"]
    except (KeyError, TypeError) as e:
        raise CheckpointError(f"{where}: not a ZeRO-3 optimizer file: no {e}") from e
    owner: list[str] = []  # per state id, in order: the sub-groups (module docstring)
    ids: list[int] = []
    for g, group in enumerate(groups):
        ids += list(group["params"])
        owner += [group.get("name", str(g))] * len(group["params"])
    if ids != list(range(len(layout))) or any(len(f) != len(layout) for f in flats):
        raise CheckpointError(f"{where}: the optimizer's state ids {ids} and {len(flats[0])} weight sub-groups do not "
                              f"match the {len(layout)} sub-groups of param_shapes")
    out: dict[str, torch.Tensor] = {}
    for sub, params in enumerate(layout):
        name = owner[sub]
        numels = [math.prod(s) for _, s in params]
        what = f"{where}: sub-group {sub} ({name})"
        weights = join_pieces([f[sub] for f in flats], numels, f"{what} weights")
        states = [b["state"].get(sub, {}) for b in bases]
        state = {}
        for key in _MASTER_KEYS:
            if key in states[0]:
                if any(key not in s for s in states):
                    raise CheckpointError(f"{what}: state {key!r} is missing on some ranks")
                state[key] = join_pieces([s[key] for s in states], numels, f"{what} state {key!r}")
        _check_towers(name, [n for n, _ in params], where)
        for j, (pname, shape) in enumerate(params):
            masters = _masters_of_flat(weights[j], {k: v[j] for k, v in state.items()})
            if masters is not None:
                out[pname] = masters.reshape(shape).clone()
    return out


# --------------------------------------------------------------------------------------------------
# ZeRO-0
# --------------------------------------------------------------------------------------------------


def _zero0(tag_dir: Path, model: torch.nn.Module | None) -> dict[str, torch.Tensor]:
    module_file = tag_dir / MODEL_STATES
    ckpt = _load(module_file)
    opt = ckpt.get("optimizer") if isinstance(ckpt, dict) else None
    if not isinstance(opt, dict) or "state" not in opt or "param_groups" not in opt:
        raise CheckpointError(f"{module_file} holds no optimizer state (key 'optimizer'), and the checkpoint has no "
                              "ZeRO optimizer files")
    state, saved_groups = opt["state"], opt["param_groups"]
    if not any(k in s for s in state.values() for k in _MASTER_KEYS):
        return {}  # no masters kept (SR groups only, fp32, or no step taken yet): nothing to map
    if model is None:
        from .architecture import build_architecture  # the run's model, as load_run builds it

        model = build_architecture(tag_dir.parent.parent)[2]
    rebuilt = {g["name"]: g["params"] for g in _rebuilt_groups(model, tag_dir.parent.parent, saved_groups)}
    names = {id(p): n for n, p in model.named_parameters()}
    module = ckpt.get("module") or {}
    out: dict[str, torch.Tensor] = {}
    for g, group in enumerate(saved_groups):
        gname = group.get("name", str(g))
        params = rebuilt.get(gname)
        if params is None or len(params) != len(group["params"]):
            raise CheckpointError(
                f"{module_file}: optimizer group {gname!r} holds {len(group['params'])} parameters, the run's model "
                f"rebuilt from model_config.json and config.json gives it "
                f"{'none' if params is None else len(params)}: cannot map the optimizer state to parameter names")
        for pid, p in zip(group["params"], params):
            s = state.get(pid, {})
            name = names[id(p)]
            for key in ("exp_avg", *_MASTER_KEYS):
                if key in s and tuple(s[key].shape) != tuple(p.shape):
                    raise CheckpointError(
                        f"{module_file}: optimizer state {pid} ({gname}) has {key} of shape {tuple(s[key].shape)}, "
                        f"the rebuilt group's parameter {name} {tuple(p.shape)}: cannot map the optimizer state to "
                        "parameter names")
            if "master_low" in s:
                hi = module.get(name)
                if hi is None or hi.dtype != torch.bfloat16 or hi.shape != s["master_low"].shape:
                    raise CheckpointError(f"{module_file}: {name} has a split master but its module weight is "
                                          f"{'missing' if hi is None else f'{hi.dtype} {tuple(hi.shape)}'}")
                out[name] = join_master(hi, s["master_low"]).clone()
            elif "master" in s:
                out[name] = s["master"].to(torch.float32).clone()
    return out


def _rebuilt_groups(model: torch.nn.Module, run_dir: Path, saved_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """SRAdamW's groups as training built them (:func:`recipe.training.optimizer.build_optimizer`): their names
    and parameter lists, which depend on the model and, of the run's settings, on the towers it locked
    and on ``--layer-decay`` (the split of the image tower by layer; any decay gives the same split)."""
    path = run_dir / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path} (the run's settings, needed to map a ZeRO-0 optimizer state "
                              f"to parameter names): {e}") from e
    m, o = cfg.get("model", {}), cfg.get("optim", {})
    layered = o.get("layer_decay") is not None or any(str(g.get("name", "")).startswith("image.layer")
                                                     for g in saved_groups)
    with _locked(model, bool(m.get("lock_image")), int(m.get("lock_image_unlocked_groups") or 0),
                 bool(m.get("lock_text"))):
        return param_groups(model, 0.0, layer_decay=(o.get("layer_decay") or 1.0) if layered else None)


@contextmanager
def _locked(model: Any, image: bool, unlocked_groups: int, text: bool) -> Iterator[None]:
    """The model with the run's towers locked (:func:`recipe.train.build_model`), as it was afterwards."""
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    visual = getattr(model, "visual", None)
    norms = list(getattr(visual, "frozen_norms", []))
    try:
        if image:
            model.lock_image_tower(unlocked_groups)
        if text:
            model.lock_text_tower()
        yield
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(trainable[n])
        if image and visual is not None:
            visual.frozen_norms = norms
            visual.train(visual.training)


# --------------------------------------------------------------------------------------------------
# into a live engine: the exact fp32 masters of a run's start
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LiveMasters:
    """What :func:`set_live_masters` did.

    Attributes:
        mastered: The parameters whose optimizer keeps an fp32 copy, which now holds the source's value
            bit for bit.
        rounded: The other tensors (parameters of SR groups, frozen parameters, buffers) whose source
            value the half-precision module could not hold: it was rounded (to nearest even).
        without_master: How many tensors with a source value keep no fp32 copy (``rounded`` among them).
        dtype: The module's dtype of the first rounded tensor (``None`` when none was rounded).
    """

    mastered: tuple[str, ...]
    rounded: tuple[str, ...]
    without_master: int
    dtype: torch.dtype | None

    def note(self, source: str) -> str | None:
        """The run's one line about the rounded tensors (``None`` when none was rounded)."""
        if not self.rounded:
            return None
        dtype = str(self.dtype).replace("torch.", "")
        return (f"--init-from {source}: {len(self.rounded)} of the {self.without_master} tensors that keep no fp32 "
                f"master here (stochastic-rounding groups, frozen parameters, buffers) were rounded from its fp32 "
                f"values to {dtype}; the {len(self.mastered)} parameters of mastered groups start from them exactly")


@torch.no_grad()
def set_live_masters(engine: Any, values: dict[str, torch.Tensor]) -> LiveMasters:
    """Makes the fp32 ``values`` (by parameter name; the fp32 weights a run starts from) the exact masters
    of every parameter whose optimizer keeps an fp32 copy, and the module weights what the optimizer's
    rounding of them is (for the split master: the high half, ties away from zero, where the cast to
    bf16 rounded ties to even). Every rank calls it after ``deepspeed.initialize`` and before the first
    step, with the same ``values``.

    The fp32 copy is SRAdamW's master of a mastered group (:meth:`optim.SRAdamW.set_master`), set on
    the tensors SRAdamW updates: the module's own under ZeRO-0, this rank's flat partition of each group
    under ZeRO-1/2 (parameters in DeepSpeed's flat order with its alignment padding) and of each
    sub-group under ZeRO-3 (each parameter's piece). DeepSpeed's own fp32 partitions (bf16 ZeRO-1/2/3
    without ``bf16_master_weights_and_grads``) and fp32 runs are exact too. A flat group that holds a
    parameter without a value (e.g. a SigLIP bias the source lacks) is left as it is.

    Raises:
        ValueError: A value whose shape is not its parameter's.
    """
    module = engine.module
    params = dict(module.named_parameters())
    for name, v in values.items():
        p = params.get(name)
        shape = tuple(p.ds_shape if hasattr(p, "ds_shape") else p.shape) if p is not None else None
        if p is not None and tuple(v.shape) != shape:
            raise ValueError(f"the fp32 value of {name} has shape {tuple(v.shape)}, the parameter {shape}")
    stage = int(engine.zero_optimization_stage())
    if stage == 0:
        mastered = _set_zero0(engine.optimizer, params, values)
    elif stage >= 3:
        mastered = _set_zero3(engine, values)
    else:
        mastered = _set_zero12(engine, values)
    done = set(mastered)
    without, rounded, dtype = 0, [], None
    tensors = {**params, **dict(module.named_buffers())}
    for name, v in values.items():
        t = tensors.get(name)
        if t is None or name in done or not t.is_floating_point():
            continue
        without += 1
        if t.dtype != torch.float32 and not torch.equal(v.to(t.dtype).to(torch.float32), v.to(torch.float32)):
            rounded.append(name)
            dtype = dtype or t.dtype
    order = [n for n in params if n in done]
    return LiveMasters(tuple(order), tuple(rounded), without, dtype)


def _value32(values: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    return values[name].detach().to(torch.float32).reshape(-1)


def _keeps_master(group: dict[str, Any], p: torch.Tensor) -> bool:
    """Whether SRAdamW keeps an fp32 copy of ``p``: a float32 tensor, or a group with masters."""
    return p.dtype == torch.float32 or bool(group.get("master_weights"))


def _set_zero0(opt: Any, params: dict[str, torch.Tensor], values: dict[str, torch.Tensor]) -> list[str]:
    """ZeRO-0: SRAdamW updates the module's own tensors."""
    names = {id(p): n for n, p in params.items()}
    out = []
    for group in opt.param_groups:
        for p in group["params"]:
            name = names.get(id(p))
            if name in values and _keeps_master(group, p):
                opt.set_master(p, _value32(values, name))
                out.append(name)
    return out


def _module_value(opt: Any, flat: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """What the module weight of a parameter whose fp32 master is ``value`` is after
    :meth:`optim.SRAdamW.set_master` on its flat tensor ``flat``: the split master's high half, else the
    value (cast to the module's dtype by the copy: round to nearest even, as the optimizer's copy)."""
    if "master_low" in opt.state.get(flat, {}):
        return split_master(value)[0]
    return value


def _set_zero12(engine: Any, values: dict[str, torch.Tensor]) -> list[str]:
    """ZeRO-1/2: this rank's partition of each flat group (elastic's layout), and the full module."""
    zo = engine.optimizer
    opt = zo.optimizer
    names = {id(p): n for n, p in engine.module.named_parameters()}
    out = []
    for i, group in enumerate(opt.param_groups):
        flat = group["params"][0]
        members = [names[id(p)] for p in zo.round_robin_bit16_groups[i]]
        if not _keeps_master(group, flat) or any(n not in values for n in members):
            continue
        pieces = []
        for name, pad in zip(members, zo.round_robin_bit16_padding[i]):
            pieces += [_value32(values, name), torch.zeros(int(pad), dtype=torch.float32)]
        full = torch.cat(pieces)
        pid = torch.distributed.get_rank(group=zo.real_dp_process_group[i])
        size, pad = int(zo.partition_size[i]), int(zo.groups_padding[i])
        part = torch.zeros(size, dtype=torch.float32)
        part[: size - pad] = full[pid * size : pid * size + size - pad]
        opt.set_master(flat, part)
        for p, name in zip(zo.round_robin_bit16_groups[i], members):  # every rank holds the full module
            p.data.copy_(_module_value(opt, flat, _value32(values, name)).reshape(p.shape))
        out += members
    return out


def _set_zero3(engine: Any, values: dict[str, torch.Tensor]) -> list[str]:
    """ZeRO-3: this rank's pieces of each sub-group's parameters (elastic's layout); the module's
    partitioned weights through DeepSpeed's gather-and-modify context."""
    import deepspeed

    zo = engine.optimizer
    opt = zo.optimizer
    pid = torch.distributed.get_rank(group=zo.dp_process_group)
    world = torch.distributed.get_world_size(group=zo.dp_process_group)
    names = engine.param_names
    out, module_values = [], {}
    for sub, members in enumerate(zo.fp16_groups):
        flat = zo.fp32_partitioned_groups_flat[sub]
        group = opt.param_groups[zo.sub_group_to_group_id[sub]]
        member_names = [names[p] for p in members]
        if not _keeps_master(group, flat) or any(n not in values for n in member_names):
            continue
        held, group["params"] = group["params"], [flat]  # DeepSpeed lists a sub-group's tensor only for its step
        try:
            opt.set_master(flat, cut_pieces([_value32(values, n) for n in member_names], pid, world))
        finally:
            group["params"] = held
        for p, name in zip(members, member_names):
            module_values[p] = _module_value(opt, flat, _value32(values, name))
        out += member_names
    changed = list(module_values)
    if changed:
        with deepspeed.zero.GatheredParameters(changed, modifier_rank=0):
            for p, v in module_values.items():
                p.data.copy_(v.reshape(p.shape))
    return out
