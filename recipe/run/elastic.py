"""Elastic resume: a checkpoint saved on one number of ranks continued on another.

What changes with the world size, and how it is carried over (:func:`load_resharded`):

* **Model weights**: DeepSpeed's module state (``mp_rank_00_model_states.pt``) is the full module
  under ZeRO 0-2; every rank loads it whatever the world size. Under ZeRO-3 the weights live only in
  the optimizer files (below).
* **Optimizer state, ZeRO-1/2**: SRAdamW's parameters are this rank's flat partition of each
  group, so its per-element state (``exp_avg``, ``exp_avg_sq``, ``master``/``master_low``) and
  DeepSpeed's own partition of the master weights are flat, partition-shaped tensors, one file per
  saved rank. Each group's saved partitions are joined into the full flat group (the padding DeepSpeed
  adds to the last partition dropped), and this rank's new partition is cut out of it exactly where
  DeepSpeed's partitioning puts it (``rank * partition_size``, zero padding at the end). Per-tensor
  scalars (``step``, the noise stream ``index``) and the ``sr`` entry (seed, skipped steps) must be the
  same on every saved rank and are taken as they are. Every element keeps its value bit for bit (the
  split master's high half is the bf16 weight, restored from the module state).
* **Optimizer state, ZeRO-3**: every parameter is split into ``ceil(numel / world)`` elements per rank
  (the last rank's piece zero-padded), and each rank's flat optimizer tensor of a sub-group is its
  pieces of the sub-group's parameters, in order (the layout ``param_shapes`` in
  ``zero_pp_rank_0_mp_rank_00_model_states.pt`` records, which must equal this run's names and
  shapes). Each parameter is joined from the saved ranks' pieces and cut again at the new world size,
  for the bf16 weights (``fp32_flat_groups``, which hold the weights under ZeRO-3) and every
  per-element SRAdamW state alike; DeepSpeed's own ZeRO-3 loader then takes the re-sharded state as
  if this rank had saved it (weights into the partitions, the module's parameters re-pointed). The
  module state of saved rank 0 (buffers; ZeRO-3 parameters are empty there) and the engine's step
  counters are loaded as DeepSpeed loads them.
* **Optimizer state, ZeRO-0** (the fp16 route): every rank holds the full module and SRAdamW updates
  the module's own tensors, drawing the noise of rank 0 on every rank (``recipe/training/optimizer.py``), so the
  replicas are identical. DeepSpeed writes the client optimizer's full state once, into rank 0's
  model-states file (``mp_rank_00_model_states.pt``, key ``optimizer``), and its ``load_checkpoint``
  reads that file on every rank whatever the data-parallel world size; it is loaded as on a same-world
  resume, bit for bit (fp16 statistics with their bounds, the fp32 masters, steps, noise indices,
  seed). A checkpoint holding ZeRO optimizer files (a change of stage) is refused.
* **Client state** (``rankNNNNN.pt``): the training counters of rank 0; each new rank takes the RNG
  state of saved rank ``rank % saved_world``; the loss scaler (identical on every rank) of rank 0;
  the data position of *every* saved rank (``client["data"]`` becomes that list), which
  :meth:`recipe.data.loader.ClipLoader.load_state_dict` re-shards (see there).

SRAdamW's rounding noise is keyed by (seed, rank, tensor index, step, stream, element index within
the partition), so under ZeRO-1/2/3 after re-sharding another rank draws the noise of an element: the
continuation equals an uninterrupted run in distribution, not bit for bit. Under ZeRO-0 the noise does
not depend on the world size, yet the continuation is not bit for bit either: the per-rank micro-batch
composition changes (e.g. 2 x 8 vs 1 x 16 samples), so the loss reduction and the sum of the fp16
gradients over the ranks round differently (measured: 1 ulp of the loss at the first step after the
resume, then within 4e-4 relative, less than an uninterrupted 1-rank run differs from a 2-rank one;
``tests/recipe/run/test_elastic.py``).

Not supported (a :class:`recipe.run.checkpoint.CheckpointError` naming the combination): a change of ZeRO
stage; fp16 state statistics with per-partition scales under ZeRO-1/2/3; DeepSpeed's ``round_robin_gradients`` (the
flat order of a group then depends on the world size); a streamed (webdataset) data position mid-epoch
(:meth:`recipe.data.loader.ClipLoader.load_state_dict`).

DeepSpeed's universal checkpoint (``ds_to_universal`` + ``load_universal_checkpoint``) is not used:
it converts the optimizer state it knows (``exp_avg``/``exp_avg_sq`` and DeepSpeed's fp32 master) and
re-creates states as fp32, while this recipe's state holds bf16 statistics, an int16 master low half
whose meaning depends on the bf16 weight, per-tensor steps and the SR seed.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import torch

from ..training.distributed import rank_world
from .files import COMPLETE, CheckpointError, load_engine_state, read_file

__all__ = ["base_states", "cut_pieces", "full_flat_state", "join_pieces", "load_resharded", "local_flat_state", "saved_world_size",
           "zero_files"]

_ZERO3_MODULE_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"

_ZERO_FILE = re.compile(r"(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt")
_SCALAR_KEYS = ("step", "index")


def saved_world_size(tag_dir: Path) -> int | None:
    """The number of ranks that wrote the checkpoint (from its ``COMPLETE`` marker), or None."""
    try:
        meta = json.loads((Path(tag_dir) / COMPLETE).read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {Path(tag_dir) / COMPLETE}: {e}") from e
    return meta.get("world_size")


def zero_files(tag_dir: Path) -> dict[int, Path]:
    """The ZeRO-1/2/3 optimizer files of a checkpoint by saving rank (empty under ZeRO-0)."""
    found = {}
    for p in Path(tag_dir).iterdir():
        m = _ZERO_FILE.fullmatch(p.name)
        if m:
            found[int(m.group(1))] = p
    return found


def _unsupported(what: str, saved: int, world: int, why: str) -> CheckpointError:
    return CheckpointError(f"resuming {what} saved on {saved} ranks on {world} ranks is not supported yet: {why}")


def load_resharded(engine: Any, tag_dir: Path, saved_world: int) -> dict[str, Any]:
    """Loads checkpoint ``tag_dir`` written by ``saved_world`` ranks into ``engine`` on this run's
    world size (see the module docstring) and returns this rank's client state, with ``"data"`` the
    list of every saved rank's data position and ``"resharded_from"`` the saved world size.

    Raises:
        CheckpointError: An unsupported combination (named), or missing/unreadable files.
    """
    rank, world = rank_world()
    stage = int(engine.zero_optimization_stage())
    files = zero_files(tag_dir)
    if stage == 0:
        return _load_zero0(engine, tag_dir, files, rank, saved_world, world)
    label = f"a ZeRO-{stage} checkpoint"
    if sorted(files) != list(range(saved_world)):
        raise CheckpointError(f"checkpoint {tag_dir} should hold ZeRO optimizer files of ranks 0..{saved_world - 1} "
                              f"for this ZeRO-{stage} run, found ranks {sorted(files)}")
    zo = engine.optimizer
    if getattr(zo, "round_robin_gradients", False):
        raise _unsupported(label, saved_world, world, "zero_optimization.round_robin_gradients orders each "
                           "group by the world size; turn it off")
    saved = [read_file(files[r], "optimizer_state_dict") for r in range(saved_world)]
    saved_stage = int(saved[0].get("zero_stage", stage))
    if saved_stage != stage:
        raise _unsupported(f"a ZeRO-{saved_stage} checkpoint", saved_world, world,
                           f"this run uses ZeRO-{stage}; resume with the saved ZeRO stage")
    if stage >= 3:
        _load_zero3(engine, Path(tag_dir), saved, label, saved_world, world)
    else:
        # the full module; DeepSpeed then copies the weights into this rank's partitions
        load_engine_state(engine, tag_dir, optimizer_states=False)
        _load_zero12(zo, saved, label, saved_world, world)
    return client_state_resharded(tag_dir, rank, saved_world)


def _load_zero0(engine: Any, tag_dir: Path, files: dict[int, Path], rank: int, saved_world: int,
                world: int) -> dict[str, Any]:
    """ZeRO-0: the module and the client optimizer's full state are in the model-states file rank 0
    wrote; DeepSpeed loads that file on every rank whatever the data-parallel world size, exactly as
    it does on a same-world resume. Only the client state is re-sharded."""
    if files:
        raise _unsupported(f"a ZeRO-1/2/3 checkpoint (ZeRO optimizer files of ranks {sorted(files)})", saved_world,
                           world, "this run uses ZeRO-0; resume with the saved ZeRO stage")
    load_engine_state(engine, tag_dir)
    return client_state_resharded(tag_dir, rank, saved_world)


def client_state_resharded(tag_dir: Path, rank: int, saved_world: int) -> dict[str, Any]:
    clients = [read_file(tag_dir / f"rank{r:05d}.pt") for r in range(saved_world)]
    client = dict(clients[0])
    client["rng"] = clients[rank % saved_world]["rng"]
    client["data"] = [c["data"] for c in clients] if "data" in client else None
    client["resharded_from"] = saved_world
    return client


# --------------------------------------------------------------------------------------------------
# ZeRO-1/2: flat partitions of each group
# --------------------------------------------------------------------------------------------------


def base_states(sd: dict[str, Any]) -> tuple[list[dict[str, Any]], dict[str, Any] | None, list]:
    """Per group the base optimizer's state of one saved rank (padded partitions), its ``sr`` entry
    and its param groups. DeepSpeed saves either the optimizer's own state dict ("rigid", the
    default) or, with ``elastic_checkpoint``, a list of per-group states without padding."""
    base = sd["base_optimizer_state"]
    if isinstance(base, dict):
        ids = [g["params"][0] for g in base["param_groups"]]
        return [base["state"].get(i, {}) for i in ids], base.get("sr"), base["param_groups"]
    return list(base), None, []


def _load_zero12(zo: Any, saved: list[dict[str, Any]], label: str, saved_world: int, world: int) -> None:
    """Re-shards the saved partitions of every group into this rank's partition (module docstring)."""
    opt = zo.optimizer
    groups = len(opt.param_groups)
    per_rank = [base_states(sd) for sd in saved]
    if any(len(states) != groups for states, _, _ in per_rank):
        raise CheckpointError(f"the checkpoint has {len(per_rank[0][0])} optimizer groups, this run {groups}")
    if any(sd.get("param_alignment_paddings", zo.round_robin_bit16_padding) != zo.round_robin_bit16_padding
           for sd in saved):
        raise _unsupported(label, saved_world, world, "the parameter alignment padding differs from this run's")
    sr = _agreed_sr([x[1] for x in per_rank])
    new_state: dict[int, dict[str, Any]] = {}
    for i in range(groups):
        numel = sum(p.numel() for p in zo.bit16_groups[i]) + sum(zo.round_robin_bit16_padding[i])
        pid = torch.distributed.get_rank(group=zo.real_dp_process_group[i])
        size, pad = int(zo.partition_size[i]), int(zo.groups_padding[i])
        lo, hi = pid * size, pid * size + size - pad
        name = opt.param_groups[i].get("name", i)
        masters = [sd["single_partition_of_fp32_groups"][i] for sd in saved]  # saved without padding
        full_master = torch.cat([m.reshape(-1) for m in masters])
        if full_master.numel() != numel:
            raise CheckpointError(f"optimizer group {name}: the checkpoint holds {full_master.numel()} elements, "
                                  f"this run's group {numel}")
        zo.single_partition_of_fp32_groups[i].data.copy_(_pad(full_master[lo:hi], size))
        states = [x[0][i] for x in per_rank]

        def reshard(key: str, saved_tensors: list[torch.Tensor]) -> torch.Tensor:
            # a saved rank's partition without its padding: as long as its master partition (saved unpadded)
            full = torch.cat([t.reshape(-1)[: m.numel()] for t, m in zip(saved_tensors, masters)])
            if full.numel() != numel:
                raise CheckpointError(f"optimizer group {name}: state {key!r} holds {full.numel()} elements in "
                                      f"the checkpoint, this run's group {numel}")
            return _pad(full[lo:hi], size)

        state = _merge_state(states, name, reshard, label, saved_world, world)
        if state:
            new_state[i] = state
    param_groups = per_rank[0][2] or [{**{k: v for k, v in g.items() if k != "params"}, "params": [i]}
                                      for i, g in enumerate(opt.param_groups)]
    sd = {"state": new_state, "param_groups": param_groups}
    if sr is not None:
        sd["sr"] = sr
    opt.load_state_dict(sd)
    if hasattr(zo, "_link_all_hp_params"):
        zo._link_all_hp_params()


