"""``--breakdown``: where one step's time goes, the recipe and the baseline interleaved in one process."""

from __future__ import annotations

import importlib
import os
import statistics
from dataclasses import asdict
from typing import Any, Callable

import torch

from _common import environment, make_inputs  # noqa: E402  (puts the repository on sys.path)

from .openclip_arm import OpenClipRunner
from .recipe_arm import RecipeRunner
from .settings import BenchSettings, available_arms, resolve_settings, worker_spec
from .clock import PhaseClock
from .worker import build_runner, worker_env

__all__ = ["BREAKDOWN_ROWS", "run_breakdown"]

#: Rows of the breakdown table: (key, label). Exclusive times, derived in :func:`_exclusive_phases`.
BREAKDOWN_ROWS = [
    ("data", "data (inputs to the model's dtype)"),
    ("forward", "forward (model, and DeepSpeed's forward wrapper)"),
    ("loss", "loss"),
    ("backward", "backward (autograd)"),
    ("ds_hooks", "DeepSpeed: per-gradient hooks (bucket copies)"),
    ("ds_reduce", "gradient all-reduce (DeepSpeed's at the end of backward; ZeRO-0: what the recipe's "
                  "overlapped all-reduce leaves after backward, none at one rank)"),
    ("ds_overflow", "DeepSpeed: overflow check"),
    ("ds_norm", "gradient norm (DeepSpeed's; ZeRO-0: the recipe's; baseline: clip_grad_norm_)"),
    ("ds_clip", "DeepSpeed: unscale and clip"),
    ("optimizer", "optimizer step (SRAdamW / torch AdamW + zero_grad)"),
    ("ds_allgather", "DeepSpeed: weight all-gather"),
    ("ds_copy", "DeepSpeed: rest of engine.step (gradient flatten, weight copies, zero_grad)"),
    ("step_own", "train step's own work (finite flags, outcome read, passes bookkeeping)"),
    ("total", "total (median step)"),
]


def _clock_recipe(runner: RecipeRunner) -> PhaseClock:
    import recipe.training.overlap
    import recipe.training.passes
    import recipe.training.step

    clock, engine = PhaseClock(runner.device), runner.arm.engine
    zero = engine.optimizer
    clock.wrap(recipe.training.passes, "_inputs", "data")
    clock.wrap(engine, "forward", "forward")
    clock.wrap(runner, "loss_fn", "loss")
    clock.wrap(engine, "backward", "backward_all")
    clock.wrap(engine, "allreduce_gradients", "ds_reduce")
    clock.wrap(engine, "step", "engine_step")
    if hasattr(zero, "_optimizer_step"):  # ZeRO-1/2: DeepSpeed's optimizer wraps the recipe's
        for attr, phase in (
            ("process_gradients", "ds_hooks"),
            ("check_overflow", "ds_overflow"),
            ("scaled_global_norm", "ds_norm"),
            ("unscale_and_clip_grads", "ds_clip"),
            ("_optimizer_step", "optimizer"),
        ):
            clock.wrap(zero, attr, phase)
    else:  # the recipe-managed routes (bf16 ZeRO-0, fp16): engine.step calls the client optimizer's step
        # at class level: recipe.training.step.step_kwargs binds ``type(opt).step`` for every step
        clock.wrap(type(zero), "step", "optimizer")
    # the recipe's own all-reduce (recipe-managed routes, two ranks or more: what is left of it after
    # backward, at class level) and clipping norm (train_step calls it by name)
    clock.wrap(recipe.training.overlap.OverlappedAllReduce, "finish", "recipe_reduce")
    clock.wrap(recipe.training.step, "grad_multiplier", "recipe_norm")
    stage12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    clock.wrap(stage12, "all_gather_dp_groups", "ds_allgather")
    return clock


def _clock_baseline(runner: OpenClipRunner) -> PhaseClock:
    clock = PhaseClock(runner.device)
    clock.wrap(runner.model, "forward", "forward")
    clock.wrap(runner, "loss_fn", "loss")
    clock.wrap(runner.opt, "step", "optimizer")
    clock.wrap(runner.opt, "zero_grad", "zero_grad")
    clock.wrap(runner, "clip", "ds_norm")
    return clock


