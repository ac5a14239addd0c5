"""Train a CLIP model under DeepSpeed with SRAdamW and the sharded contrastive loss.

Example (2 CPU ranks; `bash launch.sh` wraps this)::

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --no_local_rank -m recipe.train \\
        --deepspeed_config ds_configs/zero2_bf16_halfmaster.json --train-data data/synthetic/train.csv \\
        --val-data data/synthetic/val.csv --steps 300 --output-dir runs/demo

The loop reads top to bottom: set up (run directory and its lock, tokenizer, model, engine, loader,
resume), then per optimizer step the learning rate, :func:`recipe.training.step.train_step` (forward,
backward, step, and the skip/stop decision), logging, evaluation and checkpoints, each a named
helper below. ``--resume latest`` continues a run from its saved ``config.json`` with only the
flags given on the command line changed; SIGTERM saves a checkpoint at the next step boundary and
exits with code 143 (:mod:`recipe.run.preempt`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import torch

from .benchmark.training import benchmark_metrics
from .benchmark.training import check_tokenizer as check_benchmark_tokenizer
from .config import TrainConfig, parse_args
from .data import build_train_loader, read_captions
from .evaluate import evaluate_data
from .export import Imported, read_pretrained
from .export.masters import set_live_masters
from .loss import ClipLoss
from .model.clip import CLIPConfig, check_tokenizer_fits, create_model
from .model.tokenizer import load_tokenizer, train_tokenizer
from .quiet import quiet_libraries
from .run import checkpoint
from .run import resume as resume_settings
from .run import outcome
from .run.checkpoint import CheckpointError
from .run.metrics import MetricsLogger, peak_memory_bytes
from .run.outcome import Outcome
from .run.preempt import PREEMPTED_EXIT_CODE, STOP_UNSAVED_EXIT_CODE, StopNotSaved, StopRequest
from .run.rundir import ERROR_LOG, Claim, RunDirError, RunLockError, check_run_dir, claim_run_dir, prepare_run_dir
from .training.batchnorm import average_batchnorm_stats
from .training.distributed import barrier, broadcast_from_rank0, mean_over_ranks, rank_world
from .training.ema import ModelEMA, build_ema
from .training.engine import build_engine, eval_module, init_distributed
from .training.memory import live_bytes_per_param
from .training.numerics import NumericsMonitor, build_numerics
from .training.optimizer import describe_groups, lr_at, warmup_note
from .training.precision import ConfigError, Precision, read_ds_config, resolve_precision, slow_bf16_on_cpu
from .training.step import StepResult, TrainState, train_step

__all__ = ["train", "main", "FINAL_METRICS"]

FINAL_METRICS = "final_metrics.json"

#: Errors that name what the user has to fix; every rank raises them alike, so the command line
#: shows one line from rank 0 instead of a traceback per rank (RECIPE_TRACEBACK=1 shows them).
USER_ERRORS = (ValueError, FileNotFoundError, ConfigError, CheckpointError, RunLockError, RunDirError,
               FloatingPointError)


def train(cfg: TrainConfig, stop: StopRequest | None = None) -> dict[str, Any]:
    """Runs training (every rank calls it) and returns the final metrics.

    Returns early with ``{"finished": True, ...}`` when a resumed run has already reached its last
    step, and with ``{"stopped": "SIGTERM", ...}`` (or ``"SIGUSR1"``) after saving a checkpoint when
    ``stop`` was requested.

    Raises:
        RunDirError: ``--output-dir`` holds another run (no ``--resume``), or there is no run to resume.
        StopNotSaved: A stop was requested but its checkpoint could not be saved.
    """
    init_distributed()
    prec, ds_config = resolve_precision(read_ds_config(cfg.deepspeed_config, world_size=rank_world()[1]))
    run_dir = Path(cfg.output_dir)
    stop = stop or StopRequest()
    claim = claim_run(run_dir, cfg.resume)
    try:
        try:
            session = set_up(cfg, prec, ds_config, run_dir)
        except BaseException:
            if claim is not None:  # a failed start takes back what it wrote (rank 0 wrote it all)
                claim.undo()
            raise
        try:
            return run_steps(cfg, prec, run_dir, stop, session)
        except Exception as e:
            if stop.requested:  # the stop's checkpoint was not saved: name the steps that are lost
                raise StopNotSaved(stop.signal_name or "a signal", session.state.step, e,
                                   checkpoint.complete_checkpoints(run_dir / "checkpoints")) from e
            raise
    finally:
        if claim is not None:
            claim.release()


@dataclasses.dataclass
class Session:
    """What the start built, for the steps."""

    tokenizer: Any
    model: torch.nn.Module
    engine: Any
    opt: Any
    group_params: Any
    loader: Any
    total: int
    ema: ModelEMA | None
    state: TrainState


def set_up(cfg: TrainConfig, prec: Precision, ds_config: dict[str, Any], run_dir: Path) -> Session:
    """Everything before the first step (a failure here is a failed start): the run's files, its
    tokenizer, model, engine, loader and EMA, and the resumed state."""
    rank, world = rank_world()
    previous = resume_settings.previous_config(run_dir, cfg.resume)  # before it is rewritten (recipe/run/resume.py)
    if rank == 0:
        prepare_run_dir(run_dir, cfg.to_dict(), ds_config)
    barrier()
    torch.manual_seed(cfg.seed)  # identical initialisation on every rank
    imported = read_init_from(cfg, run_dir)
    tokenizer = get_tokenizer(cfg, run_dir, imported)
    check_benchmark_tokenizer(cfg.eval_benchmark, cfg.benchmark_root, tokenizer)  # its context holds the templates
    model = build_model(cfg, tokenizer, run_dir, imported)
    slow = slow_bf16_on_cpu(model, prec, on_cpu=not torch.cuda.is_available())
    if slow:
        say(slow)
    engine, opt, group_params = build_engine(model, cfg, prec, ds_config)
    if imported is not None:  # mastered groups start from the source's exact fp32 values, not their rounding
        note = set_live_masters(engine, imported.state_dict).note(cfg.model.init_from)
        if note:
            say(note)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    loader = build_train_loader(cfg.data, tokenizer, model.image_data_config(), micro, rank, world, cfg.seed)
    total = cfg.steps or max(1, math.ceil((cfg.epochs or 1.0) * len(loader) / accum))
    ema = build_ema(engine, cfg)  # --ema-decay: the average starts from the weights before the first step
    state = (restore(engine, run_dir, cfg.resume, loader, prec, ema, cfg=cfg, opt=opt, previous=previous)
             if cfg.resume else TrainState())
    return Session(tokenizer, model, engine, opt, group_params, loader, total, ema, state)


def run_steps(cfg: TrainConfig, prec: Precision, run_dir: Path, stop: StopRequest, session: Session) -> dict:
    """The steps with their logging, evaluation and checkpoints, then the final evaluation."""
    rank, world = rank_world()
    tokenizer, engine, opt, loader, total, ema, state = (session.tokenizer, session.engine, session.opt,
                                                        session.loader, session.total, session.ema, session.state)
    micro, accum = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    if state.step >= total:
        say(f"run {run_dir} has already reached step {state.step} of {total}: nothing to do "
            f"(give --steps larger than {state.step} to continue it)")
        loader.close()
        return {"finished": True, "steps": state.step, "run_dir": str(run_dir)}
    loss_fn = build_loss(cfg)
    log = MetricsLogger(run_dir, total, rank == 0, state.step)
    log.write(
        f"{prec.label}, {world} ranks x micro-batch {micro} x accumulation {accum}, contrastive batch "
        f"{contrastive_batch_size(cfg.contrastive_batch, micro, accum, world)} ({cfg.contrastive_batch}), "
        f"{total} steps, run dir {run_dir}"
    )
    log.write(describe_groups(opt, session.group_params))
    note = warmup_note(cfg, total)
    if note:
        log.write(note)
    # --numerics-every: optimizer step hooks sample the update on the device (recipe/training/numerics.py)
    numerics = build_numerics(opt, cfg.numerics_every, cfg.log_every, seed=cfg.seed)
    batches, t0, start_samples = _forever(loader), time.perf_counter(), state.samples
    result: StepResult | None = None
    while state.step < total:
        for g in opt.param_groups:
            g["lr"] = lr_at(state.step, cfg, total) * g.get("lr_scale", 1.0)  # per tower / layer (param_groups)
        micro_batches = [next(batches) for _ in range(accum)]
        if numerics is not None:  # sample only the steps that are read (the cost is spread over them)
            numerics.active = is_numerics_step(numerics, state.step + 1, total)
        result = train_step(engine, opt, loss_fn, prec, micro_batches, state, cfg.max_nonfinite_in_row,
                            stop_requested=stop.requested, contrastive_batch=cfg.contrastive_batch)
        if ema is not None:
            ema.update(skipped=result.skipped)  # a skipped step leaves the EMA untouched
        if numerics is not None:
            numerics.end_step(skipped=result.skipped)  # a skipped step's sample is dropped
        log.advance()
        samples_per_s = (state.samples - start_samples) / max(time.perf_counter() - t0, 1e-9)
        numerics_row = read_numerics(numerics, state.step, total)
        if state.step % cfg.log_every == 0 or state.step == total:
            metrics = train_metrics(engine, opt, result, state, prec, loader, samples_per_s)
            metrics.update(numerics_row)  # --numerics-every = --log-every (default): the same row
            numerics_row = {}
            # the schedule's base rate (groups scale it per tower and layer; --image-lr, --layer-decay...)
            metrics["lr"] = lr_at(state.step - 1, cfg, total)
            log.log(state.step, {**metrics, "contrastive_batch": cfg.contrastive_batch})
        if numerics_row:  # a numerics step that is no log step: a row of its own
            log.log(state.step, numerics_row, kind="numerics")
        if cfg.eval_every and state.step % cfg.eval_every == 0 and state.step < total and not result.stop:
            log.log(state.step, run_eval(engine, cfg, tokenizer, ema), kind="eval")
        if (cfg.save_every and state.step % cfg.save_every == 0) or state.step == total or result.stop:
            tag_dir = save(engine, run_dir, state, loader, prec, ema, settings=resume_settings.record(cfg))
        if result.stop:
            log.close()
            loader.close()
            say(f"stopped by {stop.signal_name or 'a signal to another rank'} at step {state.step}: checkpoint "
                f"{tag_dir} saved; continue with --resume latest")  # after the progress bar's last line
            return {"stopped": stop.signal_name, "steps": state.step, "checkpoint": str(tag_dir),
                    "run_dir": str(run_dir)}
    final = {
        "steps": state.step,
        "samples_per_s": (state.samples - start_samples) / max(time.perf_counter() - t0, 1e-9),
    }
    final["final_loss"] = mean_over_ranks(result.loss) if result is not None else float("nan")
    final.update(run_eval(engine, cfg, tokenizer, ema))
    if ema is not None:
        final["ema"] = ema.summary()
    final.update(
        skipped_samples=loader.global_stats(),
        nonfinite_steps=state.nonfinite_steps,
        overflow_steps=state.overflow_steps,
        precision=prec.label,
        contrastive_batch=cfg.contrastive_batch,
        contrastive_batch_size=contrastive_batch_size(cfg.contrastive_batch, micro, accum, world),
        world_size=world,
        run_dir=str(run_dir),
    )
    final["memory"] = {**live_bytes_per_param(engine.module, opt, engine.optimizer), "group_params": session.group_params}
    log.log(state.step, final, kind="final")
    log.close()
    loader.close()
    if rank == 0:
        checkpoint.atomic_write_bytes(run_dir / FINAL_METRICS, json.dumps(final, indent=1).encode())
    return final


# --------------------------------------------------------------------------------------------------
# set-up
# --------------------------------------------------------------------------------------------------


def say(text: str) -> None:
    """A line for the user, from rank 0 only."""
    if rank_world()[0] == 0:
        print(text, file=sys.stderr, flush=True)


def claim_run(run_dir: Path, resume: str | None) -> Claim | None:
    """Rank 0 checks the run directory for this start and takes its lock (:func:`recipe.run.rundir.claim_run_dir`);
    every rank raises the same error when it refuses. Returns rank 0's claim (``None`` elsewhere)."""
    claim, error = None, None
    if rank_world()[0] == 0:
        try:
            claim = claim_run_dir(run_dir, resume)
        except (RunLockError, RunDirError) as e:
            error = (type(e).__name__, str(e))
    error = broadcast_from_rank0(error)
    if error is not None:
        raise {"RunLockError": RunLockError, "RunDirError": RunDirError}[error[0]](error[1])
    return claim


