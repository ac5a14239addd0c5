"""What ``bench_train`` prints: the markdown tables of a benchmark and of a breakdown, and the log line
of one row."""

from __future__ import annotations

from typing import Any

from _common import GIB, MIB  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)

from .breakdown import BREAKDOWN_ROWS

__all__ = ["markdown_table", "breakdown_table", "row_line"]


def row_line(r: dict[str, Any]) -> str:
    if not r.get("fits", False) and "samples_per_s" not in r:
        return f"  {r['arm']} ckpt={r['ckpt']}: batch {r['batch']} does not fit ({r.get('error')})"
    fit = f", largest batch {r.get('largest_batch')}" if "largest_batch" in r else ""
    acc = f" accumulation {r['accumulation']}" if r.get("accumulation", 1) > 1 else ""
    acc += f" compiled (warm-up {r['warmup_seconds']:.1f} s)" if "towers compiled" in r.get("description", "") else ""
    return (
        f"  {r['arm']}{acc} ckpt={r['ckpt']}: {r['samples_per_s']:.1f} samples/s, "
        f"peak {r['peak_bytes'] / MIB:.1f} MiB{fit}"
    )


def markdown_table(result: dict[str, Any]) -> str:
    """The result as a markdown table with a header naming device, versions, date and settings."""
    s, env = result["settings"], result["environment"]
    unit, scale = ("GiB", GIB) if s["device"].startswith("cuda") else ("MiB", MIB)
    mem_name = "peak allocated" if s["device"].startswith("cuda") else "peak RSS growth"
    v = env["versions"]
    lines = [
        f"**{env['device']}**, {env['date']}; torch {v['torch']}, deepspeed {v['deepspeed']}, timm {v['timm']}, "
        f"transformers {v['transformers']}, open_clip {v['open_clip']}. Preset {s['preset']}, batch {s['batch']}, "
        f"{s['steps']} timed steps after {s['warmup']} warm-up steps, one process.",
        "",
        f"| arm | accumulation | grad ckpt | params | samples/s | {mem_name} ({unit}) | largest batch "
        "| vs baseline: speed | vs baseline: memory |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        if "samples_per_s" not in r:
            ckpt = "on" if r["ckpt"] else "off"
            lines.append(
                f"| {r['arm']} | {r.get('accumulation', 1)} | {ckpt} | {r.get('params', '')} "
                f"| does not fit at {r['batch']} | | | | |"
            )
            continue
        largest = r.get("largest_batch")
        if "largest_batch" not in r:
            fit = "not searched"
        elif largest is None:
            fit = f"< {r['batch']}"
        else:
            fails = r.get("first_failing_batch")
            fit = f"≥ {largest} (cap)" if r.get("fit_capped") else f"{largest} (fails at {fails})"
        speed = f"{r['speedup_vs_baseline']:.2f}×" if r.get("speedup_vs_baseline") else "—"
        mem = f"{r['memory_vs_baseline']:.2f}×" if r.get("memory_vs_baseline") else "—"
        ckpt = "on" if r["ckpt"] else "off"
        lines.append(
            f"| {r['arm']} | {r.get('accumulation', 1)} | {ckpt} | {r['params']:,} | {r['samples_per_s']:.1f} "
            f"| {r['peak_bytes'] / scale:.2f} "
            f"| {fit} | {speed} | {mem} |"
        )
    lines.append("")
    for r in result["rows"]:
        if not r["ckpt"]:
            acc = f" (accumulation {r['accumulation']})" if r.get("accumulation", 1) > 1 else ""
            lines.append(f"- `{r['arm']}`{acc}: {r.get('description', '')}")
    for arm, why in result["unavailable"].items():
        lines.append(f"- `{arm}` not run: {why}")
    if s["device"] == "cpu":
        lines.append(
            f"- CPU: memory is the peak resident-set growth over the process before the model was built; "
            f'"fits" means within --cpu-budget-mib {s["cpu_budget_mib"]:g} MiB.'
        )
    return "\n".join(lines) + "\n"


def breakdown_table(result: dict[str, Any]) -> str:
    """The breakdown as a markdown table (milliseconds per step, medians over the rounds)."""
    s, env, arms, rows = result["settings"], result["environment"], result["arms"], result["breakdown"]
    v = env["versions"]
    lines = [
        (
            f"**{env['device']}**, {env['date']}; torch {v['torch']}, deepspeed {v['deepspeed']}, open_clip "
            f"{v['open_clip']}, {s['threads']} thread(s). Preset {s['preset']}, batch {s['batch']}, {s['steps']} "
            f"rounds after {s['warmup']} warm-up rounds, arms alternating step by step in one process; "
            "per-phase medians (they need not add up to the median total)."
        ),
        "",
        "| phase (ms per step) | " + " | ".join(arms) + " |",
        "|---|" + "---:|" * len(arms),
    ]
    for key, label in BREAKDOWN_ROWS:
        lines.append(f"| {label} | " + " | ".join(f"{rows[a][key] * 1e3:.1f}" for a in arms) + " |")
    speeds = " | ".join(f"{rows[a]['samples_per_s']:.0f}" for a in arms)
    lines.append(f"| samples/s (batch / median step) | {speeds} |")
    ratio = rows[arms[0]]["samples_per_s"] / rows[arms[1]]["samples_per_s"]
    lines += ["", f"{arms[0]} / {arms[1]} samples/s: {ratio:.2f}×", ""]
    lines += [f"- `{a}`: {rows[a]['description']}" for a in arms]
    return "\n".join(lines) + "\n"
