"""Train a CLIP model under DeepSpeed with SRAdamW and the sharded contrastive loss.

Example (2 CPU ranks; `bash launch.sh` wraps this)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank -m recipe.train \\
        --deepspeed_config ds_configs/zero2_bf16_halfmaster.json --train-data data/synthetic/train.csv \\
        --val-data data/synthetic/val.csv --steps 300 --output-dir runs/demo
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.distributed as dist

from optim import SRAdamW

from . import checkpoint
from .config import TrainConfig, parse_args
from .data import DataConfig, build_eval_loader, build_train_loader, read_captions
from .evaluate import eval_data_config, evaluate, load_prompts
from .loss import ClipLoss
from .memory import live_bytes_per_param
from .metrics import MetricsLogger, peak_memory_bytes
from .model import create_model
from .param_groups import param_groups
from .precision import Precision, allreduce_gradients, resolve_precision
from .tokenizer import load_tokenizer, train_tokenizer

__all__ = ["train", "main", "lr_at"]


@dataclass
class TrainState:
    """Counters that travel in the checkpoint."""

    step: int = 0
    samples: int = 0
    nonfinite_steps: int = 0  # skipped: non-finite loss (or non-finite gradients outside fp16)
    nonfinite_in_row: int = 0
    overflow_steps: int = 0  # fp16: skipped by dynamic loss scaling


def lr_at(step: int, cfg: TrainConfig, total_steps: int) -> float:
    """Linear warmup to ``lr`` over ``warmup_steps``, then cosine decay to ``min_lr`` (or constant)."""
    o = cfg.optim
    if step < o.warmup_steps:
        return o.lr * (step + 1) / o.warmup_steps
    if o.schedule == "constant":
        return o.lr
    progress = (step - o.warmup_steps) / max(1, total_steps - o.warmup_steps)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def _rank_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def _git_revision() -> str:
    root = Path(__file__).resolve().parents[1]
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout.strip()
        return rev + (" (dirty)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"


def prepare_run_dir(cfg: TrainConfig, ds_config: dict[str, Any]) -> Path:
    """Creates the run directory with the resolved config, the DeepSpeed JSON and the git revision."""
    run_dir = Path(cfg.output_dir)
    if _rank_world()[0] == 0:
        run_dir.mkdir(parents=True, exist_ok=True)
        checkpoint.atomic_write_bytes(run_dir / "config.json", json.dumps(cfg.to_dict(), indent=2).encode())
        checkpoint.atomic_write_bytes(run_dir / "ds_config.json", json.dumps(ds_config, indent=2).encode())
        checkpoint.atomic_write_bytes(run_dir / "git_revision.txt", (_git_revision() + "\n").encode())
    if dist.is_initialized():
        dist.barrier()
    return run_dir


def train_data_config(cfg: TrainConfig) -> DataConfig:
    d = cfg.data
    return DataConfig(path=d.train_data, format=d.data_format, image_column=d.image_column, caption_column=d.caption_column, num_workers=d.workers)


def get_tokenizer(cfg: TrainConfig, run_dir: Path) -> Any:
    """The run's tokenizer: kept from an earlier start, loaded from a local directory, or a BPE
    trained on the training captions (rank 0), saved in ``<run>/tokenizer``."""
    saved = run_dir / "tokenizer"
    rank, _ = _rank_world()
    if rank == 0 and not saved.exists():
        if cfg.data.tokenizer:
            tok = load_tokenizer(cfg.data.tokenizer, context_length=cfg.data.context_length)
        else:
            tok = train_tokenizer(read_captions(train_data_config(cfg)), cfg.data.vocab_size, context_length=cfg.data.context_length or 32)
        tok.save(saved)
    if dist.is_initialized():
        dist.barrier()
    return load_tokenizer(saved, context_length=cfg.data.context_length)


def build_optimizer(model: torch.nn.Module, cfg: TrainConfig, prec: Precision) -> SRAdamW:
    """SRAdamW over the CLIP paper's parameter groups; the logit scale is clamped in the optimizer
    (under ZeRO the optimizer owns the parameter's partition, so clamping the module would be lost)."""
    groups = param_groups(
        model,
        cfg.optim.weight_decay,
        text_master_weights=cfg.model.text_master_weights,
        image_master_weights=cfg.model.image_master_weights,
        text_state_dtype=torch.float32 if cfg.model.text_master_weights else prec.sr_state_dtype,
        image_state_dtype=torch.float32 if cfg.model.image_master_weights else prec.sr_state_dtype,
    )
    for g in groups:
        if g["name"] == "logit_scale":
            g["clamp"] = (0.0, model.max_log_logit_scale)
            g["state_dtype"] = torch.float32
    o = cfg.optim
    return SRAdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, seed=o.sr_seed)