def read_init_from(cfg: TrainConfig, run_dir: Path) -> Imported | None:
    """The pretrained model ``--init-from`` names (every rank reads it: each needs the weights), or
    ``None``: no ``--init-from``, or ``--resume`` (the checkpoint holds the weights and the run's
    ``model_config.json`` the architecture; decided from the flags alone, so every rank agrees)."""
    if not cfg.model.init_from or cfg.resume:
        return None
    imported = read_pretrained(cfg.model.init_from)
    m, c = cfg.model, imported.config
    given = {"image_encoder": (m.image_encoder, c.image.name), "text_encoder": (m.text_encoder, c.text.name),
             "embed_dim": (m.embed_dim, c.embed_dim), "image_size": (m.image_size, c.image.image_size)}
    for name, (flag, found) in given.items():
        if flag is not None and flag != found:
            raise ValueError(f"--{name.replace('_', '-')} {flag} contradicts --init-from {m.init_from}, "
                             f"whose model has {name} {found}")
    return imported


def get_tokenizer(cfg: TrainConfig, run_dir: Path, imported: Imported | None = None) -> Any:
    """The run's tokenizer: kept from an earlier start, the ``--init-from`` model's, loaded from a local
    directory, or a BPE trained on the training captions (rank 0), saved in ``<run>/tokenizer``."""
    saved = run_dir / "tokenizer"
    d = cfg.data
    if rank_world()[0] == 0 and not saved.exists():
        if imported is not None:
            tok = imported.tokenizer
        elif d.tokenizer:
            tok = load_tokenizer(d.tokenizer, context_length=d.context_length)
        else:
            tok = train_tokenizer(read_captions(d), d.vocab_size, context_length=d.context_length or 32)
        tok.save(saved)
    barrier()
    return load_tokenizer(saved, context_length=d.context_length)


