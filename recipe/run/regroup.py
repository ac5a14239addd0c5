"""Optimizer state mapped by parameter name: a resume whose optimizer groups are not the checkpoint's.

``--layer-decay`` turned on or off splits the image tower's groups by layer or joins them, and
``--lock-image`` / ``--lock-image-unlocked-groups`` / ``--lock-text`` take parameters out of the
optimizer or put them in. DeepSpeed's ``load_checkpoint`` loads optimizer state by group position, so
such a resume loads the module alone and this module carries the optimizer state over parameter by
parameter (:func:`load_by_name`):

* **ZeRO-0** (the recipe-managed bf16 and fp16 routes; SRAdamW updates the module's own tensors): the
  saved state dict (``mp_rank_00_model_states.pt``, key ``optimizer``) lists each group's parameters by
  position; the checkpoint's groups are rebuilt from the model with the checkpoint's settings
  (:func:`recipe.training.param_groups.param_groups` with its ``--layer-decay`` and lock flags) and must hold as
  many parameters as the saved groups, each state of its parameter's shape. Every parameter that is
  still trained keeps its whole state (statistics, master, its own step count) bit for bit; a
  parameter locked now loses it; one trainable now and frozen then starts fresh at its first step.
* **ZeRO-1/2**: each group is one flat tensor partitioned over the ranks. Every saved rank's
  partitions are joined, cut into parameters by DeepSpeed's ``param_shapes`` (names, shapes and
  alignment padding in flat order), and this rank's partition of each new group is assembled from its
  parameters' pieces where DeepSpeed puts them (any world size). The weights of DeepSpeed's
  partitions come back the same way (exact fp32 masters included). A flat group has one step count:
  a new group must take all its parameters from saved groups at one step, or none of them (then its
  state starts at its first step); a group mixing trained and newly trainable parameters is refused
  (:class:`RegroupError`), as are fp16 statistics with one scale per partition.
* **ZeRO-3** is not handled here (the caller refuses it).

The noise stream index of every tensor with state is renumbered in the new group order (SRAdamW gives
a new tensor the next free one), the optimizer's seed and skipped-step count are kept, and the groups'
hyperparameters are this run's.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import torch

from ..training.param_groups import group_layout, locked_parameters, param_groups
from .elastic import base_states, zero_files
from .files import CheckpointError, read_file

__all__ = ["RegroupError", "Regrouped", "load_by_name", "named_state"]

#: DeepSpeed's module file under ZeRO 0-2 (ZeRO-0: also the client optimizer's full state).
MODEL_STATES = "mp_rank_00_model_states.pt"


class RegroupError(ValueError):
    """The checkpoint's optimizer state cannot be carried over to this run's groups (the caller names
    the flag that changed them)."""


@dataclasses.dataclass
class Regrouped:
    """What :func:`load_by_name` did: groups before and after, and the parameters (elements) whose state
    was carried over, dropped (no longer trained) and fresh (trained now, no saved state)."""

    groups_before: int
    groups_after: int
    kept: int
    dropped: int
    fresh: int

    def describe(self) -> str:
        parts = [f"optimizer state mapped by parameter name: {self.groups_before} groups -> {self.groups_after}"]
        if self.dropped:
            parts.append(f"{self.dropped:,} parameters frozen, their state dropped")
        if self.fresh:
            parts.append(f"{self.fresh:,} parameters trained with fresh state")
        return "; ".join(parts)


def load_by_name(engine: Any, opt: torch.optim.Optimizer, tag_dir: Path, saved: dict[str, Any]) -> Regrouped:
    """Loads the optimizer state of checkpoint ``tag_dir`` into ``opt`` (SRAdamW, this run's groups) by
    parameter name. The module must be loaded already (:func:`recipe.run.checkpoint.load` with
    ``optimizer_states=False``); under ZeRO-1/2 DeepSpeed's partitions then hold the module's weights,
    which the saved partitions replace.

    ``saved`` is the checkpoint's settings as :func:`recipe.run.resume.record` keeps them (``optim.layer_decay``,
    ``model.lock_image``, ``model.lock_image_unlocked_groups``, ``model.lock_text``): ZeRO-0 rebuilds the
    saved groups from them.

    Raises:
        RegroupError: A group that cannot be assembled (module docstring).
        CheckpointError: Missing or unreadable files, or saved groups that do not fit the model.
    """
    stage = int(engine.zero_optimization_stage())
    if stage == 0:
        return _zero0(engine.module, opt, Path(tag_dir), saved)
    if stage in (1, 2):
        return _zero12(engine, Path(tag_dir))
    raise RegroupError(f"ZeRO-{stage} optimizer state cannot be mapped to other groups")


# --------------------------------------------------------------------------------------------------
# ZeRO-0: SRAdamW's state per parameter
# --------------------------------------------------------------------------------------------------


def saved_layout(model: torch.nn.Module, saved: dict[str, Any]) -> list[tuple[str, list[str]]]:
    """The checkpoint's groups (names, parameter names) rebuilt from its settings: the parameters its
    lock flags leave trainable (of those trainable now or locked now), split by its ``--layer-decay``."""
    locked_now = {n for n, p in model.named_parameters() if not p.requires_grad}
    locked_then = locked_parameters(model, bool(saved.get("model.lock_image")),
                                    int(saved.get("model.lock_image_unlocked_groups") or 0),
                                    bool(saved.get("model.lock_text")))
    trainable = {n for n, _ in model.named_parameters() if n not in locked_then}
    # a parameter frozen now by something other than the lock flags was frozen then too
    trainable -= locked_now - _all_locked(model)
    groups = param_groups(model, 0.0, layer_decay=saved.get("optim.layer_decay"), trainable=trainable)
    return group_layout(groups, model)


def _all_locked(model: torch.nn.Module) -> set[str]:
    return locked_parameters(model, True, 0, True)


def _zero0(model: torch.nn.Module, opt: torch.optim.Optimizer, tag_dir: Path, saved: dict[str, Any]) -> Regrouped:
    module_file = tag_dir / MODEL_STATES
    sd = read_file(module_file, "optimizer")
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise CheckpointError(f"{module_file} holds no optimizer state (key 'optimizer')")
    layout = dict(saved_layout(model, saved))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    by_name: dict[str, dict[str, Any]] = {}
    for g, group in enumerate(sd["param_groups"]):
        gname = str(group.get("name", g))
        names = layout.get(gname)
        if names is None or len(names) != len(group["params"]):
            raise CheckpointError(
                f"{module_file}: optimizer group {gname!r} holds {len(group['params'])} parameters, the model "
                f"rebuilt with the checkpoint's settings gives it {'none' if names is None else len(names)}: cannot "
                "map the optimizer state to parameter names")
        for pid, name in zip(group["params"], names):
            state = sd["state"].get(pid)
            if not state:
                continue
            for key, value in state.items():
                if torch.is_tensor(value) and value.dim() > 0 and tuple(value.shape) != shapes[name]:
                    raise CheckpointError(f"{module_file}: optimizer state {key!r} of {name} ({gname}) has shape "
                                          f"{tuple(value.shape)}, the parameter {shapes[name]}")
            by_name[name] = state
    names = {id(p): n for n, p in model.named_parameters()}
    new_state: dict[int, dict[str, Any]] = {}
    new_groups = []
    pid, index, kept, fresh = 0, 0, set(), 0
    for group in opt.param_groups:
        ids = []
        for p in group["params"]:
            name = names[id(p)]
            state = by_name.get(name)
            if state is not None:
                state = dict(state)
                if "index" in state:  # noise streams numbered anew, in this run's order
                    state["index"] = index
                    index += 1
                new_state[pid] = state
                kept.add(name)
            else:
                fresh += p.numel()
            ids.append(pid)
            pid += 1
        new_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": ids})
    new_sd: dict[str, Any] = {"state": new_state, "param_groups": new_groups}
    if "sr" in sd:
        new_sd["sr"] = sd["sr"]
    opt.load_state_dict(new_sd)
    numel = {n: math.prod(shape) for n, shape in shapes.items()}
    return Regrouped(len(sd["param_groups"]), len(opt.param_groups), sum(numel[n] for n in kept),
                     sum(numel[n] for n in set(by_name) - kept), fresh)


# --------------------------------------------------------------------------------------------------
# ZeRO-1/2: flat groups partitioned over the ranks
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class _Piece:
    """One parameter's part of a saved flat group: its weights and per-element states (full, flat),
    and the group's scalar states."""

    group: str
    weight: torch.Tensor
    states: dict[str, torch.Tensor]
    scalars: dict[str, Any]


