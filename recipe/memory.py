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


def live_bytes_per_param(module: torch.nn.Module, optimizer: torch.optim.Optimizer, group_names: list[str] | None = None) -> dict[str, Any]:
    """This rank's bytes per model parameter.

    Args:
        module: The model (``engine.module``).
        optimizer: The client optimizer (SRAdamW) as DeepSpeed left it: under ZeRO its groups hold
            this rank's flat partitions.
        group_names: Names of the optimizer groups in order (their ``name`` keys by default).

    Returns:
        ``{"params": N, "module_weights": b, "groups": {name: {...}}, "total": b}`` where ``b`` are
        bytes per model parameter and each group has ``partition`` (the tensors the optimizer
        updates when they are not the module's own), ``state`` (optimizer state tensors) and
        ``group_params`` (the group's share of the model's parameters).
    """
    module_params = list(module.parameters())
    n = sum(p.numel() for p in module_params)
    module_storages = {_storage_key(p) for p in module_params}
    module_bytes = sum(p.numel() * p.element_size() for p in module_params)
    seen: set[tuple[int, int]] = set(module_storages)
    groups: dict[str, Any] = {}
    total = module_bytes
    for i, group in enumerate(optimizer.param_groups):
        name = (group_names[i] if group_names else None) or group.get("name", f"group{i}")
        part = state = 0
        for p in group["params"]:
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