def logit_init(cfg: TrainConfig) -> dict[str, float]:
    """``create_model``'s logit keywords for ``--loss``: CLIP's 1/0.07 multiplier (the preset's) unless
    ``--init-logit-scale``; SigLIP's multiplier 10 and bias -10 (SigLIP paper) unless set. Log space."""
    m = cfg.model
    out = {"init_logit_scale": math.log(m.init_logit_scale)} if m.init_logit_scale else {}
    if cfg.loss == "siglip":
        out = {"init_logit_scale": math.log(m.init_logit_scale or 10.0),
               "init_logit_bias": -10.0 if m.init_logit_bias is None else m.init_logit_bias}
    return out


def build_model(cfg: TrainConfig, tokenizer: Any, run_dir: Path, imported: Imported | None = None) -> torch.nn.Module:
    """The CLIP model of ``cfg`` (same initialisation on every rank), or of ``--init-from`` with its
    weights (a restart rebuilds that architecture from the run's ``model_config.json``); rank 0 saves
    its config (``--patch-dropout`` included). ``--lock-image``/``--lock-text`` freeze towers here."""
    m = cfg.model
    if m.init_from:
        # the architecture as the init directory (or, resuming, the run's model_config.json) has it: the
        # tokenizer must fit it but does not resize it (a pretrained vocabulary may exceed the tokenizer's)
        saved = run_dir / "model_config.json"
        if imported is None and not saved.is_file():
            raise FileNotFoundError(f"{saved} is missing: cannot rebuild the --init-from model")
        config = imported.config if imported else CLIPConfig.from_dict(json.loads(saved.read_text()))
        if config.init_logit_bias is not None and cfg.loss != "siglip":
            raise ValueError("the --init-from model has a SigLIP logit bias: train it with --loss siglip")
        adds_bias = cfg.loss == "siglip" and config.init_logit_bias is None  # a CLIP model trained with SigLIP
        if adds_bias:
            config = dataclasses.replace(config, init_logit_bias=logit_init(cfg)["init_logit_bias"])
        model = create_model(config=config, text_load_weights=False, patch_dropout=m.patch_dropout)
        check_tokenizer_fits(model.text, tokenizer)
        if imported is not None:
            missing, unexpected = model.load_state_dict(imported.state_dict, strict=False)
            if unexpected or set(missing) - ({"logit_bias"} if adds_bias else set()):
                raise ValueError(f"--init-from weights do not fit: missing {missing}, unexpected {unexpected}")
    else:
        model = create_model(m.preset, image_encoder=m.image_encoder, text_encoder=m.text_encoder,
                             embed_dim=m.embed_dim, image_size=m.image_size, image_weights=m.image_weights,
                             tokenizer=tokenizer, patch_dropout=m.patch_dropout, **logit_init(cfg))
    if rank_world()[0] == 0:
        checkpoint.atomic_write_bytes(
            run_dir / "model_config.json", json.dumps(model.config.to_dict(), indent=2).encode()
        )
    model.set_grad_checkpointing(m.grad_checkpointing)
    if m.lock_image:  # LiT: frozen (no gradients, no optimizer state), BatchNorm statistics kept
        model.lock_image_tower(m.lock_image_unlocked_groups)
    if m.lock_text:
        model.lock_text_tower()
    return model


