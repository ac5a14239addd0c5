"""``python -m recipe.export RUN_DIR --format open_clip|hf --out DIR``: see :mod:`recipe.export`."""

from __future__ import annotations

import argparse
import sys

from ..quiet import quiet_libraries

quiet_libraries()  # before the towers' libraries are imported

from . import DTYPES, FORMATS, UnsupportedExport, export_run  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m recipe.export",
        description="Export a trained run's model to open_clip or Hugging Face transformers (offline).",
        allow_abbrev=False,
    )
    ap.add_argument("run_dir", help="run directory (its latest complete checkpoint) or one checkpoint tag directory")
    ap.add_argument("--format", required=True, choices=FORMATS, help="open_clip (local-dir:) or hf (CLIPModel)")
    ap.add_argument("--out", required=True, help="output directory (must not exist, or be empty)")
    ap.add_argument("--dtype", default="fp32", choices=tuple(DTYPES), help="dtype of the written weights")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory")
    ap.add_argument("--ema", action="store_true", help="export the EMA weights (a run trained with --ema-decay)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from ..checkpoint import CheckpointError

    try:
        out = export_run(args.run_dir, args.format, args.out, args.dtype, overwrite=args.overwrite, ema=args.ema)
    except (UnsupportedExport, CheckpointError, FileNotFoundError, FileExistsError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1 if isinstance(e, UnsupportedExport) else 2
    print(f"wrote {out} ({args.format}, {args.dtype}{', EMA weights' if args.ema else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
