"""What ``bench_train`` measures: the settings, their device-dependent defaults and checks, the arms
that can run, and the spec a worker process receives."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from _common import ROOT  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)

__all__ = ["DEFAULT_DS_CONFIG", "BenchSettings", "resolve_settings", "available_arms", "worker_spec"]

DEFAULT_DS_CONFIG = str(ROOT / "ds_configs" / "zero0_bf16_sr.json")  # the default route (launch.sh, recipe.plan)


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
    compile: bool = False  # recipe arms: torch.compile of the towers (recipe.training.engine.compile_towers)
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
    from recipe.training.precision import read_ds_config

    return float(read_ds_config(s.ds_config).get("gradient_clipping", 0.0) or 0.0)


def worker_spec(s: BenchSettings, arm: str, ckpt: bool, batches: list[dict[str, Any]], accumulation: int = 1) -> dict:
    """What a worker process (:func:`train_bench.worker.measure_worker`) measures: one arm, one setting."""
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

