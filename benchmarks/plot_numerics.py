"""Plots the numerics telemetry (``numerics/*``, :mod:`recipe.training.numerics`) of one or more runs.

Reads each run's ``metrics.jsonl`` (the train rows, which carry the ``numerics/*`` values when
``--numerics-every`` equals ``--log-every``, and the ``kind: "numerics"`` rows otherwise) and writes one
PNG: one row of panels per run, one panel per metric family, x = step:

* SR groups: ``numerics/sr_below_half_ulp``, overall and per group;
* half-precision Adam statistics: ``numerics/exp_avg{,_sq}_{underflow,saturated}``;
* fp16 state scales: ``numerics/exp_avg{,_sq}_scale_log2_{min,max}`` (only when a run logs them);
* logit-scale clamp: ``numerics/logit_scale_clamped`` and ``exp(logit_scale) / max_logit_scale`` from
  the train rows (the bound from the run's ``model_config.json``, 100 without it).

The fp16 figure of docs/numerics.md::

    OUTPUT_DIR=/tmp/num_fp16 DS_CONFIG=ds_configs/zero0_fp16_sr_lossscale.json \\
        bash launch.sh --steps 200 --log-every 10
    python benchmarks/plot_numerics.py --run /tmp/num_fp16 --out docs/numerics_demo_fp16.png \\
        --title "fp16 demo: DS_CONFIG=ds_configs/zero0_fp16_sr_lossscale.json bash launch.sh --steps 200 --log-every 10 (2 CPU ranks)"

(the bf16 one: the same without ``DS_CONFIG``, ``--out docs/numerics_demo.png``). Several runs side by
side: ``--run A --run B --label a --label b``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

PREFIX = "numerics/"
SR = PREFIX + "sr_below_half_ulp"
STATS = tuple(f"{PREFIX}{s}_{what}" for what in ("underflow", "saturated") for s in ("exp_avg", "exp_avg_sq"))
SCALES = tuple(f"{PREFIX}{s}_scale_log2_{b}" for s in ("exp_avg", "exp_avg_sq") for b in ("min", "max"))
CLAMP = PREFIX + "logit_scale_clamped"
#: (family, title, y label) in panel order
FAMILIES = (
    ("sr", "SR groups: updates below half an ulp", "share"),
    ("stats", "half-precision Adam statistics", "share"),
    ("scales", "fp16 state scales 2**k", "k (log2 of the scale)"),
    ("clamp", "logit-scale clamp", "share / ratio"),
)


class NumericsFileError(ValueError):
    """A metrics file that is missing, unreadable or holds no ``numerics/*`` rows (names the file)."""


def metrics_path(where: str | Path) -> Path:
    """``where`` itself when it is a file path, ``where/metrics.jsonl`` for a run directory."""
    p = Path(where)
    return p / "metrics.jsonl" if p.is_dir() else p


def _number(v: Any) -> float | None:
    """A logged value as a float (non-finite values are logged as strings: ``"nan"``, ``"inf"``)."""
    if isinstance(v, bool):
        return None
    if isinstance(v, (int, float)):
        return float(v)
    if isinstance(v, str):
        try:
            return float(v)
        except ValueError:
            return None
    return None


def load_run(where: str | Path) -> dict[str, Any]:
    """One run's numerics series.

    Returns:
        ``{"path", "series": {metric: ([steps], [values])}, "logit_scale": ([steps], [values]),
        "max_logit_scale"}``; ``series`` holds every ``numerics/*`` key, steps ascending (a later row of
        the same step and metric wins, as after a resume).

    Raises:
        NumericsFileError: The file is missing or unreadable, a line is not JSON, or no row holds a
            ``numerics/*`` value.
    """
    path = metrics_path(where)
    if not path.is_file():
        raise NumericsFileError(f"{path}: no such metrics file (pass a run directory or its metrics.jsonl)")
    by_metric: dict[str, dict[int, float]] = {}
    logit: dict[int, float] = {}
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise NumericsFileError(f"{path}: cannot read: {e}") from e
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise NumericsFileError(f"{path}:{lineno}: not a JSON row ({e.msg})") from e
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int):
            continue
        for k, v in row.items():
            x = _number(v)
            if x is None:
                continue
            if k.startswith(PREFIX):
                by_metric.setdefault(k, {})[step] = x
            elif k == "logit_scale" and row.get("kind", "train") == "train":
                logit[step] = x
    if not by_metric:
        raise NumericsFileError(
            f"{path}: no numerics rows (no numerics/* values in {len(lines)} lines; was the run made with "
            "--numerics-every 0?)"
        )
    bound = 100.0
    cfg = path.parent / "model_config.json"
    if cfg.is_file():
        try:
            bound = float(json.loads(cfg.read_text(encoding="utf-8")).get("max_logit_scale", bound))
        except (OSError, ValueError, TypeError, AttributeError):
            pass

    def ordered(d: dict[int, float]) -> tuple[list[int], list[float]]:
        steps = sorted(d)
        return steps, [d[s] for s in steps]

    return {"path": path, "series": {k: ordered(d) for k, d in sorted(by_metric.items())},
            "logit_scale": ordered(logit), "max_logit_scale": bound}


def families_of(run: dict[str, Any]) -> list[str]:
    """The metric families a run logged, in panel order."""
    s = run["series"]
    found = {
        "sr": any(k == SR or k.startswith(SR + "/") for k in s),
        "stats": any(k in s for k in STATS),
        "scales": any(k in s for k in SCALES),
        "clamp": CLAMP in s,
    }
    return [f for f, _, _ in FAMILIES if found[f]]


def _short(metric: str) -> str:
    return metric[len(PREFIX):]


def _draw(ax: Any, run: dict[str, Any], family: str) -> None:
    s = run["series"]
    if family == "sr":
        for k in [SR] + [k for k in s if k.startswith(SR + "/")]:
            if k in s:
                ax.plot(*s[k], label=_short(k), lw=2 if k == SR else 1.2)
    elif family == "stats":
        for k, ls in zip(STATS, ("-", "--", "-.", ":")):
            if k in s:
                ax.plot(*s[k], ls, label=_short(k))
    elif family == "scales":
        for name, color in (("exp_avg", "C0"), ("exp_avg_sq", "C1")):
            lo, hi = s.get(f"{PREFIX}{name}_scale_log2_min"), s.get(f"{PREFIX}{name}_scale_log2_max")
            if lo is not None:
                ax.plot(*lo, "--", color=color, label=f"{name} min k")
            if hi is not None:
                ax.plot(*hi, "-", color=color, label=f"{name} max k")
            if lo is not None and hi is not None and lo[0] == hi[0]:
                ax.fill_between(lo[0], lo[1], hi[1], color=color, alpha=0.15)
    elif family == "clamp":
        if CLAMP in s:
            ax.plot(*s[CLAMP], label="logit_scale_clamped (share of steps)")
        steps, vals = run["logit_scale"]
        if steps:
            bound = run["max_logit_scale"]
            ax.plot(steps, [v / bound for v in vals], label=f"exp(logit_scale) / {bound:g}")
        ax.set_ylim(-0.05, 1.05)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def plot(runs: list[str | Path], out: str | Path, title: str | None = None,
         labels: list[str] | None = None) -> Path:
    """Writes the PNG ``out`` of ``runs`` (run directories or metrics files) and returns its path.

    Raises:
        NumericsFileError: A run's metrics file is missing or holds no numerics rows.
        ValueError: ``labels`` of another length than ``runs``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not runs:
        raise ValueError("no run given")
    if labels and len(labels) != len(runs):
        raise ValueError(f"{len(labels)} labels for {len(runs)} runs")
    loaded = [load_run(r) for r in runs]
    names = labels or [str(r["path"].parent.name or r["path"]) for r in loaded]
    columns = [f for f, _, _ in FAMILIES if any(f in families_of(r) for r in loaded)]
    info = {f: (t, y) for f, t, y in FAMILIES}
    fig, axes = plt.subplots(len(loaded), len(columns), figsize=(4.6 * len(columns), 3.4 * len(loaded)),
                             squeeze=False)
    for i, (run, name) in enumerate(zip(loaded, names)):
        have = families_of(run)
        for j, fam in enumerate(columns):
            ax = axes[i][j]
            head, ylabel = info[fam]
            ax.set_title(head if len(loaded) == 1 else f"{name}: {head}", fontsize=10)
            ax.set_xlabel("step")
            ax.set_ylabel(ylabel)
            if fam in have:
                _draw(ax, run, fam)
            else:
                ax.text(0.5, 0.5, "not logged by this run", ha="center", va="center", transform=ax.transAxes)
                ax.set_xticks([])
                ax.set_yticks([])
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Plot the numerics/* metrics (recipe/training/numerics.py) of one or more runs' metrics.jsonl: "
        "one row of panels per run, one panel per metric family (SR below-half-ulp share, statistics "
        "underflow/saturation, fp16 state scales, logit-scale clamp), x = step."
    )
    parser.add_argument("metrics", nargs="*", help="metrics.jsonl files or run directories")
    parser.add_argument("--run", action="append", default=[], metavar="DIR",
                        help="run directory (its metrics.jsonl); repeatable, plotted before positional files")
    parser.add_argument("--out", required=True, metavar="PNG", help="the PNG to write")
    parser.add_argument("--title", default=None, help="figure title (e.g. the command that made the run)")
    parser.add_argument("--label", action="append", default=None,
                        help="name of each run in panel titles (repeatable, one per run; default: its directory)")
    args = parser.parse_args(argv)
    runs = [*args.run, *args.metrics]
    if not runs:
        parser.error("give at least one run: --run DIR or a metrics.jsonl path")
    try:
        out = plot(runs, args.out, args.title, args.label)
    except (NumericsFileError, ValueError) as e:
        print(f"plot_numerics: error: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
