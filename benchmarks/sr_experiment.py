"""Why stochastic rounding matters: the same small CLIP trained with its weights and Adam states
stored in different precisions, over a range of learning rates, on the synthetic shapes dataset.

Arms (:data:`ARMS`); every arm trains the ``tiny`` preset from the same fp32 initialisation on the
same batches in the same order for a given seed, with :class:`optim.SRAdamW` configured per group:

* ``fp32``: fp32 weights and Adam states (the reference; SRAdamW on fp32 tensors is AdamW).
* ``bf16-rtn``: bf16 weights written round-to-nearest, no master copy, fp32 states.
* ``bf16-sr``: bf16 weights written with stochastic rounding, no master copy, fp32 states.
* ``fp16-text-sr``: the recipe's fp16 route: the whole model stored in fp16, the text tower's
  weights written with SR and its Adam states in fp16 (SR, per-tensor scaled), the image tower with
  an fp32 master and fp32 states; dynamic loss scaling (:class:`recipe.training.precision.DynamicLossScaler`).
* ``bf16-sr+bf16-states-rtn`` / ``bf16-sr+bf16-states-sr``: bf16 SR weights with bf16 Adam states
  written round-to-nearest vs. stochastically (``bf16-sr`` is the same with fp32 states).

The logit scale keeps an fp32 master and fp32 states in every arm (as in the recipe), so the arms
differ only in how the towers' weights and states are stored.

Compute: by default (``--compute fp32``) the forward and backward run in fp32 from the stored
weights (each weight is upcast exactly; its gradient is rounded to the storage dtype at the leaf,
as it is in half-precision training). This isolates what the optimizer's rounding does and keeps
the fp16 arm affordable on CPUs, which have no fast fp16 matmul. ``--compute param`` runs the
forward in the weights' own dtype (the recipe's behaviour; use it on a GPU).

Data: ``python -m recipe.synthetic`` data (written once into ``--data-dir``), decoded once with the
recipe's evaluation pipeline (resize + centre crop, no augmentation) and tokenised with a BPE
trained on the training captions; batches are drawn from a permutation seeded by the run's seed.
Zero-shot accuracy and retrieval come from :func:`recipe.evaluate.evaluate` on the validation
split; ``val_loss`` is the contrastive loss on the validation split in fixed batches.

Outputs (``--out``, default ``benchmarks/results``): ``sr_experiment.json`` (settings, environment,
every run's loss curve and final metrics, and the per-arm summary), ``sr_experiment.md`` (the
table), ``sr_loss_curves.png`` and ``sr_final.png``.

Usage::

    python benchmarks/sr_experiment.py                       # CPU default, about 10-15 min on 2 cores
    python benchmarks/sr_experiment.py --steps 2000 --batch-size 128 --n-train 20000 \\
        --lrs 1e-3 3e-4 1e-4 3e-5 1e-5 --compute param --device cuda --jobs 1
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import datetime
import hashlib
import json
import math
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from optim import SRAdamW  # noqa: E402
from recipe.config import DataConfig  # noqa: E402
from recipe.data import build_eval_loader, read_captions  # noqa: E402
from recipe.evaluate import evaluate  # noqa: E402
from recipe.loss import ClipLoss  # noqa: E402
from recipe.model import create_model  # noqa: E402
from recipe.model.tokenizer import load_tokenizer, train_tokenizer  # noqa: E402
from recipe.synthetic import write_dataset  # noqa: E402
from recipe.training.param_groups import param_groups  # noqa: E402
from recipe.training.precision import DynamicLossScaler  # noqa: E402
from recipe.zeroshot import load_zeroshot_prompts  # noqa: E402

__all__ = ["Arm", "ARMS", "ExperimentConfig", "prepare_data", "run_one", "summarize", "plot", "main"]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Arm:
    """How one arm stores and writes the towers' weights and Adam states.

    Attributes:
        label: Legend text.
        weight_dtype: Storage dtype of the model (``fp32``, ``bf16`` or ``fp16``).
        weight_rounding: ``"stochastic"`` or ``"nearest"`` for half weights without a master.
        state_dtype: Adam state dtype of the groups without a master (fp32 for mastered groups).
        state_rounding: ``"stochastic"`` or ``"nearest"`` for half states.
        image_master: The image tower keeps an fp32 master (and fp32 states).
        loss_scaling: Dynamic loss scaling (fp16).
    """

    label: str
    weight_dtype: str
    weight_rounding: str = "stochastic"
    state_dtype: str = "fp32"
    state_rounding: str = "stochastic"
    image_master: bool = False
    loss_scaling: bool = False


ARMS: dict[str, Arm] = {
    "fp32": Arm("fp32 weights + states", "fp32"),
    "bf16-rtn": Arm("bf16 weights, round-to-nearest", "bf16", weight_rounding="nearest"),
    "bf16-sr": Arm("bf16 weights, SR", "bf16"),
    "fp16-text-sr": Arm("fp16: text SR + fp16 states, image master", "fp16", state_dtype="fp16", image_master=True, loss_scaling=True),
    "bf16-sr+bf16-states-rtn": Arm("bf16 SR weights, bf16 states round-to-nearest", "bf16", state_dtype="bf16", state_rounding="nearest"),
    "bf16-sr+bf16-states-sr": Arm("bf16 SR weights, bf16 states SR", "bf16", state_dtype="bf16"),
}


@dataclass
class ExperimentConfig:
    """Settings of one experiment (all arms x learning rates x seeds)."""

    arms: list[str] = field(default_factory=lambda: list(ARMS))
    lrs: list[float] = field(default_factory=lambda: [1e-3, 1e-4, 3e-5, 1e-5])
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    steps: int = 240
    batch_size: int = 32
    warmup_steps: int = 20
    schedule: str = "constant"  # constant | cosine (to 0)
    weight_decay: float = 0.2
    betas: tuple[float, float] = (0.9, 0.98)
    eps: float = 1e-6
    n_train: int = 3072
    n_val: int = 480
    image_size: int = 32
    vocab_size: int = 320
    data_seed: int = 0
    compute: str = "fp32"  # fp32 | param
    device: str = "cpu"
    data_dir: str = str(ROOT / "data" / "sr_experiment")
    jobs: int = 2
    threads: int = 1


# ----------------------------------------------------------------------------------------------
# data
# ----------------------------------------------------------------------------------------------


def _data_key(cfg: ExperimentConfig) -> str:
    spec = dict(n=cfg.n_train, n_val=cfg.n_val, size=cfg.image_size, vocab=cfg.vocab_size, seed=cfg.data_seed)
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:10]


def _decode_split(csv: Path, tokenizer: Any, image_data_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    data = DataConfig(val_data=str(csv), label_column="label", eval_workers=0)
    loader = build_eval_loader(data, tokenizer, image_data_config, 256)
    parts: dict[str, list[torch.Tensor]] = {"pixel_values": [], "input_ids": [], "attention_mask": [], "labels": []}
    for batch in loader:
        for k in parts:
            parts[k].append(batch[k])
    if loader.num_skipped:
        raise RuntimeError(f"{csv}: {loader.num_skipped} samples could not be read")
    return {k: torch.cat(v) for k, v in parts.items()}


def prepare_data(cfg: ExperimentConfig) -> Path:
    """Writes the synthetic dataset, trains the tokenizer and decodes both splits once.

    Returns:
        Directory holding ``tensors.pt`` (train/val tensors), ``tokenizer/`` and ``zeroshot.json``;
        reused when it exists for the same settings.
    """
    root = Path(cfg.data_dir) / _data_key(cfg)
    done = root / "tensors.pt"
    if done.exists():
        return root
    raw = root / "raw"
    write_dataset(str(raw), cfg.n_train, n_val=cfg.n_val, seed=cfg.data_seed, image_size=cfg.image_size)
    captions = list(read_captions(DataConfig(train_data=str(raw / "train.csv"))))
    tok = train_tokenizer(captions, cfg.vocab_size, context_length=64)
    longest = max(len(tok.encode(c)) for c in captions)
    tok.context_length = longest  # every caption fits: no truncation, no wasted positions
    tok.save(root / "tokenizer")
    tok = load_tokenizer(root / "tokenizer")
    if tok.context_length != longest:
        raise RuntimeError(f"saved tokenizer has context length {tok.context_length}, expected {longest}")
    image_cfg = create_model("tiny", tokenizer=tok).image_data_config()
    tensors = {split: _decode_split(raw / f"{split}.csv", tok, image_cfg) for split in ("train", "val")}
    (root / "zeroshot.json").write_text((raw / "zeroshot.json").read_text())
    torch.save(tensors, root / "tensors.tmp")
    os.replace(root / "tensors.tmp", done)
    return root


_DATA: dict[str, Any] = {}


def _load_data(root: Path) -> dict[str, Any]:
    key = str(root)
    if key not in _DATA:
        _DATA.clear()
        _DATA[key] = {
            "tensors": torch.load(root / "tensors.pt", weights_only=True),
            "tokenizer": load_tokenizer(root / "tokenizer"),
            "prompts": load_zeroshot_prompts(root / "zeroshot.json"),
        }
    return _DATA[key]


# ----------------------------------------------------------------------------------------------
# one run
# ----------------------------------------------------------------------------------------------


def build_groups(model: torch.nn.Module, arm: Arm, weight_decay: float) -> list[dict[str, Any]]:
    """SRAdamW groups of ``arm`` over the recipe's CLIP-paper parameter groups."""
    half_state = DTYPES[arm.state_dtype]
    groups = param_groups(
        model,
        weight_decay,
        text_master_weights=False,
        image_master_weights=arm.image_master,
        text_state_dtype=half_state,
        image_state_dtype=torch.float32 if arm.image_master else half_state,
    )
    for g in groups:
        g["weight_rounding"] = arm.weight_rounding
        g["state_rounding"] = arm.state_rounding
        if g["name"] == "logit_scale":
            g["state_dtype"] = torch.float32
            g["clamp"] = (0.0, model.max_log_logit_scale)
    return groups