# --------------------------------------------------------------------------------------------------
# checkpoints, evaluation, logging
# --------------------------------------------------------------------------------------------------


def save(engine: Any, run_dir: Path, state: TrainState, loader: Any, prec: Precision,
         ema: ModelEMA | None = None, settings: dict[str, Any] | None = None) -> Path:
    client = {"state": state.__dict__.copy(), "data": loader.state_dict(), "rng": checkpoint.rng_state()}
    if settings is not None:  # what a resume compares its flags with (recipe/run/resume.py)
        client["settings"] = settings
    if prec.loss_scaler is not None:
        client["loss_scaler"] = prec.loss_scaler.state_dict()
    if ema is not None:
        client["ema"] = ema.client_state()
    return checkpoint.save(engine, run_dir / "checkpoints", state.step, client, ema)


def restore(engine: Any, run_dir: Path, resume: str, loader: Any, prec: Precision,
            ema: ModelEMA | None = None, *, cfg: TrainConfig | None = None, opt: Any = None,
            previous: dict[str, Any] | None = None) -> TrainState:
    """The state of the checkpoint ``resume`` names, loaded into the engine, loader and EMA. A run
    that has no complete checkpoint yet (it failed or was killed before its first save) starts again
    from step 0 under ``--resume latest``. With ``cfg`` and ``opt``, settings that differ from the
    checkpoint's are applied (each said in one line) or refused (:mod:`recipe.run.resume`; ``previous``: the
    run's ``config.json`` before this start)."""
    if resume == "latest" and not checkpoint.complete_checkpoints(run_dir / "checkpoints"):
        say(f"{run_dir} has no complete checkpoint yet: starting it again from step 0 "
            "(the metrics rows of the steps it repeats are replaced)")
        return TrainState()
    tag_dir = checkpoint.resolve(resume, run_dir / "checkpoints")
    changed: list[str] = []
    if cfg is not None and opt is not None:
        client = resume_settings.load(engine, opt, tag_dir, cfg, run_dir, previous, changed.append)
    else:
        client = checkpoint.load(engine, tag_dir)
    loader.load_state_dict(client["data"])
    checkpoint.set_rng_state(client["rng"])
    if prec.loss_scaler is not None:
        prec.loss_scaler.load_state_dict(client["loss_scaler"])
    state = TrainState(**client["state"])
    say(f"resumed from step {state.step} (checkpoint {tag_dir})")
    for line in changed:  # "--image-lr changed 0.002 -> 0.001 on resume: applied"
        say(line)
    if client.get("resharded_from"):  # elastic resume: another world size (recipe/run/elastic.py)
        say(f"elastic resume: checkpoint of {client['resharded_from']} ranks re-sharded onto {rank_world()[1]}; "
            f"the data continues at epoch {loader.epoch} with the samples not yet read")
    if ema is not None and not ema.restore(tag_dir, client.get("ema")):
        say(f"checkpoint {tag_dir} has no EMA: the average restarts from its weights")
    return state


