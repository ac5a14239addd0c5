"""``python -m recipe.verify``: the command line (one typed config, as ``recipe.plan``), the run it
describes, the checks on every rank, and the one-screen report of rank 0.

Exit codes: 0 when no check failed on any rank (warnings pass), 1 when one did, 2 for bad input
(unknown preset or encoder, unreadable or inconsistent DeepSpeed JSON, a world size other than
``--world-size``, batch sizes that do not divide); every rank returns the same code.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from recipe.config import (
    OneLineParser,
    CONTRASTIVE_BATCH_NAMES,
    LOSS_MODE_NAMES,
    LOSS_NAMES,
    add_field_flags,
    check_field_bounds,
    check_model_names,
    ModelChoice,
    option,
)

from .common import CHECKS, Row, Run, worst

__all__ = ["VerifyConfig", "build_parser", "main", "render", "resolve"]

REPO = Path(__file__).resolve().parents[2]


class VerifyError(ValueError):
    """Bad input (the message names what is wrong)."""


@dataclass
class VerifyConfig(ModelChoice):
    """The run to check (as recipe.train and recipe.plan take it) and how to check it."""

    vocab_size: int | None = option(None, "vocabulary of a tokenizer the run trains (unset: the text tower's own)",
                                    ge=1)
    context_length: int | None = option(None, "token context length (default: the text tower's)", ge=1)
    image_master_weights: bool = option(True, "the image tower keeps an fp32 master (as recipe.train)")
    text_master_weights: bool = option(False, "the text tower keeps an fp32 master (as recipe.train)")
    ds_config: str = option("ds_configs/zero0_bf16_sr.json",
                            "the run's DeepSpeed JSON: precision route, ZeRO stage, batch sizes")
    micro_batch: int | None = option(None, "pairs per GPU per forward (default: the JSON's)", ge=1)
    global_batch: int | None = option(
        None, "pairs per optimizer step, all ranks (default: the JSON's; sets the accumulation)", ge=1)
    world_size: int | None = option(
        None, "the ranks the run is planned for; a launch with another number is an error (default: any)", ge=1)
    grad_checkpointing: bool = option(False, "gradient checkpointing in both towers (as recipe.train)")
    loss: str = option("clip", "contrastive loss: clip or siglip (as recipe.train)")
    loss_mode: str = option("plain", "the run's loss mode, for the memory prediction (every mode is checked)")
    contrastive_batch: str = option("global", "pairs one loss contrasts: global or micro (as recipe.train)")
    chunk_size: int = option(4096, "tile edge of the chunked loss (as recipe.train)", ge=1)
    gpu_memory: str | None = option(
        None, "memory per rank to plan against instead of the measured free memory: 80GiB, 80GB, 81920MiB...")
    headroom: float = option(0.1, "share of free memory the prediction may not use without a warning "
                                  "(the planner's headroom)", ge=0, lt=1)
    loss_rows: int | None = option(None, "pairs per rank in the loss check (default: 256 on GPUs, 32 on CPUs, "
                                         "at most 8192 over all ranks)", ge=1)
    comm_sizes: str | None = option(None, "per-rank MiB of the collectives, comma-separated "
                                          "(default: 1,4,16,64 on GPUs, 0.25,1,4 on CPUs)")
    comm_iters: int = option(5, "timed repetitions of each collective", ge=1)
    min_busbw: float | None = option(None, "bus bandwidth (GB/s) at the largest size below which the "
                                           "communication check warns (default: 5 on GPUs, 0.05 on CPUs)", ge=0)
    timeout: float = option(60.0, "seconds one collective of the communication check may take", gt=0)
    skip: str = option("", f"checks to skip, comma-separated: {', '.join(CHECKS)}")
    json: bool = option(False, "print the results as JSON instead of the table")

    def validate(self) -> None:
        try:
            check_field_bounds(self)
        except ValueError as e:
            raise VerifyError(str(e)) from e
        for name, value, allowed in (("loss", self.loss, LOSS_NAMES), ("loss_mode", self.loss_mode, LOSS_MODE_NAMES),
                                     ("contrastive_batch", self.contrastive_batch, CONTRASTIVE_BATCH_NAMES)):
            if value not in allowed:
                raise VerifyError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")
        if self.loss == "siglip" and self.loss_mode == "fused":
            raise VerifyError("loss_mode fused is the clip loss's kernel; --loss siglip runs plain or chunked")
        unknown = sorted(set(self.skipped()) - set(CHECKS))
        if unknown:
            raise VerifyError(f"skip: unknown check(s) {', '.join(unknown)}; choose from {', '.join(CHECKS)}")
        self.sizes_mib()

    def skipped(self) -> list[str]:
        return [s.strip() for s in self.skip.split(",") if s.strip()]

    def sizes_mib(self) -> tuple[float, ...] | None:
        if not self.comm_sizes:
            return None
        try:
            sizes = tuple(float(s) for s in self.comm_sizes.split(",") if s.strip())
        except ValueError:
            sizes = ()
        if not sizes or min(sizes) <= 0:
            raise VerifyError(f"comm_sizes must be positive MiB values separated by commas, got {self.comm_sizes!r}")
        return sizes


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of :class:`VerifyConfig`, with its help text and default."""
    ap = OneLineParser(  # a mistyped flag is one line from rank 0, not the usage text from every rank
        prog="python -m recipe.verify",
        description="Preflight of a run on its cluster: sharded losses against a float64 reference, the "
                    "optimizer's default implementation against its definition, all-gather/reduce-scatter "
                    "bandwidth, free memory against the planner's prediction (docs/planning.md, 'Preflight'). "
                    "Launch it like the run: bash launch.sh verify [flags].",
        allow_abbrev=False,
    )
    add_field_flags(ap, VerifyConfig)
    return ap


