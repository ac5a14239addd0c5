"""Train a CLIP model under DeepSpeed with SRAdamW and the sharded contrastive loss.

Example (2 CPU ranks; `bash launch.sh` wraps this)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank -m recipe.train \\
        --deepspeed_config ds_configs/zero2_bf16_halfmaster.json --train-data data/synthetic/train.csv \\
        --val-data data/synthetic/val.csv --steps 300 --output-dir runs/demo

The loop reads top to bottom: set up (run directory, tokenizer, model, engine, loader), then per
optimizer step the learning rate, :func:`recipe.step.train_step` (forward, backward, step, and the
skip/stop decision), logging, evaluation and checkpoints, each a named helper below.
"""

from __future__ import annotations

import json
import math
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from . import checkpoint
from .config import TrainConfig, parse_args
from .data import build_eval_loader, build_train_loader, read_captions
from .distributed import barrier, mean_over_ranks, rank_world
from .engine import build_engine, eval_module, init_distributed
from .evaluate import evaluate, load_prompts
from .loss import ClipLoss
from .memory import live_bytes_per_param
from .metrics import MetricsLogger, peak_memory_bytes
from .model import create_model
from .optimizer import lr_at
from .precision import Precision, resolve_precision
from .step import StepResult, TrainState, train_step
from .tokenizer import load_tokenizer, train_tokenizer