def _saved_pieces(tag_dir: Path) -> tuple[dict[str, _Piece], Any, int]:
    """Every parameter's saved piece by name, the optimizer's ``sr`` entry and the number of saved groups."""
    files = zero_files(tag_dir)
    if not files or sorted(files) != list(range(len(files))):
        raise CheckpointError(f"checkpoint {tag_dir} should hold the ZeRO optimizer files of ranks 0..N-1, found "
                              f"ranks {sorted(files)}")
    saved = [read_file(files[r], "optimizer_state_dict") for r in range(len(files))]
    shapes = read_file(tag_dir / MODEL_STATES, "param_shapes")
    if not shapes:
        raise CheckpointError(f"{tag_dir / MODEL_STATES} holds no param_shapes (the flat order of the groups)")
    per_rank = [base_states(sd) for sd in saved]
    srs = [x[1] for x in per_rank]
    if any(sr != srs[0] for sr in srs):
        raise CheckpointError(f"the saved ranks disagree on the optimizer's seed and skipped steps: {srs}")
    saved_groups = per_rank[0][2]
    paddings = saved[0].get("param_alignment_paddings") or [[0] * len(g) for g in shapes]
    pieces: dict[str, _Piece] = {}
    for g, params in enumerate(shapes):
        gname = str(saved_groups[g].get("name", g)) if saved_groups else str(g)
        masters = [sd["single_partition_of_fp32_groups"][g].reshape(-1) for sd in saved]  # saved unpadded
        weight = torch.cat(masters)
        states = [x[0][g] for x in per_rank]
        flat: dict[str, torch.Tensor] = {}
        scalars: dict[str, Any] = {}
        for key, value in states[0].items():
            if torch.is_tensor(value) and value.dim() > 0:
                flat[key] = torch.cat([s[key].reshape(-1)[: m.numel()] for s, m in zip(states, masters)])
                continue
            if key.endswith("_bound"):
                raise RegroupError(f"optimizer group {gname} keeps fp16 statistics with one scale per partition, "
                                   "which cannot be split by parameter")
            if any(not _same(s[key], value) for s in states):
                raise CheckpointError(f"optimizer group {gname}: the saved ranks disagree on {key!r}")
            scalars[key] = value
        pads = list(paddings[g])
        numels = [math.prod(shape) for shape in params.values()]
        if len(pads) != len(numels) or sum(numels) + sum(pads) != weight.numel():
            raise CheckpointError(f"optimizer group {gname}: the checkpoint holds {weight.numel()} elements, its "
                                  f"param_shapes and alignment paddings {sum(numels) + sum(pads)}")
        offset = 0
        for name, n, pad in zip(params, numels, pads):
            pieces[name] = _Piece(gname, weight[offset : offset + n],
                                  {k: t[offset : offset + n] for k, t in flat.items()}, scalars)
            offset += n + pad
    return pieces, srs[0], len(shapes)