@contextlib.contextmanager
def step_kwargs(opt: SRAdamW, **kwargs: Any) -> Iterator[None]:
    """Makes DeepSpeed's argument-less ``optimizer.step()`` pass ``kwargs`` (found_inf, inverse scale)."""
    opt.step = functools.partial(type(opt).step, opt, **kwargs)
    try:
        yield
    finally:
        del opt.step


def grad_multiplier(model: torch.nn.Module, prec: Precision) -> float:
    """fp16 route: inverse loss scale times the clipping factor of the unscaled global norm."""
    inv = 1.0 / prec.loss_scaler.scale
    if prec.recipe_clip <= 0:
        return inv
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    # one host sync for the whole model, not one per tensor
    sq = torch.stack([(g.float() * inv).pow(2).sum().double() for g in grads]).sum() if grads else torch.zeros(())
    norm = math.sqrt(float(sq))
    return inv if not math.isfinite(norm) else inv * min(1.0, prec.recipe_clip / (norm + 1e-6))


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
    if not cfg.data.val_data:
        return {}
    import deepspeed

    rank, world = _rank_world()
    model = engine.module
    loader = build_eval_loader(eval_data_config(cfg, cfg.data.val_data), tokenizer, model.image_data_config(), cfg.eval_batch_size, rank, world)
    if engine.zero_optimization_stage() == 3:
        # ZeRO-3 partitions the weights and its hooks re-partition them after every module call,
        # while e.g. transformers reads a weight's shape outside the module that owns it: evaluate a
        # gathered copy instead (the full model on every rank, for the duration of the evaluation)
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        dtype, device = weights["logit_scale"].dtype, weights["logit_scale"].device
        model = create_model(config=model.config, tokenizer=tokenizer, text_load_weights=False).to(device=device, dtype=dtype)
        model.load_state_dict(weights)
    return evaluate(model, loader, tokenizer, load_prompts(cfg, cfg.data.val_data))


