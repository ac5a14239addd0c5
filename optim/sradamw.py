"""AdamW with half-precision weights and statistics written by stochastic rounding."""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.optim import Optimizer

from . import _host, _triton
from .functional import (
    STREAM_PARAM,
    STREAM_STATE,
    TensorStep,
    apply_update_,
    state_scale,
)
from ._plan import Plan
from ._rows import call_arguments
from .master16 import join_master, split_master
from .rounding import derive_key, fold_key

__all__ = ["SRAdamW"]

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_ROUNDINGS = ("stochastic", "nearest")
_MASTER_FORMATS = ("split", "fp32")
_NONFINITE = ("skip", "raise")
_STREAMS = (STREAM_PARAM, STREAM_STATE)

_Update = Callable[..., Any]  # (specs, *, grad_mul, found_inf): applies a list of TensorSteps on one device


def _fused_kernel() -> Any:
    """``optim.triton_kernel`` when Triton is usable, else ``None`` (imported on first use only)."""
    if not _triton.is_available():
        return None
    from . import triton_kernel

    return triton_kernel


def _pytorch_updates_(specs: list[TensorStep], *, grad_mul: Any = None, found_inf: Any = None,
                      states_checked: bool = False) -> None:
    """The PyTorch path over a list of tensors (one at a time; it checks nothing: torch's ops raise on
    mismatched sizes)."""
    for spec in specs:
        apply_update_(spec, grad_mul=grad_mul, found_inf=found_inf)


class _PendingSkip:
    """A device skip flag on its way to the host, and the states whose step counters it would undo."""

    def __init__(self, flag: torch.Tensor) -> None:
        # queued before the update kernels, so that settling waits for the flag, not for the update
        self.states: list[dict[str, Any]] = []  # the general path's states (their counters looked up then)
        self.counters: torch.Tensor | None = None  # a plan's packed counters
        self.event = None
        if flag.device.type == "cuda":
            self.host = torch.empty((), dtype=torch.bool, pin_memory=True)
            self.host.copy_(flag, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(flag.device))
        else:  # CPU (a test forcing the deferred path), or another accelerator (no events here):
            self.host = flag.to("cpu", copy=True)  # a plain copy; from a non-CUDA accelerator it waits for it

    def skipped(self) -> bool:
        if self.event is not None:
            self.event.synchronize()  # host wait on the flagged step's event, long finished by now
        return bool(self.host)  # pinned host memory: no device sync


def _grad_amax(grads: list[torch.Tensor]) -> torch.Tensor:
    """float32 ``[len(grads)]``: the largest magnitude of each gradient (NaN when it holds one), on their
    device. The one choice of reduction: on CUDA one multi-tensor ``_foreach_norm(ord=inf)`` launch;
    on the CPU one call of the CPU kernel's reduction for all tensors (``optim._cpu_kernel.grad_amax``),
    or without it ``aminmax`` per tensor (~20x faster there than the norm's bf16 path)."""
    if grads[0].device.type == "cpu":
        from . import _cpu_kernel

        if _cpu_kernel.available():
            return _cpu_kernel.grad_amax(grads)
        zero = torch.zeros((), dtype=torch.float32)
        ends = [torch.aminmax(g) if g.numel() else (zero, zero) for g in grads]  # an empty tensor: 0 (no identity)
        return torch.stack([torch.maximum(lo.abs(), hi.abs()).to(torch.float32) for lo, hi in ends])
    return torch.stack(torch._foreach_norm(grads, float("inf"))).to(torch.float32)


_STATE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_MAX_PLANS = 8


