"""Training throughput and memory: this recipe under DeepSpeed next to OpenCLIP, in one run.

Arms (each trains on the same random pixels and tokens, generated from one seed):

* ``recipe-<loss mode>``: :func:`recipe.model.create_model` (``ViT-B-32`` preset on CUDA, ``tiny``
  on CPU) under DeepSpeed with ``ds_configs/zero2_bf16_halfmaster.json`` (bf16, ZeRO-2), SRAdamW
  over the CLIP paper's groups as :mod:`recipe.train` builds them (text tower: SR bf16 weights and
  bf16 states, no master; image tower and logit scale: fp32 master), :class:`recipe.loss.ClipLoss`
  in each requested mode that exists (``plain``; ``fused`` once :data:`recipe.loss.LOSS_MODES` has
  it). One process, world size 1: the script sets the launcher's environment itself.
* ``openclip``: ``open_clip.create_model("ViT-B-32")`` on CUDA (on CPU the same factory with the
  ``tiny`` preset's sizes: 32 px images, patch 8, 2 layers of width 64 per tower, 4,096 tokens,
  context 32, embedding 64), fp32 weights under ``torch.autocast(bfloat16)``, ``torch.optim.AdamW``
  (``fused=True`` on CUDA) with OpenCLIP's decay / no-decay split, and ``open_clip.loss.ClipLoss``.
  Without ``open_clip`` installed the arm is ``torch-amp``: the recipe's own model in fp32 under
  the same autocast + AdamW, with the recipe's plain loss (the table says so).

Gradient accumulation (``--accumulation 1 4``): each recipe arm also runs with the same per-rank batch
split into k micro-batches under DeepSpeed's ``gradient_accumulation_steps`` = k, with
``--contrastive-batch`` ``global`` (default: one loss over all k micro-batches through the embedding
cache of :mod:`recipe.passes`, the cost of which this measures) or ``micro``. The largest-batch
search runs at accumulation 1 only.

Per arm, with and without gradient checkpointing: samples/s over ``--steps`` timed steps after
``--warmup`` steps (one step = forward, loss, backward, optimizer step), peak memory during the
timed steps, and the largest batch that fits.

Memory: on CUDA ``torch.cuda.max_memory_allocated()`` (weights, gradients, optimizer state and
activations; the peak is reset after the warm-up steps); on CPU the peak resident set size during
the timed steps minus the resident size before the model was built (Linux ``VmHWM``, reset after
the warm-up), where "before" already holds the libraries' code: the worker first builds the arm
small, trains one step on it and drops it, since much of that code loads on first use. "Fits"
means: on CUDA, two training steps without running out of memory; on CPU, a peak within
``--cpu-budget-mib`` (a stand-in for device memory, so the search can be exercised). The search
doubles the batch from ``--batch`` up to ``--max-batch``, then bisects between the last batch that
fitted and the first that did not, to ``--fit-tolerance`` (relative) or ``--fit-granularity``. Every arm and setting runs in its own process (clean peak memory; a CUDA
out-of-memory error never poisons a later measurement), and a probe after a failure starts a
fresh process.

Usage::

    python benchmarks/bench_train.py                      # CUDA if present: ViT-B-32, batch 512
    python benchmarks/bench_train.py --device cpu         # tiny presets, batch 32
    python benchmarks/bench_train.py --fit none --ckpt off --steps 5   # quick look
    python benchmarks/bench_train.py --device cpu --fit none --accumulation 1 4   # embedding cache cost
    python benchmarks/bench_train.py --device cpu --fit none --ckpt off --no-baseline --compile   # torch.compile
    python benchmarks/bench_train.py --device cpu --ckpt off --breakdown --steps 30   # per-phase times vs OpenCLIP

``--compile`` compiles the recipe arms' towers (:func:`recipe.engine.compile_towers`, ZeRO 0-2 configs)
after the engine is built; the compilation falls in the warm-up steps, whose time each row reports as
``warmup_seconds``.

``--breakdown`` instead times the phases of one step (data, forward, loss, backward, DeepSpeed's
hooks, reduction, overflow check, norm, clipping, weight copies, the optimizer, the train step's own
work) by wrapping timers around the callables that run them, the first recipe arm and the baseline
alternating step by step in this one process, so that both see the same load; it reports medians.

Output: a markdown table (device, versions, date) on stdout and a JSON file
(``benchmarks/results/bench_train_<device>.json`` by default).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from _common import (  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)
    GIB,
    MIB,
    RESULTS,
    ROOT,
    CpuPeakRss,
    TextSpec,
    build_recipe_arm,
    environment,
    input_checksum,
    make_inputs,
    write_result,
)

__all__ = [
    "BenchSettings",
    "available_arms",
    "make_inputs",
    "input_checksum",
    "RecipeRunner",
    "OpenClipRunner",
    "largest_fitting",
    "run_benchmark",
    "markdown_table",
    "run_breakdown",
    "breakdown_table",
    "main",
]

RESULT_TAG = "BENCH_TRAIN_RESULT "
DEFAULT_DS_CONFIG = str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json")

#: open_clip keyword overrides that give the ``tiny`` preset's sizes.
OPENCLIP_TINY = dict(
    embed_dim=64,
    vision_cfg=dict(image_size=32, layers=2, width=64, patch_size=8, head_width=32),
    text_cfg=dict(context_length=32, vocab_size=4096, width=64, heads=2, layers=2),
)


@dataclass
class BenchSettings:
    """What to measure. Device-dependent defaults are filled in by :func:`resolve_settings`."""

    device: str = "cuda"
    preset: str | None = None  # ViT-B-32 on CUDA, tiny on CPU
    batch: int | None = None  # 512 on CUDA, 32 on CPU
    warmup: int = 3
    steps: int = 10
    ckpt: list[bool] = field(default_factory=lambda: [False, True])
    loss_modes: list[str] = field(default_factory=lambda: ["plain", "fused"])
    accumulation: list[int] = field(default_factory=lambda: [1])  # recipe arms: micro-batches per step
    contrastive_batch: str = "global"
    compile: bool = False  # recipe arms: torch.compile of the towers (recipe.engine.compile_towers)
    baseline: bool = True
    fit: str = "all"  # all | off (checkpointing off only) | none
    max_batch: int | None = None  # 65536 on CUDA, 4 x batch on CPU
    fit_tolerance: float = 0.05
    fit_granularity: int | None = None  # 32 on CUDA, 8 on CPU
    cpu_budget_mib: float = 600.0
    ds_config: str = DEFAULT_DS_CONFIG
    baseline_grad_clip: float | None = None  # None: the DeepSpeed config's gradient_clipping (like for like)
    seed: int = 0
    threads: int | None = None
    timeout_s: float = 900.0  # per worker process


def resolve_settings(s: BenchSettings) -> BenchSettings:
    """Fills the device-dependent defaults and validates."""
    cuda = s.device.startswith("cuda")
    s.preset = s.preset or ("ViT-B-32" if cuda else "tiny")
    s.batch = s.batch or (512 if cuda else 32)
    s.max_batch = s.max_batch or (65536 if cuda else 4 * s.batch)
    s.fit_granularity = s.fit_granularity or (32 if cuda else 8)
    if s.threads is None and not cuda:
        s.threads = 1  # on a shared CPU, OpenMP threads that wait on each other cost more than they give
    if s.batch < 2 or s.steps < 1 or s.warmup < 1:
        raise ValueError("need batch >= 2, steps >= 1 and warmup >= 1 (the first step creates the optimizer state)")
    if s.fit not in ("all", "off", "none"):
        raise ValueError(f"fit must be all, off or none, got {s.fit!r}")
    if any(a < 1 or s.batch % a for a in s.accumulation):
        raise ValueError(f"every accumulation must be >= 1 and divide the batch ({s.batch}), got {s.accumulation}")
    if s.contrastive_batch not in ("global", "micro"):
        raise ValueError(f"contrastive_batch must be global or micro, got {s.contrastive_batch!r}")
    if s.max_batch < s.batch:
        raise ValueError(f"max_batch ({s.max_batch}) is below batch ({s.batch})")
    if cuda and not torch.cuda.is_available():
        raise ValueError("--device cuda but CUDA is not available (use --device cpu)")
    return s


# ----------------------------------------------------------------------------------------------
# runners: build a model + optimizer once, then train steps at any batch size
# ----------------------------------------------------------------------------------------------


class Runner:
    """One arm in one process: ``step(inputs) -> loss``; inputs are on the device."""

    name = "runner"
    description = ""
    text: TextSpec
    image_size: int
    params: int

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        raise NotImplementedError


class RecipeRunner(Runner):
    """The recipe: the engine :mod:`recipe.train` builds (DeepSpeed, SRAdamW over the CLIP paper's
    groups) stepped by the recipe's own :func:`recipe.step.train_step`."""

    def __init__(
        self,
        preset: str,
        loss_mode: str,
        ckpt: bool,
        ds_config: str,
        device: torch.device,
        batch: int,
        seed: int = 0,
        accumulation: int = 1,
        contrastive_batch: str = "global",
        compile: bool = False,
    ) -> None:
        from recipe.loss import ClipLoss
        from recipe.precision import read_ds_config
        from recipe.step import TrainState

        ds = read_ds_config(ds_config)  # a bad JSON is named, as in training
        if batch % accumulation:
            raise ValueError(f"batch {batch} is not a multiple of the accumulation {accumulation}")
        ds["train_micro_batch_size_per_gpu"] = batch // accumulation
        ds["gradient_accumulation_steps"] = accumulation
        ds.pop("train_batch_size", None)
        self.arm = build_recipe_arm(preset, ds, seed, grad_checkpointing=ckpt)
        self.loss_fn = ClipLoss(mode=loss_mode, validate=False)
        self.state = TrainState()
        self.device = device
        self.name = f"recipe-{loss_mode}"
        self.accumulation, self.contrastive_batch = accumulation, contrastive_batch
        self.description = (
            f"recipe {preset}, DeepSpeed {self.arm.precision.label} (SR text, exact-master image), ClipLoss {loss_mode}"
        )
        if accumulation > 1:
            self.description += f", {accumulation} micro-batches per step, contrastive batch {contrastive_batch}"
        if compile:  # after deepspeed.initialize: fine under ZeRO 0-2 (compile_towers refuses ZeRO-3 here)
            from recipe.engine import compile_towers

            compile_towers(self.arm.model, self.arm.engine.zero_optimization_stage())
            self.description += ", towers compiled (torch.compile)"
        model = self.arm.model
        self.text = TextSpec.of(model)
        self.image_size = int(model.image_data_config()["input_size"][-1])
        self.params = sum(p.numel() for p in model.parameters())

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        from recipe.step import train_step

        a, k = self.arm, self.accumulation
        micro = next(iter(inputs.values())).shape[0] // k
        batches = [{n: v[i * micro : (i + 1) * micro] for n, v in inputs.items()} for i in range(k)]
        result = train_step(
            a.engine, a.optimizer, self.loss_fn, a.precision, batches, self.state, max_nonfinite_in_row=10**9,
            contrastive_batch=self.contrastive_batch,
        )
        # host read, once per step in every arm alike: the measurement checks that the losses are finite
        return float(result.loss)


