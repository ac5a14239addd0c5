"""SRAdamW's default implementation on this device against its reference definition, bit for bit.

The default (``fused=None``) is the fused Triton kernel on CUDA and the C++ kernel
(:mod:`optim._cpu_kernel`) on the CPU; the reference is the eager PyTorch path (``fused=False``, :mod:`optim.functional`). Both
run on the device, on identical copies of a few thousand elements per dtype route the run uses, for
two steps with the run's step arguments (a device ``found_inf`` flag, and on the fp16 route an inverse
loss scale applied inside the update); weights and every state tensor must have the same bits
(NaN positions equal). A difference fails and is counted in elements (summed over ranks: each rank
draws its own rounding noise).

Routes, from the DeepSpeed JSON's precision and the master-weight flags (as
:func:`recipe.training.optimizer.build_optimizer` builds the groups): the text group (SR weights and SR states
unless ``--text-master-weights``), the image group (a master unless ``--no-image-master-weights``:
split in the int16 low half for bf16, fp32 for fp16) and the logit scale (one element, fp32 states,
clamped to [0, log 100]). The tensors are what ZeRO hands the optimizer: partitions in the route's
dtype (fp32 partitions for bf16 without ``bf16_master_weights_and_grads``).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import torch

from optim import SRAdamW

from .common import Row, Run, dtype_name, per_rank, ranks_with, sum_over_ranks

__all__ = ["Route", "check_optim", "differing_elements", "routes"]

ELEMENTS = 4099  # "a few thousand", not a multiple of any block size
STEPS = 2


@dataclass(frozen=True)
class Route:
    """One dtype route: the tensor's dtype and its group's optimizer settings."""

    label: str
    dtype: torch.dtype
    numel: int
    group: tuple[tuple[str, Any], ...]  # SRAdamW group keys

    def key(self) -> tuple:
        return (self.dtype, self.numel, self.group)


def routes(run: Run) -> list[Route]:
    """The distinct routes of the run's optimizer groups (text, image, logit scale)."""
    prec = run.precision
    half = prec.mode == "fp16" or (prec.mode == "bf16" and prec.half_master_partitions)
    dtype = prec.param_dtype if half else torch.float32
    out: dict[tuple, Route] = {}
    for tower, master in (("text", run.spec.text_master_weights), ("image", run.spec.image_master_weights)):
        state = torch.float32 if master else prec.sr_state_dtype
        if dtype == torch.float32:
            state, master = torch.float32, False  # nothing to round: fp32 weights and states
        r = Route(_describe(tower, dtype, master, state), dtype, ELEMENTS,
                  (("state_dtype", state), ("master_weights", master)))
        if r.key() in out:  # both towers take this route
            r = dataclasses.replace(r, label=r.label.replace(tower, "text+image", 1))
        out[r.key()] = r
    clamp = (0.0, math.log(100.0))
    r = Route(f"logit scale {dtype_name(dtype)}{' + master' if dtype != torch.float32 else ''}, clamp",
              dtype, 1, (("state_dtype", torch.float32), ("master_weights", dtype != torch.float32), ("clamp", clamp)))
    out.setdefault(r.key(), r)
    return list(out.values())


def _describe(tower: str, dtype: torch.dtype, master: bool, state: torch.dtype) -> str:
    if dtype == torch.float32:
        return f"{tower} fp32"
    if master:
        return f"{tower} {dtype_name(dtype)} + {'split' if dtype == torch.bfloat16 else 'fp32'} master"
    return f"{tower} {dtype_name(dtype)} SR, {dtype_name(state)}{' scaled' if state == torch.float16 else ''} states"