# ---------------------------------------------------------------------------------------------
# the run the flags describe
# ---------------------------------------------------------------------------------------------


def _env_int(*keys: str, default: int) -> int:
    for key in keys:
        value = os.environ.get(key, "")
        if value.isdigit():
            return int(value)
    return default


def resolve(cfg: VerifyConfig) -> dict[str, Any]:
    """The run's settings from the flags and the DeepSpeed JSON, checked before anything starts.

    Raises:
        VerifyError, PlanError, ConfigError (all ``ValueError``), FileNotFoundError: bad input, named.
    """
    from recipe.plan import ModelSpec
    from recipe.plan.states import build_meta_model
    from recipe.training.precision import read_ds_config, resolve_precision

    world = _env_int("WORLD_SIZE", default=1)
    if cfg.world_size is not None and cfg.world_size != world:
        raise VerifyError(f"launched with {world} rank(s) but --world-size is {cfg.world_size} "
                          "(NUM_GPUS, the hostfile's slots, or --world-size is wrong)")
    spec = ModelSpec(cfg.preset, cfg.image_encoder, cfg.text_encoder, cfg.embed_dim, cfg.image_size,
                     cfg.vocab_size, cfg.context_length, cfg.image_master_weights, cfg.text_master_weights)
    check_model_names(spec.preset, spec.image_encoder, spec.text_encoder)
    path = Path(cfg.ds_config)
    if not path.is_file() and not path.is_absolute() and (REPO / path).is_file():
        path = REPO / path  # the repository's ds_configs/ from any working directory
    ds = read_ds_config(path, world_size=world)
    prec, _ = resolve_precision(ds)
    micro_json, accum_json, total = (ds.get(k) for k in ("train_micro_batch_size_per_gpu",
                                                          "gradient_accumulation_steps", "train_batch_size"))
    micro = cfg.micro_batch or micro_json or total // (world * (accum_json or 1))
    global_batch = cfg.global_batch or total
    if global_batch is not None:
        if global_batch % (micro * world):
            raise VerifyError(f"global batch {global_batch} is not divisible by micro-batch {micro} x {world} rank(s)")
        accumulation = global_batch // (micro * world)
    else:
        accumulation = accum_json or 1
    try:
        embed_dim = cfg.embed_dim or int(build_meta_model(spec).embed_dim)
    except (ValueError, RuntimeError, OSError, KeyError) as e:
        raise VerifyError(f"cannot build the model {spec.label()!r}: {e}") from e
    return dict(spec=spec, ds_config=str(path), ds_json=ds, precision=prec, world=world, micro_batch=micro,
                accumulation=accumulation, embed_dim=embed_dim, loss=cfg.loss, loss_mode=cfg.loss_mode,
                contrastive_batch=cfg.contrastive_batch, chunk_size=cfg.chunk_size,
                grad_checkpointing=cfg.grad_checkpointing)