def _openclip_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """OpenCLIP's split: no decay for gains, biases, norms, embeddings' 1-d params and the logit scale."""
    no_decay, decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


class OpenClipRunner(Runner):
    """OpenCLIP's training step: fp32 weights, bf16 autocast, torch AdamW, its ClipLoss, then the
    logit-scale clamp. Without ``open_clip`` (``fallback=True``): the recipe's model in the same
    setting with the recipe's plain loss."""

    def __init__(self, preset: str, ckpt: bool, device: torch.device, seed: int = 0, fallback: bool = False,
                 grad_clip: float = 0.0) -> None:
        torch.manual_seed(seed)
        self.grad_clip = grad_clip
        if fallback:
            from recipe.loss import ClipLoss
            from recipe.model import create_model

            model = create_model(preset)
            tcfg = model.text.config
            self.text = TextSpec(
                int(tcfg.vocab_size),
                int(model.context_length),
                int(tcfg.bos_token_id),
                int(tcfg.eos_token_id),
                int(tcfg.pad_token_id or 0),
            )
            self.image_size = int(model.image_data_config()["input_size"][-1])
            recipe_loss = ClipLoss(validate=False)
            self.loss_fn: Callable[..., torch.Tensor] = lambda *a: recipe_loss(*a).loss
            self.name = "torch-amp"
            self.description = (
                f"recipe {preset} model in fp32, bf16 autocast, torch AdamW, recipe plain loss "
                "(open_clip not installed)"
            )
            self._forward = lambda m, x: m(x["pixel_values"], x["input_ids"], x["attention_mask"])
        else:
            import open_clip
            from open_clip.loss import ClipLoss as OpenClipLoss

            kwargs = {} if preset == "ViT-B-32" else OPENCLIP_TINY
            if preset not in ("ViT-B-32", "tiny"):
                raise ValueError(f"no open_clip counterpart for preset {preset!r} (ViT-B-32 or tiny)")
            model = open_clip.create_model("ViT-B-32", **kwargs)
            cfg = open_clip.get_model_config("ViT-B-32")["text_cfg"] if not kwargs else kwargs["text_cfg"]
            vocab, ctx = int(cfg["vocab_size"]), int(cfg["context_length"])
            # OpenCLIP pools at the largest token id: end-of-text is the last id of the vocabulary.
            self.text = TextSpec(vocab, ctx, bos=vocab - 2, eos=vocab - 1)
            self.image_size = int(
                model.visual.image_size[0]
                if isinstance(model.visual.image_size, (tuple, list))
                else model.visual.image_size
            )
            self.loss_fn = OpenClipLoss()
            self.name = "openclip"
            sizes = "" if not kwargs else " (tiny sizes)"
            self.description = (
                f"open_clip {open_clip.__version__} ViT-B-32{sizes}, bf16 autocast, torch AdamW, open_clip ClipLoss"
            )
            self._forward = lambda m, x: m(x["pixel_values"], x["input_ids"])
        model.to(device)
        model.set_grad_checkpointing(ckpt)
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(_openclip_param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6, **fused)
        self.model, self.device = model, device
        self.params = sum(p.numel() for p in model.parameters())
        if grad_clip:
            self.description += f", clip_grad_norm_ {grad_clip:g}"

    def clip(self) -> None:
        """OpenCLIP's ``--grad-clip-norm``: the global L2 norm of the gradients clipped to ``grad_clip``."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, norm_type=2.0)

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            img, txt, scale = self._forward(self.model, inputs)[:3]
            loss = self.loss_fn(img, txt, scale)
        loss.backward()
        if self.grad_clip:
            self.clip()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        # host read, once per step in every arm alike: the measurement checks that the losses are finite
        return float(loss.detach())


# ----------------------------------------------------------------------------------------------
# measuring one arm (in a worker process)
# ----------------------------------------------------------------------------------------------


class _Meter:
    """Peak memory of a region, CUDA or CPU, in bytes (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cpu = CpuPeakRss() if device.type == "cpu" else None
        if self.cpu is not None and not self.cpu.available:
            raise RuntimeError("CPU peak memory needs Linux /proc/self/clear_refs")
        self.base = self.cpu.rss_bytes() if self.cpu else 0

    def reset(self) -> None:
        if self.cpu:
            self.cpu.reset()
        else:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> int:
        if self.cpu:
            return self.cpu.peak_bytes() - self.base
        torch.cuda.synchronize(self.device)
        return int(torch.cuda.max_memory_allocated(self.device))


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _preload(arm: str) -> None:
    """Imports what the arm needs, so that the memory baseline already holds the libraries' code."""
    import recipe.model  # noqa: F401

    if arm.startswith("recipe-"):
        import deepspeed  # noqa: F401

        import recipe.train  # noqa: F401
    elif arm == "openclip":
        import open_clip  # noqa: F401


def _load_lazy_code(spec: dict[str, Any], device: torch.device) -> None:
    """CPU: builds the arm once more, small (batch 2 per micro-batch, uncompiled), trains one step on it
    and drops it, before the memory baseline. Much of the libraries' code loads on first use, not on
    import (transformers' and timm's model code, tokenizers, DeepSpeed's ZeRO runtime: 75 MiB of
    resident code for the recipe's tiny preset, 10 times its weights, gradients and optimizer state);
    the resident set counts it, and the baseline is meant to hold it already (see :func:`_preload`)."""
    k = int(spec.get("accumulation", 1))
    small = {**spec, "compile": False, "batches": [{"batch": 2 * k}]}
    runner = build_runner(small, device)
    inputs = make_inputs(2 * k, runner.image_size, runner.text, spec["seed"])
    runner.step({n: v.to(device) for n, v in inputs.items()})
    del runner, inputs
    gc.collect()


def build_runner(spec: dict[str, Any], device: torch.device) -> Runner:
    """The runner an arm name stands for (``recipe-<mode>``, ``openclip``, ``torch-amp``)."""
    arm = spec["arm"]
    if arm.startswith("recipe-"):
        return RecipeRunner(
            spec["preset"],
            arm.removeprefix("recipe-"),
            spec["ckpt"],
            spec["ds_config"],
            device,
            spec["batches"][0]["batch"],
            spec["seed"],
            spec.get("accumulation", 1),
            spec.get("contrastive_batch", "global"),
            spec.get("compile", False),
        )
    if arm in ("openclip", "torch-amp"):
        return OpenClipRunner(spec["preset"], spec["ckpt"], device, spec["seed"], fallback=arm == "torch-amp",
                              grad_clip=spec.get("baseline_grad_clip", 0.0))
    raise ValueError(f"unknown arm {arm!r}")


def measure_worker(spec: dict[str, Any], emit: Callable[[dict[str, Any]], None]) -> None:
    """Builds the arm once and measures each ``spec["batches"]`` entry in order, emitting one result
    per entry; stops after the first that does not fit (out of memory, or over the CPU budget)."""
    device = torch.device(spec["device"])
    if spec.get("threads"):
        torch.set_num_threads(int(spec["threads"]))
    _preload(spec["arm"])
    if device.type == "cpu":
        _load_lazy_code(spec, device)
    meter = _Meter(device)
    runner = build_runner(spec, device)
    for entry in spec["batches"]:
        batch, warmup, steps = entry["batch"], entry["warmup"], entry["steps"]
        inputs = make_inputs(batch, runner.image_size, runner.text, spec["seed"])
        out: dict[str, Any] = {
            "arm": runner.name,
            "ckpt": spec["ckpt"],
            "accumulation": spec.get("accumulation", 1),
            "batch": batch,
            "kind": entry["kind"],
            "params": runner.params,
            "description": runner.description,
            "checksum": input_checksum(inputs, runner.text),
        }
        inputs = {k: v.to(device) for k, v in inputs.items()}
        try:
            t0 = time.perf_counter()
            losses = [runner.step(inputs) for _ in range(warmup)]
            _sync(device)
            out["warmup_seconds"] = time.perf_counter() - t0  # with --compile: the compilation
            gc.collect()
            meter.reset()
            _sync(device)
            t0 = time.perf_counter()
            losses += [runner.step(inputs) for _ in range(steps)]
            _sync(device)
            elapsed = time.perf_counter() - t0
            peak = meter.peak()
        except (torch.OutOfMemoryError, RuntimeError) as err:
            if not _is_oom(err):
                raise
            out.update(fits=False, error="out of memory")
            emit(out)
            return
        fits = all(math.isfinite(v) for v in losses) and (device.type == "cuda" or peak <= spec["cpu_budget_mib"] * MIB)
        out.update(
            fits=fits,
            seconds=elapsed,
            steps=steps,
            samples_per_s=batch * steps / elapsed,
            peak_bytes=peak,
            first_loss=losses[0],
            last_loss=losses[-1],
        )
        emit(out)
        if not fits:
            return
        del inputs
        if device.type == "cuda":
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# --breakdown: where one step's time goes, recipe and baseline interleaved in one process
# ----------------------------------------------------------------------------------------------

#: Rows of the breakdown table: (key, label). Exclusive times, derived in :func:`_exclusive_phases`.
BREAKDOWN_ROWS = [
    ("data", "data (inputs to the model's dtype)"),
    ("forward", "forward (model, and DeepSpeed's forward wrapper)"),
    ("loss", "loss"),
    ("backward", "backward (autograd)"),
    ("ds_hooks", "DeepSpeed: per-gradient hooks (bucket copies)"),
    ("ds_reduce", "DeepSpeed: gradient reduction at the end of backward"),
    ("ds_overflow", "DeepSpeed: overflow check"),
    ("ds_norm", "gradient norm (DeepSpeed; baseline: clip_grad_norm_)"),
    ("ds_clip", "DeepSpeed: unscale and clip"),
    ("optimizer", "optimizer step (SRAdamW / torch AdamW + zero_grad)"),
    ("ds_allgather", "DeepSpeed: weight all-gather"),
    ("ds_copy", "DeepSpeed: rest of engine.step (gradient flatten, weight copies)"),
    ("step_own", "train step's own work (finite flags, outcome read, passes bookkeeping)"),
    ("total", "total (median step)"),
]


class _PhaseClock:
    """Inclusive wall time per phase of each step, from wrappers around the callables each phase runs
    (the arms' own code runs unchanged; only timers are added around it). A wrapper counts only while
    its clock is stepping: wrappers of module-level functions may stack when several arms share them.
    On CUDA every timed call synchronises the device before and after (host syncs that exist only for
    this diagnosis: without them a phase's time would be its kernel launches)."""

    active: _PhaseClock | None = None

    def __init__(self, device: torch.device) -> None:
        self.now: dict[str, float] = {}
        self.steps: list[dict[str, float]] = []
        self.device = device

    def wrap(self, owner: Any, attr: str, phase: str) -> None:
        orig = getattr(owner, attr, None)
        if orig is None:
            return

        def timed(*args: Any, **kwargs: Any) -> Any:
            if _PhaseClock.active is not self:
                return orig(*args, **kwargs)
            _sync(self.device)
            t0 = time.perf_counter()
            try:
                return orig(*args, **kwargs)
            finally:
                _sync(self.device)
                self.now[phase] = self.now.get(phase, 0.0) + time.perf_counter() - t0

        setattr(owner, attr, timed)

    def step(self, fn: Callable[[], Any]) -> None:
        self.now = {}
        _PhaseClock.active = self
        try:
            _sync(self.device)
            t0 = time.perf_counter()
            fn()
            _sync(self.device)
            self.now["total"] = time.perf_counter() - t0
        finally:
            _PhaseClock.active = None
        self.steps.append(self.now)


def _clock_recipe(runner: RecipeRunner) -> _PhaseClock:
    import recipe.passes

    clock, engine = _PhaseClock(runner.device), runner.arm.engine
    zero = engine.optimizer
    clock.wrap(recipe.passes, "_inputs", "data")
    clock.wrap(engine, "forward", "forward")
    clock.wrap(runner, "loss_fn", "loss")
    clock.wrap(engine, "backward", "backward_all")
    clock.wrap(engine, "allreduce_gradients", "ds_reduce")
    clock.wrap(engine, "step", "engine_step")
    for attr, phase in (
        ("process_gradients", "ds_hooks"),
        ("check_overflow", "ds_overflow"),
        ("scaled_global_norm", "ds_norm"),
        ("unscale_and_clip_grads", "ds_clip"),
        ("_optimizer_step", "optimizer"),
    ):
        clock.wrap(zero, attr, phase)
    stage12 = importlib.import_module("deepspeed.runtime.zero.stage_1_and_2")
    clock.wrap(stage12, "all_gather_dp_groups", "ds_allgather")
    return clock


def _clock_baseline(runner: OpenClipRunner) -> _PhaseClock:
    clock = _PhaseClock(runner.device)
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
        out["step_own"] = g("total") - g("engine_step") - (
            g("data") + g("forward") + g("loss") + g("backward_all")
        )
    else:  # what the wrappers leave: the backward pass (and the logit-scale clamp, the loss read)
        out["optimizer"] = g("optimizer") + g("zero_grad")
        out["backward"] = g("total") - g("forward") - g("loss") - out["optimizer"] - g("ds_norm")
    out["total"] = g("total")
    return {k: out.get(k, 0.0) for k, _ in BREAKDOWN_ROWS}  # every row, 0 where the arm has no such phase


def run_breakdown(s: BenchSettings, rounds: int | None = None, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Per-phase median times of one step, the recipe (its own :func:`recipe.step.train_step`) and
    the baseline alternating step by step in this one process (same load for both)."""
    s = resolve_settings(s)
    for key in ("DS_ACCELERATOR", "TOKENIZERS_PARALLELISM"):  # what the workers get (before DeepSpeed loads)
        if key in (env := _worker_env(s.device)):
            os.environ.setdefault(key, env[key])
    if s.threads:
        torch.set_num_threads(s.threads)
    device = torch.device(s.device)
    arms, missing = available_arms(s.loss_modes[:1], True, s.device)
    ckpt = s.ckpt[0]
    base = next(a for a in arms if not a.startswith("recipe-"))
    recipe_spec = _spec(s, arms[0], ckpt, [{"batch": s.batch}], s.accumulation[0])
    runners = [build_runner(recipe_spec, device), build_runner(_spec(s, base, ckpt, [{"batch": s.batch}]), device)]
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
        log(f"  round {i + 1}: " + ", ".join(f"{r.name} {c.steps[-1]['total'] * 1e3:.1f} ms" for r, c in zip(runners, clocks)))
    rows = {}
    for r, c, is_recipe in zip(runners, clocks, (True, False)):
        per_step = [_exclusive_phases(t, is_recipe) for t in c.steps]
        rows[r.name] = {k: statistics.median(p.get(k, 0.0) for p in per_step) for k, _ in BREAKDOWN_ROWS}
        rows[r.name]["samples_per_s"] = s.batch / rows[r.name]["total"]
        rows[r.name]["description"] = r.description
        rows[r.name]["steps"] = per_step
    return {"settings": asdict(s), "environment": environment(s.device), "unavailable": missing,
            "arms": [r.name for r in runners], "breakdown": rows}


def breakdown_table(result: dict[str, Any]) -> str:
    """The breakdown as a markdown table (milliseconds per step, medians over the rounds)."""
    s, env, arms, rows = result["settings"], result["environment"], result["arms"], result["breakdown"]
    v = env["versions"]
    lines = [
        (
            f"**{env['device']}**, {env['date']}; torch {v['torch']}, deepspeed {v['deepspeed']}, open_clip "
            f"{v['open_clip']}, {s['threads']} thread(s). Preset {s['preset']}, batch {s['batch']}, {s['steps']} "
            f"rounds after {s['warmup']} warm-up rounds, arms alternating step by step in one process; "
            "per-phase medians (they need not add up to the median total)."
        ),
        "",
        "| phase (ms per step) | " + " | ".join(arms) + " |",
        "|---|" + "---:|" * len(arms),
    ]
    for key, label in BREAKDOWN_ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{rows[a][key] * 1e3:.1f}" for a in arms) + " |")
    lines.append("| samples/s (batch / median step) | " + " | ".join(f"{rows[a]['samples_per_s']:.0f}" for a in arms) + " |")
    ratio = rows[arms[0]]["samples_per_s"] / rows[arms[1]]["samples_per_s"]
    lines += ["", f"{arms[0]} / {arms[1]} samples/s: {ratio:.2f}×", ""]
    lines += [f"- `{a}`: {rows[a]['description']}" for a in arms]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# orchestration
# ----------------------------------------------------------------------------------------------


def largest_fitting(
    probe: Callable[[list[int]], dict[int, bool]],
    start: int,
    max_batch: int,
    tolerance: float,
    granularity: int,
    known: dict[int, bool] | None = None,
) -> dict[str, Any]:
    """Largest batch size in ``[start, max_batch]`` that fits, assuming that fitting is monotone.

    Doubles from ``start`` (then ``max_batch``) until a batch does not fit, then bisects between
    the last batch that fitted and the first that did not.

    Args:
        probe: ``probe(batches) -> {batch: fits}``; tries ``batches`` in order and may stop after
            the first that does not fit (batches left out count as not fitting).
        start: First batch of the doubling phase.
        max_batch: Upper end of the search.
        tolerance: Stop bisecting when ``hi - lo <= tolerance * lo`` ...
        granularity: ... or ``hi - lo <= granularity``; bisection probes are multiples of it.
        known: Results already measured (e.g. the timed batch and a first doubling pass).

    Returns:
        ``{"largest": lo, "first_failing": hi, "probes": {batch: fits}, "capped": bool}``: ``lo`` is
        ``None`` when ``start`` does not fit, ``hi`` is ``None`` when ``max_batch`` fits (then
        ``capped`` is true: the real limit may be higher).
    """
    results: dict[int, bool] = dict(known or {})
    ladder, b = [], start
    while b < max_batch:
        ladder.append(b)
        b *= 2
    ladder.append(max_batch)
    for i, b in enumerate(ladder):
        if b not in results:
            todo = [x for x in ladder[i:] if x not in results]
            got = probe(todo)
            for x in todo:
                results[x] = bool(got.get(x, False))
                if not results[x]:
                    break
        if not results.get(b, False):
            break
    lo = hi = None
    for b in ladder:
        if not results.get(b, False):
            hi = b
            break
        lo = b
    while lo is not None and hi is not None and hi - lo > max(granularity, tolerance * lo):
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        if mid not in results:
            results[mid] = bool(probe([mid]).get(mid, False))
        if results[mid]:
            lo = mid
        else:
            hi = mid
    return {"largest": lo, "first_failing": hi, "probes": dict(sorted(results.items())), "capped": hi is None}


def _worker_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if device == "cpu":
        env["DS_ACCELERATOR"] = "cpu"
    env.setdefault("PYTHONWARNINGS", "ignore")
    return env


def run_worker(spec: dict[str, Any], timeout_s: float) -> list[dict[str, Any]]:
    """Runs :func:`measure_worker` in a fresh process; returns the results it emitted. A process
    that dies (e.g. killed for memory) without emitting a result for an entry counts that entry
    as not fitting."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=_worker_env(spec["device"]), cwd=str(ROOT)
    )
    out = [json.loads(line[len(RESULT_TAG) :]) for line in proc.stdout.splitlines() if line.startswith(RESULT_TAG)]
    if proc.returncode != 0:
        died_oom = "out of memory" in proc.stderr.lower() or proc.returncode in (-9, 137)
        if not died_oom:
            what = f"worker for {spec['arm']} (ckpt={spec['ckpt']})"
            raise RuntimeError(f"{what} failed with code {proc.returncode}:\n{proc.stderr[-4000:]}")
        done = {r["batch"] for r in out}
        for entry in spec["batches"]:
            if entry["batch"] not in done:
                out.append(
                    {
                        "arm": spec["arm"],
                        "ckpt": spec["ckpt"],
                        "batch": entry["batch"],
                        "kind": entry["kind"],
                        "fits": False,
                        "error": "process died (out of memory)",
                    }
                )
                break
    return out


def _loss_mode_unavailable(mode: str, device: str) -> str | None:
    """Why ClipLoss ``mode`` cannot be benchmarked on ``device`` (None: it can)."""
    from recipe.loss import LOSS_MODES

    if mode not in LOSS_MODES:
        return f"ClipLoss mode {mode!r} is not in recipe.loss.LOSS_MODES {sorted(LOSS_MODES)}"
    if mode == "fused":
        from optim import _triton

        if not _triton.is_available():
            return f"the fused loss needs Triton ({_triton.unavailable_reason()})"
        if not device.startswith("cuda"):
            return (
                "the fused loss runs compiled Triton kernels on CUDA only "
                "(on CPU only under TRITON_INTERPRET=1, a test mode)"
            )
    return None


def available_arms(loss_modes: list[str], baseline: bool, device: str = "cpu") -> tuple[list[str], dict[str, str]]:
    """Arms to run and, for each requested one that cannot run, why."""
    arms, missing = [], {}
    for mode in loss_modes:
        why = _loss_mode_unavailable(mode, device)
        if why is None:
            arms.append(f"recipe-{mode}")
        else:
            missing[f"recipe-{mode}"] = why
    if baseline:
        try:
            import open_clip  # noqa: F401
        except ImportError:
            arms.append("torch-amp")
            missing["openclip"] = "open_clip is not installed (pip install -e '.[bench]'); baseline is torch-amp"
        else:
            arms.append("openclip")
    return arms, missing


def _baseline_grad_clip(s: BenchSettings) -> float:
    """The OpenCLIP arm's ``clip_grad_norm_`` threshold (0: none): as asked, else the recipe's DeepSpeed
    config's ``gradient_clipping``, so that both arms do the same work (OpenCLIP's ``--grad-clip-norm``)."""
    if s.baseline_grad_clip is not None:
        return float(s.baseline_grad_clip)
    from recipe.precision import read_ds_config

    return float(read_ds_config(s.ds_config).get("gradient_clipping", 0.0) or 0.0)


def _spec(s: BenchSettings, arm: str, ckpt: bool, batches: list[dict[str, Any]], accumulation: int = 1) -> dict:
    return {
        "arm": arm,
        "ckpt": ckpt,
        "accumulation": accumulation,
        "contrastive_batch": s.contrastive_batch,
        "compile": s.compile,
        "preset": s.preset,
        "device": s.device,
        "ds_config": s.ds_config,
        "baseline_grad_clip": _baseline_grad_clip(s),
        "seed": s.seed,
        "threads": s.threads,
        "cpu_budget_mib": s.cpu_budget_mib,
        "batches": batches,
    }


def run_benchmark(s: BenchSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measures every arm x checkpointing setting; returns the JSON-ready result."""
    s = resolve_settings(s)
    arms, missing = available_arms(s.loss_modes, s.baseline, s.device)
    rows: list[dict[str, Any]] = []
    plan = [(arm, a) for arm in arms for a in (s.accumulation if arm.startswith("recipe-") else [1])]
    for ckpt in s.ckpt:
        for arm, accumulation in plan:
            fit = accumulation == 1 and (s.fit == "all" or (s.fit == "off" and not ckpt))
            timed = [{"batch": s.batch, "warmup": s.warmup, "steps": s.steps, "kind": "timed"}]
            ascent = []
            b = s.batch * 2
            while fit and b < s.max_batch:
                ascent.append(b)
                b *= 2
            if fit and s.max_batch > s.batch:
                ascent.append(s.max_batch)
            batches = timed + [{"batch": b, "warmup": 1, "steps": 1, "kind": "probe"} for b in ascent]
            log(
                f"{arm}, checkpointing {'on' if ckpt else 'off'}: batch {s.batch}"
                + (f" in {accumulation} micro-batches" if accumulation > 1 else "")
                + (f", then probing {ascent}" if ascent else "")
            )
            results = run_worker(_spec(s, arm, ckpt, batches, accumulation), s.timeout_s)
            main_result = next((r for r in results if r["kind"] == "timed"), None)
            if main_result is None:
                raise RuntimeError(f"{arm} produced no result")
            row = dict(main_result)
            row["probes"] = {r["batch"]: r["fits"] for r in results}
            if fit:

                def probe(batches: list[int], arm: str = arm, ckpt: bool = ckpt) -> dict[int, bool]:
                    log(f"  probe {arm} ckpt={ckpt}: {batches}")
                    got = run_worker(
                        _spec(s, arm, ckpt, [{"batch": b, "warmup": 1, "steps": 1, "kind": "probe"} for b in batches]),
                        s.timeout_s,
                    )
                    return {r["batch"]: r["fits"] for r in got}

                search = largest_fitting(
                    probe, s.batch, s.max_batch, s.fit_tolerance, s.fit_granularity, known=row["probes"]
                )
                row["largest_batch"], row["first_failing_batch"], row["fit_capped"] = (
                    search["largest"],
                    search["first_failing"],
                    search["capped"],
                )
                row["probes"] = search["probes"]
            rows.append(row)
            log(_row_line(row))
    _add_ratios(rows)
    return {"settings": asdict(s), "environment": environment(s.device), "unavailable": missing, "rows": rows}


def _row_line(r: dict[str, Any]) -> str:
    if not r.get("fits", False) and "samples_per_s" not in r:
        return f"  {r['arm']} ckpt={r['ckpt']}: batch {r['batch']} does not fit ({r.get('error')})"
    fit = f", largest batch {r.get('largest_batch')}" if "largest_batch" in r else ""
    acc = f" accumulation {r['accumulation']}" if r.get("accumulation", 1) > 1 else ""
    acc += f" compiled (warm-up {r['warmup_seconds']:.1f} s)" if "towers compiled" in r.get("description", "") else ""
    return (
        f"  {r['arm']}{acc} ckpt={r['ckpt']}: {r['samples_per_s']:.1f} samples/s, "
        f"peak {r['peak_bytes'] / MIB:.1f} MiB{fit}"
    )


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Speed and memory of each recipe row relative to the baseline row with the same setting."""
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["arm"] in ("openclip", "torch-amp") and b["ckpt"] == r["ckpt"] and "samples_per_s" in b
            ),
            None,
        )
        if base and "samples_per_s" in r:
            r["speedup_vs_baseline"] = r["samples_per_s"] / base["samples_per_s"]
            r["memory_vs_baseline"] = r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] > 0 else None


