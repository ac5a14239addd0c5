"""The GPU check's environment record and GOALS summary (benchmarks/gpu_check.sh), from its result files.

Usage::

    python benchmarks/gpu_goals.py env DIR      # writes DIR/env.json (device, driver, versions, date, commit)
    python benchmarks/gpu_goals.py goals DIR    # reads DIR's benchmark files, prints and writes DIR/goals.md

Files read from DIR (each written by one step of gpu_check.sh):

* ``bench_optim.json``: ``bench_optim.py --json`` rows (``optimizer``, ``layout``, ``ms``);
* ``bench_loss.json`` (rows with ``B``, ``D``, ``impl``, ``ms``, ``peak_mib``, optional ``status``;
  bench_loss.py has no ``--json`` yet) or else ``bench_loss.md``, its stdout, whose markdown table
  ``| B | D | implementation | fwd+bwd ms | floor ms | x floor | peak extra MiB | loss |`` is parsed;
* ``bench_train.json``: ``bench_train.py --json`` (``rows``: ``arm``, ``batch``, ``ckpt``,
  ``accumulation``, ``samples_per_s``, ``peak_bytes``, ``fits``).

Each goal gives one line ``PASS``, ``FAIL`` or ``MISSING`` (file, row or figure absent: the reason is
given), with the measured figure, the goal and the reference figures of the same run. The exit
status is 0 (the summary is a report; ``--strict`` makes any FAIL or MISSING exit 1).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

GIB = 2**30
MIB = 2**20

#: The goals (issue #17) and the figures they were set against.
OPTIM_GOAL_MS = 4.0  # SRAdamW step, 1.07 B parameters (bf16 weights + bf16 SR states, fused kernel)
OPTIM_ANCHOR_MS = 5.95  # torch fused AdamW, bf16 (round to nearest)
OPTIM_ROW = "SRAdamW bf16 w + bf16 SR states (fused)"
OPTIM_NOCHECK_ROW = "SRAdamW bf16 w + bf16 SR states (fused, check_finite=False)"
OPTIM_NOCHECK_GOAL_MS = 3.8  # the same without the finiteness check (floor 3.55 ms: 14 B/param at 4.23 TB/s)
OPTIM_VIT_RATIO = 0.9  # ViT-B-32's 350 tensors: at most this times torch's fused AdamW bf16 (issue 27)
OPTIM_LAYOUT = "gpu-1b"
LOSS_GOAL_MS = 16.0  # fwd+bwd, B = 32k, D = 1024, bf16
LOSS_ANCHOR_MS = 26.0  # open_clip ClipLoss
LOSS_GOAL_MIB = 1024.0  # peak extra memory at B = 131k, D = 1024
LOSS_ANCHOR_MIB = 128.5 * 1024  # open_clip
LOSS_DIM = 1024
TRAIN_GOAL_SPS = 5300.0  # ViT-B-32, batch 512, samples/s on the default route (issue 27: >= 1.25x OpenCLIP's 4233)
TRAIN_GOAL_GIB = 17.0  # peak memory of that run (issue 27)
TRAIN_BATCH = 512
DATA_GOAL_RATIO = 0.9  # the train step on the real loader's batches / on synthetic inputs (issue 27.5)


@dataclass
class Line:
    status: str  # PASS | FAIL | MISSING
    goal: str
    text: str

    def __str__(self) -> str:
        return f"{self.status:<7} {self.goal}: {self.text}"


def _load_json(path: Path) -> Any:
    return json.loads(path.read_text())


# ------------------------------------------------------------------------------------------------
# readers
# ------------------------------------------------------------------------------------------------
def optim_rows(folder: Path) -> list[dict]:
    data = _load_json(folder / "bench_optim.json")
    return data["rows"] if isinstance(data, dict) else data


def _num(cell: str) -> float | None:
    m = re.match(r"^\s*(-?[0-9.]+(?:e[-+]?\d+)?)", cell)
    return float(m.group(1)) if m else None


def parse_loss_markdown(text: str) -> list[dict]:
    """Rows of bench_loss.py's table: ``B``, ``D``, ``impl``, ``ms`` and ``peak_mib`` (None when the
    row was not measured), ``status`` (``ok`` or the text of the time cell: OOM, skipped, ...). The
    columns are found by their header names (``fwd+bwd ms``, ``peak extra MiB``), as the table grows."""
    rows: list[dict] = []
    col_ms, col_peak = 3, 6  # the first table's layout, until a header says otherwise
    for line in text.splitlines():
        if not line.strip().startswith("|"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = [c.lower() for c in cells]
        if "implementation" in names:
            col_ms = next((i for i, c in enumerate(names) if "fwd+bwd" in c), col_ms)
            col_peak = next((i for i, c in enumerate(names) if c.startswith("peak extra")), col_peak)
            continue
        if len(cells) < 4 or not cells[0].isdigit() or not cells[1].isdigit():
            continue
        ms = _num(cells[col_ms]) if col_ms < len(cells) else None
        peak = _num(cells[col_peak]) if col_peak < len(cells) else None
        measured = ms is not None
        rows.append({"B": int(cells[0]), "D": int(cells[1]), "impl": cells[2], "ms": ms if measured else None,
                     "peak_mib": peak if measured else None, "status": "ok" if measured else cells[col_ms]})
    return rows


def loss_rows(folder: Path) -> tuple[list[dict], str]:
    """The loss rows and the file they came from."""
    js, md = folder / "bench_loss.json", folder / "bench_loss.md"
    if js.exists():
        data = _load_json(js)
        rows = data["rows"] if isinstance(data, dict) else data
        return [dict(r, status=r.get("status", "ok")) for r in rows], js.name
    if md.exists():
        return parse_loss_markdown(md.read_text()), md.name
    raise FileNotFoundError(f"neither {js.name} nor {md.name}")


def train_rows(folder: Path) -> list[dict]:
    return _load_json(folder / "bench_train.json")["rows"]


# ------------------------------------------------------------------------------------------------
# goals
# ------------------------------------------------------------------------------------------------
def _missing(goal: str, why: str) -> Line:
    return Line("MISSING", goal, why)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def optimizer_goal(folder: Path) -> list[Line]:
    """Issue 27's optimizer goals: the 1.07 B step with the finiteness check and without it, and the
    ViT-B-32 layout (350 tensors: the host path) against torch's AdamW bf16 in the same run."""
    goals = (f"optimizer step, 1.07 B params <= {OPTIM_GOAL_MS:g} ms",
             f"optimizer step, 1.07 B params, check_finite=False <= {OPTIM_NOCHECK_GOAL_MS:g} ms",
             f"optimizer step, ViT-B-32 shapes <= {OPTIM_VIT_RATIO:g}x torch AdamW bf16 (same run)")
    try:
        all_rows = optim_rows(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [_missing(g, f"bench_optim.json unreadable: {err}") for g in goals]
    out = []
    for goal, layout, name, limit in ((goals[0], OPTIM_LAYOUT, OPTIM_ROW, OPTIM_GOAL_MS),
                                      (goals[1], OPTIM_LAYOUT, OPTIM_NOCHECK_ROW, OPTIM_NOCHECK_GOAL_MS)):
        by_name = {r.get("optimizer"): r for r in all_rows if r.get("layout") == layout}
        row = by_name.get(name)
        refs = [f"{n} {r['ms']:.2f} ms" if "ms" in r else f"{n}: {r.get('error', 'no figure')}"
                for n, r in by_name.items() if n != name and r is not None]
        context = f" (anchor torch fused bf16 {OPTIM_ANCHOR_MS:g} ms; this run: " + ("; ".join(refs) or "no other rows") + ")"
        if row is None or "ms" not in row:
            why = f"no '{name}' row of layout {layout}" if row is None else f"'{name}': {row.get('error')}"
            out.append(_missing(goal, why + context))
        else:
            out.append(Line(_verdict(row["ms"] <= limit), goal, f"{name}: {row['ms']:.2f} ms" + context))
    vit = {r.get("optimizer"): r for r in all_rows if r.get("layout") == "vit-b-32"}
    ours, torch_row = vit.get(OPTIM_ROW), next((r for n, r in vit.items() if str(n).startswith("torch AdamW bf16")), None)
    if ours is None or torch_row is None or "ms" not in ours or "ms" not in torch_row:
        out.append(_missing(goals[2], "no vit-b-32 rows of SRAdamW and torch AdamW bf16 with figures"))
    else:
        ratio = ours["ms"] / torch_row["ms"]
        out.append(Line(_verdict(ratio <= OPTIM_VIT_RATIO), goals[2],
                        f"{ours['ms']:.2f} ms vs {torch_row['optimizer']} {torch_row['ms']:.2f} ms: {ratio:.2f}x"))
    return out


def _loss_row(rows: list[dict], batch: int, impl: str) -> dict | None:
    return next((r for r in rows if r["B"] == batch and r["D"] == LOSS_DIM and r["impl"] == impl), None)


def _loss_ref(rows: list[dict], batch: int, key: str, unit: str) -> str:
    refs = []
    for r in rows:
        if r["B"] == batch and r["D"] == LOSS_DIM and r["impl"] != "fused":
            value = r.get(key)
            refs.append(f"{r['impl']} {value:.1f} {unit}" if value is not None and r.get("status", "ok") == "ok"
                        else f"{r['impl']} {r.get('status', 'n/a')}")
    return "; ".join(refs) or "no other rows"


def loss_goals(folder: Path) -> list[Line]:
    time_goal = f"loss fwd+bwd, B=32768 D={LOSS_DIM} bf16 <= {LOSS_GOAL_MS:g} ms"
    mem_goal = f"loss extra memory, B=131072 D={LOSS_DIM} bf16 <= {LOSS_GOAL_MIB / 1024:g} GiB"
    try:
        rows, source = loss_rows(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [_missing(time_goal, f"bench_loss results unreadable: {err}"),
                _missing(mem_goal, f"bench_loss results unreadable: {err}")]
    out = []
    for goal, batch, key, limit, anchor, unit in (
        (time_goal, 32768, "ms", LOSS_GOAL_MS, f"open_clip {LOSS_ANCHOR_MS:g} ms", "ms"),
        (mem_goal, 131072, "peak_mib", LOSS_GOAL_MIB, f"open_clip {LOSS_ANCHOR_MIB:.0f} MiB", "MiB"),
    ):
        context = f" (anchor {anchor}; this run: {_loss_ref(rows, batch, key, unit)}; from {source})"
        row = _loss_row(rows, batch, "fused")
        value = None if row is None else row.get(key)
        if value is None:
            why = "no fused row" if row is None else f"fused: {row.get('status', 'no figure')}"
            out.append(_missing(goal, why + context))
        else:
            out.append(Line(_verdict(value <= limit), goal, f"fused {value:.1f} {unit}" + context))
    return out


def train_goals(folder: Path) -> list[Line]:
    sps_goal = f"ViT-B-32 train, batch {TRAIN_BATCH} >= {TRAIN_GOAL_SPS:g} samples/s"
    mem_goal = f"ViT-B-32 train, batch {TRAIN_BATCH}, peak memory <= {TRAIN_GOAL_GIB:g} GiB"
    try:
        rows = train_rows(folder)
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [_missing(sps_goal, f"bench_train.json unreadable: {err}"),
                _missing(mem_goal, f"bench_train.json unreadable: {err}")]
    plain = [r for r in rows if r.get("batch") == TRAIN_BATCH and not r.get("ckpt") and r.get("accumulation", 1) == 1]
    ours = [r for r in plain if str(r.get("arm", "")).startswith("recipe-") and "samples_per_s" in r and r.get("fits")]
    refs = "; ".join(
        f"{r['arm']} {r['samples_per_s']:.0f} samples/s, {r.get('peak_bytes', 0) / GIB:.1f} GiB"
        if "samples_per_s" in r else f"{r.get('arm')}: {r.get('error', 'no figure')}"
        for r in plain if not str(r.get("arm", "")).startswith("recipe-"))
    context = f" (this run: {refs or 'no baseline row'})"
    if not ours:
        why = f"no recipe row at batch {TRAIN_BATCH}, checkpointing off, accumulation 1 that fits"
        return [_missing(sps_goal, why + context), _missing(mem_goal, why + context)]
    best = max(ours, key=lambda r: r["samples_per_s"])
    name = f"{best['arm']}: "
    sps, peak = best["samples_per_s"], best.get("peak_bytes")
    out = [Line(_verdict(sps >= TRAIN_GOAL_SPS), sps_goal, f"{name}{sps:.0f} samples/s" + context)]
    if peak is None:
        out.append(_missing(mem_goal, f"{name}no peak_bytes" + context))
    else:
        out.append(Line(_verdict(peak / GIB <= TRAIN_GOAL_GIB), mem_goal, f"{name}{peak / GIB:.2f} GiB" + context))
    return out


def data_goals(folder: Path) -> list[Line]:
    """The opt-in ``data`` step's goal (only when its bench_data.json is there): per decode device, the
    train step on loader batches reaches DATA_GOAL_RATIO of its synthetic-input rate."""
    path = folder / "bench_data.json"
    if not path.exists():
        return []
    try:
        res = _load_json(path)["train_step"]
        arms, synthetic = res["arms"], res["arms"]["synthetic"]["samples_per_s"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return [_missing(f"train step on loader batches >= {DATA_GOAL_RATIO:g}x synthetic", f"bench_data.json: {err}")]
    out = []
    for name, arm in arms.items():
        if name == "synthetic":
            continue
        goal = f"{res.get('preset')} batch {res.get('batch')}, {name} ({res.get('workers')} workers) >= " \
               f"{DATA_GOAL_RATIO:g}x synthetic inputs"
        if "ratio_to_synthetic" not in arm:
            out.append(_missing(goal, str(arm.get("unavailable", "no figure"))))
            continue
        out.append(Line(_verdict(arm["ratio_to_synthetic"] >= DATA_GOAL_RATIO), goal,
                        f"{arm['samples_per_s']:.0f} vs {synthetic:.0f} samples/s = {arm['ratio_to_synthetic']:.2f}x "
                        f"(loader alone {arm.get('loader_only_samples_per_s')} samples/s)"))
    return out


def evaluate(folder: Path) -> list[Line]:
    return [*optimizer_goal(folder), *loss_goals(folder), *train_goals(folder), *data_goals(folder)]


def goals_markdown(lines: list[Line], folder: Path) -> str:
    env = {}
    if (folder / "env.json").exists():
        try:
            env = _load_json(folder / "env.json")
        except ValueError:
            env = {}
    head = f"# GOALS ({folder.name})\n\n"
    if env:
        head += (f"{env.get('device', '?')}, driver {env.get('driver', '?')}; torch "
                 f"{env.get('versions', {}).get('torch', '?')}, triton {env.get('versions', {}).get('triton', '?')}; "
                 f"commit {env.get('git_commit', '?')}; {env.get('date', '?')}\n\n")
    counts = {s: sum(x.status == s for x in lines) for s in ("PASS", "FAIL", "MISSING")}
    table = ["| result | goal | measured (reference figures of this run) |", "|---|---|---|"]
    table += [f"| **{x.status}** | {x.goal} | {x.text.replace('|', '/')} |" for x in lines]
    return (head + "\n".join(table) + f"\n\n{counts['PASS']} PASS, {counts['FAIL']} FAIL, {counts['MISSING']} MISSING\n")


# ------------------------------------------------------------------------------------------------
# environment
# ------------------------------------------------------------------------------------------------
def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment() -> dict[str, Any]:
    """Device name, memory, driver, library versions, date, host and git commit of this run."""
    import importlib.metadata

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for dist, key in (("torch", "torch"), ("triton", "triton"), ("deepspeed", "deepspeed"), ("timm", "timm"),
                      ("transformers", "transformers"), ("open_clip_torch", "open_clip"),
                      ("torch-optimi", "optimi"), ("torchao", "torchao")):
        try:
            versions[key] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[key] = None
    env: dict[str, Any] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),  # noqa: UP017 (3.10)
                           "host": socket.gethostname(), "versions": versions}
    smi = _run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    if smi:
        name, memory, driver = (c.strip() for c in smi.splitlines()[0].split(",")[:3])
        env.update(device=name, memory=memory, driver=driver)
    try:
        import torch

        env["cuda_available"] = torch.cuda.is_available()
        env["torch_cuda"] = torch.version.cuda
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env.setdefault("device", props.name)
            env["memory_bytes"] = props.total_memory
            env["sm_count"] = props.multi_processor_count
            env["capability"] = f"{props.major}.{props.minor}"
    except Exception as err:  # noqa: BLE001  (the record says what went wrong)
        env["torch_error"] = f"{type(err).__name__}: {err}"
    root = Path(__file__).resolve().parents[1]
    commit = os.environ.get("GIT_COMMIT") or _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    env["git_commit"] = commit or "unknown (no .git here; set GIT_COMMIT)"
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    if dirty is not None:
        env["git_dirty"] = bool(dirty)
    return env


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("env", "goals"))
    ap.add_argument("folder", type=Path)
    ap.add_argument("--strict", action="store_true", help="goals: exit 1 on any FAIL or MISSING")
    a = ap.parse_args(argv)
    a.folder.mkdir(parents=True, exist_ok=True)
    if a.what == "env":
        env = environment()
        (a.folder / "env.json").write_text(json.dumps(env, indent=1) + "\n")
        print(json.dumps(env, indent=1))
        return 0
    lines = evaluate(a.folder)
    (a.folder / "goals.md").write_text(goals_markdown(lines, a.folder))
    print("GOALS")
    for x in lines:
        print(x)
    print(f"wrote {a.folder / 'goals.md'}", file=sys.stderr)
    return 1 if a.strict and any(x.status != "PASS" for x in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