def build_loss(cfg: TrainConfig) -> torch.nn.Module:
    """The sharded loss ``--loss`` names, in ``--loss-mode``: :class:`recipe.loss.ClipLoss` or
    :class:`recipe.loss.SigLipLoss` (which also takes the model's logit bias)."""
    if cfg.loss == "siglip":
        from .loss import SigLipLoss

        return SigLipLoss(mode=cfg.loss_mode, chunk_size=cfg.chunk_size, validate=False)
    return ClipLoss(mode=cfg.loss_mode, chunk_size=cfg.chunk_size, validate=False)


def run_eval(engine: Any, cfg: TrainConfig, tokenizer: Any, ema: ModelEMA | None = None) -> dict[str, float]:
    """Retrieval and zero-shot metrics on the validation data, and zero-shot classification of
    ``--zeroshot-data`` (e.g. ``--zeroshot imagenet``: ``imagenet_top1``...); every rank embeds its share.
    With ``--ema-decay`` the EMA weights are evaluated too, their metrics prefixed ``ema_``."""
    if not (cfg.data.val_data or cfg.data.zeroshot_data or cfg.eval_benchmark):
        return {}
    rank, world = rank_world()
    average_batchnorm_stats(engine.module, ema)  # one model evaluated: the ranks' BatchNorm statistics averaged
    model = eval_module(engine, tokenizer)
    metrics = evaluate_data(model, cfg.data, tokenizer, cfg.eval_batch_size, rank, world)
    if cfg.eval_benchmark:  # CLIP_benchmark's datasets (recipe/benchmark/): benchmark_<dataset>_<metric>
        metrics.update(benchmark_metrics(model, tokenizer, cfg.eval_benchmark, cfg.benchmark_root,
                                         cfg.eval_batch_size, cfg.data.eval_workers))
    if ema is not None:
        with ema.eval_module(tokenizer) as averaged:
            found = evaluate_data(averaged, cfg.data, tokenizer, cfg.eval_batch_size, rank, world)
            if cfg.eval_benchmark:
                found.update(benchmark_metrics(averaged, tokenizer, cfg.eval_benchmark, cfg.benchmark_root,
                                               cfg.eval_batch_size, cfg.data.eval_workers))
        metrics.update({f"ema_{k}": v for k, v in found.items()})
    return metrics