# ---------------------------------------------------------------------------------------------
# the checks on every rank
# ---------------------------------------------------------------------------------------------


def _guarded(check: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """The check's rows, or one failed row naming the exception (the traceback goes to stderr)."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a preflight reports every failure as a result
        if os.environ.get("RECIPE_TRACEBACK") == "1":
            traceback.print_exc()
        first = (str(e).strip().splitlines() or [""])[0][:200]
        return [Row(check, "error", "fail", f"{type(e).__name__}: {first}")]


def run_checks(run: Run, cfg: VerifyConfig) -> tuple[list[Row], dict[str, float], bool]:
    """``(rows, seconds per check, communication broken)`` of this rank."""
    import torch

    from recipe.plan import parse_memory

    from .check_comm import DEFAULT_MIN_BUSBW, DEFAULT_SIZES_MIB, check_comm
    from .check_loss import DEFAULT_ROWS, check_loss
    from .check_memory import check_memory, free_bytes
    from .check_optim import check_optim

    dev = run.device.type if run.device.type in ("cuda", "cpu") else "cpu"
    skipped = set(cfg.skipped())
    override = parse_memory(cfg.gpu_memory) if cfg.gpu_memory else None
    free = free_bytes(run.device, run.local_world)  # first: before the checks below allocate
    rows_per_rank = cfg.loss_rows or max(1, min(DEFAULT_ROWS[dev], 8192 // run.world))
    checks: dict[str, Callable[[], list[Row]]] = {
        "memory": lambda: check_memory(run, free, cfg.headroom, override),
        "comm": lambda: check_comm(run, cfg.sizes_mib() or DEFAULT_SIZES_MIB[dev], cfg.comm_iters, cfg.timeout,
                                   DEFAULT_MIN_BUSBW[dev] if cfg.min_busbw is None else cfg.min_busbw),
        "loss": lambda: check_loss(run, rows_per_rank),
        "optimizer": lambda: check_optim(run),
    }
    rows, seconds, broken = [], {}, False
    for name in CHECKS:
        if name in skipped:
            rows.append(Row(name, "-", "skip", "skipped (--skip)"))
            continue
        if broken and name in ("loss", "optimizer"):  # both use collectives
            rows.append(Row(name, "-", "skip", "not run: the communication check failed"))
            continue
        start = time.perf_counter()
        out = _guarded(name, checks[name])
        if run.device.type == "cuda":
            torch.cuda.empty_cache()  # the next check's allocations start from a clean pool
        seconds[name] = time.perf_counter() - start
        broken = broken or (name == "comm" and any(r.item == "error" for r in out))
        rows.extend(out)
    return rows, seconds, broken


def merge(per_rank: list[list[Row]]) -> list[Row]:
    """One row per (check, item): the worst rank's (rank 0's when all agree), with that rank named
    when the ranks' statuses differ."""
    order: list[tuple[str, str]] = []
    by_key: dict[tuple[str, str], list[tuple[int, Row]]] = {}
    for rank, rows in enumerate(per_rank):
        for row in rows:
            key = (row.check, row.item)
            if key not in by_key:
                order.append(key)
                by_key[key] = []
            by_key[key].append((rank, row))
    out = []
    for key in order:
        ranked = by_key[key]
        rank, row = max(ranked, key=lambda rr: (STATUS_RANK[rr[1].status], -rr[0]))
        if len({r.status for _, r in ranked}) > 1 or len(ranked) < len(per_rank):
            row = dataclasses.replace(row, rank=rank)
        out.append(row)
    return out


STATUS_RANK = {"pass": 0, "skip": 1, "warn": 2, "fail": 3}


# ---------------------------------------------------------------------------------------------
# the report
# ---------------------------------------------------------------------------------------------