def _mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().float().clone()
    if dist.is_initialized():
        dist.all_reduce(x)
        x /= dist.get_world_size()
    return float(x)


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Runs training (every rank calls it) and returns the final metrics."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    rank, world = _rank_world()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if torch.cuda.is_available() else torch.device("cpu")
    prec, ds_config = resolve_precision(json.loads(Path(cfg.deepspeed_config).read_text()))
    run_dir = prepare_run_dir(cfg, ds_config)
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    tokenizer = get_tokenizer(cfg, run_dir)
    m = cfg.model
    model = create_model(m.preset, image_encoder=m.image_encoder, text_encoder=m.text_encoder, embed_dim=m.embed_dim, image_weights=m.image_weights, tokenizer=tokenizer)
    if rank == 0:
        checkpoint.atomic_write_bytes(run_dir / "model_config.json", json.dumps(model.config.to_dict(), indent=2).encode())
    model.set_grad_checkpointing(m.grad_checkpointing)
    if prec.mode == "fp16":
        model.half()
    opt = build_optimizer(model, cfg, prec)
    group_params = {g["name"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if prec.mode == "fp16":
        engine.enable_backward_allreduce = False  # done by allreduce_gradients (see recipe.precision)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    loader = build_train_loader(train_data_config(cfg), tokenizer, model.image_data_config(), micro, rank, world, cfg.seed)
    total = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * len(loader) / accum))
    state = restore(engine, run_dir, cfg.resume, loader, prec) if cfg.resume else TrainState()
    loss_fn = ClipLoss(mode=cfg.loss_mode, chunk_size=cfg.chunk_size, validate=False)
    log = MetricsLogger(run_dir, total, rank == 0, state.step)
    log.write(f"{prec.label}, {world} ranks x micro-batch {micro} x accumulation {accum}, {total} steps, run dir {run_dir}")
    batches, t0, start_step = _forever(loader), time.perf_counter(), state.step
    while state.step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, cfg, total)
        losses, skipped_before = [], opt.skipped_steps
        for _ in range(accum):
            batch = next(batches)
            img, txt, scale = engine(batch["pixel_values"].to(device, prec.param_dtype), batch["input_ids"].to(device), batch["attention_mask"].to(device))
            loss = loss_fn(img, txt, scale)
            losses.append(loss.detach())
            engine.backward(loss * prec.loss_scaler.scale if prec.loss_scaler else loss)
        found_inf = torch.tensor(float(not all(torch.isfinite(x) for x in losses)))
        if dist.is_initialized():
            dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
        kw: dict[str, Any] = {"found_inf": found_inf}
        if prec.loss_scaler is not None:
            allreduce_gradients(list(engine.module.parameters()))
            kw["inv_grad_scale"] = grad_multiplier(engine.module, prec)
        with step_kwargs(opt, **kw):
            engine.step()
        # skipped by SRAdamW (non-finite input) or by DeepSpeed's ZeRO overflow check before it
        skipped = bool(found_inf) or opt.skipped_steps > skipped_before or bool(getattr(engine.optimizer, "overflow", False))
        record_skip(state, prec, skipped, bool(found_inf), cfg.max_nonfinite_in_row)
        state.step += 1
        state.samples += micro * accum * world
        log.advance()
        if state.step % cfg.log_every == 0 or state.step == total:
            log.log(state.step, _train_metrics(engine, opt, loss_fn, losses, state, prec, loader, (state.step - start_step) * micro * accum * world / (time.perf_counter() - t0)))
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < total:
            log.log(state.step, run_eval(engine, cfg, tokenizer), kind="eval")
        if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == total:
            save(engine, run_dir, state, loader, prec)
    samples_per_s = (state.step - start_step) * micro * accum * world / max(time.perf_counter() - t0, 1e-9)
    final = {"steps": state.step, "samples_per_s": samples_per_s, "final_loss": _mean_over_ranks(torch.stack(losses).mean()), **run_eval(engine, cfg, tokenizer)}
    final.update(skipped_samples=loader.global_stats(), nonfinite_steps=state.nonfinite_steps, overflow_steps=state.overflow_steps, precision=prec.label, world_size=world)
    final["memory"] = {**live_bytes_per_param(engine.module, opt, engine.optimizer), "group_params": group_params}
    log.log(state.step, final, kind="final")
    log.close()
    loader.close()
    return final


def record_skip(state: TrainState, prec: Precision, skipped: bool, loss_nonfinite: bool, limit: int) -> None:
    """Counts a skipped step and updates the loss scale; stops after ``limit`` non-finite steps in a row.

    On the fp16 route a step skipped with a finite loss is the loss scaler's overflow (counted in
    ``overflow_steps``), not a bad loss.
    """
    overflow = skipped and prec.loss_scaler is not None and not loss_nonfinite
    nonfinite = skipped and not overflow
    if prec.loss_scaler is not None:
        prec.loss_scaler.update(skipped)
    state.overflow_steps += int(overflow)
    state.nonfinite_steps += int(nonfinite)
    state.nonfinite_in_row = state.nonfinite_in_row + 1 if nonfinite else 0
    if state.nonfinite_in_row >= limit:
        raise FloatingPointError(
            f"{state.nonfinite_in_row} non-finite steps in a row at step {state.step}: stopping "
            "(loss or gradients are inf/NaN; lower the learning rate or check the data)"
        )


def _forever(loader: Any) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def _train_metrics(engine: Any, opt: SRAdamW, loss_fn: ClipLoss, losses: list[torch.Tensor], state: TrainState, prec: Precision, loader: Any, samples_per_s: float) -> dict[str, Any]:
    gn = engine.get_global_grad_norm() if hasattr(engine, "get_global_grad_norm") else None
    return {
        "loss": _mean_over_ranks(torch.stack(losses).mean()),
        "acc_i2t": _mean_over_ranks(loss_fn.last_metrics["acc_i2t"]),
        "acc_t2i": _mean_over_ranks(loss_fn.last_metrics["acc_t2i"]),
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


def main(argv: list[str] | None = None) -> None:
    cfg = parse_args(argv)
    final = train(cfg)
    if _rank_world()[0] == 0:
        print(json.dumps({k: (round(v, 5) if isinstance(v, float) else v) for k, v in final.items()}), flush=True)


if __name__ == "__main__":
    main()