def _zero12(engine: Any, tag_dir: Path) -> Regrouped:
    zo = engine.optimizer
    opt = zo.optimizer
    pieces, sr, groups_before = _saved_pieces(tag_dir)
    new_state: dict[int, dict[str, Any]] = {}
    index, kept, fresh = 0, set(), 0
    for i, group in enumerate(opt.param_groups):
        gname = group.get("name", i)
        params = list(zo.round_robin_bit16_groups[i])
        offsets = list(zo.round_robin_bit16_offsets[i])
        names = [engine.param_names[p] for p in params]
        have = [n for n in names if n in pieces and pieces[n].states]
        new = [n for n in names if n not in have]
        fresh += sum(p.numel() for p, n in zip(params, names) if n in new)
        size = int(zo.partition_size[i])
        pid = torch.distributed.get_rank(group=zo.real_dp_process_group[i])
        lo, hi = pid * size, pid * size + size
        partition = zo.single_partition_of_fp32_groups[i]
        for p, off, name in zip(params, offsets, names):  # saved weights (exact masters), where there are
            if name in pieces:
                _place(partition.data.view(-1), pieces[name].weight, off, lo, hi)
        if not have:
            continue  # every parameter newly trainable: the state starts at the first step
        if new:
            raise RegroupError(f"under ZeRO-{engine.zero_optimization_stage()} optimizer group {gname} would hold "
                               f"parameters trained so far ({len(have)}) and newly trainable ones ({len(new)}, e.g. "
                               f"{new[0]}) in one flat state with one step count")
        first = pieces[have[0]]
        for name in have[1:]:
            other = pieces[name]
            if set(other.states) != set(first.states) or any(not _same(other.scalars.get(k), v)
                                                             for k, v in first.scalars.items() if k != "index"):
                raise RegroupError(f"optimizer group {gname} would join parameters of saved groups {first.group} and "
                                   f"{other.group}, whose optimizer states differ (steps {first.scalars.get('step')} "
                                   f"and {other.scalars.get('step')})")
        state: dict[str, Any] = {}
        for key, t in first.states.items():
            out = torch.zeros(size, dtype=t.dtype)
            for off, name in zip(offsets, names):
                _place(out, pieces[name].states[key], off, lo, hi)
            state[key] = out.to(partition.device)
        for key, value in first.scalars.items():
            state[key] = value.clone() if torch.is_tensor(value) else value
        if "index" in state:
            state["index"] = index
            index += 1
        new_state[i] = state
        kept.update(have)
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]} for i, g in enumerate(opt.param_groups)]
    sd: dict[str, Any] = {"state": new_state, "param_groups": param_groups}
    if sr is not None:
        sd["sr"] = sr
    opt.load_state_dict(sd)
    if hasattr(zo, "_link_all_hp_params"):
        zo._link_all_hp_params()
    dropped = sum(piece.weight.numel() for name, piece in pieces.items() if piece.states and name not in kept)
    return Regrouped(groups_before, len(opt.param_groups), sum(pieces[n].weight.numel() for n in kept), dropped, fresh)


