"""Numerics telemetry of SRAdamW (``--numerics-every N``): what half precision does to the update.

Metrics (``metrics.jsonl`` and TensorBoard; shares are pooled over every sampled element of every
rank and every counted step since the previous read; the training loop samples only the steps it
reads, every ``--numerics-every`` steps, so the hooks' cost is spread over that many steps):

* ``numerics/sr_below_half_ulp``: in the stochastic-rounding groups (no master, half-precision
  weights), the share of sampled elements whose float32 update ``Δw = w_new - w`` is nonzero but would
  be dropped by round-to-nearest, i.e. ``|Δw|`` is below half the spacing of the weight's dtype at
  ``w`` (tested exactly as ``round_to_nearest(w_new) == w``). Stochastic rounding keeps these in
  expectation; round-to-nearest would lose them. Per group too: ``numerics/sr_below_half_ulp/<name>``.
* ``numerics/exp_avg_underflow``, ``numerics/exp_avg_sq_underflow``: in groups whose Adam statistics
  are stored in bfloat16 or float16, the share of sampled elements whose float32 value after the
  step is nonzero but whose stored value is zero.
* ``numerics/exp_avg_saturated``, ``numerics/exp_avg_sq_saturated``: the share (same elements) whose
  stored value is at the storage dtype's largest finite magnitude or beyond (inf).
* ``numerics/exp_avg_scale_log2_min`` / ``_max``, ``numerics/exp_avg_sq_scale_log2_min`` / ``_max``:
  only with float16 statistics: the smallest and largest exponent ``k`` of the power-of-two state
  scales ``2**k`` (:func:`optim.functional.state_scale` of the running bounds after each step) over
  every such tensor and step.
* ``numerics/logit_scale_clamped``: the share of steps in which a clamped group (the recipe clamps the
  logit scale to ``[0, log(max_logit_scale)]`` inside the optimizer) ended the step at its bound with
  the clamp holding it there: the value after the step equals a bound and either the recomputed
  unclamped update would have left the range or the value moved onto the bound in this step (the
  second condition keeps ZeRO's zero padding, which sits at 0 without an update, out).

How: each tensor of the optimizer's groups gets a fixed sample of element indices (seeded, drawn
once; the whole tensor when it is no larger than ``sample_per_tensor``). Before the optimizer step
(a step pre-hook: under DeepSpeed ZeRO the gradients of the flat partitions exist only inside the
engine's step) the sampled weights (the master where a group keeps one), gradients and statistics are
gathered and the float32 update is recomputed with the AdamW definition of :mod:`optim.functional`
(folded bias corrections, float16 statistics scaled by their power-of-two scales, the step's gradient
multiplier). This is a sample estimate: the sample gives shares with a binomial error of about
``sqrt(p (1 - p) / n)``, and the recomputation differs from the optimizer's own arithmetic in the
order of the float32 operations (it does not replay the kernel), which can only change the verdict for
elements within a float32 rounding of the half-ulp threshold. After the step (a post-hook) the stored
statistics and clamped values are gathered at the same indices and compared. Everything stays on the
device: counts are accumulated in device tensors, :meth:`NumericsMonitor.end_step` adds a step's
counts unless the train step reports it skipped (a host flag the train step has already read), and
only :meth:`NumericsMonitor.read`, called on numerics/log steps, all-reduces and reads them.

Only documented optimizer keys are read: group ``master_weights``, ``state_dtype``, ``clamp``, ``lr``,
``betas``, ``eps``, ``weight_decay``, ``name``; state ``step``, ``exp_avg``, ``exp_avg_sq``,
``exp_avg_bound``, ``exp_avg_sq_bound``, ``master``.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import Any

import torch

from optim.functional import state_scale

__all__ = ["NumericsMonitor", "build_numerics", "METRIC_NAMES"]

_HALF = (torch.bfloat16, torch.float16)

#: Columns of the per-group count table.
_COLS = ("sr_n", "sr_below", "m_n", "m_under", "m_sat", "v_n", "v_under", "v_sat")
_C = {name: i for i, name in enumerate(_COLS)}

#: Every name :meth:`NumericsMonitor.read` may return (besides the per-group split of the first).
METRIC_NAMES = (
    "numerics/sr_below_half_ulp",
    "numerics/exp_avg_underflow",
    "numerics/exp_avg_sq_underflow",
    "numerics/exp_avg_saturated",
    "numerics/exp_avg_sq_saturated",
    "numerics/exp_avg_scale_log2_min",
    "numerics/exp_avg_scale_log2_max",
    "numerics/exp_avg_sq_scale_log2_min",
    "numerics/exp_avg_sq_scale_log2_max",
    "numerics/logit_scale_clamped",
)

# host-side per-tensor table (float64 on the CPU, one row per tensor):
_HP = ("decay", "beta1", "omb1", "beta2", "omb2", "neg_step", "eps_hat", "lo", "hi", "lo_v", "hi_v", "sr", "half",
       "clamped", "group")
_H = {name: i for i, name in enumerate(_HP)}


@dataclass
class _Route:
    """The sampled tensors of one call that share a device and dtypes, concatenated."""

    params: list[torch.Tensor]
    dtype: torch.dtype  # the parameter's
    state_dtype: torch.dtype
    owner: torch.Tensor  # int64 [n]: element -> row of the route's tensors
    pred_m: torch.Tensor | None = None  # float32 [n]: exp_avg after the step, as recomputed
    pred_v: torch.Tensor | None = None
    w_pre: torch.Tensor | None = None  # float32 [n]: value (master or weight) before the step
    beyond: torch.Tensor | None = None  # bool [n]: the unclamped update leaves the clamp range
    hp: torch.Tensor | None = None  # float32 [rows, len(_HP)] on the device
    counts: torch.Tensor | None = None  # float64 [groups, len(_COLS)]
    has_clamp: bool = False  # some tensor of the route is in a clamped group (host knowledge)
    masks: list[torch.Tensor] = field(default_factory=list)  # bool [n] per column of _COLS, in order
    groups: torch.Tensor | None = None  # float32 [n, groups] one-hot (several groups in the route)
    group: int | None = None  # the one group of the route's tensors


@dataclass
class _Pending:
    """One optimizer step's counts until :meth:`NumericsMonitor.end_step` adds or drops them."""

    counts: torch.Tensor
    clamp: torch.Tensor  # float64 0-dim: 1 when a clamp held
    extremes: torch.Tensor  # float64 [4]: -min, max of log2 scale (exp_avg), same for exp_avg_sq
    routes: list[_Route] = field(default_factory=list)