def train_metrics(
    engine: Any, opt: Any, result: StepResult, state: TrainState, prec: Precision, loader: Any, samples_per_s: float
) -> dict[str, Any]:
    """The logged training metrics (collectives and host reads: log steps only)."""
    gn = result.grad_norm  # the recipe's (recipe-managed routes), else the engine's
    if gn is None and hasattr(engine, "get_global_grad_norm"):
        gn = engine.get_global_grad_norm()
    return {
        "loss": mean_over_ranks(result.loss),
        **{k: mean_over_ranks(v) for k, v in result.metrics.items()},
        "lr": opt.param_groups[0]["lr"],
        "logit_scale": float(engine.module.logit_scale.detach().float().exp()),
        **({"logit_bias": float(engine.module.logit_bias.detach().float())}
           if getattr(engine.module, "logit_bias", None) is not None else {}),
        "samples_per_s": samples_per_s,
        "contrastive_batch_size": result.contrastive_batch,
        "grad_norm": float(gn) if gn is not None else float("nan"),
        "loss_scale": prec.loss_scaler.scale if prec.loss_scaler else 1.0,
        "peak_memory_bytes": peak_memory_bytes(),
        "skipped_samples": sum(v for k, v in loader.global_stats().items() if k != "repeated"),
        "nonfinite_steps": state.nonfinite_steps,
        "overflow_steps": state.overflow_steps,
    }


