"""The measurement plan: every arm x checkpointing setting (x accumulation), each in a worker process,
with the largest-batch search."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from _common import environment  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)

from .report import row_line
from .settings import BenchSettings, available_arms, resolve_settings, worker_spec
from .worker import run_worker

__all__ = ["largest_fitting", "run_benchmark"]


def largest_fitting(
    probe: Callable[[list[int]], dict[int, bool]],
    start: int,
    max_batch: int,
    tolerance: float,
    granularity: int,
    known: dict[int, bool] | None = None,
) -> dict[str, Any]:
    """Largest batch size in ``[start, max_batch]`` that fits, assuming that fitting is monotone.

    Doubles from ``start`` (then ``max_batch``) until a batch does not fit, then bisects between
    the last batch that fitted and the first that did not.

    Args:
        probe: ``probe(batches) -> {batch: fits}``; tries ``batches`` in order and may stop after
            the first that does not fit (batches left out count as not fitting).
        start: First batch of the doubling phase.
        max_batch: Upper end of the search.
        tolerance: Stop bisecting when ``hi - lo <= tolerance * lo`` ...
        granularity: ... or ``hi - lo <= granularity``; bisection probes are multiples of it.
        known: Results already measured (e.g. the timed batch and a first doubling pass).

    Returns:
        ``{"largest": lo, "first_failing": hi, "probes": {batch: fits}, "capped": bool}``: ``lo`` is
        ``None`` when ``start`` does not fit, ``hi`` is ``None`` when ``max_batch`` fits (then
        ``capped`` is true: the real limit may be higher).
    """
    results: dict[int, bool] = dict(known or {})
    ladder, b = [], start
    while b < max_batch:
        ladder.append(b)
        b *= 2
    ladder.append(max_batch)
    for i, b in enumerate(ladder):
        if b not in results:
            todo = [x for x in ladder[i:] if x not in results]
            got = probe(todo)
            for x in todo:
                results[x] = bool(got.get(x, False))
                if not results[x]:
                    break
        if not results.get(b, False):
            break
    lo = hi = None
    for b in ladder:
        if not results.get(b, False):
            hi = b
            break
        lo = b
    while lo is not None and hi is not None and hi - lo > max(granularity, tolerance * lo):
        mid = (lo + hi) // 2 // granularity * granularity
        if mid <= lo:
            break
        if mid not in results:
            results[mid] = bool(probe([mid]).get(mid, False))
        if results[mid]:
            lo = mid
        else:
            hi = mid
    return {"largest": lo, "first_failing": hi, "probes": dict(sorted(results.items())), "capped": hi is None}


def run_benchmark(s: BenchSettings, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Measures every arm x checkpointing setting; returns the JSON-ready result."""
    s = resolve_settings(s)
    arms, missing = available_arms(s.loss_modes, s.baseline, s.device)
    rows: list[dict[str, Any]] = []
    plan = [(arm, a) for arm in arms for a in (s.accumulation if arm.startswith("recipe-") else [1])]
    for ckpt in s.ckpt:
        for arm, accumulation in plan:
            fit = accumulation == 1 and (s.fit == "all" or (s.fit == "off" and not ckpt))
            timed = [{"batch": s.batch, "warmup": s.warmup, "steps": s.steps, "kind": "timed"}]
            ascent = []
            b = s.batch * 2
            while fit and b < s.max_batch:
                ascent.append(b)
                b *= 2
            if fit and s.max_batch > s.batch:
                ascent.append(s.max_batch)
            batches = timed + [{"batch": b, "warmup": 1, "steps": 1, "kind": "probe"} for b in ascent]
            log(
                f"{arm}, checkpointing {'on' if ckpt else 'off'}: batch {s.batch}"
                + (f" in {accumulation} micro-batches" if accumulation > 1 else "")
                + (f", then probing {ascent}" if ascent else "")
            )
            results = run_worker(worker_spec(s, arm, ckpt, batches, accumulation), s.timeout_s)
            main_result = next((r for r in results if r["kind"] == "timed"), None)
            if main_result is None:
                raise RuntimeError(f"{arm} produced no result")
            row = dict(main_result)
            row["probes"] = {r["batch"]: r["fits"] for r in results}
            if fit:

                def probe(batches: list[int], arm: str = arm, ckpt: bool = ckpt) -> dict[int, bool]:
                    log(f"  probe {arm} ckpt={ckpt}: {batches}")
                    probes = [{"batch": b, "warmup": 1, "steps": 1, "kind": "probe"} for b in batches]
                    got = run_worker(worker_spec(s, arm, ckpt, probes), s.timeout_s)
                    return {r["batch"]: r["fits"] for r in got}

                search = largest_fitting(
                    probe, s.batch, s.max_batch, s.fit_tolerance, s.fit_granularity, known=row["probes"]
                )
                row["largest_batch"], row["first_failing_batch"], row["fit_capped"] = (
                    search["largest"],
                    search["first_failing"],
                    search["capped"],
                )
                row["probes"] = search["probes"]
            rows.append(row)
            log(row_line(row))
    _add_ratios(rows)
    return {"settings": asdict(s), "environment": environment(s.device), "unavailable": missing, "rows": rows}


def _add_ratios(rows: list[dict[str, Any]]) -> None:
    """Speed and memory of each recipe row relative to the baseline row with the same setting."""
    for r in rows:
        base = next(
            (
                b
                for b in rows
                if b["arm"] in ("openclip", "torch-amp") and b["ckpt"] == r["ckpt"] and "samples_per_s" in b
            ),
            None,
        )
        if base and "samples_per_s" in r:
            r["speedup_vs_baseline"] = r["samples_per_s"] / base["samples_per_s"]
            r["memory_vs_baseline"] = r["peak_bytes"] / base["peak_bytes"] if base["peak_bytes"] > 0 else None