class NumericsMonitor:
    """Samples SRAdamW's update on the device and accumulates the numerics metrics (module docstring).

    Args:
        optimizer: The SRAdamW instance (under DeepSpeed the client optimizer: ``engine.optimizer``'s
            inner one, as :func:`recipe.training.engine.build_engine` returns it); its ``param_groups`` at
            construction define the groups reported (groups added later are ignored).
        every: Steps between reads (the training loop's schedule; 0 = off, stored for the caller).
        sample_per_tensor: Elements sampled per tensor (ZeRO: per flat partition of this rank).
        seed: Seed of the sampled indices.

    Use: :meth:`attach` (step hooks call :meth:`before_step` / :meth:`after_step`), then once per
    optimizer step :meth:`end_step`, and :meth:`read` on numerics steps (every rank: it all-reduces).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, every: int = 1, sample_per_tensor: int = 4096,
                 seed: int = 0) -> None:
        if not isinstance(every, int) or isinstance(every, bool) or every < 0:
            raise ValueError(f"numerics every must be an integer >= 0 (0: off), got {every!r}")
        if not isinstance(sample_per_tensor, int) or sample_per_tensor < 1:
            raise ValueError(f"sample_per_tensor must be an integer >= 1, got {sample_per_tensor!r}")
        self.optimizer = optimizer
        self.every = every
        self.sample_per_tensor = sample_per_tensor
        self.seed = seed
        self._groups = list(optimizer.param_groups)
        self._group_index = {id(g): i for i, g in enumerate(self._groups)}
        self.group_names = [str(g.get("name", f"group{i}")) for i, g in enumerate(self._groups)]
        self._sr_groups = [i for i, g in enumerate(self._groups) if _is_sr(g)]
        self._indices: dict[int, tuple[torch.Tensor, int, int]] = {}  # id(param) -> (device indices, numel, samples)
        self._owners: dict[tuple, torch.Tensor] = {}
        self._handles: list[Any] = []
        self._calls: list[_Route] = []  # the routes of the call in flight (pre-hook -> post-hook)
        self._pending: _Pending | None = None
        self._acc: _Pending | None = None
        self.steps = 0  # counted steps since the last read (host: end_step's flag is a host bool)
        # whether the hooks sample the coming optimizer step: the training loop arms only the steps it
        # reads (every ``every`` steps), so the cost is spread over ``every`` steps
        self.active = True

    # ------------------------------------------------------------------------------------------
    def attach(self) -> "NumericsMonitor":
        """Registers the optimizer step hooks (the ``inv_grad_scale`` / ``grad_scale`` the train step
        passes reach the pre-hook as keyword arguments)."""
        if not self._handles:
            self._handles = [self.optimizer.register_step_pre_hook(self._pre_hook),
                             self.optimizer.register_step_post_hook(self._post_hook)]
        return self

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []
        self._calls, self._pending = [], None

    def _pre_hook(self, opt: Any, args: tuple, kwargs: dict) -> None:
        if not self.active:
            return
        grad_mul = kwargs.get("inv_grad_scale")
        scale = kwargs.get("grad_scale")
        if grad_mul is None and scale is not None:
            grad_mul = 1.0 / scale  # a device tensor stays one (no host read)
        self.before_step(grad_mul)

    def _post_hook(self, opt: Any, args: tuple, kwargs: dict) -> None:
        if self.active:
            self.after_step()

    # ------------------------------------------------------------------------------------------
    def _sample(self, p: torch.Tensor, ordinal: int) -> torch.Tensor:
        """The fixed sampled indices of ``p`` (drawn once on the CPU, kept on ``p``'s device)."""
        got = self._indices.get(id(p))
        n = p.numel()
        if got is not None and got[1] == n and got[0].device == p.device:
            return got[0]
        if n <= self.sample_per_tensor:
            idx = torch.arange(n)
        else:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + ordinal)
            idx = torch.randint(0, n, (self.sample_per_tensor,), generator=gen).sort().values  # with replacement
        k = len(idx)
        idx = idx.to(p.device)
        self._indices[id(p)] = (idx, n, k)
        return idx

    @torch.no_grad()
    def before_step(self, grad_mul: torch.Tensor | float | None = None) -> None:
        """Gathers the sample and recomputes the update of every tensor in the optimizer's current
        ``param_groups`` that has a gradient (ZeRO may step one group at a time). Device ops only."""
        opt = self.optimizer
        by_route: dict[tuple, list[tuple[torch.Tensor, dict, int, int]]] = {}
        for group in opt.param_groups:
            gi = self._group_index.get(id(group))
            if gi is None:
                continue
            sr, clamp = _is_sr(group), group.get("clamp") is not None
            for j, p in enumerate(group["params"]):
                if p.grad is None or p.numel() == 0:
                    continue
                sdt = group.get("state_dtype") or p.dtype
                if not (sr or clamp or sdt in _HALF):
                    continue  # nothing of interest: float32 statistics behind a master, unclamped
                by_route.setdefault((p.device, p.dtype, sdt), []).append((p, group, gi, j))
        routes = []
        for (device, dtype, sdt), items in by_route.items():
            routes.append(self._route_before(device, dtype, sdt, items, grad_mul))
        self._calls = routes

    def _route_before(self, device: torch.device, dtype: torch.dtype, sdt: torch.dtype,
                      items: list[tuple[torch.Tensor, dict, int, int]], grad_mul: Any) -> _Route:
        opt = self.optimizer
        f32 = torch.float32
        rows, steps, w, g, m, v, ps, bm, bv = [], [], [], [], [], [], [], [], []
        for p, group, gi, j in items:
            idx = self._sample(p, gi * 100_003 + j)
            st = opt.state.get(p) or {}
            master = _master(opt, p, st, group)
            value = master if master is not None else p
            g.append(p.grad.reshape(-1)[idx])
            ps.append(p.detach().reshape(-1)[idx])
            w.append(ps[-1] if value is p else value.reshape(-1)[idx])
            k = len(idx)
            for name, out in (("exp_avg", m), ("exp_avg_sq", v)):
                s = st.get(name)
                out.append(s.reshape(-1)[idx] if s is not None else torch.zeros(k, dtype=sdt, device=p.device))
            if sdt == torch.float16:
                zero = torch.zeros((), dtype=f32, device=p.device)
                bm.append(st.get("exp_avg_bound", zero))
                bv.append(st.get("exp_avg_sq_bound", zero))
            steps.append(st["step"] if "step" in st else torch.zeros((), dtype=torch.int64))
            beta1, beta2 = group["betas"]
            lo, hi = group["clamp"] if group.get("clamp") is not None else (-math.inf, math.inf)
            vdt = f32 if value is not p else p.dtype
            rows.append([1 - float(group["lr"]) * float(group["weight_decay"]), beta1, 1 - beta1, beta2, 1 - beta2,
                         float(group["lr"]), float(group["eps"]), lo, hi, _cast(lo, vdt), _cast(hi, vdt),
                         float(_is_sr(group)), float(sdt in _HALF), float(group.get("clamp") is not None), gi])
        table = torch.tensor(rows, dtype=torch.float64)
        # bias corrections of step t = state step + 1, from the CPU step counters (no device read)
        t = torch.stack([s.reshape(()) for s in steps]).to(torch.float64) + 1
        bc1 = 1 - table[:, _H["beta1"]] ** t
        bc2 = 1 - table[:, _H["beta2"]] ** t
        table[:, _H["eps_hat"]] = table[:, _H["eps_hat"]] * bc2.sqrt()
        table[:, _H["neg_step"]] = -table[:, _H["neg_step"]] * bc2.sqrt() / bc1
        hp = table.to(f32).to(device, non_blocking=True)
        owner = self._owner(items, device)
        n = owner.numel()
        e = hp.expand(n, -1) if len(items) == 1 else hp[owner]  # [n, len(_HP)] (one tensor: a view)
        col = lambda name: e[:, _H[name]]  # noqa: E731

        gf = _cat(g).to(f32)
        if grad_mul is not None:
            gf = gf * (grad_mul.to(device=device, dtype=f32) if isinstance(grad_mul, torch.Tensor) else grad_mul)
        mo, vo = _cat(m).to(f32), _cat(v).to(f32)
        if sdt == torch.float16:  # stored value / power-of-two scale (from the bounds before the step)
            mo = mo * state_scale(torch.stack(bm))[owner]
            vo = vo * state_scale(torch.stack(bv))[owner]
        wv = _cat(w).to(f32)
        mn = mo * col("beta1") + gf * col("omb1")
        vn = vo * col("beta2") + (gf * gf) * col("omb2")
        w_unc = wv * col("decay") + (mn * col("neg_step")) / (vn.sqrt() + col("eps_hat"))
        # host knowledge of the route decides which comparisons run at all (fewer small ops per step)
        srs = [_is_sr(group) for _, group, *_ in items]
        has_clamp = any(group.get("clamp") is not None for _, group, *_ in items)
        w_new, beyond = w_unc, None
        if has_clamp:
            w_new = torch.minimum(torch.maximum(w_unc, col("lo")), col("hi"))
            beyond = (w_unc < col("lo")) | (w_unc > col("hi"))
        if any(srs):
            moved = w_new != wv
            if not all(srs):
                moved = moved & (col("sr") != 0)
            below = moved & (w_new.to(dtype) == _cat(ps))  # round to nearest would give back w
        else:
            moved = below = torch.zeros(n, dtype=torch.bool, device=device)
        route = _Route([p for p, *_ in items], dtype, sdt, owner, mn, vn, wv, beyond, e, None, has_clamp)
        route.masks = [moved, below]
        gis = {gi for _, _, gi, _ in items}
        route.group = gis.pop() if len(gis) == 1 else None
        if route.group is None:
            route.groups = self._onehot(items, device)
        return route

    def _onehot(self, items: list, device: torch.device) -> torch.Tensor:
        """float32 [n, groups]: element -> its group (cached with the owners)."""
        key = ("groups",) + tuple(id(p) for p, *_ in items)
        got = self._owners.get(key)
        if got is None or got.device != device:
            owner = self._owners[("cpu",) + tuple(id(p) for p, *_ in items)]
            gid = torch.tensor([gi for _, _, gi, _ in items])[owner]
            got = self._owners[key] = torch.nn.functional.one_hot(gid, len(self._groups)).to(
                torch.float32).to(device, non_blocking=True)
        return got

    def _owner(self, items: list, device: torch.device) -> torch.Tensor:
        key = tuple(id(p) for p, *_ in items)
        got = self._owners.get(key)
        if got is None or got.device != device:
            sizes = torch.tensor([self._indices[id(p)][2] for p, *_ in items])
            host = self._owners[("cpu",) + key] = torch.repeat_interleave(torch.arange(len(items)), sizes)
            got = self._owners[key] = host.to(device, non_blocking=True)
        return got

    @torch.no_grad()
    def after_step(self) -> None:
        """Compares the stored statistics and clamped values with the recomputation of
        :meth:`before_step` and adds the counts to this step's pending ones. Device ops only."""
        routes, self._calls = self._calls, []
        if not routes:
            return
        opt = self.optimizer
        device = routes[0].owner.device
        pending = self._pending
        if pending is None:
            pending = self._pending = _Pending(
                torch.zeros(len(self._groups), len(_COLS), dtype=torch.float64, device=device),
                torch.zeros((), dtype=torch.float64, device=device),
                torch.full((4,), -math.inf, dtype=torch.float64, device=device),
            )
        for r in routes:
            states = [opt.state.get(p) or {} for p in r.params]
            idx = [self._indices[id(p)][0] for p in r.params]
            masks = r.masks  # columns of _COLS, in order
            if r.state_dtype in _HALF and all("exp_avg" in s for s in states):
                big = torch.finfo(r.state_dtype).max
                for name, pred in (("exp_avg", r.pred_m), ("exp_avg_sq", r.pred_v)):
                    stored = _cat([s[name].reshape(-1)[i] for s, i in zip(states, idx)])
                    live = pred != 0
                    masks += [live, live & (stored == 0), live & (stored.abs() >= big)]
            stacked = torch.stack(masks).to(torch.float32)  # [columns, n]
            if r.group is not None:  # one group: a row sum (exact: n < 2**24)
                pending.counts[r.group, :len(masks)] += stacked.sum(1).to(device)
            else:
                pending.counts[:, :len(masks)] += (stacked @ r.groups).T.to(device)
            if r.has_clamp:
                self._clamp_after(r, states, idx, pending, device)
            if r.state_dtype == torch.float16:
                self._scales_after(states, pending, device)

    def _clamp_after(self, r: _Route, states: list[dict], idx: list[torch.Tensor], pending: _Pending,
                     device: torch.device) -> None:
        values = []
        for s, p, i in zip(states, r.params, idx):
            master = _master(self.optimizer, p, s, {"clamp": True})
            value = master if master is not None else p
            values.append(value.detach().reshape(-1)[i])
        post = _cat(values).to(torch.float32)
        e = r.hp
        at_bound = (post == e[:, _H["lo_v"]]) | (post == e[:, _H["hi_v"]])
        held = (e[:, _H["clamped"]] != 0) & at_bound & (r.beyond | (post != r.w_pre))
        pending.clamp.copy_(torch.maximum(pending.clamp, held.any().to(device=device, dtype=torch.float64)))

    @staticmethod
    def _scales_after(states: list[dict], pending: _Pending, device: torch.device) -> None:
        if not all("exp_avg_bound" in s for s in states):
            return
        k = []
        for name in ("exp_avg_bound", "exp_avg_sq_bound"):
            exps = torch.frexp(state_scale(torch.stack([s[name] for s in states]))).exponent - 1  # scale = 2**exps
            k += [-exps.min(), exps.max()]
        pending.extremes.copy_(torch.maximum(pending.extremes, torch.stack(k).to(device=device, dtype=torch.float64)))

    # ------------------------------------------------------------------------------------------
    def end_step(self, skipped: bool) -> None:
        """Adds this optimizer step's counts unless the step was skipped (``skipped``: the train
        step's outcome, already read on the host); a step that never reached the optimizer adds nothing."""
        pending, self._pending = self._pending, None
        self._calls = []
        if pending is None or skipped:
            return
        if self._acc is None:
            self._acc = pending
        else:
            self._acc.counts += pending.counts
            self._acc.clamp += pending.clamp
            torch.maximum(self._acc.extremes, pending.extremes, out=self._acc.extremes)
        self.steps += 1

    def read(self) -> dict[str, float]:
        """The metrics since the last read (all ranks pooled), then starts a new window. A collective
        when torch.distributed is initialised: every rank calls it at the same steps."""
        from .distributed import collective_device, initialized

        acc, steps = self._acc, self.steps
        self._acc, self.steps = None, 0
        dist = torch.distributed
        distributed = initialized() and dist.get_world_size() > 1
        g = len(self._groups)
        if acc is None:
            acc = _Pending(torch.zeros(g, len(_COLS), dtype=torch.float64), torch.zeros((), dtype=torch.float64),
                           torch.full((4,), -math.inf, dtype=torch.float64))
        summed = acc.counts.reshape(-1)
        # clamp: the element lives on one rank under ZeRO, on all of them without: MAX counts it once;
        # the counted steps are the same on every rank (skips are decided for all ranks together)
        maxed = torch.cat([acc.clamp.reshape(1), acc.extremes.to(acc.clamp.device),
                           torch.tensor([float(steps)], dtype=torch.float64, device=acc.clamp.device)])
        if distributed:
            where = collective_device()
            summed, maxed = summed.to(where), maxed.to(where)
            dist.all_reduce(summed)
            dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        # host read: on numerics/log steps only, where the loop already reads its metrics
        summed_l, maxed_l = summed.tolist(), maxed.tolist()
        steps_all = maxed_l[-1]
        counts = torch.tensor(summed_l, dtype=torch.float64).view(g, len(_COLS))
        out: dict[str, float] = {}
        if steps_all == 0:
            return out
        total = counts.sum(0)

        def share(num: str, den: str, rows: Any = None) -> float | None:
            c = total if rows is None else counts[rows].sum(0)
            d = float(c[_C[den]])
            return float(c[_C[num]]) / d if d > 0 else None

        values = {
            "numerics/sr_below_half_ulp": share("sr_below", "sr_n"),
            "numerics/exp_avg_underflow": share("m_under", "m_n"),
            "numerics/exp_avg_sq_underflow": share("v_under", "v_n"),
            "numerics/exp_avg_saturated": share("m_sat", "m_n"),
            "numerics/exp_avg_sq_saturated": share("v_sat", "v_n"),
        }
        if len(self._sr_groups) > 1:
            for i in self._sr_groups:
                values[f"numerics/sr_below_half_ulp/{self.group_names[i]}"] = share("sr_below", "sr_n", [i])
        ext = maxed_l[1:5]
        if math.isfinite(ext[1]):
            values["numerics/exp_avg_scale_log2_min"] = -ext[0]
            values["numerics/exp_avg_scale_log2_max"] = ext[1]
            values["numerics/exp_avg_sq_scale_log2_min"] = -ext[2]
            values["numerics/exp_avg_sq_scale_log2_max"] = ext[3]
        if any(gr.get("clamp") is not None for gr in self._groups):
            values["numerics/logit_scale_clamped"] = maxed_l[0] / steps_all
        out.update({k: v for k, v in values.items() if v is not None})
        return out


