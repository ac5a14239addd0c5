"""``python -m recipe.plan``: the command line, generated from one typed config as ``recipe.config`` does.

Every field of :class:`PlanConfig` is a flag whose help and default come from the field (the same
:func:`recipe.config.option`), so nothing is described twice.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
from collections.abc import Iterator
from dataclasses import dataclass

from recipe.config import (
    CONTRASTIVE_BATCH_NAMES,
    LOSS_MODE_NAMES,
    ModelChoice,
    add_field_flags,
    check_field_bounds,
    option,
    preset_option,
)

from .search import MemoryPrediction, Plan, PlanError, format_bytes, plan
from .states import ModelSpec
from .vocab import TokenizerShape, run_tokenizer

__all__ = ["PlanConfig", "build_parser", "explain_peak", "main", "render"]


@dataclass
class PlanConfig(ModelChoice):
    """What to plan: the model, the cluster, the global batch; what the planner may choose from."""

    preset: str | None = preset_option("ViT-B-32")
    vocab_size: int | None = option(
        None, "most tokens of the tokenizer the run trains (recipe.train's --vocab-size, and its default); the "
              "plan counts the tokens it really gets on --train-data's captions, else plans with this upper bound",
        ge=1)
    context_length: int | None = option(
        None, "token context length (recipe.train's --context-length; default: the run's tokenizer's)", ge=1)
    tokenizer: str | None = option(
        None, "local tokenizer directory the run loads (recipe.train's --tokenizer; default: the run trains one)")
    count_vocab: bool = option(
        True, "train the tokenizer on --train-data's captions as the run does (reads every caption) to plan with "
              "its real vocabulary; --no-count-vocab: plan with --vocab-size, an upper bound")
    data_format: str | None = option(None, "format of --train-data (recipe.train's --data-format; detected when unset)")
    caption_column: str | None = option(
        None, "caption column of --train-data (recipe.train's --caption-column; detected when unset)")
    image_master_weights: bool = option(True, "the image tower keeps an fp32 master (as recipe.train)")
    text_master_weights: bool = option(False, "the text tower keeps an fp32 master (as recipe.train)")
    gpus: int = option(8, "data-parallel GPUs (all nodes together)", ge=1)
    gpu_memory: str = option("80GiB", "memory of one GPU: 80GiB, 80GB (decimal), 81920MiB...")
    global_batch: int = option(32768, "pairs per optimizer step, all GPUs (micro-batch x accumulation x GPUs)", ge=1)
    headroom: float = option(
        0.1, "share of the GPU memory left unplanned: allocator fragmentation, transient peaks, CUDA context",
        ge=0, lt=1)
    ds_config: str | None = option(None, "only this DeepSpeed JSON (default: choose among ds_configs/*.json)")
    grad_checkpointing: str = option("auto", "auto (off unless needed), on or off")
    loss_mode: str = option("plain", "contrastive loss implementation: plain, chunked or fused (as recipe.train)")
    contrastive_batch: str = option("global", "pairs one loss contrasts: global or micro (as recipe.train)")
    chunk_size: int = option(4096, "tile edge of the chunked loss (as recipe.train)", ge=1)
    max_micro_batch: int | None = option(None, "largest micro-batch to consider", ge=1)
    train_data: str | None = option(
        None, "training data (recipe.train's --train-data): its captions size the tokenizer; it goes into the launch "
              "command")
    ds_config_out: str | None = option(
        None, "where the plan's DeepSpeed JSON (batch sizes set) goes (default runs/plans/<config>_m<M>_k<K>.json)")
    write: bool = option(True, "write the plan's DeepSpeed JSON to --ds-config-out (the launch command names it)")
    runner_ups: int = option(5, "runner-up candidates to show", ge=0)
    json: bool = option(False, "print the plan as JSON instead of the table")

    def validate(self) -> None:
        try:
            check_field_bounds(self)
        except ValueError as e:
            raise PlanError(str(e)) from e
        if self.grad_checkpointing not in ("auto", "on", "off"):
            raise PlanError(f"grad_checkpointing must be auto, on or off, got {self.grad_checkpointing!r}")
        if self.loss_mode not in LOSS_MODE_NAMES:
            raise PlanError(f"loss_mode must be one of {', '.join(LOSS_MODE_NAMES)}, got {self.loss_mode!r}")
        if self.contrastive_batch not in CONTRASTIVE_BATCH_NAMES:
            raise PlanError(f"contrastive_batch must be one of {', '.join(CONTRASTIVE_BATCH_NAMES)}, "
                            f"got {self.contrastive_batch!r}")

    def spec(self, tokenizer: TokenizerShape | None = None) -> ModelSpec:
        """The model to plan; ``tokenizer``: the run's (:meth:`run_tokenizer`)."""
        return ModelSpec(self.preset, self.image_encoder, self.text_encoder, self.embed_dim, self.image_size,
                         self.vocab_size, self.context_length, self.image_master_weights, self.text_master_weights,
                         tokenizer)

    def run_tokenizer(self) -> TokenizerShape:
        """The tokenizer the launched run will have (:func:`recipe.plan.vocab.run_tokenizer`)."""
        try:
            return run_tokenizer(self.train_data, tokenizer=self.tokenizer, vocab_size=self.vocab_size,
                                 context_length=self.context_length, data_format=self.data_format,
                                 caption_column=self.caption_column, count=self.count_vocab)
        except ValueError as e:
            raise PlanError(str(e)) from e

    def launch_flags(self) -> tuple[str, ...]:
        """recipe.train flags of the data and tokenizer for the launch command (the model's come from the spec)."""
        flags: tuple[str, ...] = ()
        if self.chunk_size != 4096:
            flags += ("--chunk-size", str(self.chunk_size))
        for flag, value in (("--train-data", self.train_data), ("--data-format", self.data_format),
                            ("--caption-column", self.caption_column), ("--tokenizer", self.tokenizer)):
            if value:
                flags += (flag, value)
        return flags


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of :class:`PlanConfig`, with its help text and default."""
    ap = argparse.ArgumentParser(
        prog="python -m recipe.plan",
        description="Plan micro-batch, accumulation, checkpointing, ZeRO stage and precision route for a run "
                    "(see docs/planning.md).",
        allow_abbrev=False,
    )
    add_field_flags(ap, PlanConfig)
    return ap


def render(p: Plan) -> str:
    """One screen: the chosen plan, its memory terms and what the peak is made of, the runner-ups and
    the launch command."""
    best = p.prediction
    bpp = p.bytes_per_param
    lines = [
        (f"{best.model}: {best.params:,} parameters, {p.gpus} GPUs x {format_bytes(p.gpu_memory)} "
        f"(planned to {format_bytes(p.usable_bytes)}: {p.headroom:.0%} headroom), global batch {p.global_batch:,}"),
        f"text vocabulary: {p.vocabulary}",
        "",
        (f"plan: micro-batch {p.micro_batch} x accumulation {p.accumulation} x {p.gpus} GPUs, gradient checkpointing "
        f"{'on' if p.checkpointing else 'off'}, {p.ds_config} (ZeRO-{p.zero_stage}, {p.precision_route}), "
        f"loss {best.loss_mode}, contrastive batch {best.contrastive_batch}"),
        "",
        "| per GPU | bytes/param | bytes |",
        "|---|---:|---:|",
    ]
    n = best.params
    for kind in ("weights", "partitions", "grads", "optimizer_state", "buffers"):
        lines.append(f"| {kind.replace('_', ' ')} | {bpp[kind]:.2f} | {format_bytes(bpp[kind] * n)} |")
    lines += [
        (f"| activations ({format_bytes(best.activation_bytes_per_sample)}/sample x {p.micro_batch}) | "
        f"| {format_bytes(best.activation_bytes)} |"),
        f"| embedding cache | | {format_bytes(best.cache_bytes)} |",
        f"| gathered embeddings | | {format_bytes(best.gathered_bytes)} |",
        f"| loss ({best.loss_mode}) | | {format_bytes(best.loss_bytes)} |",
        f"| **peak** | | **{format_bytes(p.total_bytes_per_gpu)}** of {format_bytes(p.usable_bytes)} |",
        "",
        explain_peak(best, p.headroom),
        "",
    ]
    if p.runner_ups:
        lines += ["runner-ups:", "", "| config | micro | accum | ckpt | activations | peak |",
                  "|---|---:|---:|---|---:|---:|"]
        for r in p.runner_ups:
            lines.append(f"| {r.ds_config.rsplit('/', 1)[-1]} | {r.micro_batch} | {r.accumulation} | "
                         f"{'on' if r.checkpointing else 'off'} | {format_bytes(r.activation_bytes)} | "
                         f"{format_bytes(r.total_bytes)} |")
        lines.append("")
    lines += [(f"DeepSpeed JSON: {p.ds_config} with train_micro_batch_size_per_gpu {p.micro_batch}, "
              f"gradient_accumulation_steps {p.accumulation} -> {p.ds_config_out}"), "", p.launch_command]
    return "\n".join(lines)


def explain_peak(p: MemoryPrediction, headroom: float) -> str:
    """What the peak adds up (:meth:`MemoryPrediction.peak_terms`), and what it leaves to the headroom."""
    t = {k: format_bytes(v) for k, v in p.peak_terms().items()}
    steady = (f"model states {t['model states']} (weights, partitions, grads, optimizer state"
              + (", ZeRO-3's reduce bucket)" if p.zero_stage == 3 else ")"))
    backward = f"activations {format_bytes(p.activation_bytes)}"
    if p.backward_buffer_bytes:
        backward += f" + reduce buckets {format_bytes(p.backward_buffer_bytes)}"
    loss = f"gathered embeddings {format_bytes(p.gathered_bytes)} + loss {format_bytes(p.loss_bytes)}"
    if p.phased():
        body = (f"peak = {steady} + embedding cache {t['embedding cache']} + the larger of one micro-batch's "
                f"backward ({backward}" + (f" = {t['backward']}" if p.backward_buffer_bytes else "")
                + f") and the loss over the cached batch ({loss} = {t['loss']}): the two never overlap, so the peak "
                "is less than the rows' sum")
    else:
        body = (f"peak = the rows' sum, all alive at once in one micro-batch's backward: {steady} + {backward} + "
                f"{loss}; nothing else is added")
    return (f"{body}. Not counted, left to the {headroom:.0%} headroom: allocator rounding and fragmentation, "
            "one operation's transient workspace, collectives' communication buffers, the CUDA context.")


@contextlib.contextmanager
def _stdout_is_the_plan() -> Iterator[None]:
    """Only errors from DeepSpeed's logger (which writes to stdout) while planning: its accelerator
    notice ("Setting accelerator to CPU") says nothing about the plan and would break ``--json``. A
    filter, not a level: importing DeepSpeed sets its logger's level."""
    logger = logging.getLogger("DeepSpeed")
    logger.addFilter(_errors_only)
    try:
        yield
    finally:
        logger.removeFilter(_errors_only)


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def main(argv: list[str] | None = None) -> int:
    with _stdout_is_the_plan():
        return _main(argv)


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    cfg = PlanConfig(**vars(args))
    try:
        cfg.validate()
        result = plan(
            cfg.spec(cfg.run_tokenizer()), cfg.gpus, cfg.gpu_memory, cfg.global_batch, headroom=cfg.headroom,
            ds_config=cfg.ds_config, checkpointing={"auto": None, "on": True, "off": False}[cfg.grad_checkpointing],
            loss_mode=cfg.loss_mode, contrastive_batch=cfg.contrastive_batch, chunk_size=cfg.chunk_size,
            max_micro_batch=cfg.max_micro_batch, runner_ups=cfg.runner_ups, ds_config_out=cfg.ds_config_out,
            extra_args=cfg.launch_flags(),
        )
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.write:
        result.write_ds_config()
    print(json.dumps(result.to_dict(), indent=2) if cfg.json else render(result))
    return 0