class _Version:
    """A counter that every write to SRAdamW's state containers advances: a step plan (``optim._plan``)
    holds addresses of state tensors, and is retired when the state may have changed under it."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value = 0


class _State(dict):
    """One parameter's state; an assignment or removal of an entry advances the optimizer's :class:`_Version`."""

    __slots__ = ("_version",)

    def __init__(self, version: _Version, *args: Any) -> None:
        super().__init__(*args)
        self._version = version

    def _bump(self) -> None:
        self._version.value += 1

    def __setitem__(self, key: Any, value: Any) -> None:
        self._bump()
        super().__setitem__(key, value)

    def __delitem__(self, key: Any) -> None:
        self._bump()
        super().__delitem__(key)

    def __reduce__(self) -> Any:  # pickles (and deep-copies) as a plain dict: checkpoints name no class of ours
        return (dict, (dict(self),))

    def _changes(name: str) -> Callable[..., Any]:
        method = getattr(dict, name)

        def changed(self: "_State", *args: Any, **kwargs: Any) -> Any:
            self._bump()
            return method(self, *args, **kwargs)

        changed.__name__ = name
        return changed

    update = _changes("update")
    pop = _changes("pop")
    popitem = _changes("popitem")
    clear = _changes("clear")
    setdefault = _changes("setdefault")
    del _changes


class _States(defaultdict):
    """``optimizer.state`` (parameter -> :class:`_State`); an assignment or removal advances the :class:`_Version`."""

    def __init__(self, version: _Version, items: Any = ()) -> None:
        super().__init__(None)
        self._version = version
        for k, v in dict(items).items():
            super().__setitem__(k, v if isinstance(v, _State) else _State(version, v))

    def __missing__(self, key: Any) -> _State:
        value = self[key] = _State(self._version)
        return value

    def __setitem__(self, key: Any, value: Any) -> None:
        self._version.value += 1
        super().__setitem__(key, value if isinstance(value, _State) else _State(self._version, value))

    def __delitem__(self, key: Any) -> None:
        self._version.value += 1
        super().__delitem__(key)

    def __reduce__(self) -> Any:  # a plain defaultdict(dict) of plain dicts
        return (defaultdict, (dict,), None, None, iter(dict(self).items()))


def _check_state(p: torch.Tensor, state: dict[str, Any], name: str) -> None:
    """A loaded state fits its parameter (checked once, at load: the kernels then check only the
    gradients per step). ``ValueError`` names the parameter and the state entry."""
    n = p.numel()
    for key in ("exp_avg", "exp_avg_sq", "master", "master_low"):
        t = state.get(key)
        if t is None:
            continue
        ok_dtype = (t.dtype in _STATE_DTYPES if key.startswith("exp") else
                    t.dtype == torch.float32 if key == "master" else
                    t.dtype == torch.int16 and p.dtype == torch.bfloat16)
        if t.numel() != n or not ok_dtype:
            raise ValueError(f"SRAdamW.load_state_dict: {name} ({tuple(p.shape)}, {p.dtype}) does not match its "
                             f"saved {key!r} ({tuple(t.shape)}, {t.dtype})")


def _validate_group(group: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the offending hyperparameter."""
    lr = group["lr"]
    if isinstance(lr, torch.Tensor):
        lr = float(lr)  # when groups are created or loaded, not per step
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
    if group.get("master_format", "split") not in _MASTER_FORMATS:
        raise ValueError(f"Invalid master_format: {group['master_format']!r} (must be 'split' or 'fp32')")
    for name in ("weight_rounding", "state_rounding"):
        if group[name] not in _ROUNDINGS:
            raise ValueError(f"Invalid {name}: {group[name]!r} (must be 'stochastic' or 'nearest')")
    clamp = group.get("clamp")
    pair = isinstance(clamp, (tuple, list)) and len(clamp) == 2
    if clamp is not None and not (pair and float(clamp[0]) <= float(clamp[1])):
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
    NaN in any parameter (on any rank of ``process_group`` when distributed), or whose ``found_inf``
    is nonzero, changes nothing, does not advance any per-tensor step and increments
    :attr:`skipped_steps`; with ``"raise"`` non-finite gradients raise ``FloatingPointError`` before
    any parameter is touched. ``check_finite=False`` turns the check off for callers that check
    themselves; ``found_inf`` passed to :meth:`step` is always honoured.

    No host synchronisation: :meth:`step` never reads a flag that lives on an accelerator. The
    non-finite check runs on the parameters' device and is combined there with ``found_inf`` (and
    all-reduced over the process group); the update is then issued with that flag as a device-side
    skip (masked stores), and the host bookkeeping (per-tensor steps, :attr:`skipped_steps`) is
    settled at the next :meth:`step`, :meth:`state_dict` or read of :attr:`skipped_steps`, by which
    time the flag has long arrived. A flag in CPU memory (CPU parameters, or a Python or CPU
    ``found_inf``) is read at once and a skipped step touches nothing. ``nonfinite="raise"`` reads
    the device flag (one sync per step), since it must raise at once.

    Works on any tensors, including the flat 1-D partitions DeepSpeed ZeRO hands a client
    optimizer (one tensor per group, any length; element indices are 64-bit).

    Args:
        params: Parameters or parameter groups. Groups may override every keyword below except
            ``seed``, ``rank``, ``nonfinite``, ``check_finite`` and ``process_group``. A group may
            also set ``clamp=(min, max)``: its weights (the master, when kept) are projected into
            that range after every update, before rounding.
        lr: Learning rate (a tensor learning rate is read on the host at every step).
        betas: Decay rates of the first and second moments.
        eps: Term added to the denominator.
        weight_decay: Decoupled weight decay (applied as ``w *= 1 - lr * weight_decay``).
        state_dtype: Storage dtype of the Adam statistics; ``None`` means the parameter's dtype.
        master_weights: Keep a float32 master copy of half-precision parameters.
        master_format: How a kept master is stored: ``"split"`` (default): for bfloat16 parameters the
            parameter is the master's high half (nearest, ties away from zero) and the state keeps
            its low 16 bits (``master_low``, int16): the same float32 master bit for bit in 2 extra
            bytes per parameter instead of 4 (:mod:`optim.master16`); float16 parameters keep a
            float32 ``master`` either way. ``"fp32"``: a separate float32 ``master`` and the
            parameter its round-to-nearest-even copy. A state loaded from a checkpoint keeps the
            form it was saved in.
        weight_rounding: ``"stochastic"`` or ``"nearest"`` for half-precision weights without master.
        state_rounding: ``"stochastic"`` or ``"nearest"`` for half-precision statistics.
        seed: Seed of the rounding noise (any non-negative int).
        rank: Data-parallel rank mixed into the noise; ``None`` reads ``torch.distributed`` at each
            step (0 when not initialised).
        nonfinite: ``"skip"`` or ``"raise"`` on non-finite gradients.
        check_finite: Check gradients for inf/NaN before each step.
        process_group: Group over which the non-finite flag is reduced (default: the world group
            when ``torch.distributed`` is initialised).
        fused: ``None`` (default) picks the fastest implementation per device: CUDA tensors get the
            fused Triton kernel when Triton imports, CPU tensors the C++ kernel (``optim._cpu_kernel``:
            one vectorised, multi-threaded call per dtype route and step; built on first use, ~1 s
            per route and cached on disk; a machine without a C++ compiler falls back to the eager
            path);
            ``True`` forces the Triton kernel (CUDA tensors, or CPU tensors when the kernel runs
            interpreted: ``TRITON_INTERPRET=1``, the default on a machine without CUDA); ``False``
            always uses the eager PyTorch path (the reference definition). All paths compute the
            same bits (see ``optim.functional`` for the definition).

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
        master_format: str = "split",
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
            raise ValueError(f"Invalid fused: fused=True needs Triton ({_triton.unavailable_reason()})")
        defaults = dict(
            lr=lr,
            betas=tuple(betas) if isinstance(betas, (tuple, list)) else betas,
            eps=eps,
            weight_decay=weight_decay,
            state_dtype=state_dtype,
            master_weights=master_weights,
            master_format=master_format,
            weight_rounding=weight_rounding,
            state_rounding=state_rounding,
        )
        self.seed = seed
        self.rank = rank
        self.nonfinite = nonfinite
        self.check_finite = check_finite
        self.process_group = process_group
        self._skipped_steps = 0
        self._pending: _PendingSkip | None = None
        self._key_prefixes: dict[tuple[int, int], int] = {}  # (rank, tensor index) -> derive_key(seed, rank, index)
        self.fused = fused
        super().__init__(params, defaults)
        self._version = _Version()
        self.state = _States(self._version)
        self._plans: list[Plan] = []  # optim._plan: the cached work of steps over the same tensors
        self._use_plans = True  # False: every step takes the general path (tests compare the two)
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
        self._retire_plans()

    def _retire_plans(self) -> None:
        """Forgets every step plan (the groups or states changed); the next step takes the general path."""
        if getattr(self, "_plans", None):
            self._plans.clear()

    @property
    def skipped_steps(self) -> int:
        """Steps skipped so far. Reading it settles the last step's device-side skip decision (a
        wait on that step's event; call it after later work was queued to keep the GPU busy)."""
        self._settle()
        return self._skipped_steps

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._settle()
        self._skipped_steps = int(value)

    # ------------------------------------------------------------------------------------------
    def _rank(self) -> int:
        if self.rank is not None:
            return self.rank
        dist = torch.distributed
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
        return 0

    def _settle(self) -> None:
        """Applies a deferred skip decision to the host bookkeeping: a skipped step advances nothing."""
        pending, self._pending = self._pending, None
        if pending is not None and pending.skipped():
            if pending.counters is not None:
                pending.counters.sub_(1)
            for state in pending.states:
                state["step"] -= 1
            self._skipped_steps += 1

    def _has_scaled_states(self) -> bool:
        """Whether any tensor keeps float16 statistics with scales (decided by the state dtype)."""
        return any((g["state_dtype"] or p.dtype) == torch.float16 for g in self.param_groups for p in g["params"])

    def master(self, p: torch.Tensor) -> torch.Tensor | None:
        """The float32 master of parameter ``p`` (a new tensor for the split form, the state tensor for
        a float32 one), or None when ``p`` keeps none (yet)."""
        state = self.state.get(p, {})
        if "master_low" in state:
            return join_master(p.detach(), state["master_low"])
        return state.get("master")

    @torch.no_grad()
    def set_master(self, p: torch.Tensor, value: torch.Tensor) -> None:
        """Makes ``value`` (float32, ``p.numel()`` elements) the exact float32 master of parameter ``p``,
        so that :meth:`master` then gives it back bit for bit: e.g. a run started from float32 weights
        whose parameters were cast to bfloat16 before the optimizer was built.

        * A bfloat16 parameter of a group with ``master_weights`` and the split form: ``p`` becomes the
          master's high half (nearest, ties away from zero) and ``master_low`` its low 16 bits
          (:func:`optim.master16.split_master`).
        * A float32 ``master`` state (``master_format="fp32"``, float16 parameters, or a state loaded in
          that form): the state becomes ``value`` and ``p`` its round-to-nearest-even copy.
        * A float32 parameter is its own master: it becomes ``value``.

        ``p``'s state is created first when it has none (zero statistics at step 0, as its first step
        would create it; its noise stream index is the order in which states are created, as always).
        No other state changes.

        Raises:
            ValueError: ``p`` is in no group of this optimizer, ``value`` is not float32 or has another
                number of elements, or ``p`` is a half-precision parameter of a group without
                ``master_weights`` (its weight is all there is: it keeps no master).
        """
        group = next((g for g in self.param_groups if any(q is p for q in g["params"])), None)
        if group is None:
            raise ValueError("SRAdamW.set_master: the tensor is not a parameter of this optimizer")
        if value.dtype != torch.float32 or value.numel() != p.numel():
            raise ValueError(f"SRAdamW.set_master: the master of a parameter of {p.numel()} elements must be "
                             f"float32 with as many elements, got {value.dtype} {tuple(value.shape)}")
        value = value.detach().to(p.device).reshape(p.shape)
        if p.dtype == torch.float32:
            p.copy_(value)
            self._retire_plans()
            return
        if not group["master_weights"]:
            raise ValueError(f"SRAdamW.set_master: a {p.dtype} parameter of a group without master_weights keeps "
                             "no master (its stochastically rounded weight is all there is)")
        self._settle()
        state = self.state[p] if len(self.state.get(p, {})) else self._init_state(p, group)
        if "master_low" in state:
            hi, lo = split_master(value)
            p.copy_(hi)
            state["master_low"].copy_(lo.reshape(state["master_low"].shape))
        elif "master" in state:
            state["master"].copy_(value.reshape(state["master"].shape))
            p.copy_(value)  # round to nearest (even), as an update leaves it
        else:
            raise ValueError("SRAdamW.set_master: the parameter's state keeps no master (a state loaded from a "
                             "group without master_weights)")
        self._retire_plans()

    def _grad_maxima(self) -> dict[torch.device, torch.Tensor]:
        """Per device, the largest magnitude of each gradient (:func:`_grad_amax`, NaN propagates) in
        the order of the parameter groups: the one read of the gradients that both the non-finite
        check and the float16 state scales use. Not read on the host."""
        by_device: dict[torch.device, list[torch.Tensor]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    by_device.setdefault(p.grad.device, []).append(p.grad.detach())
        return {device: _grad_amax(grads) for device, grads in by_device.items()}

    @staticmethod
    def _nonfinite(maxima: dict[torch.device, torch.Tensor], grad_mul: torch.Tensor | float | None) -> torch.Tensor | None:
        """float32 ``[1]`` on the first gradient's device: 1 when any gradient (times ``grad_mul``)
        holds an inf or NaN; ``None`` without gradients. Not read.

        From the gradients' maxima (:meth:`_grad_maxima`) times ``|grad_mul|`` (rounding is
        monotonic, so the largest product overflows exactly when one does)."""
        flag = SRAdamW._nonfinite_flag(maxima, grad_mul)
        return None if flag is None else flag.to(torch.float32).reshape(1)

    @staticmethod
    def _nonfinite_flag(maxima: dict[torch.device, torch.Tensor], grad_mul: torch.Tensor | float | None) -> torch.Tensor | None:
        """:meth:`_nonfinite` as a 0-dim bool tensor (one device: three operations)."""
        if not maxima:
            return None
        flags = []
        for amax in maxima.values():
            if grad_mul is not None:
                amax = amax * (grad_mul.abs().to(amax.device) if isinstance(grad_mul, torch.Tensor) else abs(grad_mul))
            flags.append(torch.isfinite(amax).all().logical_not())
        if len(flags) == 1:
            return flags[0]
        return torch.stack([f.to(flags[0].device) for f in flags]).any()

    def _skip_flag(self, found_inf: Any, grad_mul: torch.Tensor | float | None,
                   maxima: dict[torch.device, torch.Tensor]) -> bool | torch.Tensor:
        """The step's skip decision: a bool decided on the host, or a 0-dim bool tensor that the
        update applies on its device (see :meth:`_defers`). ``maxima``: :meth:`_grad_maxima`."""
        found = None
        if isinstance(found_inf, torch.Tensor) and self._defers(found_inf):
            found = found_inf.detach().reshape(1).to(torch.float32)
        elif found_inf is not None and float(found_inf) != 0.0:  # a number or CPU memory: no device sync
            return True
        dist = torch.distributed
        shared = dist.is_available() and dist.is_initialized() and dist.get_world_size(self.process_group) > 1
        if found is None and not shared and self.nonfinite == "skip":  # the flag alone decides: fewest operations
            bad = self._nonfinite_flag(maxima, grad_mul) if self.check_finite else None
            if bad is None:
                return False
            return bad if self._defers(bad) else bool(bad)  # CPU memory: reading it is no device sync
        bad = self._nonfinite(maxima, grad_mul) if self.check_finite else None
        if bad is None:
            return False if found is None else found.reshape(()) != 0
        # [found_inf, non-finite gradients], where the gradients are (a device flag crossing to CPU
        # parameters waits for its device: a mixed setup only)
        flags = torch.cat([found.to(bad.device) if found is not None else torch.zeros_like(bad), bad])
        if shared:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.process_group)
        if self.nonfinite == "raise":
            found_now, bad_now = flags.tolist()  # host read (a sync on a device): raising cannot wait
            if bad_now and not found_now:
                raise FloatingPointError("SRAdamW: non-finite gradient; no parameter was updated")
            return bool(found_now)
        skip = flags.amax() != 0
        return skip if self._defers(skip) else bool(skip)  # CPU memory: reading it is no device sync

    def _defers(self, flag: torch.Tensor) -> bool:
        """Whether a skip flag is applied on its device (masked update, bookkeeping settled at the next
        step) instead of being read now. A flag in CPU memory is read now: that is no device sync.

        The one place that chooses between the two paths (tests force the deferred one on CPU)."""
        return flag.device.type != "cpu"

    def _update_for(self, device: torch.device) -> _Update:
        """The implementation that updates this device's tensors (the one place that chooses): the
        fused Triton kernel, the C++ CPU kernel, or the eager PyTorch path (all compute the same bits)."""
        if self.fused is False:
            return _pytorch_updates_
        if self.fused is None and device.type == "cpu":
            from . import _cpu_kernel

            return _cpu_kernel.cpu_updates_ if _cpu_kernel.available() else _pytorch_updates_
        if self.fused is None:
            kernel = _fused_kernel()
            if device.type != "cuda" or kernel is None or kernel.interpreting():
                return _pytorch_updates_
        return _fused_kernel().sradamw_fused_

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
        if group["master_weights"] and p.dtype == torch.bfloat16 and group.get("master_format", "split") == "split":
            # the master is p itself (exactly) plus zero low halves: optim.master16
            state["master_low"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
        elif group["master_weights"] and p.dtype != torch.float32:
            state["master"] = p.detach().to(torch.float32, memory_format=torch.contiguous_format).clone()
        return state

    def _tensor_steps(self, todo: list[tuple[torch.Tensor, dict[str, Any]]]) -> list[TensorStep]:
        """Advances the step counters of ``todo``'s parameters (``(param, group)`` pairs; states are
        created on first use) and returns their updates, keys and float16 state scales still unset
        (:meth:`_derive_keys`, :meth:`_f16_scales`). The counters are CPU tensors: advanced and read
        with a few multi-tensor operations for all of them, not two per tensor."""
        states = [self.state[p] if len(self.state[p]) else self._init_state(p, group) for p, group in todo]
        counters = [st["step"] for st in states]
        torch._foreach_add_(counters, 1)
        if all(c.dtype == torch.int64 for c in counters):
            steps = torch.stack(counters).tolist()  # CPU tensors: no device sync
        else:  # a state loaded from elsewhere (e.g. float32 counters)
            steps = [int(c) for c in counters]
        lrs = {id(group): float(group["lr"]) for _, group in todo}  # a tensor lr is read here (a sync on a device)
        out = []
        for (p, group), state, t in zip(todo, states, steps):
            beta1, beta2 = group["betas"]
            out.append(TensorStep(
                p, p.grad, state["exp_avg"], state["exp_avg_sq"], step=int(t), lr=lrs[id(group)],
                beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                keys=(0, 0),  # filled for all tensors at once by _derive_keys
                master=state.get("master", state.get("master_low")),
                weight_rounding=group["weight_rounding"], state_rounding=group["state_rounding"],
                clamp=group.get("clamp"),
            ))
        return out

    def _derive_keys(self, steps: list[TensorStep], rank: int) -> None:
        """Sets every step's noise keys ``derive_key(seed, rank, tensor index, step, stream)`` for the
        weight and the statistics streams: the ``(seed, rank, index)`` prefix is derived once per
        tensor and cached, the step and stream are folded in for all tensors with a few tensor
        operations (a Python hash chain per tensor and step cost ~20 us each)."""
        if not steps:
            return
        prefixes = [self._key_prefix(rank, self.state[s.param]["index"]) for s in steps]
        h = fold_key(torch.tensor(prefixes, dtype=torch.int64), torch.tensor([s.step for s in steps], dtype=torch.int64))
        keys = torch.stack([fold_key(h, stream) for stream in _STREAMS], 1)  # CPU [tensors, 2], never read back
        for s, k in zip(steps, keys.unbind()):
            s.keys = k

    def _key_prefix(self, rank: int, index: int) -> int:
        """``derive_key(seed, rank, index)``, cached: the part of a tensor's noise key that never changes."""
        prefix = self._key_prefixes.get((rank, index))
        if prefix is None:
            prefix = self._key_prefixes[(rank, index)] = derive_key(self.seed, rank, index)
        return prefix

    def _f16_scales(
        self, items: list[TensorStep], grad_mul: torch.Tensor | float | None, skip: torch.Tensor | None,
        maxima: torch.Tensor | None,
    ) -> None:
        """Advances the running bounds of every float16 statistic on one device and sets the steps'
        ``(old, new)`` power-of-two state scales, for all such tensors at once.

        A bound follows the statistic from the gradient's absolute maximum alone (``m_bound = beta1 *
        m_bound + (1 - beta1) * amax|g|``, ``v_bound`` likewise with ``amax|g|**2``), so the update
        needs no second pass. A fixed number of multi-tensor operations per step whatever the number
        of tensors on CUDA (one ``_foreach_norm`` for the maxima, vector arithmetic, one ``_foreach_copy_``
        back into the per-tensor bound states); the scales are elements of one vector that the
        update reads in place. Masked by the device skip flag, never read on the host. ``maxima``:
        the gradients' maxima of ``items`` in order (:meth:`_grad_maxima`)."""
        picked = [i for i, s in enumerate(items) if "exp_avg_bound" in self.state[s.param]]
        if not picked:
            return
        scaled = [items[i] for i in picked]
        device = scaled[0].param.device
        states = [self.state[s.param] for s in scaled]
        if maxima is None or maxima.numel() != len(items):
            raise RuntimeError("SRAdamW: gradient maxima do not match the tensors of the step")
        amax = maxima if len(picked) == len(items) else maxima[torch.tensor(picked, device=maxima.device)]
        if grad_mul is not None:
            amax = amax * (grad_mul.abs() if isinstance(grad_mul, torch.Tensor) else abs(grad_mul))
        bounds = [st[k] for k in ("exp_avg_bound", "exp_avg_sq_bound") for st in states]
        old = torch.stack(bounds).view(2, -1)  # rows: exp_avg, exp_avg_sq
        betas = torch.tensor([[s.beta1 for s in scaled], [s.beta2 for s in scaled]], dtype=torch.float32)
        betas = betas.to(device, non_blocking=True)
        grow = torch.stack([amax, amax * amax])
        new = old * betas + grow * (1 - betas)
        if skip is not None:
            new = torch.where(skip, old, new)
        torch._foreach_copy_(bounds, list(new.view(-1).unbind()))
        scales = state_scale(torch.stack([old, new])).permute(2, 1, 0).contiguous()  # [tensor, m/v, old/new]
        for s, pair in zip(scaled, scales.unbind()):
            s.exp_avg_scales, s.exp_avg_sq_scales = pair.unbind()  # float32 [2] (old, new) each

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
            found_inf: When nonzero the step is skipped and counted in :attr:`skipped_steps`: a
                Python number, a CPU tensor (both read at once) or a device tensor (never read here:
                the update is skipped on the device, the bookkeeping settled later).

        Returns:
            The closure's loss, or ``None``.
        """
        self._settle()
        if grad_scale is None and inv_grad_scale is None and found_inf is None:
            # torch.amp.GradScaler hands optimizers with _step_supports_amp_scaling its scale and inf
            # flag as attributes (device tensors) for the duration of step()
            grad_scale, found_inf = getattr(self, "grad_scale", None), getattr(self, "found_inf", None)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if grad_scale is not None and inv_grad_scale is not None:
            raise ValueError("pass grad_scale or inv_grad_scale, not both")
        grad_mul: torch.Tensor | float | None = inv_grad_scale
        if grad_scale is not None:
            if isinstance(grad_scale, torch.Tensor):
                grad_mul = grad_scale.double().reciprocal().float()
            else:
                grad_mul = 1.0 / grad_scale
        if isinstance(grad_mul, torch.Tensor):
            if grad_mul.numel() != 1:
                raise ValueError(f"grad_scale / inv_grad_scale must hold one value, got shape {tuple(grad_mul.shape)}")
            grad_mul = grad_mul.to(torch.float32).reshape(())  # GradScaler's scale has shape [1]
        if self._use_plans and self._plans and self._plan_step(found_inf, grad_mul):
            return loss
        maxima = self._grad_maxima() if self.check_finite or self._has_scaled_states() else {}
        skip = self._skip_flag(found_inf, grad_mul, maxima)
        if skip is True:
            self._skipped_steps += 1
            return loss
        device_skip = skip if isinstance(skip, torch.Tensor) else None
        pending = _PendingSkip(device_skip) if device_skip is not None else None

        rank = self._rank()
        specs: dict[torch.device, list[TensorStep]] = {}
        skips: dict[torch.device, torch.Tensor | None] = {}
        todo = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("SRAdamW does not support sparse gradients")
                if p.device not in skips:  # the flag where this device's update reads it (no host sync)
                    skips[p.device] = device_skip.to(p.device) if device_skip is not None else None
                todo.append((p, group))
        for s in self._tensor_steps(todo):
            specs.setdefault(s.param.device, []).append(s)
        self._derive_keys([s for items in specs.values() for s in items], rank)
        for device, items in specs.items():
            self._f16_scales(items, grad_mul, skips[device], maxima.get(device))  # one implementation per device; the kernel: one launch per dtype group
            # the states were checked when created or loaded (_check_state): the kernels check the gradients
            self._update_for(device)(items, grad_mul=grad_mul, found_inf=skips[device], states_checked=True)
        if pending is not None:
            pending.states = [self.state[s.param] for items in specs.values() for s in items]
            self._pending = pending
        self._leave_plan(specs, todo, grad_mul, rank)
        return loss

    # ------------------------------------------------------------------------------------------
    # step plans (optim._plan): the general path leaves one; later steps over the same tensors use it
    def plan_tensors(self) -> list[torch.Tensor]:
        """The tensors this optimizer's step plans hold beyond its state (metadata tables, packed
        counters and bounds, key words: ~10 KiB plus 32 bytes per tensor and step derived ahead), for
        memory accounting."""
        return [t for plan in self._plans for t in plan.tensors()]

    def _plan_kind(self, device: torch.device) -> tuple[str, Callable[..., None], Callable, Callable] | None:
        """``(kind, launch, place, make_amax)`` of the kernel that updates ``device``'s tensors, or None on
        the eager path (no plan: it is the reference). ``make_amax(grads)`` gives the kernel's gradient
        maxima for those gradients' dtypes and lengths, called with their addresses."""
        update = self._update_for(device)
        if update is _pytorch_updates_:
            return None
        if update is getattr(_fused_kernel(), "sradamw_fused_", None):
            from . import triton_kernel

            return ("triton", lambda table, launches, skip, gmul: triton_kernel.launch(table, launches, device, skip, gmul),
                    lambda x: triton_kernel._flag_on(x, device), lambda grads: triton_kernel.GradAmax(grads, device))
        from . import _cpu_kernel

        return "cpu", _cpu_kernel.run, _cpu_kernel._cpu_float, _cpu_kernel.GradAmax

    def _leave_plan(self, specs: dict[torch.device, list[TensorStep]], todo: list[tuple[torch.Tensor, dict[str, Any]]],
                    grad_mul: torch.Tensor | float | None, rank: int) -> None:
        """After a general-path step: retires the plans that share its tensors (their counters moved),
        and leaves one for these tensors when a kernel updates them all on one device."""
        stepped = {id(p) for p, _ in todo}
        self._plans = [plan for plan in self._plans if not any(id(p) in stepped for p in plan.params)]
        if not self._use_plans or len(specs) != 1 or not todo:
            return
        (device, items), = specs.items()
        kind = self._plan_kind(device)
        if kind is None or not all(s.param.is_contiguous() and s.grad.is_contiguous() for s in items):
            return
        name, launch, place, make_amax = kind
        gmul_mode = call_arguments(grad_mul, None, place)[0]
        plan = Plan(self, items, [g for _, g in todo], name, gmul_mode, rank, launch, place,
                    make_amax([s.grad for s in items]), self._version.value)
        self._plans = [plan, *self._plans][:_MAX_PLANS]

    def _plan_step(self, found_inf: Any, grad_mul: torch.Tensor | float | None) -> bool:
        """One step on a plan when one fits (the same tensors with gradients as the step that left it,
        nothing changed under it: :meth:`optim._plan.Plan.usable`); False leaves the step to the general
        path. The order of work is the general path's: maxima, skip decision, counters, scales, update."""
        gmul_mode = gmul_value = gmul_tensor = place = None
        rank = self._rank()
        for plan in self._plans:
            if plan.version != self._version.value:
                continue  # the state changed under it: the general path retires it
            if plan.place is not place:  # the multiplier's form where this plan's kernels read it
                place = plan.place
                gmul_mode, gmul_value, gmul_tensor, _ = call_arguments(grad_mul, None, place)
            code = plan.usable(self.param_groups, rank, gmul_mode)
            if code == _host.OK:
                break
            if code != _host.OTHER_TENSORS:  # its tensors moved or a gradient is not contiguous: retire it
                self._plans.remove(plan)
                return False
        else:
            return False
        scaled = plan.scaled_index is not None
        maxima = {plan.device: plan.grad_maxima()} if self.check_finite or scaled else {}
        skip = self._skip_flag(found_inf, grad_mul, maxima)
        if skip is True:
            self._skipped_steps += 1
            return True
        device_skip = skip.to(plan.device) if isinstance(skip, torch.Tensor) else None
        pending = _PendingSkip(skip) if device_skip is not None else None
        plan.step(self.param_groups, grad_mul, gmul_value, gmul_tensor, device_skip,
                  maxima.get(plan.device))
        if pending is not None:
            pending.counters = plan.steps
            self._pending = pending
        return True

    # ------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The optimizer state, plus the rounding seed and the count of skipped steps.

        State tensors keep their dtypes (half statistics, float32 masters and bounds). A pending
        device-side skip decision is settled first.
        """
        self._settle()
        sd = super().state_dict()
        sd["state"] = {k: dict(v) for k, v in sd["state"].items()}  # plain dicts (the containers track writes)
        sd["sr"] = {"seed": self.seed, "skipped_steps": self._skipped_steps}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Loads a state saved by :meth:`state_dict`, keeping the saved state dtypes and seed.

        ``torch.optim.Optimizer.load_state_dict`` casts floating state to the parameter's dtype,
        which would turn a float32 master into bfloat16; here every state tensor is restored with
        its saved dtype (moved to the parameter's device), and the seed and skipped-step count of
        the saved run replace this optimizer's, so a resumed run continues bit-identically.
        """
        self._settle()
        self._retire_plans()
        saved = copy.deepcopy(state_dict)
        sr = saved.pop("sr", None)
        super().load_state_dict(saved)
        self.state = _States(self._version, self.state)
        self._version.value += 1
        saved_ids = [pid for g in saved["param_groups"] for pid in g["params"]]
        params = [p for g in self.param_groups for p in g["params"]]
        for i, (pid, p) in enumerate(zip(saved_ids, params)):
            if pid not in saved["state"]:
                continue
            for k, v in saved["state"][pid].items():
                if isinstance(v, torch.Tensor) and k != "step":
                    self.state[p][k] = v.to(device=p.device, memory_format=torch.contiguous_format)
            _check_state(p, self.state[p], f"parameter {i}")
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            _validate_group(group)
        self._key_prefixes.clear()
        if sr is not None:
            self.seed = int(sr["seed"])
            self._skipped_steps = int(sr.get("skipped_steps", 0))
