"""Loss curves of three precision routes trained side by side: the same model, seed and batches.

Arms (``bench_memory.MemoryMode`` s, engines built as :mod:`recipe.train` builds them by
``_common.build_recipe_arm`` and stepped by the recipe's own :func:`recipe.training.step.train_step`):

* ``sr``: the recipe's default route, ``--sr-config`` (default ``ds_configs/zero0_bf16_sr.json``, what
  ``launch.sh`` takes): bf16 module, text tower with SR bf16 weights and SR bf16 Adam statistics (no
  master), image tower and logit scale with an exact master;
* ``all-sr``: the same with the image tower SR too (``--no-image-master-weights``: no master but the
  logit scale's);
* ``standard``: DeepSpeed's standard bf16 mixed precision on ``--standard-config`` (default
  ``zero2_bf16_halfmaster.json`` less its two half-master flags, bench_memory's ``zero2_bf16_standard``;
  DeepSpeed has no fp32-master bf16 optimizer at ZeRO-0): fp32 master weights and fp32 Adam states in
  DeepSpeed's optimizer, ``torch.optim.AdamW``.

Every arm starts from the same initialisation (``torch.manual_seed(--seed)`` before the model is built),
uses the recipe's hyperparameters (lr 5e-4 peak, betas (0.9, 0.98), eps 1e-6, weight decay 0.2 on
weights only, linear warm-up then cosine, ``recipe.training.optimizer.lr_at``) and sees the same batches in the
same order: a pool of ``--pool`` synthetic batches (random pixels and token rows,
``_common.make_inputs``, seeded) cycled over the steps, so the loss falls as the model learns the pool's
pairs. The arms run one after another in this process (one engine at a time); ``--time-budget-s`` is
shared: each arm stops once its share is spent (its curve is then shorter, and says so).

Output: ``--json`` (settings, environment, each arm's losses, seconds and steps per second) and ``--png``
(the loss curves in one figure, and each SR arm's difference to ``standard``).

Usage::

    python benchmarks/numerics_routes.py --device cuda                     # ViT-B-32, batch 256, 300 steps
    python benchmarks/numerics_routes.py --device cpu --preset tiny --batch 8 --steps 5 --pool 2   # smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from _common import ROOT, TextSpec, build_recipe_arm, environment, make_inputs  # noqa: E402  (repo on sys.path)

ARMS = ("sr", "all-sr", "standard")
LABELS = {
    "sr": "default SR route (SR text tower, exact-master image tower)",
    "all-sr": "all-SR (image tower SR too)",
    "standard": "DeepSpeed standard bf16, fp32 masters + AdamW",
}


def _standard_adamw(weight_decay: float, betas: tuple[float, float], eps: float, lr: float):
    def make(model: torch.nn.Module) -> torch.optim.Optimizer:
        from recipe.training.param_groups import param_groups

        groups = param_groups(model, weight_decay)
        for g in groups:
            g.pop("master_weights", None)
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)

    return make


def arm_mode(arm: str, args: argparse.Namespace):
    """The arm's ``bench_memory.MemoryMode`` (DeepSpeed JSON, standard or not, image master or not)."""
    from bench_memory import MemoryMode

    if arm == "standard":
        return MemoryMode(args.standard_config, standard=True, label=LABELS[arm])
    return MemoryMode(args.sr_config, label=LABELS[arm], image_master=arm == "sr")


