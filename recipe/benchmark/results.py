"""Benchmark results as CLIP_benchmark writes them (one JSON per dataset), one summary table (printed and
saved as CSV), and the flat metric names training logs.

A result file holds CLIP_benchmark's schema, ``{"dataset", "model", "pretrained", "task", "metrics",
"language"}`` (``clip_benchmark build`` reads it), named as its command line names results,
``<dataset>_<language>_<task>.json`` (its default template without the model's name, which the folder
holds). In training the metrics are ``benchmark_<dataset>_<metric>`` (``benchmark_cifar10_acc1``,
``benchmark_mscoco_captions_image_retrieval_recall@5``) with ``benchmark_<dataset>_samples``.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path
from typing import Any, Sequence

from .datasets import CLASSIFICATION
from .evaluation import RECALL_K, BenchmarkResult

__all__ = ["PREFIX", "COLUMNS", "result_record", "result_filename", "flat_metrics", "summary_rows", "format_table",
           "csv_text", "write_results"]

#: Prefix of the benchmark metrics in training's metrics.
PREFIX = "benchmark"
#: The summary's metric columns: CLIP_benchmark's metric names.
COLUMNS = ("acc1", "acc5", "mean_per_class_recall", "mean_average_precision",
           *(f"image_retrieval_recall@{k}" for k in RECALL_K), *(f"text_retrieval_recall@{k}" for k in RECALL_K))
_SHORT = {"mean_per_class_recall": "mean recall", "mean_average_precision": "mAP",
          **{f"image_retrieval_recall@{k}": f"image R@{k}" for k in RECALL_K},
          **{f"text_retrieval_recall@{k}": f"text R@{k}" for k in RECALL_K}}


def result_record(result: BenchmarkResult, model: str, pretrained: str, language: str = "en") -> dict[str, Any]:
    """The JSON CLIP_benchmark's ``eval`` writes for one dataset."""
    return {"dataset": result.spec.dataset, "model": model, "pretrained": pretrained, "task": result.spec.task,
            "metrics": dict(result.metrics), "language": language}


def result_filename(result: BenchmarkResult, language: str = "en") -> str:
    """``<dataset>_<language>_<task>.json`` (CLIP_benchmark's dataset slug: ``wds/`` left out, ``/`` as ``_``)."""
    return f"{result.spec.base.replace('/', '_')}_{language}_{result.spec.task}.json"


def flat_metrics(results: Sequence[BenchmarkResult], prefix: str = PREFIX) -> dict[str, float]:
    """``{<prefix>_<dataset>_<metric>: value}`` and ``<prefix>_<dataset>_samples`` for every result."""
    out: dict[str, float] = {}
    for r in results:
        for k, v in r.metrics.items():
            out[f"{prefix}_{r.spec.slug}_{k}"] = float(v)
        out[f"{prefix}_{r.spec.slug}_samples"] = float(r.samples)
    return out


def summary_rows(results: Sequence[BenchmarkResult]) -> list[dict[str, Any]]:
    """One row per dataset: dataset, task, images, captions, then the metric columns it has."""
    used = [c for c in COLUMNS if any(c in r.metrics for r in results)]
    rows = []
    for r in results:
        row: dict[str, Any] = {"dataset": r.spec.dataset,
                               "task": "classification" if r.spec.task == CLASSIFICATION else "retrieval",
                               "images": r.samples, "captions": r.texts or ""}
        row.update({c: r.metrics.get(c, "") for c in used})
        rows.append(row)
    return rows


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return "nan" if math.isnan(v) else f"{v:.4f}"
    return str(v)


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """The rows as a Markdown table (metric columns by short names)."""
    if not rows:
        return ""
    keys = list(rows[0])
    head = [_SHORT.get(k, k) for k in keys]
    body = [[_cell(row.get(k, "")) for k in keys] for row in rows]
    align = ["---" if k in ("dataset", "task") else "---:" for k in keys]
    return "\n".join("| " + " | ".join(line) + " |" for line in [head, align, *body])


def csv_text(rows: Sequence[dict[str, Any]], extra: dict[str, Any] | None = None) -> str:
    """The rows as CSV (CLIP_benchmark's metric names as columns), ``extra`` columns on every row."""
    if not rows:
        return ""
    buf = io.StringIO()
    fields = [*rows[0], *(extra or {})]
    writer = csv.DictWriter(buf, fieldnames=fields, lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({**row, **(extra or {})})
    return buf.getvalue()


def write_results(results: Sequence[BenchmarkResult], out_dir: Path, model: str, pretrained: str,
                  extra: dict[str, Any] | None = None, language: str = "en") -> list[Path]:
    """Writes each result's JSON and ``summary.csv`` into ``out_dir`` (created), each file atomically;
    returns the JSON paths and then the CSV's."""
    from ..run.checkpoint import atomic_write_bytes

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for r in results:
        path = out_dir / result_filename(r, language)
        atomic_write_bytes(path, json.dumps(result_record(r, model, pretrained, language)).encode())
        written.append(path)
    path = out_dir / "summary.csv"
    atomic_write_bytes(path, csv_text(summary_rows(results), extra).encode())
    return written + [path]
