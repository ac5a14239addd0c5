"""``python -m recipe.plan``: the command line, generated from one typed config as ``recipe.config`` does.

Every field of :class:`PlanConfig` is a flag whose help and default come from the field (the same
:func:`recipe.config.option`), so nothing is described twice.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

from recipe.config import (
    CONTRASTIVE_BATCH_NAMES,
    LOSS_MODE_NAMES,
    add_field_flags,
    check_field_bounds,
    option,
    preset_names,
    text_tower_names,
)

from .search import Plan, PlanError, format_bytes, plan
from .states import ModelSpec

__all__ = ["PlanConfig", "build_parser", "main", "render"]


@dataclass
class PlanConfig:
    """What to plan: the model, the cluster, the global batch; what the planner may choose from."""

    preset: str | None = option("ViT-B-32", "model preset, one of {names}; the encoder flags override its towers",
                                names=preset_names)
    image_encoder: str | None = option(None, "timm image model name (replaces the preset's image tower)")
    text_encoder: str | None = option(
        None, "text tower: a built-in one ({names}), a config JSON or a local model directory", names=text_tower_names)
    embed_dim: int | None = option(None, "shared embedding width (default: the preset's)", ge=1)
    image_size: int | None = option(None, "image side in pixels (default: the model's)", ge=1)
    vocab_size: int | None = option(
        None, "vocabulary of a tokenizer the run trains (recipe.train's --vocab-size; unset: the text tower's own)", ge=1)
    context_length: int | None = option(None, "token context length (default: the text tower's)", ge=1)
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
    train_data: str | None = option(None, "training data to put into the launch command (recipe.train's --train-data)")
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

    def spec(self) -> ModelSpec:
        return ModelSpec(self.preset, self.image_encoder, self.text_encoder, self.embed_dim, self.image_size,
                         self.vocab_size, self.context_length, self.image_master_weights, self.text_master_weights)


def build_parser() -> argparse.ArgumentParser:
    """One flag per field of :class:`PlanConfig`, with its help text and default."""
    ap = argparse.ArgumentParser(
        prog="python -m recipe.plan",
        description="Plan micro-batch, accumulation, checkpointing, ZeRO stage and precision route for a run "
                    "(see README.md, 'Planning a run').",
        allow_abbrev=False,
    )
    add_field_flags(ap, PlanConfig)
    return ap


def render(p: Plan) -> str:
    """One screen: the chosen plan, its memory terms, the runner-ups and the launch command."""
    best = p.prediction
    bpp = p.bytes_per_param
    lines = [
        (f"{best.model}: {best.params:,} parameters, {p.gpus} GPUs x {format_bytes(p.gpu_memory)} "
        f"(planned to {format_bytes(p.usable_bytes)}: {p.headroom:.0%} headroom), global batch {p.global_batch:,}"),
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
        f"| embedding cache + gathered embeddings | | {format_bytes(best.cache_bytes + best.gathered_bytes)} |",
        f"| loss ({best.loss_mode}) | | {format_bytes(best.loss_bytes)} |",
        f"| **peak** | | **{format_bytes(p.total_bytes_per_gpu)}** of {format_bytes(p.usable_bytes)} |",
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


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = PlanConfig(**vars(args))
    try:
        cfg.validate()
        extra: tuple[str, ...] = ()
        if cfg.chunk_size != 4096:
            extra += ("--chunk-size", str(cfg.chunk_size))
        if cfg.train_data:
            extra += ("--train-data", cfg.train_data)
        result = plan(
            cfg.spec(), cfg.gpus, cfg.gpu_memory, cfg.global_batch, headroom=cfg.headroom, ds_config=cfg.ds_config,
            checkpointing={"auto": None, "on": True, "off": False}[cfg.grad_checkpointing], loss_mode=cfg.loss_mode,
            contrastive_batch=cfg.contrastive_batch, chunk_size=cfg.chunk_size, max_micro_batch=cfg.max_micro_batch,
            runner_ups=cfg.runner_ups, ds_config_out=cfg.ds_config_out, extra_args=extra,
        )
    except PlanError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.write:
        result.write_ds_config()
    print(json.dumps(result.to_dict(), indent=2) if cfg.json else render(result))
    return 0