def run_arm(arm: str, args: argparse.Namespace, device: torch.device, budget_s: float) -> dict[str, Any]:
    """Trains one arm for ``args.steps`` steps (or until ``budget_s`` is spent); its losses per step."""
    from bench_memory import ds_config_of
    from recipe.config import TrainConfig
    from recipe.loss import ClipLoss
    from recipe.training.optimizer import lr_at
    from recipe.training.step import TrainState, train_step

    t0 = time.perf_counter()
    mode = arm_mode(arm, args)
    cfg = TrainConfig()
    o = cfg.optim
    o.warmup_steps = min(o.warmup_steps, max(1, args.steps // 5))
    make_opt = _standard_adamw(o.weight_decay, (o.beta1, o.beta2), o.eps, o.lr) if mode.standard else None
    built = build_recipe_arm(args.preset, ds_config_of(mode, args.batch), args.seed,
                             image_master_weights=mode.image_master, optimizer=make_opt)
    engine, opt, prec = built.engine, built.optimizer, built.precision
    text = TextSpec.of(built.model)
    size = int(built.model.image_data_config()["input_size"][-1])
    pool = [{k: v.to(device) for k, v in make_inputs(args.batch, size, text, args.seed * 1000 + i).items()}
            for i in range(args.pool)]
    loss_fn, state = ClipLoss(mode=args.loss_mode, validate=False), TrainState()
    losses: list[float] = []
    t_steps = time.perf_counter()
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, cfg, args.steps) * g.get("lr_scale", 1.0)
        result = train_step(engine, opt, loss_fn, prec, [pool[step % args.pool]], state, max_nonfinite_in_row=10**9)
        losses.append(float(result.loss))
        if time.perf_counter() - t0 > budget_s:
            break
    seconds = time.perf_counter() - t_steps
    out = {"arm": arm, "ds_config": mode.config, "label": LABELS[arm], "precision": prec.label,
           "optimizer": type(opt).__name__, "losses": losses, "steps": len(losses),
           "complete": len(losses) == args.steps, "steps_per_s": len(losses) / max(seconds, 1e-9),
           "seconds": time.perf_counter() - t0, "skipped_steps": state.nonfinite_steps + state.overflow_steps}
    if hasattr(engine, "destroy"):
        engine.destroy()
    del engine, opt, built, pool
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def running_mean(xs: list[float], k: int) -> list[float]:
    """Mean of the last ``k`` values at each step (fewer at the start): one pass over the pool."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """The loss curves in one figure: per step (thin) and over the last pass over the pool (bold), left;
    each SR arm's pool-mean loss minus ``standard``'s, right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = result["settings"]
    runs = {r["arm"]: r for r in result["arms"] if "losses" in r}
    means = {arm: running_mean(r["losses"], s["pool"]) for arm, r in runs.items()}
    fig, (ax, dx) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, (arm, r) in enumerate(runs.items()):
        steps = range(1, len(r["losses"]) + 1)
        color = f"C{i}"
        ax.plot(steps, r["losses"], color=color, linewidth=0.6, alpha=0.35)
        ax.plot(steps, means[arm], color=color, linewidth=1.6, label=f"{arm}: {r['label']}")
    ax.set_xlabel("step")
    ax.set_ylabel("contrastive loss (thin: the step's batch; bold: mean over the pool)")
    ax.set_title("loss")
    ax.legend(fontsize=8)
    if "standard" in runs:
        for i, arm in enumerate(runs):
            if arm == "standard":
                continue
            n = min(len(means[arm]), len(means["standard"]))
            dx.plot(range(1, n + 1), [a - b for a, b in zip(means[arm][:n], means["standard"][:n])], color=f"C{i}",
                    label=arm, linewidth=1.2)
        dx.axhline(0.0, color="grey", linewidth=0.8)
        dx.legend(fontsize=8)
    dx.set_xlabel("step")
    dx.set_ylabel("pool-mean loss - standard's")
    dx.set_title("difference to DeepSpeed standard bf16")
    fig.suptitle(f"{s['preset']}, batch {s['batch']}, {s['steps']} steps over a pool of {s['pool']} synthetic batches, "
                 f"seed {s['seed']}; SR arms {s['sr_config']}, standard {s['standard_config']} without its master "
                 f"flags; {result['env'].get('device', '')}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: dict[str, Any]) -> str:
    lines = ["| arm | route | steps | first loss | last loss | min loss | steps/s |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in result["arms"]:
        if "error" in r:
            lines.append(f"| {r['arm']} | error: {r['error'][:120]} | | | | | |")
            continue
        ls = r["losses"]
        finite = [x for x in ls if math.isfinite(x)]
        lines.append(f"| {r['arm']} | {r['label']} | {r['steps']}{'' if r['complete'] else ' (time budget)'} "
                     f"| {ls[0]:.4f} | {ls[-1]:.4f} | {min(finite) if finite else float('nan'):.4f} "
                     f"| {r['steps_per_s']:.2f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="recipe preset (default ViT-B-32 on CUDA, tiny on CPU)")
    ap.add_argument("--batch", type=int, default=None, help="pairs per step (default 256 on CUDA, 8 on CPU)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--pool", type=int, default=8, help="synthetic batches, cycled over the steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    ap.add_argument("--sr-config", default="zero0_bf16_sr.json", help="ds_configs/ JSON of the two SR arms")
    ap.add_argument("--standard-config", default="zero2_bf16_halfmaster.json",
                    help="ds_configs/ bf16 JSON of the standard arm, its half-master flags removed (ZeRO >= 1)")
    ap.add_argument("--loss-mode", default=None, help="ClipLoss mode (default fused on CUDA, plain on CPU)")
    ap.add_argument("--time-budget-s", type=float, default=200.0,
                    help="for all arms together: each arm stops once its share is spent")
    ap.add_argument("--json", default=None,
                    help="output JSON (default benchmarks/results/numerics_routes_<device>.json)")
    ap.add_argument("--png", default=None, help="output figure (default: the JSON's path with .png)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    if not cuda:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    args.preset = args.preset or ("ViT-B-32" if cuda else "tiny")
    args.batch = args.batch or (256 if cuda else 8)
    args.loss_mode = args.loss_mode or ("fused" if cuda else "plain")
    if args.steps < 1 or args.pool < 1 or args.batch < 2:
        ap.error("need --steps >= 1, --pool >= 1 and --batch >= 2")
    default_json = ROOT / "benchmarks" / "results" / f"numerics_routes_{device.type}.json"
    json_path = Path(args.json) if args.json else default_json
    png_path = Path(args.png) if args.png else json_path.with_suffix(".png")
    t0 = time.perf_counter()
    arms = []
    for i, arm in enumerate(args.arms):
        share = (args.time_budget_s - (time.perf_counter() - t0)) / (len(args.arms) - i)
        try:
            r = run_arm(arm, args, device, share)
        except Exception as err:  # an arm that fails is reported; the others still run
            r = {"arm": arm, "label": LABELS[arm], "error": f"{type(err).__name__}: {err}"}
        arms.append(r)
        print(f"{arm}: " + (r["error"] if "error" in r else
                            f"{r['steps']} steps, loss {r['losses'][0]:.4f} -> {r['losses'][-1]:.4f}, "
                            f"{r['seconds']:.1f} s"), flush=True)
    settings = {k: getattr(args, k) for k in ("device", "preset", "batch", "steps", "pool", "seed", "loss_mode",
                                              "time_budget_s", "arms", "sr_config", "standard_config")}
    result = {"settings": settings, "env": environment(args.device), "arms": arms}
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(result, indent=1, default=str))
    print(markdown(result))
    try:
        plot(result, png_path)
        print(f"wrote {json_path} and {png_path}")
    except ImportError as err:  # no matplotlib: the JSON holds the curves
        print(f"wrote {json_path} (no figure: {err})")
    return result


if __name__ == "__main__":
    sys.exit(0 if all("error" not in r for r in main()["arms"]) else 1)
