"""Exponential moving average of the weights (``--ema-decay D``), stored in the weights' own dtype.

After every optimizer step that was not skipped (a non-finite or fp16-overflow step, see
:class:`recipe.training.step.StepResult`, leaves the EMA untouched)::

    ema <- d * ema + (1 - d) * w,    d = D, or with --ema-warmup d = min(D, (1 + t) / (10 + t))

where ``t`` is the number of EMA updates done before this one (0 at the first optimizer step; the
optimizer step minus one when no step was skipped). The EMA starts as a copy of the weights the
engine holds before the first step.

Precision: the update is computed in fp32 (``lerp(ema, w, 1 - d)``, exact when ``ema == w``) and
written back in the weights' dtype. fp32 weights keep an fp32 EMA. bf16 and fp16 weights keep a
bf16/fp16 EMA written with **stochastic rounding**: with D = 0.999 an update moves the average by
``(1 - D)(w - ema)``, far below half an ulp unless ``w`` and ``ema`` are hundreds of ulps apart, so
round-to-nearest returns ``ema`` unchanged and the average freezes at its initial value; stochastic
rounding is unbiased (``E[round(x)] = x`` exactly for bf16, to 2**-24 of an ulp for fp16), so the
half EMA follows the fp32 one with a zero-mean error (``benchmarks/ema_experiment.py``). The noise
is counter based (:mod:`optim.rounding`): element ``j`` of parameter ``i`` at EMA update ``t`` draws
``random_bits(noise_key(seed, i, t), j)`` with ``j`` its index in the whole flattened parameter, so
the EMA is a function of ``(--sr-seed, live weights)`` alone: the same on every rank, the same
whether a parameter is sharded or not (ZeRO-3 partitions give bit for bit the unsharded result),
and resumed bit-identically from a checkpoint (which stores ``t``).

Buffers (BatchNorm statistics, ...) are copied from the model at every update, not averaged.
Parameters that do not require gradients (locked towers, ``--lock-image``/``--lock-text``) keep no
copy: the average of a constant is that constant, so their entries in the EMA state dict are the
live weights (a parameter unfrozen later starts its average from its weights then).

Where it lives, and its memory per rank (P trainable parameters, W data-parallel ranks, b bytes per
weight: 2 for bf16/fp16, 4 for fp32):

* ZeRO 0, 1, 2 (and the fp16 route): every rank holds the full module weights, and keeps a full EMA
  copy next to them: ``b * P`` bytes on every rank. Every rank computes the same EMA (same weights,
  rank-independent noise), so no communication is needed, and evaluation, which is data parallel
  (each rank embeds its share), runs on every rank by swapping the EMA tensors into the module
  (no copy). Keeping it on rank 0 only would save that memory on the other ranks but cost a
  broadcast of the whole model at every evaluation.
* ZeRO 3: each rank keeps the EMA of its own partition of every parameter (``param.ds_tensor``):
  ``b * P / W`` bytes per rank, updated without communication. A checkpoint gathers it parameter
  by parameter to rank 0; an evaluation gathers it to every rank into a full model copy for the
  duration of the evaluation, as :func:`recipe.training.engine.eval_module` does for the live weights.

The update's temporaries are fp32 copies of one parameter (or partition) at a time.

In a checkpoint the EMA is ``ema_weights.pt`` (:data:`recipe.run.checkpoint.EMA_WEIGHTS`): a complete
state dict with the model's parameter and buffer names, in the weights' dtype, loadable on its own
(``python -m recipe.evaluate --ema``, :func:`recipe.export.load_run` with ``ema=True``); the update
count travels in the rank files' client state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from optim.rounding import derive_key, random_bits, round_with_bits

__all__ = ["ModelEMA", "build_ema", "noise_key", "ema_decay_at", "ema_update_"]

#: Salt of the EMA's noise keys (keeps them apart from SRAdamW's weight and state streams).
_EMA_SALT = 0x454D41  # "EMA"
_HALF = (torch.bfloat16, torch.float16)


def noise_key(seed: int, index: int, update: int) -> int:
    """Noise key of parameter ``index`` (its position in ``named_parameters()``) at EMA update
    ``update`` (1 for the first update)."""
    return derive_key(seed, _EMA_SALT, index, update)


def ema_decay_at(decay: float, warmup: bool, t: int) -> float:
    """The decay of the EMA update that follows ``t`` earlier updates."""
    return min(decay, (1.0 + t) / (10.0 + t)) if warmup else decay


@torch.no_grad()
def ema_update_(ema: torch.Tensor, live: torch.Tensor, decay: float, key: int, offset: int = 0) -> None:
    """``ema <- decay * ema + (1 - decay) * live`` in place, computed in fp32.

    ``ema`` and ``live`` are 1-D (or same-shaped) tensors of one dtype holding the elements
    ``offset, offset + 1, ...`` of a flattened parameter. Half dtypes are written with stochastic
    rounding drawn from ``random_bits(key, offset, n)``; fp32 (and fp64) are updated directly.
    """
    if ema.dtype in _HALF:
        x = torch.lerp(ema.float(), live.float(), 1.0 - decay)
        bits = random_bits(key, offset, x.numel(), device=x.device)
        ema.copy_(round_with_bits(x.contiguous(), ema.dtype, bits))
    else:
        ema.lerp_(live.to(ema.dtype), 1.0 - decay)


class _Entry:
    """One parameter's EMA: the whole tensor, or under ZeRO-3 this rank's partition of it; ``None``
    while the parameter is frozen (its average is the parameter itself: no copy is kept)."""

    def __init__(self, name: str, index: int, param: torch.nn.Parameter) -> None:
        self.name, self.index, self.param = name, index, param
        self.zero3 = getattr(param, "ds_tensor", None) is not None
        self.offset, self.valid = 0, param.numel()
        if self.zero3:
            self.group = getattr(param, "ds_process_group", None)
            part = param.ds_tensor.numel()
            self.offset = part * dist.get_rank(group=self.group)
            self.valid = max(0, min(part, param.ds_numel - self.offset))  # the last partition is padded
        self.ema: torch.Tensor | None = None
        if param.requires_grad:
            self.start()

    def live(self) -> torch.Tensor:
        """The weights this rank holds: the partition under ZeRO-3, else the parameter."""
        return self.param.ds_tensor.data if self.zero3 else self.param.data

    def held(self) -> torch.Tensor:
        """The EMA this rank holds (the live weights of a frozen parameter)."""
        return self.ema if self.ema is not None else self.live()

    def start(self) -> None:
        """(Re)starts the average at the live weights."""
        live = self.live()
        if self.ema is None:
            self.ema = torch.zeros_like(live, memory_format=torch.contiguous_format)
        self.ema.view(-1)[: self.valid].copy_(live.reshape(-1)[: self.valid])

    def update(self, decay: float, key: int) -> None:
        if not self.param.requires_grad:  # frozen: the average of a constant
            if self.ema is not None:
                self.ema.copy_(self.live())
        elif self.ema is None:  # unfrozen since: the average of the constant it was until now
            self.start()
            self.update(decay, key)
        else:
            ema_update_(self.ema.view(-1)[: self.valid], self.live().reshape(-1)[: self.valid], decay, key,
                        self.offset)

    def full(self, dst: int | None) -> torch.Tensor | None:
        """The whole EMA tensor on CPU (a collective under ZeRO-3: to rank ``dst``, or every rank
        for ``None``; other ranks get ``None``)."""
        held = self.held()
        if not self.zero3:
            return held.detach().cpu()
        world = dist.get_world_size(group=self.group)
        mine = held.contiguous().view(torch.uint8)  # bytes: every backend gathers them
        if dst is None:
            parts = [torch.empty_like(mine) for _ in range(world)]
            dist.all_gather(parts, mine, group=self.group)
        else:
            parts = [torch.empty_like(mine) for _ in range(world)] if dist.get_rank() == dst else None
            dist.gather(mine, parts, dst=dst, group=self.group)
            if parts is None:
                return None
        flat = torch.cat(parts).view(held.dtype)[: self.param.ds_numel]
        return flat.view(self.param.ds_shape).cpu()

    def load(self, full: torch.Tensor) -> None:
        if self.ema is None:  # frozen: the restored live weights are the average
            return
        flat = full.reshape(-1).to(device=self.ema.device, dtype=self.ema.dtype)
        self.ema.view(-1)[: self.valid].copy_(flat[self.offset : self.offset + self.valid])


class ModelEMA:
    """The EMA of a module's weights, updated after every optimizer step (see the module docstring).

    Args:
        module: The model (under DeepSpeed: ``engine.module``, after ``deepspeed.initialize``).
        decay: ``D`` in ``[0, 1)``.
        warmup: Use ``min(D, (1 + t) / (10 + t))`` at update ``t``.
        seed: Seed of the stochastic-rounding noise (``--sr-seed``).
    """

    def __init__(self, module: torch.nn.Module, decay: float, warmup: bool = False, seed: int = 0) -> None:
        if not 0.0 <= decay < 1.0:
            raise ValueError(f"ema decay must be in [0, 1), got {decay}")
        self.module, self.decay, self.warmup, self.seed = module, float(decay), bool(warmup), int(seed)
        self.updates = 0
        self.entries: list[_Entry] = []
        by_id: dict[int, _Entry] = {}
        for index, (name, p) in enumerate(module.named_parameters()):
            by_id[id(p)] = _Entry(name, index, p)
            self.entries.append(by_id[id(p)])
        # the state dict's names, in its order: each a parameter's entry (tied ones share it) or a
        # buffer, whose copy is kept here
        self.names: dict[str, _Entry | str] = {}
        self.buffers: dict[str, torch.Tensor] = {}
        live_buffers = dict(module.named_buffers())
        for name, value in module.state_dict(keep_vars=True).items():
            if id(value) in by_id:
                self.names[name] = by_id[id(value)]
            else:
                self.names[name] = name
                self.buffers[name] = live_buffers.get(name, value).detach().clone()
        self._live_buffers = {k: live_buffers[k] for k in self.buffers if k in live_buffers}
        self.zero3 = any(e.zero3 for e in self.entries)

    # --------------------------------------------------------------------------------------------
    # training
    # --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def update(self, skipped: bool = False) -> bool:
        """One EMA update after an optimizer step; nothing when the step was ``skipped``.

        Returns:
            Whether the EMA was updated.
        """
        if skipped:
            return False
        d = ema_decay_at(self.decay, self.warmup, self.updates)
        self.updates += 1
        for e in self.entries:
            e.update(d, noise_key(self.seed, e.index, self.updates))
        for name, buf in self._live_buffers.items():
            self.buffers[name].copy_(buf)
        return True

    def bytes_per_param(self) -> float:
        """Bytes this rank holds for the EMA per model parameter (buffers not counted)."""
        held = sum(e.ema.numel() * e.ema.element_size() for e in self.entries if e.ema is not None)
        total = sum(int(getattr(e.param, "ds_numel", e.param.numel())) for e in self.entries)
        return held / max(total, 1)

    def summary(self) -> dict[str, Any]:
        return {"decay": self.decay, "warmup": self.warmup, "updates": self.updates,
                "bytes_per_param": self.bytes_per_param()}

    # --------------------------------------------------------------------------------------------
    # state
    # --------------------------------------------------------------------------------------------

    def full_state_dict(self, dst: int | None = None) -> dict[str, torch.Tensor] | None:
        """The complete EMA state dict (the model's names, on CPU, in the weights' dtype).

        Every rank must call it; it goes to rank ``dst`` (the other ranks get ``None``), or to every
        rank for ``None``. Under ZeRO-3 it is gathered parameter by parameter; otherwise the tensors
        of a CPU model are the EMA's own (clone them to keep them past the next update).
        """
        fulls: dict[int, torch.Tensor | None] = {id(e): e.full(dst) for e in self.entries}
        if dst is not None and dist.is_available() and dist.is_initialized() and dist.get_rank() != dst:
            return None
        out: dict[str, torch.Tensor] = {}
        for name, ref in self.names.items():
            out[name] = fulls[id(ref)] if isinstance(ref, _Entry) else self.buffers[name].detach().cpu()
        return out

    def load_full_state_dict(self, state: dict[str, torch.Tensor], updates: int) -> None:
        """Loads what :meth:`full_state_dict` returned (every rank, each takes its part)."""
        missing = [n for n in self.names if n not in state]
        if missing:
            raise ValueError(f"the EMA state dict misses {len(missing)} of the model's entries: {missing[:5]}")
        for name, ref in self.names.items():
            if isinstance(ref, _Entry):
                ref.load(state[name])
            else:
                self.buffers[name].copy_(state[name])
        self.updates = int(updates)

    def reset(self) -> None:
        """Restarts the average from the module's current weights (update count 0)."""
        for e in self.entries:
            if e.ema is not None:
                e.start()
        for name, buf in self._live_buffers.items():
            self.buffers[name].copy_(buf)
        self.updates = 0

    def client_state(self) -> dict[str, Any]:
        """What a checkpoint's rank file keeps besides the weights."""
        return {"updates": self.updates, "decay": self.decay, "warmup": self.warmup, "seed": self.seed}

    def restore(self, tag_dir: str | Path, client: dict[str, Any] | None) -> bool:
        """Loads the EMA of checkpoint ``tag_dir`` (every rank reads the file). A checkpoint saved
        without an EMA restarts it from the restored weights.

        Returns:
            Whether the checkpoint had an EMA.
        """
        from ..run.checkpoint import EMA_WEIGHTS, CheckpointError

        path = Path(tag_dir) / EMA_WEIGHTS
        if client is None or not path.is_file():
            self.reset()
            return False
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as e:  # a truncated or foreign file
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e}") from e
        self.load_full_state_dict(state, client["updates"])
        return True

    # --------------------------------------------------------------------------------------------
    # evaluation
    # --------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def swapped_in(self) -> Iterator[torch.nn.Module]:
        """The module with the EMA weights and buffers in place of its own (ZeRO 0-2: the tensors'
        storage is swapped, nothing copied); the module's own come back on exit, bit for bit."""
        if self.zero3:
            raise RuntimeError("swapped_in needs full weights: under ZeRO-3 use eval_module")
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        try:
            for e in (e for e in self.entries if e.ema is not None):
                saved.append((e.param, e.param.data))
                e.param.data = e.ema
            for name, buf in self._live_buffers.items():
                saved.append((buf, buf.data))
                buf.data = self.buffers[name]
            yield self.module
        finally:
            for t, data in reversed(saved):
                t.data = data

    @contextlib.contextmanager
    def eval_module(self, tokenizer: Any = None) -> Iterator[torch.nn.Module]:
        """A module with the EMA weights to evaluate (every rank enters it): the swapped module, or
        under ZeRO-3 a full copy built from the gathered EMA (the model needs a ``config``)."""
        if not self.zero3:
            with self.swapped_in() as m:
                yield m
            return
        from ..model.clip import create_model

        state = self.full_state_dict(dst=None)
        held = self.entries[0].held()
        dtype = state["logit_scale"].dtype if "logit_scale" in state else held.dtype
        copy = create_model(config=self.module.config, tokenizer=tokenizer, text_load_weights=False)
        copy = copy.to(device=held.device, dtype=dtype)  # as recipe.training.engine.eval_module
        copy.load_state_dict(state)
        del state
        yield copy


def build_ema(engine: Any, cfg: Any) -> ModelEMA | None:
    """The run's EMA of ``engine.module`` (``cfg.optim.ema_decay``), or ``None`` without one."""
    o = cfg.optim
    if o.ema_decay is None:
        return None
    return ModelEMA(engine.module, o.ema_decay, warmup=o.ema_warmup, seed=o.sr_seed)