__all__ = ["train", "main"]


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs training (every rank calls it) and returns the final metrics."""
    init_distributed()
    rank, world = rank_world()
    prec, ds_config = resolve_precision(json.loads(Path(cfg.deepspeed_config).read_text()))
    run_dir = prepare_run_dir(cfg, ds_config)
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    tokenizer = get_tokenizer(cfg, run_dir)
    model = build_model(cfg, tokenizer, run_dir)
    engine, opt, group_params = build_engine(model, cfg, prec, ds_config)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    loader = build_train_loader(cfg.data, tokenizer, model.image_data_config(), micro, rank, world, cfg.seed)
    total = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * len(loader) / accum))
    state = restore(engine, run_dir, cfg.resume, loader, prec) if cfg.resume else TrainState()
    loss_fn = ClipLoss(mode=cfg.loss_mode, chunk_size=cfg.chunk_size, validate=False)
    log = MetricsLogger(run_dir, total, rank == 0, state.step)
    log.write(
        f"{prec.label}, {world} ranks x micro-batch {micro} x accumulation {accum}, {total} steps, run dir {run_dir}"
    )
    batches, t0, start_samples = _forever(loader), time.perf_counter(), state.samples
    result: StepResult | None = None
    while state.step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, cfg, total)
        micro_batches = [next(batches) for _ in range(accum)]
        result = train_step(engine, opt, loss_fn, prec, micro_batches, state, cfg.max_nonfinite_in_row)
        log.advance()
        samples_per_s = (state.samples - start_samples) / max(time.perf_counter() - t0, 1e-9)
        if state.step % cfg.log_every == 0 or state.step == total:
            log.log(state.step, train_metrics(engine, opt, result, state, prec, loader, samples_per_s))
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < total:
            log.log(state.step, run_eval(engine, cfg, tokenizer), kind="eval")
        if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == total:
            save(engine, run_dir, state, loader, prec)
    final = {
        "steps": state.step,
        "samples_per_s": (state.samples - start_samples) / max(time.perf_counter() - t0, 1e-9),
    }
    final["final_loss"] = mean_over_ranks(result.loss) if result is not None else float("nan")
    final.update(run_eval(engine, cfg, tokenizer))
    final.update(
        skipped_samples=loader.global_stats(),
        nonfinite_steps=state.nonfinite_steps,
        overflow_steps=state.overflow_steps,
        precision=prec.label,
        world_size=world,
    )
    final["memory"] = {**live_bytes_per_param(engine.module, opt, engine.optimizer), "group_params": group_params}
    log.log(state.step, final, kind="final")
    log.close()
    loader.close()
    return final


# --------------------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------------------


def _git_revision() -> str:
    root = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "HEAD") + (" (dirty)" if git("status", "--porcelain") else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def prepare_run_dir(cfg: TrainConfig, ds_config: dict[str, Any]) -> Path:
    """Creates the run directory with the resolved config, the DeepSpeed JSON and the git revision."""
    run_dir = Path(cfg.output_dir)
    if rank_world()[0] == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_bytes(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2).encode())
        checkpoint.atomic_write_bytes(run_dir / "ds_config.json", json.dumps(ds_config, indent=2).encode())
        checkpoint.atomic_write_bytes(run_dir / "git_revision.txt", (_git_revision() + "\n").encode())
    barrier()
    return run_dir


def get_tokenizer(cfg: TrainConfig, run_dir: Path) -> Any:
    """The run's tokenizer: kept from an earlier start, loaded from a local directory, or a BPE
    trained on the training captions (rank 0), saved in ``<run>/tokenizer``."""
    saved = run_dir / "tokenizer"
    d = cfg.data
    if rank_world()[0] == 0 and not saved.exists():
        if d.tokenizer:
            tok = load_tokenizer(d.tokenizer, context_length=d.context_length)
        else:
            tok = train_tokenizer(read_captions(d), d.vocab_size, context_length=d.context_length or 32)
        tok.save(saved)
    barrier()
    return load_tokenizer(saved, context_length=d.context_length)


def build_model(cfg: TrainConfig, tokenizer: Any, run_dir: Path) -> torch.nn.Module:
    """The CLIP model of ``cfg`` (same initialisation on every rank); rank 0 saves its config."""
    m = cfg.model
    model = create_model(
        m.preset,
        image_encoder=m.image_encoder,
        text_encoder=m.text_encoder,
        embed_dim=m.embed_dim,
        image_weights=m.image_weights,
        tokenizer=tokenizer,
    )
    if rank_world()[0] == 0:
        checkpoint.atomic_write_bytes(
            run_dir / "model_config.json", json.dumps(model.config.to_dict(), indent=2).encode()
        )
    model.set_grad_checkpointing(m.grad_checkpointing)
    return model


# --------------------------------------------------------------------------------------------------
# checkpoints, evaluation, logging
# --------------------------------------------------------------------------------------------------


def save(engine: Any, run_dir: Path, state: TrainState, loader: Any, prec: Precision) -> None:
    client = {"state": state.__dict__.copy(), "data": loader.state_dict(), "rng": checkpoint.rng_state()}
    if prec.loss_scaler is not None:
        client["loss_scaler"] = prec.loss_scaler.state_dict()
    checkpoint.save(engine, run_dir / "checkpoints", state.step, client)


def restore(engine: Any, run_dir: Path, resume: str, loader: Any, prec: Precision) -> TrainState:
    tag_dir = checkpoint.resolve(resume, run_dir / "checkpoints")
    client = checkpoint.load(engine, tag_dir)
    loader.load_state_dict(client["data"])
    checkpoint.set_rng_state(client["rng"])
    if prec.loss_scaler is not None:
        prec.loss_scaler.load_state_dict(client["loss_scaler"])
    return TrainState(**client["state"])


def run_eval(engine: Any, cfg: TrainConfig, tokenizer: Any) -> dict[str, float]:
    """Zero-shot and retrieval metrics on the validation data (every rank embeds its share)."""
    if not cfg.data.val_data:
        return {}
    rank, world = rank_world()
    model = eval_module(engine, tokenizer)
    loader = build_eval_loader(cfg.data, tokenizer, model.image_data_config(), cfg.eval_batch_size, rank, world)
    return evaluate(model, loader, tokenizer, load_prompts(cfg.data))


def train_metrics(
    engine: Any, opt: Any, result: StepResult, state: TrainState, prec: Precision, loader: Any, samples_per_s: float
) -> dict[str, Any]:
    """The logged training metrics (collectives and host reads: log steps only)."""
    gn = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    return {
        "loss": mean_over_ranks(result.loss),
        **{k: mean_over_ranks(v) for k, v in result.metrics.items()},
        "lr": opt.param_groups[0]["lr"],
        "logit_scale": float(engine.module.logit_scale.detach().float().exp()),
        "samples_per_s": samples_per_s,
        "grad_norm": float(gn) if gn is not None else float("nan"),
        "loss_scale": prec.loss_scaler.scale if prec.loss_scaler else 1.0,
        "peak_memory_bytes": peak_memory_bytes(),
        "skipped_samples": sum(v for k, v in loader.global_stats().items() if k != "repeated"),
        "nonfinite_steps": state.nonfinite_steps,
        "overflow_steps": state.overflow_steps,
    }


def _forever(loader: Any) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    final = train(cfg)
    if rank_world()[0] == 0:
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in final.items()}), flush=True)


if __name__ == "__main__":
    main()