def read_numerics(numerics: NumericsMonitor | None, step: int, total: int) -> dict[str, float]:
    """The numerics metrics on a numerics step (every ``--numerics-every`` steps and the last), else
    ``{}``. All ranks call it at the same steps (it all-reduces, then reads on the host)."""
    if numerics is None or not is_numerics_step(numerics, step, total):
        return {}
    return numerics.read()


def is_numerics_step(numerics: NumericsMonitor, step: int, total: int) -> bool:
    """Whether step ``step`` (1-based) is sampled and read: every ``--numerics-every`` steps and the last."""
    return step % numerics.every == 0 or step == total


def contrastive_batch_size(mode: str, micro: int, accum: int, world: int) -> int:
    """Pairs one loss contrasts in contrastive-batch ``mode``."""
    return micro * world * (accum if mode == "global" else 1)


def _forever(loader: Any) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


# --------------------------------------------------------------------------------------------------
# the command line
# --------------------------------------------------------------------------------------------------


def with_run_config(argv: list[str]) -> list[str]:
    """``argv`` with ``--config <run>/config.json`` in front when it resumes a run that has one, so
    that only the flags given explicitly change the saved configuration."""
    ap = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    ap.add_argument("--resume")
    ap.add_argument("--config")
    ap.add_argument("--output-dir", default=TrainConfig().output_dir)
    known, _ = ap.parse_known_args(argv)
    if known.resume == "latest" and not known.config:
        check_run_dir(Path(known.output_dir), "latest")  # no run there: say so before its flags are read
    saved = Path(known.output_dir) / "config.json"
    if known.resume and not known.config and saved.is_file():
        return ["--config", str(saved), *argv]
    return argv


