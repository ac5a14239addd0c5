"""``python -m recipe.export RUN_DIR --format open_clip|hf --out DIR``: see :mod:`recipe.export`."""

from __future__ import annotations

import argparse
import sys

from ..quiet import quiet_libraries

quiet_libraries()  # before the towers' libraries are imported

from ..run.checkpoint import EMA_WEIGHTS  # noqa: E402
from . import DTYPES, FORMATS, WEIGHTS, LoadedRun, UnsupportedExport, _export  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m recipe.export",
        description="Export a trained run's model to open_clip or Hugging Face transformers (offline).",
        allow_abbrev=False,
    )
    ap.add_argument("run_dir", help="run directory (its latest complete checkpoint) or one checkpoint tag directory")
    ap.add_argument("--format", required=True, choices=FORMATS, help="open_clip (local-dir:) or hf (CLIPModel)")
    ap.add_argument("--out", required=True,
                    help="output directory: new or empty (or, with --overwrite, an earlier export that is not "
                         "inside the source run); never the run or a directory around it")
    ap.add_argument("--dtype", default="fp32", choices=tuple(DTYPES),
                    help="dtype of the written weights (bf16/fp16: the fp32 values rounded to nearest)")
    ap.add_argument("--weights", choices=WEIGHTS, default=None,
                    help="master (default): the exact fp32 masters the optimizer keeps for mastered groups (the "
                         "image tower and the logit scale by default), read from the checkpoint's optimizer files, "
                         "and the module weights for the other parameters; module: the module weights alone "
                         "(model_weights.pt, the run's bf16/fp16 weights as it trained and evaluated; the default "
                         "with --ema)")
    ap.add_argument("--overwrite", action="store_true",
                    help="replace an earlier export (a directory holding recipe_export.json) at --out; nothing "
                         "else is ever replaced")
    ap.add_argument("--ema", action="store_true",
                    help="export the EMA weights (a run trained with --ema-decay); they have no fp32 master, so "
                         "--weights master is refused with --ema")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..run.checkpoint import CheckpointError

    try:
        out, run = _export(args.run_dir, args.format, args.out, args.dtype, args.overwrite, args.ema, args.weights)
    except (UnsupportedExport, CheckpointError, FileNotFoundError, FileExistsError, PermissionError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, UnsupportedExport) else 2
    print(f"wrote {out} ({args.format}, {args.dtype}, {describe(run, args.dtype)})")
    if run.weights == "master" and not run.optimizer_state:
        print(f"note: {run.tag_dir} holds no optimizer state (only {run.weights_file}): the module weights were "
              "exported", file=sys.stderr)
    return 0


def describe(run: LoadedRun, dtype: str = "fp32") -> str:
    """Which weights an export in ``dtype`` holds, for its report line."""
    if run.weights_file == EMA_WEIGHTS:
        return "EMA weights"
    saved = str(run.saved_dtype).replace("torch.", "")
    if run.weights == "module":
        return f"module weights ({saved})"
    total = sum(1 for _ in run.model.parameters())
    rounded = f" rounded to {dtype}" if dtype != "fp32" and run.master_names else ""
    masters = f"fp32 masters of {len(run.master_names)} of {total} parameters{rounded}"
    return f"{masters}, module weights ({saved}) for the rest"


if __name__ == "__main__":
    sys.exit(main())
