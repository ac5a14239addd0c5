"""AdamW with half-precision weights and statistics written by stochastic rounding."""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from .functional import (
    STREAM_EXP_AVG,
    STREAM_EXP_AVG_SQ,
    STREAM_PARAM,
    sradamw_update_,
    state_scale,
)
from .rounding import derive_key

__all__ = ["SRAdamW"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_FUSED_MODULE: Any = None


def _fused_kernel() -> Any:
    """``optim.triton_kernel`` when Triton is usable, else ``None`` (imported on first use only)."""
    global _FUSED_MODULE
    if _FUSED_MODULE is None:
        from . import triton_kernel

        _FUSED_MODULE = triton_kernel
    return _FUSED_MODULE if _FUSED_MODULE.is_available() else None
_ROUNDINGS = ("stochastic", "nearest")
_NONFINITE = ("skip", "raise")


def _validate_group(group: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the offending hyperparameter."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)
    if not 0.0 <= lr < float("inf"):
        raise ValueError(f"Invalid lr: {group['lr']} (must be finite and >= 0)")
    betas = group["betas"]
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2):
        raise ValueError(f"Invalid betas: {betas} (must be a pair)")
    for i, b in enumerate(betas):
        if not 0.0 <= float(b) < 1.0:
            raise ValueError(f"Invalid betas[{i}]: {b} (must be in [0, 1))")
    if not 0.0 <= float(group["eps"]) < float("inf"):
        raise ValueError(f"Invalid eps: {group['eps']} (must be finite and >= 0)")
    if not 0.0 <= float(group["weight_decay"]) < float("inf"):
        raise ValueError(f"Invalid weight_decay: {group['weight_decay']} (must be finite and >= 0)")
    sd = group["state_dtype"]
    if sd is not None and sd not in _FLOAT_DTYPES:
        raise ValueError(f"Invalid state_dtype: {sd} (must be None, torch.float32, torch.bfloat16 or torch.float16)")
    if not isinstance(group["master_weights"], bool):
        raise ValueError(f"Invalid master_weights: {group['master_weights']!r} (must be a bool)")
    for name in ("weight_rounding", "state_rounding"):
        if group[name] not in _ROUNDINGS:
            raise ValueError(f"Invalid {name}: {group[name]!r} (must be 'stochastic' or 'nearest')")
    clamp = group.get("clamp")
    if clamp is not None and not (isinstance(clamp, (tuple, list)) and len(clamp) == 2 and float(clamp[0]) <= float(clamp[1])):
        raise ValueError(f"Invalid clamp: {clamp!r} (must be None or a (min, max) pair with min <= max)")
    for p in group["params"]:
        if p.dtype not in _FLOAT_DTYPES:
            raise ValueError(f"Invalid params: dtype {p.dtype} is not float32, bfloat16 or float16")


class SRAdamW(Optimizer):
    """AdamW (decoupled weight decay) for float32, bfloat16 and float16 parameters without master copies.

    Half-precision parameters are updated in float32 arithmetic and written back with stochastic
    rounding, so updates smaller than half a unit in the last place are kept in expectation instead
    of being lost. The Adam statistics may be stored in float32, bfloat16 or float16 (float16 with a
    per-tensor power-of-two scale), also written with stochastic rounding. A group with
    ``master_weights=True`` instead keeps a float32 master copy in the optimizer state and gives the
    parameter its round-to-nearest copy (classic mixed precision), so one optimizer can hold an SR
    text tower and a mastered image tower.

    The rounding noise is counter based: a function of ``(seed, rank, tensor index, step, stream,
    element index)``. Two optimizers with the same seed produce bit-identical results, the seed and
    per-tensor steps travel in ``state_dict()``, and data-parallel ranks draw different noise.

    Non-finite gradients: with ``nonfinite="skip"`` (default) a step whose gradients hold an inf or
    NaN in any parameter (on any rank of ``process_group`` when distributed) changes nothing and
    increments :attr:`skipped_steps`; with ``"raise"`` it raises ``FloatingPointError`` before any
    parameter is touched. ``check_finite=False`` turns the check (and its device sync) off for
    callers that check themselves; ``found_inf`` passed to :meth:`step` is always honoured.

    Works on any tensors, including the flat 1-D partitions DeepSpeed ZeRO hands a client
    optimizer (one tensor per group, any length; element indices are 64-bit).

    Args:
        params: Parameters or parameter groups. Groups may override every keyword below except
            ``seed``, ``rank``, ``nonfinite``, ``check_finite`` and ``process_group``. A group may
            also set ``clamp=(min, max)``: its weights (the master, when kept) are projected into
            that range after every update, before rounding.
        lr: Learning rate.
        betas: Decay rates of the first and second moments.
        eps: Term added to the denominator.
        weight_decay: Decoupled weight decay (applied as ``w *= 1 - lr * weight_decay``).
        state_dtype: Storage dtype of the Adam statistics; ``None`` means the parameter's dtype.
        master_weights: Keep a float32 master copy of half-precision parameters.
        weight_rounding: ``"stochastic"`` or ``"nearest"`` for half-precision weights without master.
        state_rounding: ``"stochastic"`` or ``"nearest"`` for half-precision statistics.
        seed: Seed of the rounding noise (any non-negative int).
        rank: Data-parallel rank mixed into the noise; ``None`` reads ``torch.distributed`` at each
            step (0 when not initialised).
        nonfinite: ``"skip"`` or ``"raise"`` on non-finite gradients.
        check_finite: Check gradients for inf/NaN before each step.
        process_group: Group over which the non-finite flag is reduced (default: the world group
            when ``torch.distributed`` is initialised).
        fused: ``None`` (default) updates CUDA tensors with the fused Triton kernel when Triton
            imports and every other tensor with the PyTorch path; ``True`` forces the kernel
            (CUDA tensors, or CPU tensors when ``TRITON_INTERPRET=1`` was set before the first fused
            step); ``False`` always uses the PyTorch path. Both paths compute the same update with
            the same noise (see ``optim.triton_kernel`` for the bit-exactness notes).

    Example:
        >>> model = torch.nn.Linear(4, 4).to(torch.bfloat16)
        >>> opt = SRAdamW(model.parameters(), lr=1e-3, state_dtype=torch.bfloat16, seed=1)
    """

    _step_supports_amp_scaling = True  # accepts GradScaler's grad_scale / found_inf

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        *,
        state_dtype: torch.dtype | None = None,
        master_weights: bool = False,
        weight_rounding: str = "stochastic",
        state_rounding: str = "stochastic",
        seed: int = 0,
        rank: int | None = None,
        nonfinite: str = "skip",
        check_finite: bool = True,
        process_group: Any = None,
        fused: bool | None = None,
    ) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"Invalid seed: {seed!r} (must be a non-negative int)")
        if rank is not None and (not isinstance(rank, int) or rank < 0):
            raise ValueError(f"Invalid rank: {rank!r} (must be None or a non-negative int)")
        if nonfinite not in _NONFINITE:
            raise ValueError(f"Invalid nonfinite: {nonfinite!r} (must be 'skip' or 'raise')")
        if fused not in (None, True, False):
            raise ValueError(f"Invalid fused: {fused!r} (must be None, True or False)")
        if fused and _fused_kernel() is None:
            from .triton_kernel import unavailable_reason

            raise ValueError(f"Invalid fused: fused=True needs Triton ({unavailable_reason()})")
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            eps=eps,
            weight_decay=weight_decay,
            state_dtype=state_dtype,
            master_weights=master_weights,
            weight_rounding=weight_rounding,
            state_rounding=state_rounding,
        )
        self.seed = seed
        self.rank = rank
        self.nonfinite = nonfinite
        self.check_finite = check_finite
        self.process_group = process_group
        self.skipped_steps = 0
        self.fused = fused
        super().__init__(params, defaults)
        if fused:
            runs_on = "cpu" if _fused_kernel().interpreting() else "cuda"
            for group in self.param_groups:
                for p in group["params"]:
                    if p.device.type != runs_on:
                        raise ValueError(
                            f"Invalid fused: fused=True runs on {runs_on} tensors here, got a parameter on "
                            f"{p.device} (TRITON_INTERPRET=1 runs the kernel on CPU tensors)"
                        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Adds a group after validating its hyperparameters (``ValueError`` names a bad one)."""
        super().add_param_group(param_group)
        _validate_group(self.param_groups[-1])

    # ------------------------------------------------------------------------------------------
    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return 0

    def _has_nonfinite(self, grad_mul: torch.Tensor | float | None) -> bool:
        flags = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad if grad_mul is None else p.grad.to(torch.float32) * grad_mul
                    flags.append(torch.isfinite(g).all().logical_not().reshape(1))
        if not flags:
            return False
        flag = torch.cat([f.to(flags[0].device) for f in flags]).any().to(torch.float32)
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1:
            flag = flag.reshape(1)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.process_group)
        return bool(flag.item())

    def _use_fused(self, p: torch.Tensor) -> bool:
        if self.fused is None:
            if p.device.type != "cuda":
                return False
            kernel = _fused_kernel()
            return kernel is not None and not kernel.interpreting()
        return bool(self.fused)

    def _init_state(self, p: torch.Tensor, group: dict[str, Any]) -> dict[str, Any]:
        state = self.state[p]
        sdt = group["state_dtype"] or p.dtype
        # The tensor's noise stream index: the order in which states are first created. It does
        # not depend on the param_groups list at step time (DeepSpeed ZeRO steps one group at a
        # time) and it is saved with the state, so a resumed run keeps it.
        state["index"] = sum(1 for s in self.state.values() if "index" in s)
        state["step"] = torch.tensor(0, dtype=torch.int64)
        state["exp_avg"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
        state["exp_avg_sq"] = torch.zeros_like(p, dtype=sdt, memory_format=torch.contiguous_format)
        if sdt == torch.float16:
            state["exp_avg_bound"] = torch.zeros((), dtype=torch.float32, device=p.device)
            state["exp_avg_sq_bound"] = torch.zeros((), dtype=torch.float32, device=p.device)
        if group["master_weights"] and p.dtype != torch.float32:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        return state

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], float] | None = None,
        *,
        grad_scale: torch.Tensor | float | None = None,
        inv_grad_scale: torch.Tensor | float | None = None,
        found_inf: torch.Tensor | float | None = None,
    ) -> float | None:
        """Performs one optimisation step.

        Args:
            closure: Re-evaluates the model and returns the loss (run with gradients enabled).
            grad_scale: The gradients are divided by this (a loss scale, as ``torch.amp.GradScaler``
                passes it); mutually exclusive with ``inv_grad_scale``.
            inv_grad_scale: The gradients are multiplied by this (an inverse loss scale).
            found_inf: When nonzero the step is skipped and counted in :attr:`skipped_steps`.

        Returns:
            The closure's loss, or ``None``.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is not None and inv_grad_scale is not None:
            raise ValueError("pass grad_scale or inv_grad_scale, not both")
        grad_mul: torch.Tensor | float | None = inv_grad_scale
        if grad_scale is not None:
            grad_mul = 1.0 / grad_scale if not isinstance(grad_scale, torch.Tensor) else grad_scale.double().reciprocal().float()
        if isinstance(grad_mul, torch.Tensor):
            grad_mul = grad_mul.to(torch.float32)
        if found_inf is not None and float(found_inf) != 0.0:
            self.skipped_steps += 1
            return loss
        if self.check_finite and self._has_nonfinite(grad_mul):
            if self.nonfinite == "raise":
                raise FloatingPointError("SRAdamW: non-finite gradient; no parameter was updated")
            self.skipped_steps += 1
            return loss

        rank = self._rank()
        fused_steps: dict[torch.device, list[Any]] = {}
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SRAdamW does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state = self._init_state(p, group)
                state["step"] += 1
                t = int(state["step"])
                index = state["index"]
                keys = tuple(derive_key(self.seed, rank, index, t, s) for s in (STREAM_PARAM, STREAM_EXP_AVG, STREAM_EXP_AVG_SQ))
                m_scales = v_scales = None
                if "exp_avg_bound" in state:
                    g_amax = p.grad.detach().abs().amax().to(torch.float32)
                    if grad_mul is not None:
                        g_amax = g_amax * abs(grad_mul) if not isinstance(grad_mul, torch.Tensor) else g_amax * grad_mul.abs()
                    m_old, v_old = state_scale(state["exp_avg_bound"]), state_scale(state["exp_avg_sq_bound"])
                    state["exp_avg_bound"].mul_(beta1).add_(g_amax, alpha=1 - beta1)
                    state["exp_avg_sq_bound"].mul_(beta2).add_(g_amax * g_amax, alpha=1 - beta2)
                    m_scales = (m_old, state_scale(state["exp_avg_bound"]))
                    v_scales = (v_old, state_scale(state["exp_avg_sq_bound"]))
                if self._use_fused(p):
                    fused_steps.setdefault(p.device, []).append(
                        _fused_kernel().TensorStep(
                            p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=t, lr=float(group["lr"]),
                            beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                            keys=keys, master=state.get("master"), exp_avg_scales=m_scales,
                            exp_avg_sq_scales=v_scales, weight_rounding=group["weight_rounding"],
                            state_rounding=group["state_rounding"], clamp=group.get("clamp"),
                        )
                    )
                    continue
                param = p if p.is_contiguous() else p.contiguous()
                sradamw_update_(
                    param,
                    p.grad,
                    state["exp_avg"],
                    state["exp_avg_sq"],
                    step=t,
                    lr=float(group["lr"]),
                    beta1=beta1,
                    beta2=beta2,
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                    keys=keys,
                    master=state.get("master"),
                    exp_avg_scales=m_scales,
                    exp_avg_sq_scales=v_scales,
                    grad_mul=grad_mul,
                    weight_rounding=group["weight_rounding"],
                    state_rounding=group["state_rounding"],
                    clamp=group.get("clamp"),
                )
                if param is not p:
                    p.copy_(param)
        for items in fused_steps.values():  # one launch per dtype group and device
            _fused_kernel().sradamw_fused_(items, grad_mul=grad_mul)
        return loss

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state, plus the rounding seed and the count of skipped steps.

        State tensors keep their dtypes (half statistics, float32 masters and bounds).
        """
        sd = super().state_dict()
        sd["sr"] = {"seed": self.seed, "skipped_steps": self.skipped_steps}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state saved by :meth:`state_dict`, keeping the saved state dtypes and seed.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter's dtype,
        which would turn a float32 master into bfloat16; here every state tensor is restored with
        its saved dtype (moved to the parameter's device), and the seed and skipped-step count of
        the saved run replace this optimizer's, so a resumed run continues bit-identically.
        """
        saved = copy.deepcopy(state_dict)
        sr = saved.pop("sr", None)
        super().load_state_dict(saved)
        saved_ids = [pid for g in saved["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, p in zip(saved_ids, params):
            if pid not in saved["state"]:
                continue
            for k, v in saved["state"][pid].items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device)
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            _validate_group(group)
        if sr is not None:
            self.seed = int(sr["seed"])
            self.skipped_steps = int(sr.get("skipped_steps", 0))