def _place(out: torch.Tensor, piece: torch.Tensor, offset: int, lo: int, hi: int) -> None:
    """Copies the part of ``piece`` (a parameter at ``offset`` of a flat group) that falls in this rank's
    partition ``[lo, hi)`` into ``out`` (the partition)."""
    a, b = max(lo, offset), min(hi, offset + piece.numel())
    if a < b:
        out[a - lo : b - lo].copy_(piece[a - offset : b - offset].to(out.dtype))


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# --------------------------------------------------------------------------------------------------
# the state by parameter name (tests and checks)
# --------------------------------------------------------------------------------------------------


def named_state(engine: Any, opt: torch.optim.Optimizer) -> dict[str, dict[str, torch.Tensor]]:
    """Every trained parameter's optimizer state by name (ZeRO 0-2; a collective under ZeRO-1/2): its
    per-element states in the parameter's shape and its scalars (``step``, ``index``) as 0-dim tensors;
    under ZeRO-1/2 the weights of DeepSpeed's partition too (``"weight"``), and the scalars are its group's."""
    stage = int(engine.zero_optimization_stage())
    out: dict[str, dict[str, torch.Tensor]] = {}
    if stage == 0:
        names = {id(p): n for n, p in engine.module.named_parameters()}
        for group in opt.param_groups:
            for p in group["params"]:
                out[names[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v) else torch.as_tensor(v))
                                     for k, v in opt.state.get(p, {}).items()}
        return out
    if stage not in (1, 2):
        raise ValueError(f"named_state covers ZeRO 0-2, not ZeRO-{stage}")
    zo = engine.optimizer
    local = []
    for i, group in enumerate(opt.param_groups):
        flat = group["params"][0]
        keep = flat.numel() - int(zo.groups_padding[i])
        view = {"weight": flat.detach().reshape(-1)[:keep].clone()}
        for k, v in opt.state.get(flat, {}).items():
            view[k] = v.reshape(-1)[:keep].clone() if torch.is_tensor(v) and v.dim() > 0 else torch.as_tensor(v).clone()
        local.append(view)
    every: list[Any] = [local]
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        every = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, local)
    for i, group in enumerate(opt.param_groups):
        views = [e[i] for e in every]
        full = {k: (torch.cat([v[k] for v in views]) if views[0][k].dim() > 0 else views[0][k]) for k in views[0]}
        for p, off in zip(zo.round_robin_bit16_groups[i], zo.round_robin_bit16_offsets[i]):
            n = p.numel()
            out[engine.param_names[p]] = {k: (t[off : off + n].reshape(p.shape) if t.dim() > 0 else t)
                                          for k, t in full.items()}
    return out