def describe(run: Run) -> str:
    p = run.precision
    route = {"bf16": "bf16 halfmaster" if p.half_master_partitions else "bf16", "fp16": "fp16 SR", "fp32": "fp32"}
    return (f"{run.world} rank(s) ({run.backend}, {run.device.type}), {run.spec.label()} (D={run.embed_dim}), "
            f"{_relative(run.ds_config)} (ZeRO-{p.zero_stage}, {route[p.mode]}), micro-batch {run.micro_batch} "
            f"x accumulation {run.accumulation}, loss {run.loss} {run.loss_mode}")


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(REPO))
    except ValueError:
        return path


def render(run: Run, rows: list[Row], seconds: dict[str, float], total: float) -> str:
    """One screen: the run, one line per checked item, the verdict."""
    verdict = worst([r.status for r in rows])
    width = max(len(r.item) for r in rows)
    lines = [f"recipe.verify: {describe(run)}", ""]
    for r in rows:
        where = f" [rank {r.rank}]" if r.rank is not None else ""
        lines.append(f"{r.check:<9} {r.item:<{width}}  {r.status.upper():<4}  {r.detail}{where}")
    counts = {s: sum(r.status == s for r in rows) for s in ("pass", "warn", "fail", "skip")}
    times = ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items())
    summary = (f"{'FAIL' if verdict == 'fail' else 'OK'}: {counts['pass']} passed, {counts['warn']} warning(s), "
               f"{counts['fail']} failed, {counts['skip']} skipped in {total:.1f} s ({times}; slowest rank)")
    lines += ["", summary]
    return "\n".join(lines)


def _fail(rank: int, error: BaseException, code: int) -> int:
    """One line naming the error from rank 0 (``RECIPE_TRACEBACK=1`` raises instead)."""
    if os.environ.get("RECIPE_TRACEBACK") == "1":
        raise error
    if rank == 0:
        print(f"error: {error}", file=sys.stderr, flush=True)
    else:
        # the launcher ends every rank once one exits with an error: give rank 0 time to print first
        time.sleep(3)
    return code


def _process_seconds(fallback_start: float) -> float:
    """Seconds since this process started (Linux: /proc), else since ``fallback_start`` (perf_counter)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - fallback_start


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    from recipe.quiet import quiet_libraries

    quiet_libraries()
    rank = _env_int("RANK", default=0)
    from recipe.plan import PlanError
    from recipe.training.precision import ConfigError

    try:
        cfg = VerifyConfig(**vars(build_parser().parse_args(argv)))
        cfg.validate()
        settings = resolve(cfg)
    except (VerifyError, PlanError, ConfigError, FileNotFoundError, ValueError) as e:
        return _fail(rank, e, 2)

    import torch
    import torch.distributed as dist

    from recipe.training.engine import init_distributed

    from .common import local_world

    if torch.cuda.is_available():
        device = torch.device("cuda", _env_int("LOCAL_RANK", default=0))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    init_distributed()
    run = Run(rank=dist.get_rank(), local_world=local_world(), device=device, **settings)
    rows, seconds, broken = run_checks(run, cfg)
    elapsed = _process_seconds(started)  # imports and start-up included: what the user waits for
    if broken:  # no collective can be trusted to agree on the verdict: each rank reports its own
        if run.rank == 0:
            print(render(run, rows, seconds, elapsed), flush=True)
        else:
            print(f"rank {run.rank}: the communication check failed", file=sys.stderr, flush=True)
        return 1
    gathered: list[Any] = [None] * run.world
    # every rank's rows, times and elapsed seconds on every rank: they all return the same code
    dist.all_gather_object(gathered, (rows, seconds, elapsed))
    merged = merge([g[0] for g in gathered])
    slowest = {k: max(g[1].get(k, 0.0) for g in gathered) for k in seconds}
    total = max(g[2] for g in gathered)
    verdict = worst([r.status for r in merged])
    if run.rank == 0:
        if cfg.json:
            print(json.dumps({"verdict": verdict, "seconds": total, "check_seconds": slowest, "run": describe(run),
                              "rows": [r.to_dict() for r in merged]}, indent=2), flush=True)
        else:
            print(render(run, merged, slowest, total), flush=True)
    dist.destroy_process_group()
    return 1 if verdict == "fail" else 0
