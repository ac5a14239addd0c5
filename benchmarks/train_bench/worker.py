"""One arm measured in its own process (clean peak memory; an out-of-memory error never poisons a later
measurement): :func:`measure_worker` runs in the worker, :func:`run_worker` starts it from the parent."""

from __future__ import annotations

import gc
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

from _common import (  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)
    MIB,
    ROOT,
    CpuPeakRss,
    input_checksum,
    make_inputs,
)

from .openclip_arm import OpenClipRunner
from .recipe_arm import RecipeRunner
from .runner import Runner

__all__ = ["RESULT_TAG", "build_runner", "measure_worker", "run_worker", "sync", "worker_env"]

RESULT_TAG = "BENCH_TRAIN_RESULT "
#: The worker's entry point: ``bench_train.py --worker SPEC`` runs :func:`measure_worker`.
SCRIPT = Path(__file__).resolve().parents[1] / "bench_train.py"


class _Meter:
    """Peak memory of a region, CUDA or CPU, in bytes (see ``bench_train.py``'s docstring)."""

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


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _is_oom(err: BaseException) -> bool:
    return isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()


def _preload(arm: str) -> None:
    """Imports what the arm needs, so that the memory baseline already holds the libraries' code."""
    import recipe.model.clip  # noqa: F401

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
            sync(device)
            out["warmup_seconds"] = time.perf_counter() - t0  # with --compile: the compilation
            gc.collect()
            meter.reset()
            sync(device)
            t0 = time.perf_counter()
            losses += [runner.step(inputs) for _ in range(steps)]
            sync(device)
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


def worker_env(device: str) -> dict[str, str]:
    """A worker process's environment (``--breakdown`` sets the same in its own process)."""
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
    cmd = [sys.executable, str(SCRIPT), "--worker", json.dumps(spec)]
    proc = subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout_s, env=worker_env(spec["device"]), cwd=str(ROOT)
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
