"""Bytes per parameter of weights and optimizer state, read from the live engine and optimizer.

Nothing here is computed from formulas: every tensor the module, DeepSpeed's ZeRO partitions and
SRAdamW's state hold on this rank is measured (``numel * element_size``), deduplicated by storage,
and divided by the model's parameter count. Groups are reported separately, so an SR group
(half weights, half states, no master) and a mastered group (fp32 master + fp32 states inside the
optimizer state, sharded with the partition) can be checked against what the mode promises.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["live_bytes_per_param"]


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    return (t.untyped_storage().data_ptr(), t.dtype.itemsize)


def _group_tensors(optimizer: torch.optim.Optimizer, zero_optimizer: Any) -> list[list[torch.Tensor]]:
    """The tensors each optimizer group updates. ZeRO-3 empties ``param_groups`` between steps and
    keeps its flat partitions (possibly several sub-groups per group) in the ZeRO optimizer."""
    flats = getattr(zero_optimizer, "fp32_partitioned_groups_flat", None)
    if flats is None:
        return [list(g["params"]) for g in optimizer.param_groups]
    out: list[list[torch.Tensor]] = [[] for _ in optimizer.param_groups]
    for sub, flat in enumerate(flats):
        out[zero_optimizer.sub_group_to_group_id[sub]].append(flat)
    return out


def live_bytes_per_param(
    module: torch.nn.Module, optimizer: torch.optim.Optimizer, zero_optimizer: Any = None
) -> dict[str, Any]:
    """This rank's bytes per model parameter.

    Args:
        module: The model (``engine.module``); under ZeRO-3 its parameters' ``ds_tensor``
            partitions are what this rank holds.
        optimizer: The client optimizer (SRAdamW) as DeepSpeed left it: under ZeRO its groups hold
            this rank's flat partitions.
        zero_optimizer: DeepSpeed's ZeRO optimizer (``engine.optimizer``), needed for ZeRO-3.

    Returns:
        ``{"params": N, "module_weights": b, "groups": {name: {...}}, "total": b}`` where ``b`` are
        bytes per model parameter and each group has ``partition`` (the tensors the optimizer
        updates when they are not the module's own) and ``state`` (optimizer state tensors).
    """
    module_params = list(module.parameters())
    held = [getattr(p, "ds_tensor", p) for p in module_params]  # ZeRO-3: this rank's partition
    n = sum(int(getattr(p, "ds_numel", p.numel())) for p in module_params)
    module_bytes = sum(t.numel() * t.element_size() for t in held)
    seen: set[tuple[int, int]] = {_storage_key(t) for t in held if t.numel()}
    groups: dict[str, Any] = {}
    total = module_bytes
    for group, tensors in zip(optimizer.param_groups, _group_tensors(optimizer, zero_optimizer)):
        name = group.get("name", f"group{len(groups)}")
        part = state = 0
        for p in tensors:
            if _storage_key(p) not in seen:
                seen.add(_storage_key(p))
                part += p.numel() * p.element_size()
            for v in optimizer.state.get(p, {}).values():
                if isinstance(v, torch.Tensor) and v.numel() > 1 and _storage_key(v) not in seen:
                    seen.add(_storage_key(v))
                    state += v.numel() * v.element_size()
        groups[name] = {"partition": part / n, "state": state / n}
        total += part + state
    return {"params": n, "module_weights": module_bytes / n, "groups": groups, "total": total / n}