def _master(opt: Any, p: torch.Tensor, state: dict, group: dict) -> torch.Tensor | None:
    """The float32 master of ``p``: the ``master`` state, or for a clamped group whose bf16 master is
    split (``master_low``, int16 low half) the optimizer's own join ``SRAdamW.master(p)`` (a whole-tensor
    device op: only for clamped groups, the one-element logit scale)."""
    if state.get("master") is not None:
        return state["master"]
    if "master_low" in state and group.get("clamp") is not None and hasattr(opt, "master"):
        return opt.master(p)
    return None


def _cat(xs: list[torch.Tensor]) -> torch.Tensor:
    return xs[0] if len(xs) == 1 else torch.cat(xs)


def _is_sr(group: dict[str, Any]) -> bool:
    """A group whose half-precision weights are written by stochastic rounding: no master copy."""
    return not group.get("master_weights", False) and any(p.dtype in _HALF for p in group["params"])


def _cast(x: float, dtype: torch.dtype) -> float:
    """``x`` rounded to nearest in ``dtype``, in host arithmetic (no tensor, nothing to read back)."""
    if not math.isfinite(x) or dtype == torch.float64:
        return x
    if dtype == torch.float16:
        try:
            return struct.unpack("e", struct.pack("e", x))[0]
        except OverflowError:
            return math.copysign(math.inf, x)
    (bits,) = struct.unpack("I", struct.pack("f", x))  # float32 bits
    if dtype == torch.bfloat16:  # keep the top 16 bits, round to nearest even
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return struct.unpack("f", struct.pack("I", bits & 0xFFFFFFFF))[0]


def build_numerics(optimizer: torch.optim.Optimizer, numerics_every: int | None, log_every: int,
                   sample_per_tensor: int = 4096, seed: int = 0) -> NumericsMonitor | None:
    """The run's monitor, attached (``numerics_every`` unset: every ``log_every`` steps), or ``None``
    for ``0`` (off)."""
    every = log_every if numerics_every is None else numerics_every
    if every == 0:
        return None
    return NumericsMonitor(optimizer, every, sample_per_tensor, seed).attach()
