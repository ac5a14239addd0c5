"""A small, learnable image-caption dataset of rendered shapes, written to disk.

Each image shows one shape (circle, square, triangle, ...) of one colour at one of five
positions, in one of two sizes, on a noisy grey background. The class is (colour, shape); the
caption, drawn from varied templates, names the colour and shape and often the size, position or
background. Zero-shot prompts use templates that do not occur in the captions.

``python -m recipe.synthetic --out DIR --n N [--n-val M] [--seed S] [--image-size 64]`` writes::

    DIR/images/{train,val}/00000000.png   the images
    DIR/train.csv, DIR/val.csv            OpenCLIP CSV: tab-separated filepath, title, label
                                          (paths relative to DIR)
    DIR/wds/{train,val}/00000.tar         webdataset shards: <key>.png, <key>.txt, <key>.cls, <key>.json
    DIR/zeroshot.json                     {"classnames": [...], "templates": [...]}
    DIR/info.json                         sizes, seed, classes and attribute vocabularies

Output is byte-for-byte deterministic given the arguments: each sample is drawn from its own
generator seeded by ``(seed, split, index)``.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import math
import os
import tarfile
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from PIL import Image, ImageDraw

#: RGB values of the colours shapes can have (well separated in hue).
PALETTE = {
    "red": (214, 39, 40),
    "green": (44, 160, 44),
    "blue": (31, 90, 220),
    "yellow": (240, 210, 30),
    "purple": (148, 60, 189),
    "orange": (255, 127, 14),
    "cyan": (23, 200, 215),
    "pink": (240, 110, 190),
}
SHAPES = ("circle", "square", "triangle", "cross", "diamond")
#: Centre of the shape, as fractions of the image size.
POSITIONS = {
    "top left": (0.3, 0.3),
    "top right": (0.7, 0.3),
    "bottom left": (0.3, 0.7),
    "bottom right": (0.7, 0.7),
    "center": (0.5, 0.5),
}
#: Radius ranges (fractions of the image size).
SIZES = {"small": (0.15, 0.19), "large": (0.23, 0.27)}
#: Largest rotation of a shape from its upright pose, in radians.
MAX_ROTATION = math.radians(20)
#: Background grey levels.
BACKGROUNDS = {"dark": 50, "grey": 120, "light": 200}

DEFAULT_COLOURS = ("red", "green", "blue", "yellow")
DEFAULT_SHAPES = ("circle", "square", "triangle")

CAPTION_TEMPLATES = (
    "a {size} {colour} {shape} in the {position}",
    "a {colour} {shape}",
    "a {colour} {shape} on a {background} background",
    "{position}: a {colour} {shape}",
    "a {size} {shape} coloured {colour}",
    "the {shape} is {colour}",
    "one {colour} {shape}, {size}, at the {position}",
    "a drawing of a {colour} {shape}",
    "a {shape} in {colour} near the {position}",
    "{colour} {shape}",
)
ZEROSHOT_TEMPLATES = (
    "a photo of a {}.",
    "a picture of a {}.",
    "an image showing a {}.",
    "a rendering of a {}.",
)
ZEROSHOT_FILENAME = "zeroshot.json"
_SPLIT_CODE = {"train": 0, "val": 1}
_SUPERSAMPLE = 4


@dataclass(frozen=True)
class SceneSpec:
    """What one image shows.

    Attributes:
        label: Class index ``colour_index * len(shapes) + shape_index``.
        colour: Colour name.
        shape: Shape name.
        position: Position name.
        size: Size name.
        background: Background name.
        radius: Radius as a fraction of the image size.
        angle: Rotation in radians.
        center: Shape centre as fractions of the image size (position plus jitter).
        caption: The caption.
    """

    label: int
    colour: str
    shape: str
    position: str
    size: str
    background: str
    radius: float
    angle: float
    center: tuple[float, float]
    caption: str


def class_names(colours: Sequence[str], shapes: Sequence[str]) -> list[str]:
    """Class names, ``"<colour> <shape>"``, in label order."""
    return [f"{c} {s}" for c in colours for s in shapes]


def sample_scene(rng: np.random.Generator, label: int, colours: Sequence[str], shapes: Sequence[str]) -> SceneSpec:
    """Draw everything but the class of one scene."""
    colour, shape = colours[label // len(shapes)], shapes[label % len(shapes)]
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    size = list(SIZES)[rng.integers(len(SIZES))]
    background = list(BACKGROUNDS)[rng.integers(len(BACKGROUNDS))]
    radius = float(rng.uniform(*SIZES[size]))
    angle = float(rng.uniform(-1, 1) * MAX_ROTATION)
    cx, cy = POSITIONS[position]
    center = (cx + float(rng.uniform(-0.04, 0.04)), cy + float(rng.uniform(-0.04, 0.04)))
    template = CAPTION_TEMPLATES[rng.integers(len(CAPTION_TEMPLATES))]
    caption = template.format(colour=colour, shape=shape, position=position, size=size, background=background)
    return SceneSpec(label, colour, shape, position, size, background, radius, angle, center, caption)


def _polygon(shape: str, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    if shape == "square":
        corners = [angle + math.pi / 4 + k * math.pi / 2 for k in range(4)]
        return [(cx + r * math.cos(a), cy + r * math.sin(a)) for a in corners]
    if shape == "triangle":
        corners = [angle - math.pi / 2 + k * 2 * math.pi / 3 for k in range(3)]
        return [(cx + 1.15 * r * math.cos(a), cy + 1.15 * r * math.sin(a)) for a in corners]
    if shape == "diamond":
        corners = [angle + k * math.pi / 2 for k in range(4)]
        scale = [1.2, 0.6, 1.2, 0.6]
        return [(cx + s * r * math.cos(a), cy + s * r * math.sin(a)) for a, s in zip(corners, scale)]
    if shape == "cross":
        w = 0.36 * r
        outline = [(w, r), (w, w), (r, w), (r, -w), (w, -w), (w, -r),
                   (-w, -r), (-w, -w), (-r, -w), (-r, w), (-w, w), (-w, r)]
        ca, sa = math.cos(angle), math.sin(angle)
        return [(cx + x * ca - y * sa, cy + x * sa + y * ca) for x, y in outline]
    raise ValueError(f"unknown shape {shape!r}; known: {SHAPES}")


def render(spec: SceneSpec, image_size: int, rng: np.random.Generator) -> Image.Image:
    """Draw a scene (anti-aliased by supersampling), with colour jitter and pixel noise."""
    big = image_size * _SUPERSAMPLE
    grey = BACKGROUNDS[spec.background]
    img = Image.new("RGB", (big, big), (grey, grey, grey))
    draw = ImageDraw.Draw(img)
    base = np.array(PALETTE[spec.colour], dtype=np.int64)
    fill = tuple(int(v) for v in np.clip(base + rng.integers(-18, 19, size=3), 0, 255))
    cx, cy, r = spec.center[0] * big, spec.center[1] * big, spec.radius * big
    if spec.shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    else:
        draw.polygon(_polygon(spec.shape, cx, cy, r, spec.angle), fill=fill)
    img = img.resize((image_size, image_size), Image.Resampling.BOX)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-8, 9, size=(image_size, image_size, 3), dtype=np.int16)
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def _encode(img: Image.Image, image_format: str) -> bytes:
    buf = io.BytesIO()
    if image_format == "png":
        img.save(buf, format="PNG", compress_level=1)
    else:
        img.save(buf, format="JPEG", quality=92)
    return buf.getvalue()


def _add_tar_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    info.mtime = 0
    info.mode = 0o644
    info.uname = info.gname = ""
    tf.addfile(info, io.BytesIO(data))


def write_split(
    out: str,
    split: str,
    n: int,
    *,
    seed: int,
    image_size: int,
    colours: Sequence[str],
    shapes: Sequence[str],
    image_format: str = "png",
    shard_size: int = 1000,
) -> list[SceneSpec]:
    """Write ``n`` samples of ``split`` as image files + CSV and as webdataset shards.

    Classes cycle ``0, 1, ..., C-1, 0, ...`` so every split is balanced.

    Returns:
        The scene specs, in sample order.
    """
    ext = "png" if image_format == "png" else "jpg"
    img_dir = os.path.join(out, "images", split)
    wds_dir = os.path.join(out, "wds", split)
    os.makedirs(img_dir, exist_ok=True)
    os.makedirs(wds_dir, exist_ok=True)
    num_classes = len(colours) * len(shapes)
    specs: list[SceneSpec] = []
    tf: tarfile.TarFile | None = None
    with open(os.path.join(out, f"{split}.csv"), "w", newline="", encoding="utf-8") as fcsv:
        writer = csv.writer(fcsv, delimiter="\t", lineterminator="\n")
        writer.writerow(["filepath", "title", "label"])
        try:
            for i in range(n):
                if i % shard_size == 0:
                    if tf is not None:
                        tf.close()
                    shard = os.path.join(wds_dir, f"{i // shard_size:05d}.tar")
                    tf = tarfile.open(shard, "w", format=tarfile.USTAR_FORMAT)
                rng = np.random.default_rng([seed, _SPLIT_CODE[split], i])
                spec = sample_scene(rng, i % num_classes, colours, shapes)
                data = _encode(render(spec, image_size, rng), image_format)
                key = f"{i:08d}"
                rel = f"images/{split}/{key}.{ext}"
                with open(os.path.join(out, rel), "wb") as f:
                    f.write(data)
                writer.writerow([rel, spec.caption, spec.label])
                meta = {"label": spec.label, "colour": spec.colour, "shape": spec.shape, "position": spec.position,
                        "size": spec.size}
                _add_tar_member(tf, f"{key}.{ext}", data)
                _add_tar_member(tf, f"{key}.txt", spec.caption.encode("utf-8"))
                _add_tar_member(tf, f"{key}.cls", str(spec.label).encode("ascii"))
                _add_tar_member(tf, f"{key}.json", json.dumps(meta, sort_keys=True).encode("utf-8"))
                specs.append(spec)
        finally:
            if tf is not None:
                tf.close()
    return specs


def write_dataset(
    out: str,
    n: int,
    *,
    n_val: int | None = None,
    seed: int = 0,
    image_size: int = 64,
    colours: Sequence[str] = DEFAULT_COLOURS,
    shapes: Sequence[str] = DEFAULT_SHAPES,
    image_format: str = "png",
    shard_size: int = 1000,
) -> dict:
    """Write the train and validation splits, the zero-shot prompts and ``info.json``.

    Args:
        out: Output directory (created).
        n: Training samples.
        n_val: Validation samples (default ``max(n // 5, number of classes)``).
        seed: Seed; the output is a deterministic function of all arguments.
        image_size: Side of the square images in pixels.
        colours: Colour names from :data:`PALETTE`.
        shapes: Shape names from :data:`SHAPES`.
        image_format: ``png`` or ``jpg``.
        shard_size: Samples per webdataset shard.

    Returns:
        The content of ``info.json``.

    Raises:
        ValueError: Unknown colour/shape/format or non-positive sizes.
    """
    colours, shapes = list(colours), list(shapes)
    unknown = [c for c in colours if c not in PALETTE] + [s for s in shapes if s not in SHAPES]
    if unknown:
        raise ValueError(f"unknown colours/shapes {unknown}; colours: {list(PALETTE)}, shapes: {list(SHAPES)}")
    if len(set(colours)) != len(colours) or len(set(shapes)) != len(shapes) or not colours or not shapes:
        raise ValueError("colours and shapes must be non-empty and without repeats")
    if image_format not in ("png", "jpg"):
        raise ValueError(f"image_format must be 'png' or 'jpg', got {image_format!r}")
    num_classes = len(colours) * len(shapes)
    n_val = max(n // 5, num_classes) if n_val is None else n_val
    if n < 1 or n_val < 1 or image_size < 8 or shard_size < 1:
        got = f"got {n}, {n_val}, {image_size}, {shard_size}"
        raise ValueError(f"need n >= 1, n_val >= 1, image_size >= 8, shard_size >= 1 ({got})")
    os.makedirs(out, exist_ok=True)
    kwargs = dict(seed=seed, image_size=image_size, colours=colours, shapes=shapes, image_format=image_format,
                  shard_size=shard_size)
    write_split(out, "train", n, **kwargs)
    write_split(out, "val", n_val, **kwargs)
    with open(os.path.join(out, ZEROSHOT_FILENAME), "w", encoding="utf-8") as f:
        json.dump({"classnames": class_names(colours, shapes), "templates": list(ZEROSHOT_TEMPLATES)}, f, indent=1)
    info = {
        "seed": seed,
        "n_train": n,
        "n_val": n_val,
        "image_size": image_size,
        "image_format": image_format,
        "shard_size": shard_size,
        "num_classes": num_classes,
        "classnames": class_names(colours, shapes),
        "colours": colours,
        "shapes": shapes,
        "positions": list(POSITIONS),
        "sizes": list(SIZES),
        "backgrounds": list(BACKGROUNDS),
        "csv": {"train": "train.csv", "val": "val.csv", "separator": "\t", "image_column": "filepath",
                "caption_column": "title", "label_column": "label"},
        "webdataset": {"train": f"wds/train/{{00000..{(n - 1) // shard_size:05d}}}.tar",
                       "val": f"wds/val/{{00000..{(n_val - 1) // shard_size:05d}}}.tar",
                       "image_column": "png" if image_format == "png" else "jpg", "caption_column": "txt",
                       "label_column": "cls"},
    }
    with open(os.path.join(out, "info.json"), "w", encoding="utf-8") as f:
        json.dump(info, f, indent=1)
    return info


def main(argv: Sequence[str] | None = None) -> dict:
    """Command line entry point."""
    parser = argparse.ArgumentParser(prog="python -m recipe.synthetic", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n", type=int, required=True, help="training samples")
    parser.add_argument("--n-val", type=int, default=None,
                        help="validation samples (default: n // 5, at least one per class)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=int, default=64)
    parser.add_argument("--colours", default=",".join(DEFAULT_COLOURS),
                        help=f"comma-separated, from {','.join(PALETTE)}")
    parser.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help=f"comma-separated, from {','.join(SHAPES)}")
    parser.add_argument("--image-format", choices=("png", "jpg"), default="png")
    parser.add_argument("--shard-size", type=int, default=1000, help="samples per webdataset shard")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    info = write_dataset(
        args.out,
        args.n,
        n_val=args.n_val,
        seed=args.seed,
        image_size=args.image_size,
        colours=[c.strip() for c in args.colours.split(",") if c.strip()],
        shapes=[s.strip() for s in args.shapes.split(",") if s.strip()],
        image_format=args.image_format,
        shard_size=args.shard_size,
    )
    print(
        f"wrote {info['n_train']} train + {info['n_val']} val samples, {info['num_classes']} classes, "
        f"to {args.out} in {time.perf_counter() - t0:.1f}s"
    )
    return info


if __name__ == "__main__":
    main()