def summary(final: dict[str, Any]) -> str:
    """The end of a run in a few readable lines."""
    lines = [f"finished {final['steps']} steps in {final.get('run_dir', '')} ({final.get('precision', '')}, "
             f"{final.get('world_size', 1)} ranks, {final.get('samples_per_s', float('nan')):.1f} samples/s)"]
    for prefix, what in (("zeroshot", "zero-shot"), ("imagenet", "ImageNet zero-shot"),
                         ("ema_zeroshot", "EMA zero-shot"), ("ema_imagenet", "EMA ImageNet zero-shot")):
        if f"{prefix}_top1" in final:
            lines.append(f"  {what} top-1 {final[f'{prefix}_top1']:.3f} (chance {final[f'{prefix}_chance']:.3f}), "
                         f"top-5 {final[f'{prefix}_top5']:.3f}")
    if "retrieval_r1" in final:
        lines.append(f"  retrieval R@1 {final['retrieval_r1']:.3f} (image->text {final['i2t_r1']:.3f}, "
                     f"text->image {final['t2i_r1']:.3f}) on {int(final['eval_samples'])} held-out pairs")
    skipped = sum(v for k, v in final.get("skipped_samples", {}).items() if k != "repeated")
    lines.append(f"  final loss {final['final_loss']:.4f}; skipped samples {skipped}, non-finite steps "
                 f"{final.get('nonfinite_steps', 0)}, fp16 overflow steps {final.get('overflow_steps', 0)}")
    lines.append(f"  all metrics: {Path(final.get('run_dir', '.')) / FINAL_METRICS}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command-line entry point; returns the exit code: 0, 2 for a bad command line or configuration
    (nothing written), 1 for another error, 143 after a SIGTERM/SIGUSR1 stop with its checkpoint saved,
    3 for a stop whose checkpoint could not be saved, 130 after SIGINT. An error is one line (under
    ``launch.sh``, which prints it once for all ranks: :mod:`recipe.run.outcome`); tracebacks go to
    ``<run>/error.log`` (``RECIPE_TRACEBACK=1`` raises instead)."""
    quiet_libraries()
    # torch.compile (--compile) compiles in this process: Inductor's default pool of compile-worker
    # subprocesses shares the ranks' process group, so a Ctrl-C reaches the workers too, and a rank's
    # exit could then wait on a pool that lost a worker
    import torch._inductor.config  # already imported with DeepSpeed; its environment variable is read then

    torch._inductor.config.compile_threads = 1
    argv = list(sys.argv[1:] if argv is None else argv)
    rank = int(os.environ.get("RANK", "0"))
    outcome.announce(rank)
    stop = StopRequest().install()
    try:
        try:
            cfg = parse_args(with_run_config(argv))
            check_run_dir(Path(cfg.output_dir), cfg.resume)  # a first refusal before any process group
        except USER_ERRORS as e:
            return _fail(rank, e, stop, None, configuring=True)
        try:
            final = train(cfg, stop)
        except KeyboardInterrupt:
            outcome.record(Outcome(rank, 130, "interrupted", "interrupted (SIGINT): stopped without saving; "
                                   "--resume latest continues from the last checkpoint"))
            return 130
        except Exception as e:
            return _fail(rank, e, stop, Path(cfg.output_dir))
    finally:
        stop.restore()
    if final.get("stopped"):
        outcome.record(Outcome(rank, PREEMPTED_EXIT_CODE, "stopped"))
        return PREEMPTED_EXIT_CODE
    outcome.record(Outcome(rank, 0, "done"))
    if rank == 0 and not final.get("finished"):
        print(summary(final), flush=True)
    return 0


def classify(error: BaseException, configuring: bool = False) -> tuple[str, int]:
    """The outcome kind (:data:`recipe.run.outcome.KINDS`) and exit code of a rank that raised ``error``."""
    if outcome.is_peer_lost(error):
        return "peer", 1  # a consequence: another rank ended first
    if isinstance(error, StopNotSaved):
        return "stop_unsaved", STOP_UNSAVED_EXIT_CODE
    if isinstance(error, USER_ERRORS):
        return "user", 2 if configuring else 1
    return "internal", 1


def _fail(rank: int, error: BaseException, stop: StopRequest, run_dir: Path | None, configuring: bool = False) -> int:
    """Reports ``error``: its traceback appended to ``<run>/error.log`` (not for a refused command
    line or run directory: nothing is written then), its one line left for ``launch.sh`` or printed
    here (rank 0, or a rank whose error is its own), and returns the exit code."""
    if os.environ.get("RECIPE_TRACEBACK") == "1":
        raise error
    kind, code = classify(error, configuring)
    first = (str(error).strip().splitlines() or [""])[0]
    message = first if kind in ("user", "stop_unsaved") else f"{type(error).__name__}: {first}"
    if kind == "peer":
        message = f"rank {rank} lost contact with another rank, which ended first ({message})"
    log = None
    if run_dir is not None and not configuring and not isinstance(error, (RunLockError, RunDirError)):
        # never into another run's directory; kept when a failed start is taken back (rundir.Claim.undo)
        log = outcome.write_traceback(error, run_dir / ERROR_LOG, rank)
    outcome.record(Outcome(rank, code, kind, message, str(log) if log else None))
    if outcome.collected():
        return code  # launch.sh prints one line for all ranks once they have ended
    if rank == 0 or kind in ("internal", "stop_unsaved"):
        print(f"error: {message}" + (f" (traceback: {log})" if log else ""), file=sys.stderr, flush=True)
    if rank != 0:
        # the launcher terminates every rank as soon as one exits with an error: give rank 0 the
        # moment it needs to print the message before this rank's exit brings that about
        time.sleep(3)
    return code


if __name__ == "__main__":
    sys.exit(main())