def _agreed_sr(srs: list[Any]) -> Any:
    """The optimizer's ``sr`` entry (seed, skipped steps), which every saved rank must hold alike."""
    if any(sr != srs[0] for sr in srs):
        raise CheckpointError(f"the saved ranks disagree on the optimizer's seed and skipped steps: {srs}")
    return srs[0]


def _merge_state(states: list[dict[str, Any]], name: Any, reshard: Any, label: str, saved_world: int,
                 world: int) -> dict[str, Any]:
    """One flat optimizer tensor's state from every saved rank's (rank order): the scalars (``step``,
    ``index``), which every saved rank must hold alike, as they are; each per-element state through
    ``reshard(key, saved_tensors)`` into this rank's partition."""
    state: dict[str, Any] = {}
    for key, value in states[0].items():
        if torch.is_tensor(value) and value.dim() > 0:
            state[key] = reshard(key, [s[key] for s in states])
            continue
        values = [s[key] for s in states]
        if key.endswith("_bound"):
            raise _unsupported(label, saved_world, world, f"group {name} keeps fp16 statistics with a "
                               "scale per partition, which cannot be re-sharded exactly")
        if any(not _same(v, value) for v in values):
            raise CheckpointError(f"optimizer group {name}: the saved ranks disagree on {key!r}: {values}")
        state[key] = value.clone() if torch.is_tensor(value) else value
    return state