def differing_elements(a: torch.Tensor, b: torch.Tensor) -> int:
    """Elements whose bit patterns differ (NaN against NaN counts as equal; dtypes/shapes must agree)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return max(a.numel(), b.numel())
    a, b = a.detach().reshape(-1), b.detach().reshape(-1)
    if not a.is_floating_point():
        return int((a != b).sum())
    ints = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    differ = (a.view(ints) != b.view(ints)) & ~(nan_a & nan_b)
    return int(differ.sum())


def _grad(shape: torch.Size, step: int, seed: int, scale: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 7 + step)
    out = torch.randn(shape, generator=g) * (1e-2 * scale)
    flat = out.view(-1)
    flat[: flat.numel() // 50] = 0.0  # zero gradients: zero second moments
    flat[flat.numel() // 50: flat.numel() // 10] *= 1e-5  # tiny ones: 16-bit subnormal states
    return out


def _run_route(route: Route, run: Run, seed: int) -> tuple[int, int, str]:
    """``(differing elements, compared elements, implementation name)`` of one route on this rank."""
    dev = run.device
    g = torch.Generator().manual_seed(seed + run.rank)
    init = torch.randn(route.numel, generator=g) * 0.05
    if route.numel == 1:  # the logit scale at its initial value log(1/0.07)
        init = torch.full((1,), math.log(1 / 0.07))
    params = [torch.nn.Parameter(init.to(dev, route.dtype)) for _ in range(2)]
    group = dict(route.group)
    kw = dict(lr=1e-3, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.2, seed=17)
    ref = SRAdamW([{"params": [params[0]], **group}], fused=False, **kw)
    dut = SRAdamW([{"params": [params[1]], **group}], **kw)  # the device's default implementation
    # the implementation the default picks here (SRAdamW's one place that chooses)
    impl = dut._update_for(dev)
    name = f"{impl.__module__.rsplit('.', 1)[-1]}.{impl.__name__}"
    loss_scale = 2.0**16 if run.precision.mode == "fp16" else 1.0
    for step in range(STEPS):
        grad = _grad(init.shape, step, seed, loss_scale).to(dev, route.dtype)
        step_kw: dict[str, Any] = {"found_inf": torch.zeros(1, device=dev)}  # as recipe.training.step passes it
        if loss_scale != 1.0:  # the fp16 route: inverse scale x clipping factor, applied in the update
            step_kw["inv_grad_scale"] = torch.tensor(0.75 / loss_scale, device=dev)
        for p, opt in zip(params, (ref, dut)):
            p.grad = grad.clone()
            opt.step(**step_kw)
    differ = differing_elements(params[0], params[1])
    compared = params[0].numel()
    for name_, value in ref.state[params[0]].items():
        other = dut.state[params[1]].get(name_)
        if isinstance(value, torch.Tensor):
            differ += differing_elements(value, other) if isinstance(other, torch.Tensor) else value.numel()
            compared += value.numel()
    return differ, compared, name


def check_optim(run: Run, seed: int = 0) -> list[Row]:
    """One row per route: bit-identical or the number of differing elements (summed over ranks)."""
    rows = []
    for i, route in enumerate(routes(run)):
        differ, compared, impl = _run_route(route, run, seed + 1000 * i)
        by_rank = per_rank(float(differ), run.device)
        differ, compared = int(sum(by_rank)), int(sum_over_ranks([float(compared)], run.device)[0])
        eager = impl.endswith("_pytorch_updates_")
        values = {"differing": differ, "differing_by_rank": by_rank, "compared": compared, "implementation": impl, "steps": STEPS}
        if differ:
            status, detail = "fail", (f"{differ} of {compared} elements differ ({ranks_with(by_rank)}), {impl} vs "
                                      f"eager, {STEPS} steps")
        elif eager and route.numel > 1:
            status, detail = "warn", f"the default is the eager reference itself here ({impl}): nothing compared"
        else:
            status, detail = "pass", f"bit-identical: {compared} elements, {impl} vs eager, {STEPS} steps"
            if eager:
                detail += "; 1-element tensors run eagerly by design"
        rows.append(Row("optimizer", route.label, status, detail, values))
    return rows
