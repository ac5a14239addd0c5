"""SRAdamW's step plan: what stays the same from one step to the next, worked out once.

A training loop steps the same tensors every step: the same parameters with the same states, groups
and kernel specialisations. The first step over a set of tensors takes SRAdamW's general path
(:class:`optim.functional.TensorStep` per tensor, per-tensor checks, metadata rows built one by one)
and leaves a :class:`Plan`: the kernels' metadata table with every word that does not change between
steps (the addresses of parameters, statistics and masters, lengths, noise bases, the addresses of
the float16 state scales, now in one buffer), the kernel groups and block tables, the step counters
of all its tensors packed into one vector (each state's ``step`` becomes a 0-dim view of it) and the
float16 statistics' running bounds likewise. A later step over the same tensors then costs a fixed
number of tensor operations and a few C-level passes over the tensor list:

* gradients: read, checked contiguous, their addresses written into the table's ``G`` column
  (autograd's ``.grad`` setter already guarantees their dtype, size and device);
* parameters: their addresses compared with the plan's; a replaced ``.data`` retires the plan and
  the general path checks everything again;
* step counters: one ``add_``; noise keys: one row of a block of key words derived ahead for the next
  steps (:class:`KeyWords`), all tensors at once;
* hyperparameters: one float32 row per parameter group and step (computed in float64 and rounded
  once, as :func:`optim.functional.hyperparameters` does), gathered to the rows;
* float16 state scales: the same vector arithmetic as the general path, into fixed buffers;
* launches: one per kernel specialisation, as before.

Every word equals the one the general path writes (tests compare the tables and the results bit for
bit), so the kernels compute the same bits. ``SRAdamW`` owns the decision when a plan applies
(:meth:`Plan.usable`) and retires plans when their assumptions may no longer hold.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _host
from ._rows import INT_WORDS, ROW_WORDS, Word, metadata, specialisation
from .functional import HYPERPARAMETERS, TensorStep, _hyperparameters, state_scale
from .rounding import fold_key, key_words_tensor

__all__ = ["Plan", "KeyWords", "group_signature"]

_DATA_PTR = torch.Tensor.data_ptr
_G = int(Word.G)
# the words a step rewrites: G, the four key words, then the float slots, adjacent (one write per step)
assert [int(Word.G), int(Word.A_P), int(Word.B_P), int(Word.A_S), int(Word.B_S)] == list(range(_G, INT_WORDS))
_M_OLD, _M_NEW, _V_OLD, _V_NEW = (int(Word.M_SCALE_OLD), int(Word.M_SCALE_NEW), int(Word.V_SCALE_OLD),
                                  int(Word.V_SCALE_NEW))
_FLOAT_PAD = [0.0] * (len(HYPERPARAMETERS) % 2)  # the float part padded to whole words, as _rows does


def group_signature(group: dict[str, Any]) -> tuple:
    """What of a parameter group selects kernel specialisations (a change retires the plan); the
    values that only enter the rows (lr, betas, eps, weight decay, clamp bounds) are read every step."""
    return group["weight_rounding"], group["state_rounding"], group.get("clamp") is None


class KeyWords:
    """The four noise key words ``(a_p, b_p, a_s, b_s)`` of every row for a range of steps, derived
    ``ahead`` steps at a time with the general path's tensor operations: ``derive_key(seed, rank,
    index, step, stream)`` split into words by ``optim.rounding.key_words``."""

    def __init__(self, prefixes: torch.Tensor, ahead: int) -> None:
        self.prefixes = prefixes  # int64 [rows]: derive_key(seed, rank, index)
        self.ahead = ahead
        self.first = -1
        self.block: torch.Tensor | None = None  # int64 [ahead, rows, 4]

    @staticmethod
    def derive(prefixes: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
        """int64 ``[..., 4]`` key words for ``prefixes`` at ``steps`` (broadcast together)."""
        h = fold_key(prefixes, steps)
        (a_p, b_p), (a_s, b_s) = key_words_tensor(fold_key(h, 0)), key_words_tensor(fold_key(h, 1))
        return torch.stack([a_p, b_p, a_s, b_s], -1)

    def at(self, step: int) -> torch.Tensor:
        """int64 ``[rows, 4]`` for every row at ``step`` (a view into the cached block)."""
        if not 0 <= step - self.first < self.ahead or self.block is None:
            self.first = step
            steps = torch.arange(step, step + self.ahead, dtype=torch.int64).unsqueeze(1)
            self.block = self.derive(self.prefixes.unsqueeze(0), steps)
        return self.block[step - self.first]

    def each(self, steps: torch.Tensor) -> torch.Tensor:
        """int64 ``[rows, 4]`` for rows at different steps."""
        return self.derive(self.prefixes, steps)


class Plan:
    """The cached work of SRAdamW's steps over one list of parameters on one device.

    Built by :meth:`SRAdamW._build_plan` from the general path's TensorSteps of the step that made
    it (in the order of the parameter groups), after that step advanced the counters.

    Attributes:
        params: The parameters, in the order of the groups (those with gradients at that step).
        steps: int64 CPU ``[len(params)]``: the step counters (the states' ``step`` entries are views).
        uniform: Whether all counters are equal (they move together while the plan lives).
    """

    def __init__(self, opt: Any, items: Sequence[TensorStep], item_groups: Sequence[dict[str, Any]], kernel: str,
                 gmul_mode: int, rank: int, launch: Callable[..., None], place: Callable[[torch.Tensor], torch.Tensor],
                 amax: Callable[[torch.Tensor], torch.Tensor], version: int) -> None:
        self.params = [s.param for s in items]
        self.version = version
        self.place = place  # a 1-element tensor where the kernels read it (float32 [1])
        self.device = self.params[0].device
        self.kernel, self.gmul_mode, self.rank = kernel, gmul_mode, rank
        self._launch, self.amax = launch, amax  # the kernel's gradient maxima, from the gradients' addresses
        self.param_ptrs = _host.as_int64(list(map(_DATA_PTR, self.params)))  # where they were
        states = [opt.state[p] for p in self.params]

        # step counters: one vector, the states' entries views of it
        self.steps = torch.tensor([int(st["step"]) for st in states], dtype=torch.int64)
        for i, st in enumerate(states):
            dict.__setitem__(st, "step", self.steps[i])
        self.uniform = bool((self.steps == self.steps[0]).all()) if len(states) else True

        # groups: the signature checked every step, each tensor's group
        self.groups = list(opt.param_groups)
        self.signatures = [group_signature(g) for g in self.groups]
        index = {id(g): i for i, g in enumerate(self.groups)}
        group_of = [index[id(g)] for g in item_groups]

        # rows: the tensors with elements, grouped by kernel specialisation (rows contiguous per group)
        gmul_value_free = 1.0  # the grad_mul slot is rewritten every step with the floats
        by_spec: dict[tuple, list[int]] = {}
        for i, s in enumerate(items):
            if s.param.numel() == 0:
                continue
            by_spec.setdefault(self._spec(s), []).append(i)
        self.row_of = [i for rows in by_spec.values() for i in rows]  # position in params of each row
        self.rows = len(self.row_of)
        self.row_index = torch.tensor(self.row_of, dtype=torch.int64)
        self.row_group = torch.tensor([group_of[i] for i in self.row_of], dtype=torch.int64)
        self.table = metadata([(items[i], items[i].param, items[i].grad) for i in self.row_of], gmul_value_free)
        self.groups_of_rows = [(spec, len(rows)) for spec, rows in by_spec.items()]
        self.numels = [items[i].param.numel() for i in self.row_of]

        # float16 statistics: running bounds in one buffer (the states' entries views), scales in another
        scaled = [i for i, st in enumerate(states) if "exp_avg_bound" in st]
        self.scaled_index = torch.tensor(scaled, dtype=torch.int64, device=self.device) if scaled else None
        self.scaled_all = len(scaled) == len(states)
        self.scaled_group = torch.tensor([group_of[i] for i in scaled], dtype=torch.int64)
        if scaled:
            self.bounds = torch.stack([states[i][k].to(torch.float32).reshape(())
                                       for k in ("exp_avg_bound", "exp_avg_sq_bound") for i in scaled]).view(2, -1)
            for j, i in enumerate(scaled):
                dict.__setitem__(states[i], "exp_avg_bound", self.bounds[0, j])
                dict.__setitem__(states[i], "exp_avg_sq_bound", self.bounds[1, j])
            self.scales = torch.zeros(len(scaled), 2, 2, dtype=torch.float32, device=self.device)
            row_at = {i: r for r, i in enumerate(self.row_of)}
            for j, i in enumerate(scaled):
                r = row_at.get(i)
                if r is not None:
                    self.table[r, _M_OLD] = self.scales[j, 0].data_ptr()
                    self.table[r, _M_NEW] = self.scales[j, 0].data_ptr() + 4
                    self.table[r, _V_OLD] = self.scales[j, 1].data_ptr()
                    self.table[r, _V_NEW] = self.scales[j, 1].data_ptr() + 4

        # noise keys: derived ahead for the rows
        prefixes = [opt._key_prefix(rank, int(opt.state[items[i].param]["index"])) for i in self.row_of]
        self.keys = KeyWords(torch.tensor(prefixes, dtype=torch.int64), ahead=max(8, min(256, 65536 // max(1, self.rows))))

        self.launches = self._launch_groups()

        # what a step's walk over the parameters (optim._host.gather) checks against and writes into
        assert self.table.is_contiguous() and self.table.shape[1:] == (ROW_WORDS,)
        n = len(self.params)
        g_words = [-1] * n
        for r, i in enumerate(self.row_of):
            g_words[i] = r * ROW_WORDS + _G
        self.g_words = _host.as_int64(g_words)
        self.grad_ptrs = torch.zeros(n, dtype=torch.int64)  # the gradients' addresses

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the plan owns (its tables, counters, bounds, scales, key words, the maxima's
        buffers), for memory accounting; on the CPU but the float16 bounds and scales and the Triton
        kernels' block tables and maxima buffers, which live with the parameters."""
        out = [self.table, self.steps, self.row_index, self.row_group, self.scaled_group, self.keys.prefixes,
               self.grad_ptrs, self.param_ptrs, self.g_words]
        out += [t for t in (self.keys.block, self.scaled_index) if t is not None]
        out += self.amax.tensors()
        if self.scaled_index is not None:
            out += [self.bounds, self.scales]
        if self.kernel == "triton":
            out += [blocks for *_, blocks in self.launches]
        return out

    # ------------------------------------------------------------------------------------------
    def _spec(self, s: TensorStep) -> tuple:
        if self.kernel == "triton":
            from .triton_kernel import _aligned

            return specialisation(s, s.grad, self.gmul_mode, ALIGNED=_aligned(s, s.param, s.grad))
        return specialisation(s, s.grad, self.gmul_mode)

    def _launch_groups(self) -> list:
        if self.kernel == "triton":
            from .triton_kernel import DEFAULT_BLOCK, plan_launches

            start, groups = 0, []
            for spec, count in self.groups_of_rows:
                groups.append((spec, self.numels[start:start + count]))
                start += count
            return plan_launches(groups, DEFAULT_BLOCK, self.device)
        from ._cpu_kernel import plan_calls

        return plan_calls(self.groups_of_rows)

    # ------------------------------------------------------------------------------------------
    def usable(self, groups: Sequence[dict[str, Any]], rank: int, gmul_mode: int) -> int:
        """Whether this step can run on the plan, as a code of :mod:`optim._host`: ``OK`` when the groups
        are the plan's with the same signatures, rank and gradient-multiplier form and the parameters
        with gradients are the plan's, where they were, with contiguous gradients (whose addresses are
        then in :attr:`grad_ptrs` and the table); ``OTHER_TENSORS`` when the step is over other tensors
        or settings; ``MOVED`` / ``NOT_CONTIGUOUS`` when this plan's tensors can no longer use it."""
        if not (rank == self.rank and gmul_mode == self.gmul_mode and len(groups) == len(self.groups)
                and all(map(operator.is_, groups, self.groups))
                and [group_signature(g) for g in groups] == self.signatures):
            return _host.OTHER_TENSORS
        return _host.gather([g["params"] for g in groups], self.params, self.param_ptrs, self.table, self.g_words,
                            self.grad_ptrs)

    def grad_maxima(self) -> torch.Tensor:
        """float32 ``[len(params)]``: each gradient's largest magnitude (the general path's reduction),
        after :meth:`usable` said ``OK``."""
        return self.amax(self.grad_ptrs)  # one call of the kernel's reduction, from the gathered addresses

    def step(self, groups: Sequence[dict[str, Any]], grad_mul: torch.Tensor | float | None,
             gmul_value: float, gmul_tensor: torch.Tensor | None, skip: torch.Tensor | None,
             maxima: torch.Tensor | None) -> None:
        """Advances the counters and issues the step's launches, after :meth:`usable` said ``OK`` (the
        gradients' addresses are in the table; ``skip``: the 0-dim bool device skip flag on the plan's
        device, or None; ``maxima``: :meth:`grad_maxima`, needed with float16 statistics)."""
        self.steps.add_(1)
        if self.rows:
            if self.uniform:
                t = int(self.steps[0])  # a CPU tensor: no device sync
                keys = self.keys.at(t)
                floats = torch.tensor([self._floats(g, t, gmul_value) for g in groups], dtype=torch.float32)
                floats = floats.view(torch.int64)
                floats = floats[self.row_group] if len(groups) > 1 else floats.expand(self.rows, -1)
            else:
                row_steps = self.steps[self.row_index]
                keys = self.keys.each(row_steps)
                floats = self._floats_each(groups, row_steps.tolist(), gmul_value)
            self.table[:, _G + 1:] = torch.cat([keys, floats], 1)
        if self.scaled_index is not None:
            self._scales(groups, grad_mul, skip, maxima)
        if self.rows:
            self._launch(self.table, self.launches, self.place(skip) if skip is not None else None, gmul_tensor)

    @staticmethod
    def _floats(group: dict[str, Any], t: int, gmul_value: float) -> list[float]:
        beta1, beta2 = group["betas"]
        clamp = group.get("clamp")
        clamp = (float(clamp[0]), float(clamp[1])) if clamp is not None else None
        hp = _hyperparameters(float(group["lr"]), float(group["weight_decay"]), float(beta1), float(beta2),
                              float(group["eps"]), t, clamp, float(gmul_value))
        return [hp[name] for name in HYPERPARAMETERS] + _FLOAT_PAD

    def _floats_each(self, groups: Sequence[dict[str, Any]], row_steps: list[int], gmul_value: float) -> torch.Tensor:
        rows: dict[tuple[int, int], int] = {}
        unique: list[list[float]] = []
        which = []
        for g, t in zip(self.row_group.tolist(), row_steps):
            i = rows.get((g, t))
            if i is None:
                i = rows[(g, t)] = len(unique)
                unique.append(self._floats(groups[g], t, gmul_value))
            which.append(i)
        return torch.tensor(unique, dtype=torch.float32).view(torch.int64)[torch.tensor(which)]

    def _scales(self, groups: Sequence[dict[str, Any]], grad_mul: torch.Tensor | float | None,
                skip: torch.Tensor | None, maxima: torch.Tensor | None) -> None:
        """The float16 statistics' bounds and ``(old, new)`` scales, as ``SRAdamW._f16_scales`` computes
        them, into the plan's buffers (never read on the host)."""
        if maxima is None or maxima.numel() != len(self.params):
            raise RuntimeError("SRAdamW: gradient maxima do not match the tensors of the step")
        amax = maxima if self.scaled_all else maxima[self.scaled_index.to(maxima.device)]
        if grad_mul is not None:
            amax = amax * (grad_mul.abs() if isinstance(grad_mul, torch.Tensor) else abs(grad_mul))
        betas_of = [[float(g["betas"][0]) for g in groups], [float(g["betas"][1]) for g in groups]]
        betas = torch.tensor(betas_of, dtype=torch.float32)[:, self.scaled_group].to(self.device, non_blocking=True)
        old = self.bounds.clone()
        new = old * betas + torch.stack([amax, amax * amax]) * (1 - betas)
        if skip is not None:
            new = torch.where(skip, old, new)
        self.bounds.copy_(new)
        self.scales.copy_(state_scale(torch.stack([old, new])).permute(2, 1, 0))


