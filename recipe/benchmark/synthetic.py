"""Two small CLIP_benchmark datasets of the demo's synthetic shapes, written by CLIP_benchmark's own
converter (``clip_benchmark.webdataset_builder``) in its ``wds/`` layout::

    python -m recipe.benchmark.synthetic --out data/clip_benchmark
    # -> data/clip_benchmark/wds_synthetic_shapes    classification: the 12 "<colour> <shape>" classes of the
    #                                                 demo, CLIP_benchmark's CIFAR-10 templates
    #    data/clip_benchmark/wds_synthetic_captions  retrieval: each image with two captions

The images are new draws of the demo's scenes (:mod:`recipe.synthetic`, a split of their own: neither
the demo's training nor its validation images), so ``python -m recipe.evaluate --checkpoint RUN
--benchmark synthetic_shapes,synthetic_captions --benchmark-root data/clip_benchmark`` scores a demo run
the way CLIP_benchmark scores CIFAR-10 and MSCOCO.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["CLASSIFICATION_NAME", "RETRIEVAL_NAME", "TEMPLATES_OF", "write_benchmarks", "main"]

#: The benchmark names the two sets go by (``wds_<name>`` folders).
CLASSIFICATION_NAME = "synthetic_shapes"
RETRIEVAL_NAME = "synthetic_captions"
#: Whose CLIP_benchmark templates the classification set takes.
TEMPLATES_OF = "cifar10"
_SPLIT = 2  # recipe.synthetic draws the demo's train split with 0 and its val split with 1


class _Items(list):
    """A list of ``(image, target)`` with CLIP_benchmark's ``classes`` and ``templates`` attributes."""

    classes: list[str] | None = None
    templates: list[str] | None = None


def clip_benchmark_templates(name: str = TEMPLATES_OF) -> list[str]:
    """CLIP_benchmark's English zero-shot templates of dataset ``name`` (its packaged JSON)."""
    import clip_benchmark.datasets

    path = Path(clip_benchmark.datasets.__file__).parent / "en_zeroshot_classification_templates.json"
    return list(json.loads(path.read_text())[name])


def write_benchmarks(out: str | os.PathLike, n: int = 240, image_size: int = 32, seed: int = 0,
                     colours: Sequence[str] | None = None, shapes: Sequence[str] | None = None,
                     quiet: bool = True) -> dict[str, Path]:
    """Writes ``OUT/wds_synthetic_shapes`` (``n`` labelled images) and ``OUT/wds_synthetic_captions``
    (``n`` images with two captions each) with CLIP_benchmark's converter; returns ``{name: folder}``."""
    from clip_benchmark.webdataset_builder import PIL_to_bytes, convert_dataset, convert_retrieval_dataset

    from .. import synthetic as syn

    colours = list(colours or syn.DEFAULT_COLOURS)
    shapes = list(shapes or syn.DEFAULT_SHAPES)
    classes = syn.class_names(colours, shapes)
    labelled, captioned = _Items(), _Items()
    for i in range(n):
        rng = np.random.default_rng([seed, _SPLIT, i])
        spec = syn.sample_scene(rng, i % len(classes), colours, shapes)
        labelled.append((syn.render(spec, image_size, rng), spec.label))
        rng = np.random.default_rng([seed, _SPLIT + 1, i])
        spec = syn.sample_scene(rng, int(rng.integers(len(classes))), colours, shapes)
        other = syn.sample_scene(rng, spec.label, colours, shapes).caption  # a second caption, same colour/shape
        captioned.append((syn.render(spec, image_size, rng), [spec.caption, other]))
    labelled.classes, labelled.templates = classes, clip_benchmark_templates()
    out = Path(out)
    folders = {CLASSIFICATION_NAME: out / f"wds_{CLASSIFICATION_NAME}", RETRIEVAL_NAME: out / f"wds_{RETRIEVAL_NAME}"}
    sink = io.StringIO() if quiet else sys.stdout
    with contextlib.redirect_stdout(sink), warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")  # the converter's 8 workers
        convert_dataset(labelled, "test", str(folders[CLASSIFICATION_NAME]), transform=PIL_to_bytes("png"),
                        image_format="png", verbose=not quiet)
        convert_retrieval_dataset(captioned, "test", str(folders[RETRIEVAL_NAME]), transform=PIL_to_bytes("png"),
                                  image_format="png", verbose=not quiet)
    return folders


def main(argv: Sequence[str] | None = None) -> dict[str, Path]:
    ap = argparse.ArgumentParser(prog="python -m recipe.benchmark.synthetic", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True,
                    help="benchmark root to write wds_synthetic_shapes/ and wds_synthetic_captions/ into")
    ap.add_argument("--n", type=int, default=240, help="images in each set")
    ap.add_argument("--image-size", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    folders = write_benchmarks(args.out, args.n, args.image_size, args.seed)
    for name, folder in folders.items():
        print(f"{name}: {folder}", file=sys.stderr)
    return folders


if __name__ == "__main__":
    main()