def _exclusive_phases(t: dict[str, float], recipe_arm: bool) -> dict[str, float]:
    """One step's inclusive phase times turned into the table's exclusive rows."""

    def g(k: str) -> float:
        return t.get(k, 0.0)

    out = {k: g(k) for k in ("data", "forward", "loss", "ds_hooks", "ds_reduce", "ds_overflow", "ds_norm", "ds_clip",
                             "optimizer", "ds_allgather")}
    if recipe_arm:
        out["backward"] = g("backward_all") - g("ds_hooks") - g("ds_reduce")
        named = sum(g(k) for k in ("ds_overflow", "ds_norm", "ds_clip", "optimizer", "ds_allgather"))
        out["ds_copy"] = g("engine_step") - named
        # the recipe's all-reduce and norm run between backward and engine.step (recipe-managed routes)
        out["step_own"] = g("total") - g("engine_step") - (
            g("data") + g("forward") + g("loss") + g("backward_all") + g("recipe_reduce") + g("recipe_norm")
        )
        out["ds_reduce"] += g("recipe_reduce")
        out["ds_norm"] += g("recipe_norm")
    else:  # what the wrappers leave: the backward pass (and the logit-scale clamp, the loss read)
        out["optimizer"] = g("optimizer") + g("zero_grad")
        out["backward"] = g("total") - g("forward") - g("loss") - out["optimizer"] - g("ds_norm")
    out["total"] = g("total")
    return {k: out.get(k, 0.0) for k, _ in BREAKDOWN_ROWS}  # every row, 0 where the arm has no such phase


def run_breakdown(s: BenchSettings, rounds: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per-phase median times of one step, the recipe (its own :func:`recipe.training.step.train_step`) and
    the baseline alternating step by step in this one process (same load for both)."""
    s = resolve_settings(s)
    for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM"):  # what the workers get (before DeepSpeed loads)
        if key in (env := worker_env(s.device)):
            os.environ.setdefault(key, env[key])
    if s.threads:
        torch.set_num_threads(s.threads)
    device = torch.device(s.device)
    arms, missing = available_arms(s.loss_modes[:1], True, s.device)
    ckpt = s.ckpt[0]
    base = next(a for a in arms if not a.startswith("recipe-"))
    recipe_spec = worker_spec(s, arms[0], ckpt, [{"batch": s.batch}], s.accumulation[0])
    base_spec = worker_spec(s, base, ckpt, [{"batch": s.batch}])
    runners = [build_runner(recipe_spec, device), build_runner(base_spec, device)]
    inputs = []
    for r in runners:
        x = make_inputs(s.batch, r.image_size, r.text, s.seed)
        inputs.append({k: v.to(device) for k, v in x.items()})
    for _ in range(s.warmup):
        for r, x in zip(runners, inputs):
            r.step(x)
    clocks = [_clock_recipe(runners[0]), _clock_baseline(runners[1])]
    for i in range(rounds or s.steps):
        for r, x, c in zip(runners, inputs, clocks):
            c.step(lambda r=r, x=x: r.step(x))
        times = (f"{r.name} {c.inclusive[-1]['total'] * 1e3:.1f} ms" for r, c in zip(runners, clocks))
        log(f"  round {i + 1}: " + ", ".join(times))
    rows = {}
    for r, c, is_recipe in zip(runners, clocks, (True, False)):
        per_step = [_exclusive_phases(t, is_recipe) for t in c.inclusive]
        rows[r.name] = {k: statistics.median(p.get(k, 0.0) for p in per_step) for k, _ in BREAKDOWN_ROWS}
        rows[r.name]["samples_per_s"] = s.batch / rows[r.name]["total"]
        rows[r.name]["description"] = r.description
        rows[r.name]["steps"] = per_step
    return {"settings": asdict(s), "environment": environment(s.device), "unavailable": missing,
            "arms": [r.name for r in runners], "breakdown": rows}