def markdown_table(result: dict[str, Any]) -> str:
    """The result as a markdown table with a header naming device, versions, date and settings."""
    s, env = result["settings"], result["environment"]
    unit, scale = ("GiB", GIB) if s["device"].startswith("cuda") else ("MiB", MIB)
    mem_name = "peak allocated" if s["device"].startswith("cuda") else "peak RSS growth"
    v = env["versions"]
    lines = [
        f"**{env['device']}**, {env['date']}; torch {v['torch']}, deepspeed {v['deepspeed']}, timm {v['timm']}, "
        f"transformers {v['transformers']}, open_clip {v['open_clip']}. Preset {s['preset']}, batch {s['batch']}, "
        f"{s['steps']} timed steps after {s['warmup']} warm-up steps, one process.",
        "",
        f"| arm | accumulation | grad ckpt | params | samples/s | {mem_name} ({unit}) | largest batch "
        "| vs baseline: speed | vs baseline: memory |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "samples_per_s" not in r:
            ckpt = "on" if r["ckpt"] else "off"
            lines.append(
                f"| {r['arm']} | {r.get('accumulation', 1)} | {ckpt} | {r.get('params', '')} "
                f"| does not fit at {r['batch']} | | | | |"
            )
            continue
        largest = r.get("largest_batch")
        if "largest_batch" not in r:
            fit = "not searched"
        elif largest is None:
            fit = f"< {r['batch']}"
        else:
            fails = r.get("first_failing_batch")
            fit = f"≥ {largest} (cap)" if r.get("fit_capped") else f"{largest} (fails at {fails})"
        speed = f"{r['speedup_vs_baseline']:.2f}×" if r.get("speedup_vs_baseline") else "—"
        mem = f"{r['memory_vs_baseline']:.2f}×" if r.get("memory_vs_baseline") else "—"
        ckpt = "on" if r["ckpt"] else "off"
        lines.append(
            f"| {r['arm']} | {r.get('accumulation', 1)} | {ckpt} | {r['params']:,} | {r['samples_per_s']:.1f} "
            f"| {r['peak_bytes'] / scale:.2f} "
            f"| {fit} | {speed} | {mem} |"
        )
    lines.append("")
    for r in result["rows"]:
        if not r["ckpt"]:
            acc = f" (accumulation {r['accumulation']})" if r.get("accumulation", 1) > 1 else ""
            lines.append(f"- `{r['arm']}`{acc}: {r.get('description', '')}")
    for arm, why in result["unavailable"].items():
        lines.append(f"- `{arm}` not run: {why}")
    if s["device"] == "cpu":
        lines.append(
            f"- CPU: memory is the peak resident-set growth over the process before the model was built; "
            f'"fits" means within --cpu-budget-mib {s["cpu_budget_mib"]:g} MiB.'
        )
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="recipe preset (default ViT-B-32 on CUDA, tiny on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="batch of the timed steps (default 512 on CUDA, 32 on CPU)")
    ap.add_argument("--warmup", type=int, default=BenchSettings.warmup)
    ap.add_argument("--steps", type=int, default=BenchSettings.steps)
    ap.add_argument(
        "--ckpt", choices=("both", "off", "on"), default="both", help="gradient checkpointing settings to run"
    )
    ap.add_argument(
        "--loss-modes", nargs="+", default=["plain", "fused"], help="recipe ClipLoss modes (missing ones are reported)"
    )
    ap.add_argument("--no-baseline", action="store_true", help="skip the OpenCLIP arm")
    ap.add_argument(
        "--accumulation", type=int, nargs="+", default=[1],
        help="recipe arms: run each with the batch split into K micro-batches per optimizer step (e.g. 1 4)",
    )
    ap.add_argument(
        "--contrastive-batch", choices=("global", "micro"), default="global",
        help="recipe arms with accumulation: one loss over the whole step (global) or per micro-batch",
    )
    ap.add_argument("--compile", action="store_true", help="recipe arms: torch.compile the towers (ZeRO 0-2 configs)")
    ap.add_argument(
        "--fit",
        choices=("all", "off", "none"),
        default="all",
        help="largest-batch search: every setting, checkpointing off only, or none",
    )
    ap.add_argument("--max-batch", type=int, default=None)
    ap.add_argument("--fit-tolerance", type=float, default=BenchSettings.fit_tolerance)
    ap.add_argument("--fit-granularity", type=int, default=None)
    ap.add_argument("--cpu-budget-mib", type=float, default=BenchSettings.cpu_budget_mib)
    ap.add_argument("--ds-config", default=DEFAULT_DS_CONFIG)
    ap.add_argument("--baseline-grad-clip", type=float, default=None,
                    help="OpenCLIP arm: clip_grad_norm_ threshold (default: the DeepSpeed config's gradient_clipping, "
                    "so both arms clip; 0: OpenCLIP's default, no clipping)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch threads per worker (default 1 on CPU)")
    ap.add_argument("--worker-timeout", type=float, default=BenchSettings.timeout_s, help="seconds per worker process")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/bench_train_<device>.json)")
    ap.add_argument(
        "--breakdown", action="store_true",
        help="instead: per-phase time of one step, the first recipe arm and the baseline alternating in one "
        "process (--steps rounds; first --ckpt setting and --accumulation; writes bench_train_breakdown_<device>.json)",
    )
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = build_parser().parse_args(argv)
    if args.worker:
        measure_worker(json.loads(args.worker), lambda r: print(RESULT_TAG + json.dumps(r), flush=True))
        return None
    s = BenchSettings(
        device=args.device,
        preset=args.preset,
        batch=args.batch,
        warmup=args.warmup,
        steps=args.steps,
        ckpt={"both": [False, True], "off": [False], "on": [True]}[args.ckpt],
        loss_modes=args.loss_modes,
        accumulation=args.accumulation,
        contrastive_batch=args.contrastive_batch,
        compile=args.compile,
        baseline=not args.no_baseline,
        fit=args.fit,
        max_batch=args.max_batch,
        fit_tolerance=args.fit_tolerance,
        fit_granularity=args.fit_granularity,
        cpu_budget_mib=args.cpu_budget_mib,
        ds_config=args.ds_config,
        baseline_grad_clip=args.baseline_grad_clip,
        seed=args.seed,
        threads=args.threads,
        timeout_s=args.worker_timeout,
    )
    kind = "cuda" if s.device.startswith("cuda") else "cpu"

    def log(m: str) -> None:
        print(m, file=sys.stderr, flush=True)

    try:
        if args.breakdown:
            result = run_breakdown(s, log=log)
            write_result(args.json or RESULTS / f"bench_train_breakdown_{kind}.json", result, breakdown_table(result))
            return result
        result = run_benchmark(s, log=log)
    except ValueError as err:
        raise SystemExit(str(err)) from err
    write_result(args.json or RESULTS / f"bench_train_{kind}.json", result, markdown_table(result))
    return result


if __name__ == "__main__":
    main()