def _pad(t: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=t.dtype)
    out[: t.numel()] = t
    return out


def _same(a: Any, b: Any) -> bool:
    if torch.is_tensor(a) and torch.is_tensor(b):
        return a.dtype == b.dtype and torch.equal(a, b)
    return a == b


# --------------------------------------------------------------------------------------------------
# ZeRO-3: every parameter partitioned, flat sub-groups of per-parameter pieces
# --------------------------------------------------------------------------------------------------


def _zero3_layout(engine: Any) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Per ZeRO-3 sub-group the names and full shapes of its parameters, in the flat order (what
    DeepSpeed saves as ``param_shapes``)."""
    return [[(engine.param_names[p], tuple(p.ds_shape)) for p in group] for group in engine.optimizer.fp16_groups]


def _piece(numel: int, world: int) -> int:
    """Elements of one parameter on each rank under ZeRO-3 (the last rank's piece zero-padded)."""
    return -(-numel // world)


def join_pieces(flats: list[torch.Tensor], numels: list[int], what: str) -> list[torch.Tensor]:
    """The full parameters (flattened, padding dropped) from every rank's flat tensor of one sub-group."""
    world = len(flats)
    pieces = [_piece(n, world) for n in numels]
    for r, flat in enumerate(flats):
        if flat.numel() != sum(pieces):
            raise CheckpointError(f"{what}: rank {r} holds {flat.numel()} elements, the layout {sum(pieces)}")
    split = [flat.reshape(-1).split(pieces) for flat in flats]
    return [torch.cat([s[j] for s in split])[:n] for j, n in enumerate(numels)]


def cut_pieces(full: list[torch.Tensor], rank: int, world: int) -> torch.Tensor:
    """This rank's flat tensor of one sub-group from its full parameters (:func:`join_pieces`)."""
    out = []
    for t in full:
        piece = _piece(t.numel(), world)
        out.append(_pad(t[rank * piece : (rank + 1) * piece], piece))
    return torch.cat(out) if out else torch.zeros(0)


def _load_zero3(engine: Any, tag_dir: Path, saved: list[dict[str, Any]], label: str, saved_world: int,
                world: int) -> None:
    """Re-shards a ZeRO-3 checkpoint into this rank's partitions (module docstring)."""
    zo = engine.optimizer
    if any(c != zo.partition_count for c in getattr(zo, "sub_group_partition_counts", [])):
        raise _unsupported(label, saved_world, world, "sub-groups partitioned over other process groups "
                           "than the data-parallel one")
    module_file = tag_dir / _ZERO3_MODULE_FILE
    ckpt = read_file(module_file)
    layout = _zero3_layout(engine)
    stored = [[(n, tuple(s)) for n, s in shapes.items()] for shapes in ckpt.get("param_shapes", [])]
    if stored != layout:
        diff = next((f"sub-group {i}: saved {a}, this run {b}" for i, (a, b) in enumerate(zip(stored, layout))
                     if a != b), f"{len(stored)} sub-groups saved, this run has {len(layout)}")
        raise CheckpointError(f"checkpoint {tag_dir}: the saved ZeRO-3 parameters (names, shapes, order) are not "
                              f"this run's ({diff})")
    numels = [[math.prod(shape) for _, shape in group] for group in layout]
    pid = torch.distributed.get_rank(group=zo.dp_process_group)

    def reshard(sub: int, what: str, flats: list[torch.Tensor]) -> torch.Tensor:
        out = cut_pieces(join_pieces(flats, numels[sub], what), pid, world)
        if out.numel() != zo.fp32_partitioned_groups_flat[sub].numel():  # the layout matched: cannot happen
            raise CheckpointError(f"{what}: re-sharded to {out.numel()} elements, this rank holds "
                                  f"{zo.fp32_partitioned_groups_flat[sub].numel()}")
        return out

    weights = [reshard(i, f"sub-group {i} weights", [sd["fp32_flat_groups"][i] for sd in saved])
               for i in range(len(layout))]

    bases = [sd["optimizer_state_dict"] for sd in saved]
    groups = bases[0]["param_groups"]
    if len(groups) != len(zo.optimizer.param_groups):
        raise CheckpointError(f"the checkpoint has {len(groups)} optimizer groups, this run "
                              f"{len(zo.optimizer.param_groups)}")
    _agreed_sr([b.get("sr") for b in bases])
    new_state: dict[int, dict[str, Any]] = {}
    for g, group in enumerate(groups):
        # DeepSpeed lists each group's sub-groups in order (stage3._set_fp32_optimizer_param_groups)
        subs = [i for i, owner in enumerate(zo.sub_group_to_group_id) if owner == g]
        if len(subs) != len(group["params"]):
            raise CheckpointError(f"optimizer group {group.get('name', g)}: {len(group['params'])} sub-groups "
                                  f"saved, this run has {len(subs)}")
        for sub, sid in zip(subs, group["params"]):
            states = [b["state"].get(sid, {}) for b in bases]
            name = group.get("name", g)
            state = _merge_state(states, name, lambda key, ts, sub=sub, name=name: reshard(
                sub, f"optimizer group {name} state {key!r}", ts), label, saved_world, world)
            if state:
                new_state[sid] = state
    new = dict(saved[0])
    new.update(optimizer_state_dict={**bases[0], "state": new_state}, fp32_flat_groups=weights,
               partition_count=zo.partition_count)
    # what DeepSpeed's load_checkpoint does for ZeRO-3, with this rank's re-sharded state in place of the
    # file it would have saved: release gathered parameters, load the module (buffers; ZeRO-3 parameters
    # are empty there), the optimizer (weights into the partitions), the step counters, re-gather the
    # persistent (small, always gathered) parameters
    zo.checkpoint_event_prologue()
    try:
        engine.load_module_state_dict(checkpoint=ckpt, strict=True)
    except Exception as e:
        raise CheckpointError(f"cannot load the module state of {module_file}: {type(e).__name__}: {e}") from e
    states_by_rank: list[Any] = [None] * world
    states_by_rank[pid] = new
    zo.load_state_dict(states_by_rank, load_optimizer_states=True)
    engine.global_steps = ckpt["global_steps"]
    engine.global_samples = ckpt.get("global_samples", engine.global_steps * engine.train_batch_size())
    engine.skipped_steps = ckpt["skipped_steps"]
    engine.loaded_checkpoint_dp_world_size = ckpt["dp_world_size"]
    if engine.lr_scheduler is not None and ckpt.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(ckpt["lr_scheduler"])
    zo.checkpoint_event_epilogue()


# --------------------------------------------------------------------------------------------------
# the full view (tests and checks): every group's state over all ranks, without padding
# --------------------------------------------------------------------------------------------------


def local_flat_state(engine: Any) -> list[dict[str, torch.Tensor]]:
    """This rank's flat optimizer tensors: the weights (``"weight"``), every per-element SRAdamW state
    and the scalar states (as 0-dim tensors). ZeRO-1/2: one per group, padding dropped; ZeRO-3: one
    per sub-group, this rank's pieces of its parameters (padding included)."""
    zo = engine.optimizer
    opt = zo.optimizer
    if engine.zero_optimization_stage() >= 3:
        flats = list(zo.fp32_partitioned_groups_flat)
        keeps = [t.numel() for t in flats]
    else:
        flats = [g["params"][0] for g in opt.param_groups]
        keeps = [p.numel() - int(zo.groups_padding[i]) for i, p in enumerate(flats)]
    out = []
    for p, keep in zip(flats, keeps):
        view = {"weight": p.detach().reshape(-1)[:keep].clone()}
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v) and v.dim() > 0:
                view[k] = v.reshape(-1)[:keep].clone()
            elif k in _SCALAR_KEYS:
                view[k] = torch.as_tensor(v).clone()
        out.append(view)
    return out


def full_flat_state(engine: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Every flat optimizer tensor's full state over all ranks (a collective), which does not depend
    on the world size: per group name (ZeRO-3: per sub-group, ``"<group>/<k>"`` when a group has
    several), ``"weight"`` and the per-element states joined in rank order (ZeRO-3: parameter by
    parameter), padding dropped, the scalars as rank 0 has them, and ``"sr"`` the optimizer's seed and
    skipped steps."""
    local = local_flat_state(engine)
    if torch.distributed.is_initialized():
        every: list[Any] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, local)
    else:
        every = [local]
    zo = engine.optimizer
    opt = zo.optimizer
    if engine.zero_optimization_stage() >= 3:
        numels = [[math.prod(shape) for _, shape in group] for group in _zero3_layout(engine)]
        owners = list(zo.sub_group_to_group_id)
        names = [opt.param_groups[g].get("name", str(g)) for g in owners]
        names = [n if names.count(n) == 1 else f"{n}/{owners[:i].count(owners[i])}" for i, n in enumerate(names)]

        def join(i: int, tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(join_pieces(tensors, numels[i], names[i]))
    else:
        names = [g.get("name", str(i)) for i, g in enumerate(opt.param_groups)]

        def join(i: int, tensors: list[torch.Tensor]) -> torch.Tensor:
            return torch.cat(tensors)

    out: dict[str, Any] = {}
    for i, name in enumerate(names):
        views = [e[i] for e in every]
        out[name] = {k: (join(i, [v[k] for v in views]) if views[0][k].dim() > 0 else views[0][k]) for k in views[0]}
    out["sr"] = {"seed": opt.seed, "skipped_steps": opt.skipped_steps}
    return out