def _lr_at(step: int, cfg: ExperimentConfig, lr: float) -> float:
    if step < cfg.warmup_steps:
        return lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return lr
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return 0.5 * lr * (1 + math.cos(math.pi * progress))


def _forward(model: torch.nn.Module, compute: str, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if compute == "param":
        dtype = next(model.parameters()).dtype
        return model(inputs[0].to(dtype), *inputs[1:])
    params = {k: v.float() for k, v in model.named_parameters()}
    return torch.func.functional_call(model, params, inputs)


@torch.no_grad()
def _val_loss(model: torch.nn.Module, val: dict[str, torch.Tensor], batch: int, device: torch.device) -> float:
    loss_fn = ClipLoss(validate=False)
    n = val["pixel_values"].shape[0] // batch * batch
    total = 0.0
    for i in range(0, n, batch):
        x = [val[k][i : i + batch].to(device) for k in ("pixel_values", "input_ids", "attention_mask")]
        total += float(loss_fn(*model(x[0].to(next(model.parameters()).dtype), x[1], x[2])).loss)
    return total / (n // batch)


def run_one(arm_name: str, lr: float, seed: int, cfg: ExperimentConfig, data_root: str) -> dict[str, Any]:
    """Trains one (arm, learning rate, seed) and returns its loss curve and final metrics."""
    torch.set_num_threads(cfg.threads)
    arm, data, device = ARMS[arm_name], _load_data(Path(data_root)), torch.device(cfg.device)
    train, val, tok = data["tensors"]["train"], data["tensors"]["val"], data["tokenizer"]
    torch.manual_seed(seed)
    model = create_model("tiny", tokenizer=tok).to(device)  # fp32 init, identical for every arm
    model.to(DTYPES[arm.weight_dtype])
    init = {k: p.detach().clone() for k, p in model.named_parameters()}
    opt = SRAdamW(build_groups(model, arm, cfg.weight_decay), lr=lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay, seed=seed)
    scaler = DynamicLossScaler(scale=2.0**12, window=200) if arm.loss_scaling else None
    loss_fn = ClipLoss(validate=False)
    order = torch.Generator().manual_seed(seed)
    n, b = train["pixel_values"].shape[0], cfg.batch_size
    perm, pos = torch.randperm(n, generator=order), 0
    losses: list[float] = []
    t0 = time.perf_counter()
    for step in range(cfg.steps):
        if pos + b > n:
            perm, pos = torch.randperm(n, generator=order), 0
        idx = perm[pos : pos + b]
        pos += b
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, cfg, lr)
        x = [train[k][idx].to(device) for k in ("pixel_values", "input_ids", "attention_mask")]
        img, txt, scale = _forward(model, cfg.compute, *x)
        loss, _ = loss_fn(img, txt, scale)
        (loss * scaler.scale if scaler else loss).backward()
        skipped = opt.skipped_steps
        opt.step(inv_grad_scale=1.0 / scaler.scale if scaler else None)
        if scaler:
            scaler.update(opt.skipped_steps > skipped)
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    seconds = time.perf_counter() - t0
    unchanged = sum(int((p.detach() == init[k]).sum()) for k, p in model.named_parameters())
    total = sum(p.numel() for p in model.parameters())
    eval_model = copy.deepcopy(model).float() if cfg.compute == "fp32" else model
    metrics = evaluate(eval_model, _batches(val, 256, device), tok, data["prompts"])
    tail = max(1, cfg.steps // 10)
    return {
        "arm": arm_name,
        "lr": lr,
        "seed": seed,
        "losses": [round(v, 5) for v in losses],
        "final_train_loss": statistics.fmean(losses[-tail:]),
        "val_loss": _val_loss(eval_model, val, b, device),
        "zeroshot_top1": metrics["zeroshot_top1"],
        "zeroshot_chance": metrics["zeroshot_chance"],
        "retrieval_r1": metrics["retrieval_r1"],
        "frac_weights_unchanged": unchanged / total,
        "skipped_steps": opt.skipped_steps,
        "final_loss_scale": scaler.scale if scaler else None,
        "seconds": seconds,
    }


def _batches(split: dict[str, torch.Tensor], size: int, device: torch.device) -> list[dict[str, torch.Tensor]]:
    n = split["pixel_values"].shape[0]
    return [{k: v[i : i + size].to(device) for k, v in split.items()} for i in range(0, n, size)]


def _run_task(task: tuple[str, float, int, dict[str, Any], str]) -> dict[str, Any]:
    arm, lr, seed, cfg_dict, root = task
    return run_one(arm, lr, seed, ExperimentConfig(**cfg_dict), root)


# ----------------------------------------------------------------------------------------------
# summary, plots
# ----------------------------------------------------------------------------------------------


def _mean_std(xs: list[float]) -> tuple[float, float]:
    return statistics.fmean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (arm, lr): mean and std over seeds, and the paired gap to fp32 (same seed, same data).

    ``*_vs_fp32_pct`` is ``100 * (arm - fp32) / fp32`` of the seed-averaged final losses; positive
    means worse than fp32.
    """
    by: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault((r["arm"], r["lr"]), []).append(r)
    rows = []
    for (arm, lr), rs in sorted(by.items(), key=lambda kv: (-kv[0][1], list(ARMS).index(kv[0][0]))):
        row: dict[str, Any] = {"arm": arm, "lr": lr, "seeds": sorted(r["seed"] for r in rs)}
        for key in ("final_train_loss", "val_loss", "zeroshot_top1", "retrieval_r1", "frac_weights_unchanged"):
            row[key], row[key + "_std"] = _mean_std([r[key] for r in rs])
        row["skipped_steps"] = sum(r["skipped_steps"] for r in rs)
        ref = by.get(("fp32", lr))
        if ref:
            for key in ("final_train_loss", "val_loss"):
                base = statistics.fmean(r[key] for r in ref)
                row[key + "_vs_fp32_pct"] = 100 * (row[key] - base) / base
        rows.append(row)
    return rows


def markdown_table(rows: list[dict[str, Any]], chance: float | None) -> str:
    head = (
        "| lr | arm | final train loss | vs fp32 | val loss | vs fp32 | zero-shot top-1 | retrieval R@1 | weights never changed |\n"
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for r in rows:
        lines.append(
            f"| {r['lr']:.0e} | {r['arm']} | {r['final_train_loss']:.4f} ± {r['final_train_loss_std']:.4f} | "
            f"{r.get('final_train_loss_vs_fp32_pct', float('nan')):+.2f} % | {r['val_loss']:.4f} ± {r['val_loss_std']:.4f} | "
            f"{r.get('val_loss_vs_fp32_pct', float('nan')):+.2f} % | {100 * r['zeroshot_top1']:.1f} ± {100 * r['zeroshot_top1_std']:.1f} % | "
            f"{100 * r['retrieval_r1']:.1f} % | {100 * r['frac_weights_unchanged']:.1f} % |"
        )
    foot = f"\nMean ± std over seeds. Zero-shot chance: {100 * chance:.1f} %.\n" if chance else "\n"
    return head + "\n".join(lines) + foot


def plot(runs: list[dict[str, Any]], rows: list[dict[str, Any]], out: Path, cfg: ExperimentConfig, prefix: str = "sr") -> list[Path]:
    """Loss curves (one panel per learning rate, seed mean, smoothed) and final metrics vs lr."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms = [a for a in ARMS if any(r["arm"] == a for r in runs)]
    lrs = sorted({r["lr"] for r in runs}, reverse=True)
    colours = {a: plt.get_cmap("tab10")(i) for i, a in enumerate(ARMS)}
    fig, axes = plt.subplots(2, len(lrs), figsize=(4.2 * len(lrs), 6.6), squeeze=False, sharex=True, sharey="row")
    steps = len(runs[0]["losses"])
    window = max(1, steps // 25)
    seeds = len({r["seed"] for r in runs})

    def smooth(curve: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.avg_pool1d(curve[None, None], window, 1).flatten()

    x = range(window - 1, steps)
    for col, lr in enumerate(lrs):
        ref = {r["seed"]: torch.tensor(r["losses"]) for r in runs if r["arm"] == "fp32" and r["lr"] == lr}
        for arm in arms:
            mine = {r["seed"]: torch.tensor(r["losses"]) for r in runs if r["arm"] == arm and r["lr"] == lr}
            if not mine:
                continue
            axes[0][col].plot(x, smooth(torch.stack(list(mine.values())).mean(0)), color=colours[arm], label=ARMS[arm].label, lw=1.3)
            paired = [mine[s] - ref[s] for s in mine if s in ref]
            if paired and arm != "fp32":
                axes[1][col].plot(x, smooth(torch.stack(paired).mean(0)), color=colours[arm], lw=1.1)
        axes[0][col].set_title(f"lr {lr:g}")
        axes[1][col].axhline(0, color="grey", lw=0.8)
        axes[1][col].set_xlabel("step")
        for row in axes:
            row[col].grid(alpha=0.3)
    axes[0][0].set_ylabel(f"train loss\n(mean of {seeds} seed{'s' * (seeds > 1)}, {window}-step average)")
    axes[1][0].set_ylabel("train loss minus fp32's\n(same seed and batches)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    curves_png = out / f"{prefix}_loss_curves.png"
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for arm in arms:
        rs = sorted((r for r in rows if r["arm"] == arm), key=lambda r: r["lr"])
        x = [r["lr"] for r in rs]
        axes[0].errorbar(x, [r["val_loss"] for r in rs], yerr=[r["val_loss_std"] for r in rs], color=colours[arm], marker="o", ms=3, capsize=2, label=ARMS[arm].label)
        axes[1].errorbar(x, [100 * r["zeroshot_top1"] for r in rs], yerr=[100 * r["zeroshot_top1_std"] for r in rs], color=colours[arm], marker="o", ms=3, capsize=2)
    chance = next((r["zeroshot_chance"] for r in runs), None)
    if chance:
        axes[1].axhline(100 * chance, color="grey", ls=":", lw=1, label="chance")
    for ax, name in zip(axes, ("validation loss", "zero-shot top-1 (%)")):
        ax.set_xscale("log")
        ax.set_xlabel("learning rate")
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle(f"after {cfg.steps} steps, batch {cfg.batch_size}; mean ± std of {seeds} seed{'s' * (seeds > 1)}", fontsize=9)
    fig.tight_layout()
    final_png = out / f"{prefix}_final.png"
    fig.savefig(final_png, dpi=110)
    plt.close(fig)
    return [curves_png, final_png]


# ----------------------------------------------------------------------------------------------
# command line
# ----------------------------------------------------------------------------------------------


def _environment() -> dict[str, Any]:
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor() or "cpu",
    }


def dump_json(result: dict[str, Any]) -> str:
    """The result as JSON: settings and summary indented, one line per run (loss curves are long)."""
    head = {k: v for k, v in result.items() if k != "runs"}
    text = json.dumps(head, indent=1)[:-2]
    runs = ",\n  ".join(json.dumps(r) for r in result["runs"])
    return text + ',\n "runs": [\n  ' + runs + "\n ]\n}\n"


def build_parser() -> argparse.ArgumentParser:
    d = ExperimentConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", nargs="+", default=d.arms, choices=list(ARMS))
    ap.add_argument("--lrs", nargs="+", type=float, default=d.lrs)
    ap.add_argument("--seeds", nargs="+", type=int, default=d.seeds)
    ap.add_argument("--steps", type=int, default=d.steps)
    ap.add_argument("--batch-size", type=int, default=d.batch_size)
    ap.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    ap.add_argument("--schedule", choices=("constant", "cosine"), default=d.schedule)
    ap.add_argument("--weight-decay", type=float, default=d.weight_decay)
    ap.add_argument("--n-train", type=int, default=d.n_train)
    ap.add_argument("--n-val", type=int, default=d.n_val)
    ap.add_argument("--image-size", type=int, default=d.image_size)
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--compute", choices=("fp32", "param"), default=d.compute, help="forward/backward dtype: fp32 from the stored weights, or the weights' own dtype")
    ap.add_argument("--device", default=d.device)
    ap.add_argument("--data-dir", default=d.data_dir)
    ap.add_argument("--jobs", type=int, default=d.jobs, help="runs in parallel (processes)")
    ap.add_argument("--threads", type=int, default=d.threads, help="torch threads per process")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--prefix", default="sr", help="prefix of the output files")
    ap.add_argument("--no-plot", action="store_true", help="skip the PNGs (no matplotlib needed)")
    ap.add_argument("--replot", default=None, metavar="JSON", help="only redraw the PNGs of an earlier run's JSON (into --out)")
    return ap


def _check(cfg: ExperimentConfig) -> None:
    if cfg.steps < 1 or cfg.batch_size < 2 or cfg.jobs < 1 or cfg.threads < 1:
        raise SystemExit("need steps >= 1, batch size >= 2, jobs >= 1, threads >= 1")
    if any(lr <= 0 or not math.isfinite(lr) for lr in cfg.lrs):
        raise SystemExit(f"learning rates must be finite and positive, got {cfg.lrs}")
    if cfg.n_train < cfg.batch_size:
        raise SystemExit(f"n_train ({cfg.n_train}) must hold at least one batch ({cfg.batch_size})")
    if cfg.device.startswith("cuda") and cfg.jobs > 1:
        raise SystemExit("use --jobs 1 with a CUDA device")


def replot(path: Path, out: Path, prefix: str = "sr") -> dict[str, Any]:
    """Redraws the figures of a saved result (no training)."""
    result = json.loads(path.read_text())
    fields = ExperimentConfig.__dataclass_fields__
    cfg = ExperimentConfig(**{k: v for k, v in result["settings"].items() if k in fields})
    out.mkdir(parents=True, exist_ok=True)
    for p in plot(result["runs"], result["summary"], out, cfg, prefix):
        print(f"wrote {p}")
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.replot:
        return replot(Path(args.replot), Path(args.out), args.prefix)
    cfg = ExperimentConfig(
        arms=args.arms, lrs=args.lrs, seeds=args.seeds, steps=args.steps, batch_size=args.batch_size,
        warmup_steps=min(args.warmup_steps, max(0, args.steps - 1)), schedule=args.schedule,
        weight_decay=args.weight_decay, n_train=args.n_train, n_val=args.n_val, image_size=args.image_size,
        vocab_size=args.vocab_size, compute=args.compute, device=args.device, data_dir=args.data_dir,
        jobs=args.jobs, threads=args.threads,
    )
    _check(cfg)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    root = prepare_data(cfg)
    print(f"data ready in {time.perf_counter() - t0:.0f} s: {root}", flush=True)
    cfg_dict = dataclasses.asdict(cfg)
    # slow arms first, so the pool's tail is short
    cost = {"fp16-text-sr": 3, "bf16-sr+bf16-states-sr": 2, "bf16-sr+bf16-states-rtn": 2}
    tasks = sorted(((a, lr, s, cfg_dict, str(root)) for a in cfg.arms for lr in cfg.lrs for s in cfg.seeds), key=lambda t: -cost.get(t[0], 1))
    runs: list[dict[str, Any]] = []
    if cfg.jobs == 1:
        results = map(_run_task, tasks)
    else:
        pool = mp.get_context("spawn").Pool(cfg.jobs)
        results = pool.imap_unordered(_run_task, tasks)
    try:
        for r in results:
            runs.append(r)
            print(
                f"[{len(runs)}/{len(tasks)}] {r['arm']:<24} lr {r['lr']:.0e} seed {r['seed']}: final loss {r['final_train_loss']:.4f}, "
                f"val {r['val_loss']:.4f}, zero-shot {100 * r['zeroshot_top1']:.1f} %, unchanged {100 * r['frac_weights_unchanged']:.1f} % ({r['seconds']:.0f} s)",
                flush=True,
            )
    finally:
        if cfg.jobs > 1:
            pool.close()
            pool.join()
    runs.sort(key=lambda r: (list(ARMS).index(r["arm"]), -r["lr"], r["seed"]))
    rows = summarize(runs)
    chance = runs[0]["zeroshot_chance"]
    table = markdown_table(rows, chance)
    env = _environment()
    settings = {k: v for k, v in cfg_dict.items() if k not in ("data_dir", "jobs", "threads")}
    result = {"settings": settings, "environment": env, "wall_seconds": time.perf_counter() - t0, "summary": rows, "runs": runs}
    (out / f"{args.prefix}_experiment.json").write_text(dump_json(result))
    header = f"SR experiment, {env['date']}, torch {env['torch']}, {env['device']}; settings: {json.dumps(settings)}\n\n"
    (out / f"{args.prefix}_experiment.md").write_text(header + table)
    print(table)
    if not args.no_plot:
        for path in plot(runs, rows, out, cfg, args.prefix):
            print(f"wrote {path}")
    print(f"wrote {out / f'{args.prefix}_experiment.json'} in {time.perf_counter() - t0:.0f} s")
    return result


if __name__ == "__main__":
    main()
