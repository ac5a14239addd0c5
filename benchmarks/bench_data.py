"""Data loading throughput: the recipe's training loader next to OpenCLIP's webdataset pipeline, in one run.

ViT-B-32 trains at about 4,800 samples/s on one H200, so the loader has to decode that many JPEGs per
second. This measures samples/s per DataLoader worker of

* ``recipe``: :func:`recipe.data.build_train_loader` over webdataset shards with the ``ViT-B-32``
  preset's training transform (224 px random resized crop, scale 0.9-1, bicubic, OpenAI mean/std), on
  its default decode path (:mod:`recipe.data.images`: crop box first, uint8 pixels, one normalising
  write per sample into shared memory, draft decoding of JPEGs at least twice the output size);
* ``recipe-exact``: the same without draft decoding (identical to ``recipe`` below ~1000 px images);
* ``recipe-pil``: the same loader with timm's transform applied to the fully decoded PIL image (the
  path before :mod:`recipe.data.images`; same crop boxes, see there for the resampling difference);
* ``openclip``: OpenCLIP's ``open_clip_train.data.get_wds_dataset`` (``wds.WebDataset`` pipeline: tar
  samples, shuffle, ``decode("pilrgb")``, ``preprocess_train``, tokenizer, ``batched``) with
  ``open_clip.create_model_and_transforms("ViT-B-32")``'s training preprocess;

all on the same shards and with the same tokenizer (OpenCLIP's ViT-B-32 ``SimpleTokenizer``, context
77), with 1 and with 2 workers. The arms alternate within each repetition (order reversed every other
one) so that all see the same machine load; the table gives medians over the repetitions, the ratio of
each arm to ``openclip`` (median of the per-repetition ratios), and how many cores -- one worker per
core -- the GPU's rate (``--gpu-rate``, 4,800 samples/s) needs at that per-worker rate.

Rates are steady-state: the samples after each worker's first batch over the time from that batch to
the last (worker start-up, shard counting and shuffle-buffer filling are reported apart as
``startup_s``). The shards (``--samples`` JPEG images, shorter side ``--image-size`` with aspect ratios
from 3:4 to 4:3, natural-image-like content: 1/f noise, a colour gradient and a few filled shapes,
quality 90, and 4-20 word captions) are written once into a cache folder under ``--data`` and reused.

``--profile`` runs the ``recipe`` arm's producer in this process (no workers, one torch thread, as
in a worker) under cProfile and prints where the time goes. ``--quality`` measures the fast path's
two departures from timm's path: its uint8 resize against PIL's on the same crop boxes, and draft
decoding's PSNR against the full decode (:mod:`recipe.data.images`).

``--train-step`` instead measures the recipe's train step (:func:`recipe.training.step.train_step`, the
engine :mod:`recipe.train` builds; ``ViT-B-32`` on CUDA, ``tiny`` on CPU) on real batches from the
training loader next to the same step on synthetic inputs already on the device (what
``bench_train.py`` measures): synthetic steps first, then steps pulling batches from the loader
(``--workers``, ``--decode-device``), after warm-up steps that fill the workers' pipelines; the goal
is a ratio >= 0.9.

Usage::

    python benchmarks/bench_data.py                          # 4096 samples, 256 px, 1 and 2 workers, 5 reps
    python benchmarks/bench_data.py --image-size 512         # larger images: where draft decoding helps
    python benchmarks/bench_data.py --profile --quality      # plus a worker's profile and draft PSNR
    python benchmarks/bench_data.py --samples 64 --batch 8 --repeats 1 --shard-size 16   # seconds
    python benchmarks/bench_data.py --train-step --device cuda --workers 14 --batch 512 \\
        --samples 16384 --decode-device cpu cuda          # on the GPU machine (16 cores)

Output: a markdown table (device, versions, date) on stdout and a JSON file
(``benchmarks/results/bench_data_<device>.json`` by default).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from _common import RESULTS, environment, write_result  # noqa: E402  (puts the repository on sys.path)

__all__ = [
    "ARMS",
    "ClipTokens",
    "write_shards",
    "natural_image",
    "measure_arms",
    "summarise",
    "markdown_table",
    "profile_recipe",
    "train_step_bench",
    "main",
]

DEFAULT_DATA = os.path.join(os.environ.get("TMPDIR", "/tmp"), "clip_bench_data")
FORMAT_VERSION = 1  # of the written shards: a change of the generator makes a new cache folder
WORDS = (
    "a an the photo picture image of with on in at by near under over small large red green blue yellow "
    "white black old new bright dark little big happy young wooden metal glass stone street city house car "
    "dog cat bird tree flower river mountain beach sky cloud sun night morning window door table chair book "
    "woman man child people group family friends playing running sitting standing walking holding looking "
    "food plate coffee cup bread fruit garden park field road bridge building tower boat train bus bicycle "
    "painting drawing poster logo text sign shirt dress shoes hat bag phone computer screen wall floor room"
).split()


# --------------------------------------------------------------------------------------------------
# the shards
# --------------------------------------------------------------------------------------------------


def natural_image(rng: np.random.Generator, short: int) -> np.ndarray:
    """A uint8 ``[H, W, 3]`` image with natural-image statistics: shorter side ``short``, aspect ratio
    log-uniform in 3:4 .. 4:3; 1/f^1.25 colour noise, a linear colour gradient, 2-6 filled shapes."""
    from PIL import Image, ImageDraw

    ratio = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
    h, w = (short, int(round(short * ratio))) if ratio >= 1 else (int(round(short / ratio)), short)
    fy, fx = np.fft.fftfreq(h)[:, None], np.fft.rfftfreq(w)[None, :]
    f = np.sqrt(fx**2 + fy**2)
    f[0, 0] = 1.0
    chans = []
    for _ in range(3):
        spec = (rng.normal(size=f.shape) + 1j * rng.normal(size=f.shape)) / f**1.25
        spec[0, 0] = 0
        x = np.fft.irfft2(spec, s=(h, w))
        chans.append((x - x.mean()) / (x.std() + 1e-8))
    mix = rng.normal(size=(3, 3)) * 0.3 + np.eye(3)
    img = np.tensordot(mix, np.stack(chans), 1).transpose(1, 2, 0) * 25
    yy, xx = np.mgrid[0:h, 0:w]
    angle = rng.uniform(0, 2 * np.pi)
    img = img + (np.cos(angle) * xx / w + np.sin(angle) * yy / h)[..., None] * rng.uniform(-120, 120, 3)
    img = img + rng.uniform(60, 190, 3)
    im = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(im)
    for _ in range(int(rng.integers(2, 7))):
        x0, y0 = int(rng.integers(0, w)), int(rng.integers(0, h))
        box = (x0, y0, x0 + int(rng.integers(10, max(11, w // 2))), y0 + int(rng.integers(10, max(11, h // 2))))
        fill = tuple(int(v) for v in rng.integers(0, 256, 3))
        (draw.ellipse if rng.integers(2) else draw.rectangle)(box, fill=fill)
    return np.asarray(im)


def _caption(rng: np.random.Generator) -> str:
    return " ".join(WORDS[i] for i in rng.integers(0, len(WORDS), int(rng.integers(4, 21))))


def _jpeg(seed: int, index: int, size: int, quality: int) -> bytes:
    buf = io.BytesIO()
    from PIL import Image

    Image.fromarray(natural_image(np.random.default_rng([seed, index]), size)).save(buf, "JPEG", quality=quality)
    return buf.getvalue()


def _write_shard(task: tuple[str, int, int, int, int, int, int]) -> int:
    """Writes one shard (``path, first sample, count, image size, seed, quality, unique images``);
    returns its bytes. Sample ``i`` holds image ``i % unique`` and its own caption."""
    import tarfile

    path, first, count, size, seed, quality, unique = task
    tmp = path + ".part"
    made: dict[int, bytes] = {}
    with tarfile.open(tmp, "w") as tf:
        for i in range(first, first + count):
            j = i % unique
            if j not in made:
                made[j] = _jpeg(seed, j, size, quality)
            caption = _caption(np.random.default_rng([seed, i, 1]))
            for ext, data in (("jpg", made[j]), ("txt", caption.encode())):
                info = tarfile.TarInfo(f"{i:08d}.{ext}")
                info.size = len(data)
                tf.addfile(info, io.BytesIO(data))
    os.replace(tmp, path)
    return os.path.getsize(path)


def write_shards(
    data: str, samples: int, shard_size: int, image_size: int, seed: int = 0, quality: int = 90,
    unique: int | None = None, jobs: int | None = None,
) -> dict[str, Any]:
    """Writes (once) ``samples`` JPEG + caption samples as webdataset shards of ``shard_size`` into a
    folder of ``data`` named by these settings; returns its manifest (``pattern``, ``shards``,
    ``samples``, ``bytes``...). ``unique``: distinct images, repeated in turn when fewer than the
    samples (decoding costs the same; writing a large set is faster); every sample has its own key and
    caption. A folder whose ``manifest.json`` exists is reused as it is."""
    unique = min(unique or samples, samples)
    tag = "" if unique == samples else f"_u{unique}"
    folder = Path(data) / f"v{FORMAT_VERSION}_n{samples}{tag}_shard{shard_size}_px{image_size}_q{quality}_seed{seed}"
    manifest_path = folder / "manifest.json"
    if manifest_path.is_file():
        return json.loads(manifest_path.read_text())
    folder.mkdir(parents=True, exist_ok=True)
    n_shards = -(-samples // shard_size)
    tasks = [
        (str(folder / f"{s:05d}.tar"), s * shard_size, min(shard_size, samples - s * shard_size), image_size, seed,
         quality, unique)
        for s in range(n_shards)
    ]
    t0 = time.perf_counter()
    jobs = jobs or min(len(tasks), os.cpu_count() or 1)
    if jobs > 1:
        import multiprocessing as mp

        with mp.get_context("fork").Pool(jobs) as pool:
            sizes = pool.map(_write_shard, tasks)
    else:
        sizes = [_write_shard(t) for t in tasks]
    names = [os.path.basename(t[0]) for t in tasks]
    # OpenCLIP's get_dataset_size reads sizes.json next to the shards (img2dataset writes it)
    (folder / "sizes.json").write_text(json.dumps({n: t[2] for n, t in zip(names, tasks)}))
    manifest = {
        "folder": str(folder),
        "pattern": str(folder / f"{{00000..{n_shards - 1:05d}}}.tar"),
        "shards": n_shards,
        "samples": samples,
        "unique_images": unique,
        "image_size": image_size,
        "quality": quality,
        "bytes": int(sum(sizes)),
        "mean_sample_kib": round(sum(sizes) / samples / 1024, 1),
        "write_seconds": round(time.perf_counter() - t0, 1),
    }
    manifest_path.write_text(json.dumps(manifest, indent=1))
    return manifest


def shard_images(manifest: dict[str, Any], limit: int) -> list[bytes]:
    """The JPEG bytes of the first ``limit`` samples of the shards."""
    import tarfile

    out: list[bytes] = []
    for s in range(manifest["shards"]):
        with tarfile.open(os.path.join(manifest["folder"], f"{s:05d}.tar")) as tf:
            for member in tf:
                if member.name.endswith(".jpg"):
                    out.append(tf.extractfile(member).read())
                    if len(out) == limit:
                        return out
    return out


# --------------------------------------------------------------------------------------------------
# the tokenizer both pipelines use
# --------------------------------------------------------------------------------------------------


class ClipTokens:
    """OpenCLIP's ViT-B-32 tokenizer (``SimpleTokenizer``, context 77), called as OpenCLIP calls it
    (:meth:`openclip`: ``[1, 77]`` per caption) or as the recipe's loader does (``__call__``: a list of
    captions to ``input_ids`` and ``attention_mask``). ``vocab_size``/``context_length`` fit the ids to
    a smaller text tower (the CPU ``tiny`` preset): truncated rows keep their end token, ids beyond the
    vocabulary are clamped."""

    def __init__(self, context_length: int | None = None, vocab_size: int | None = None) -> None:
        import open_clip

        self.tok = open_clip.get_tokenizer("ViT-B-32")
        self.context_length = context_length
        self.vocab_size = vocab_size

    def openclip(self, texts: Any) -> torch.Tensor:
        return self.tok(texts)

    def __call__(self, captions: list[str]) -> dict[str, torch.Tensor]:
        ids = self.tok(captions)
        if self.context_length is not None and self.context_length < ids.shape[1]:
            eot = self.tok.eot_token_id
            lengths = (ids != 0).sum(1).clamp(max=self.context_length)
            ids = ids[:, : self.context_length].clone()
            ids[torch.arange(ids.shape[0]), lengths - 1] = eot
        if self.vocab_size is not None:
            ids = ids.clamp(max=self.vocab_size - 1)
        return {"input_ids": ids, "attention_mask": (ids != 0).long()}


# --------------------------------------------------------------------------------------------------
# the arms
# --------------------------------------------------------------------------------------------------


def vit_b_32_image_config() -> dict[str, Any]:
    """The ``ViT-B-32`` preset's timm data config, resolved as the model resolves it (no weights)."""
    from recipe.model import PRESETS
    from recipe.model.image_tower import create_image_tower

    img = PRESETS["ViT-B-32"]().image
    return dict(
        create_image_tower(img.name, mean=img.mean, std=img.std, crop_pct=img.crop_pct, image_size=img.image_size)
        .data_config()
    )


def _recipe_loader(variant: str) -> Callable[..., Iterable]:
    def make(manifest: dict[str, Any], workers: int, batch: int, seed: int, tokens: ClipTokens,
             image_cfg: dict[str, Any], decode_device: str = "cpu") -> Any:
        from recipe.config import DataConfig
        from recipe.data.loader import build_train_loader

        cfg = DataConfig(train_data=manifest["pattern"], data_format="webdataset", workers=workers,
                         num_samples=manifest["samples"], decode_device=decode_device)
        return build_train_loader(cfg, tokens, image_cfg, batch, seed=seed, image_pipeline=variant)

    return make


def _openclip_loader(manifest: dict[str, Any], workers: int, batch: int, seed: int, tokens: ClipTokens,
                     image_cfg: dict[str, Any], decode_device: str = "cpu") -> Any:
    from open_clip_train.data import get_wds_dataset

    preprocess_train = _openclip_transforms()[1]
    args = argparse.Namespace(
        train_data=manifest["pattern"], train_num_samples=manifest["samples"], dataset_resampled=False, seed=seed,
        batch_size=batch, world_size=1, workers=workers, train_data_upsampling_factors=None, distributed=False,
    )
    return get_wds_dataset(args, preprocess_train, is_train=True, epoch=0, tokenizer=tokens.openclip).dataloader


_OPENCLIP_TRANSFORMS: Any = None


def _openclip_transforms() -> Any:
    """``open_clip.create_model_and_transforms("ViT-B-32")`` once (its model is dropped)."""
    global _OPENCLIP_TRANSFORMS
    if _OPENCLIP_TRANSFORMS is None:
        import logging

        import open_clip

        logging.getLogger().setLevel(logging.ERROR)  # "No pretrained weights loaded" is expected
        model, train, val = open_clip.create_model_and_transforms("ViT-B-32")
        del model
        _OPENCLIP_TRANSFORMS = (None, train, val)
    return _OPENCLIP_TRANSFORMS


def _openclip_available() -> str | None:
    try:
        import open_clip  # noqa: F401
        import open_clip_train.data  # noqa: F401
        import webdataset  # noqa: F401
    except ImportError as exc:
        return f"{exc} (pip install open_clip_torch webdataset)"
    return None


#: arm -> (loader factory, what it is, why it cannot run here or None)
ARMS: dict[str, tuple[Callable[..., Iterable], str, Callable[[], str | None]]] = {
    "recipe": (_recipe_loader(None), "recipe build_train_loader, default (fast) decode path", lambda: None),
    "recipe-exact": (_recipe_loader("exact"), "recipe build_train_loader, fast path without draft decoding",
                     lambda: None),
    "recipe-pil": (_recipe_loader("pil"), "recipe build_train_loader, full PIL decode + timm transform (before)",
                   lambda: None),
    "openclip": (_openclip_loader, "open_clip_train get_wds_dataset + ViT-B-32 preprocess_train",
                 _openclip_available),
}


def _batch_size_of(batch: Any) -> int:
    if isinstance(batch, dict):
        return len(batch["input_ids"])
    return int(batch[0].shape[0])  # OpenCLIP: (images, texts)


def measure_epoch(loader: Iterable, workers: int) -> dict[str, Any]:
    """One epoch of ``loader``: the steady-state rate counts the samples after each worker's first
    batch (the first ``max(1, workers)`` batches) over the time from the last of those to the end."""
    t0 = time.perf_counter()
    warm = max(1, workers)
    n_batches = samples = counted = 0
    t_warm = None
    for batch in loader:
        n = _batch_size_of(batch)
        n_batches += 1
        samples += n
        if n_batches == warm:
            t_warm = time.perf_counter()
        elif n_batches > warm:
            counted += n
    t_end = time.perf_counter()
    steady = counted / (t_end - t_warm) if t_warm is not None and counted and t_end > t_warm else float("nan")
    return {
        "samples": samples,
        "batches": n_batches,
        "seconds": round(t_end - t0, 4),
        "startup_s": round((t_warm or t_end) - t0, 4),
        "samples_per_s": steady,
        "samples_per_s_per_worker": steady / max(1, workers),
    }


def measure_arms(
    manifest: dict[str, Any],
    arms: list[str],
    workers_list: list[int],
    batch: int,
    repeats: int,
    seed: int = 0,
    log: Callable[[str], None] = lambda s: print(s, file=sys.stderr),
) -> list[dict[str, Any]]:
    """Every arm at every worker count, ``repeats`` times, interleaved (arm order reversed on odd
    repetitions). Returns one row per measurement."""
    tokens = ClipTokens()
    image_cfg = vit_b_32_image_config()
    rows = []
    for rep in range(repeats):
        order = arms if rep % 2 == 0 else arms[::-1]
        for workers in workers_list:
            for arm in order:
                make = ARMS[arm][0]
                loader = make(manifest, workers, batch, seed + rep, tokens, image_cfg)
                row = {"arm": arm, "workers": workers, "repeat": rep, **measure_epoch(loader, workers)}
                if hasattr(loader, "close"):
                    loader.close()
                del loader
                rows.append(row)
                log(f"rep {rep} workers {workers} {arm:12s} {row['samples_per_s']:8.1f} samples/s "
                    f"({row['samples_per_s_per_worker']:.1f} per worker, {row['samples']} samples, "
                    f"start-up {row['startup_s']:.2f} s)")
    return rows


def summarise(rows: list[dict[str, Any]], gpu_rate: float, baseline: str = "openclip") -> list[dict[str, Any]]:
    """Medians per (arm, workers), the median of per-repetition ratios to ``baseline``, and cores needed."""
    out = []
    keys = sorted({(r["workers"], r["arm"]) for r in rows}, key=lambda k: (k[0], list(ARMS).index(k[1])))
    for workers, arm in keys:
        mine = {r["repeat"]: r for r in rows if r["arm"] == arm and r["workers"] == workers}
        base = {r["repeat"]: r for r in rows if r["arm"] == baseline and r["workers"] == workers}
        rates = [r["samples_per_s"] for r in mine.values() if math.isfinite(r["samples_per_s"])]
        med = statistics.median(rates) if rates else float("nan")
        per_worker = med / max(1, workers)
        ratios = [mine[k]["samples_per_s"] / base[k]["samples_per_s"] for k in mine if k in base
                  and base[k]["samples_per_s"] > 0 and math.isfinite(mine[k]["samples_per_s"])]
        out.append({
            "arm": arm,
            "workers": workers,
            "samples_per_s": round(med, 1),
            "samples_per_s_per_worker": round(per_worker, 1),
            "min_max": [round(min(rates), 1), round(max(rates), 1)] if rates else None,
            f"ratio_to_{baseline}": round(statistics.median(ratios), 3) if ratios else None,
            "cores_for_gpu_rate": math.ceil(gpu_rate / per_worker) if per_worker > 0 else None,
            "startup_s": round(statistics.median(r["startup_s"] for r in mine.values()), 2),
            "repeats": len(rates),
        })
    return out


def markdown_table(summary: list[dict[str, Any]], env: dict[str, Any], manifest: dict[str, Any], args: Any) -> str:
    lines = [
        f"Data loading, samples/s per DataLoader worker ({env['device']}; torch {env['versions']['torch']}, "
        f"{env['date']}): {manifest['samples']} JPEG samples in {manifest['shards']} shards, shorter side "
        f"{manifest['image_size']} px (mean {manifest['mean_sample_kib']} KiB/sample), batch {args.batch}, "
        f"ViT-B-32 train transform (224 px), medians of {args.repeats} interleaved repetitions. "
        f"Cores: ceil({args.gpu_rate:g} / per-worker rate), one worker per core.",
        "",
        "| arm | workers | samples/s | per worker | min-max | x openclip | cores for "
        f"{args.gpu_rate:g}/s | start-up s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary:
        mm = "-" if r["min_max"] is None else f"{r['min_max'][0]:.0f}-{r['min_max'][1]:.0f}"
        ratio = r.get("ratio_to_openclip")
        lines.append(
            f"| {r['arm']} | {r['workers']} | {r['samples_per_s']:.0f} | {r['samples_per_s_per_worker']:.0f} | {mm} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {r['cores_for_gpu_rate'] or '-'} | {r['startup_s']:.2f} |"
        )
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# profile, quality
# --------------------------------------------------------------------------------------------------


def profile_recipe(manifest: dict[str, Any], batch: int, batches: int, arm: str = "recipe", top: int = 25) -> dict:
    """The ``arm``'s producer in this process (no workers) under cProfile for ``batches`` batches:
    the ``top`` functions by own time, and the total per sample."""
    tokens = ClipTokens()
    loader = ARMS[arm][0](manifest, 0, batch, 0, tokens, vit_b_32_image_config())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as in a DataLoader worker
    it = iter(loader)
    next(it)  # shard counting, shuffle buffer, first batch: not part of the steady state
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    done = 0
    for b in it:
        done += 1
        if done == batches:
            break
    prof.disable()
    seconds = time.perf_counter() - t0
    torch.set_num_threads(threads)
    loader.close()
    stats = pstats.Stats(prof)
    total = stats.total_tt
    rows = []
    for (file, line, name), (cc, nc, tt, ct, _) in sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:top]:
        rows.append({"function": f"{os.path.basename(file)}:{line}({name})", "calls": nc,
                     "own_us_per_sample": round(tt / (done * batch) * 1e6, 1),
                     "cum_us_per_sample": round(ct / (done * batch) * 1e6, 1),
                     "own_share": round(tt / total, 3)})
    return {"arm": arm, "batches": done, "batch": batch, "seconds": round(seconds, 3),
            "us_per_sample": round(seconds / (done * batch) * 1e6, 1), "top": rows}


def profile_table(prof: dict[str, Any]) -> str:
    lines = [f"Profile of the {prof['arm']} producer in-process ({prof['batches']} batches of {prof['batch']}, "
             f"{prof['us_per_sample']} us/sample under cProfile)", "",
             "| function | calls | own us/sample | cum us/sample | own share |", "|---|---:|---:|---:|---:|"]
    for r in prof["top"]:
        lines.append(f"| `{r['function']}` | {r['calls']} | {r['own_us_per_sample']} | {r['cum_us_per_sample']} | "
                     f"{r['own_share']:.1%} |")
    return "\n".join(lines)


def quality_check(manifest: dict[str, Any], n: int, seed: int, log: Callable[[str], None],
                  sizes: Iterable[int] = (1024, 2048)) -> dict[str, Any]:
    """The fast path's two departures from timm's, on ``n`` images: its resize against PIL's on the
    shards' images (:func:`recipe.data.images.resize_agreement`), and draft decoding against the full
    decode (:func:`recipe.data.images.draft_psnr`) on the shards' images and on 16 images of each of
    ``sizes`` px made like them (the shards' own are only drafted when large enough)."""
    from PIL import Image

    from recipe.data.images import draft_psnr, resize_agreement

    cfg = vit_b_32_image_config()
    images = shard_images(manifest, n)
    out: dict[str, Any] = {"resize": resize_agreement(images, cfg, seed=seed), "draft": {}}
    out["draft"][str(manifest["image_size"])] = draft_psnr(images, cfg, seed=seed)
    for size in sizes:
        made = []
        for i in range(16):
            buf = io.BytesIO()
            Image.fromarray(natural_image(np.random.default_rng([seed, size, i]), size)).save(buf, "JPEG", quality=90)
            made.append(buf.getvalue())
        out["draft"][str(size)] = draft_psnr(made, cfg, seed=seed)
        log(f"draft at {size} px: {out['draft'][str(size)]}")
    return out


def quality_table(q: dict[str, Any]) -> str:
    r = q["resize"]
    lines = [f"Fast path vs timm's PIL path on {r['images']} shard images, same crop boxes: torch uint8 resize vs "
             f"PIL: {r['identical']:.2%} of values identical, {r['within_one']:.4%} within one level, at most "
             f"{r['max_levels']} levels apart, PSNR >= {r['psnr_min_db']} dB.", "",
             "| draft decoding | images | drafted | reductions | PSNR min dB | PSNR median dB |",
             "|---|---:|---:|---|---:|---:|"]
    for size, d in q["draft"].items():
        lines.append(f"| {size} px | {d['images']} | {d['drafted']} | {d['scales']} | {d['psnr_min_db'] or '-'} | "
                     f"{d['psnr_median_db'] or '-'} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# the train step on real batches vs synthetic inputs
# --------------------------------------------------------------------------------------------------


def _forever(loader: Any) -> Iterator[dict[str, Any]]:
    while True:
        yield from loader


def train_step_bench(args: argparse.Namespace, manifest: dict[str, Any], log: Callable[[str], None]) -> dict:
    """The recipe's train step on synthetic inputs (on the device) and on loader batches, in one process."""
    from _common import make_inputs
    from train_bench.recipe_arm import RecipeRunner
    from train_bench.settings import DEFAULT_DS_CONFIG

    from recipe.config import DataConfig
    from recipe.data.loader import build_train_loader

    device = torch.device(args.device)
    preset = args.preset or ("ViT-B-32" if device.type == "cuda" else "tiny")
    loss_mode = "fused" if device.type == "cuda" else "plain"
    runner = RecipeRunner(preset, loss_mode, False, args.ds_config or DEFAULT_DS_CONFIG, device, args.batch,
                          seed=args.seed)
    image_cfg = runner.arm.model.image_data_config()
    tokens = ClipTokens(context_length=runner.text.context_length, vocab_size=runner.text.vocab_size)

    def timed(step_inputs: Callable[[], dict[str, Any]], warmup: int, steps: int) -> dict[str, Any]:
        for _ in range(warmup):
            runner.step(step_inputs())
        times = []
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            runner.step(step_inputs())  # returns a float: the step has finished on the device
            times.append(time.perf_counter() - t)
        total = time.perf_counter() - t0
        return {"steps": steps, "seconds": round(total, 4), "samples_per_s": round(steps * args.batch / total, 1),
                "median_step_ms": round(statistics.median(times) * 1e3, 2)}

    x = make_inputs(args.batch, runner.image_size, runner.text, args.seed)
    x = {k: v.to(device) for k, v in x.items()}
    result: dict[str, Any] = {"preset": preset, "loss_mode": loss_mode, "batch": args.batch, "device": str(device),
                              "workers": args.workers[-1], "arms": {}}
    synthetic = timed(lambda: x, args.warmup, args.steps)
    result["arms"]["synthetic"] = synthetic
    log(f"synthetic inputs: {synthetic['samples_per_s']} samples/s")
    workers = args.workers[-1]
    for decode_device in args.decode_device:
        cfg = DataConfig(train_data=manifest["pattern"], data_format="webdataset", workers=workers,
                         num_samples=manifest["samples"], decode_device=decode_device, pin_memory=device.type == "cuda")
        try:
            loader = build_train_loader(cfg, tokens, image_cfg, args.batch, seed=args.seed)
        except ValueError as exc:  # e.g. --decode-device cuda without torchvision's decoder
            result["arms"][f"loader-{decode_device}"] = {"unavailable": str(exc)}
            log(f"loader decode {decode_device}: cannot run here: {exc}")
            continue
        batches = _forever(loader)
        # warm-up: every worker's first batch twice over, so the pipelines run at their steady rate
        real = timed(lambda: next(batches), max(args.warmup, 2 * max(1, workers)), args.steps)
        # the loader alone, right after: its rate without the train step competing for the host,
        # after taking what the workers prefetched meanwhile
        for _ in range(max(1, workers) * cfg.prefetch_factor):
            next(batches)
        t0 = time.perf_counter()
        n = sum(len(next(batches)["input_ids"]) for _ in range(args.steps))
        real["loader_only_samples_per_s"] = round(n / (time.perf_counter() - t0), 1)
        real["ratio_to_synthetic"] = round(real["samples_per_s"] / synthetic["samples_per_s"], 3)
        batches.close()
        loader.close()
        result["arms"][f"loader-{decode_device}"] = real
        log(f"loader decode {decode_device}: {real['samples_per_s']} samples/s, "
            f"{real['ratio_to_synthetic']:.2f} x synthetic (loader alone {real['loader_only_samples_per_s']})")
    return result


def train_step_table(res: dict[str, Any], env: dict[str, Any], manifest: dict[str, Any]) -> str:
    lines = [
        f"Train step on loader batches vs synthetic inputs ({env['device']}; torch {env['versions']['torch']}, "
        f"{env['date']}): preset {res['preset']}, loss {res['loss_mode']}, batch {res['batch']}, "
        f"{res['workers']} workers, {manifest['samples']} JPEG samples of {manifest['image_size']} px. Goal: >= 0.9x.",
        "",
        "| inputs | samples/s | median step ms | x synthetic | loader alone samples/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in res["arms"].items():
        if "unavailable" in r:
            lines.append(f"| {name} | - | - | - | cannot run: {r['unavailable']} |")
            continue
        ratio = r.get("ratio_to_synthetic")
        lines.append(f"| {name} | {r['samples_per_s']:.0f} | {r['median_step_ms']} | "
                     f"{'1.00' if ratio is None else f'{ratio:.2f}'} | {r.get('loader_only_samples_per_s', '-')} |")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------
# command line
# --------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=DEFAULT_DATA, help="cache folder of the written shards")
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--shard-size", type=int, default=256)
    ap.add_argument("--unique-images", type=int, default=None,
                    help="distinct images, repeated in turn over the samples (default: all distinct)")
    ap.add_argument("--image-size", type=int, default=256, help="shorter side of the written JPEGs")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--arms", nargs="+", default=["recipe", "recipe-pil", "openclip"], choices=list(ARMS))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--gpu-rate", type=float, default=4800.0, help="samples/s the GPU trains at (ViT-B-32, H200)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also profile the recipe arm's producer in-process")
    ap.add_argument("--profile-batches", type=int, default=20)
    ap.add_argument("--quality", dest="quality_images", type=int, nargs="?", const=64, default=0, metavar="N",
                    help="also measure the fast path's resize vs PIL's and draft decoding's PSNR on N images (64)")
    ap.add_argument("--quality-sizes", type=int, nargs="*", default=[1024, 2048],
                    help="--quality: sizes of the extra images draft decoding is measured on")
    ap.add_argument("--jpeg-quality", type=int, default=90, help="JPEG quality of the written images")
    ap.add_argument("--train-step", action="store_true", help="measure the train step on loader batches instead")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default=None, help="--train-step: preset (ViT-B-32 on CUDA, tiny on CPU)")
    ap.add_argument("--ds-config", default=None, help="--train-step: DeepSpeed JSON (bench_train's default)")
    ap.add_argument("--decode-device", nargs="+", default=["cpu"], help="--train-step: loader arms (cpu, cuda)")
    ap.add_argument("--steps", type=int, default=20, help="--train-step: timed steps per arm")
    ap.add_argument("--warmup", type=int, default=3, help="--train-step: warm-up steps (loader arms: >= 2 x workers)")
    ap.add_argument("--json", default=None, help="output JSON (default benchmarks/results/bench_data_<device>.json)")
    return ap


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    manifest = write_shards(args.data, args.samples, args.shard_size, args.image_size, args.seed, args.jpeg_quality,
                            args.unique_images)
    log(f"shards: {manifest['pattern']} ({manifest['samples']} samples, {manifest['mean_sample_kib']} KiB each)")
    env = environment(args.device)
    result: dict[str, Any] = {"benchmark": "bench_data", "environment": env, "data": manifest,
                              "settings": {k: v for k, v in vars(args).items() if k != "json"}}
    tables = []
    if args.train_step:
        result["train_step"] = train_step_bench(args, manifest, log)
        tables.append(train_step_table(result["train_step"], env, manifest))
    else:
        arms = []
        for arm in args.arms:
            why = ARMS[arm][2]()
            if why is None:
                arms.append(arm)
            else:
                result.setdefault("unavailable", {})[arm] = why
                log(f"arm {arm} cannot run here: {why}")
        rows = measure_arms(manifest, arms, args.workers, args.batch, args.repeats, args.seed, log)
        result["rows"] = rows
        result["summary"] = summarise(rows, args.gpu_rate)
        tables.append(markdown_table(result["summary"], env, manifest, args))
    if args.quality_images:
        result["quality"] = quality_check(manifest, args.quality_images, args.seed, log, args.quality_sizes)
        tables.append(quality_table(result["quality"]))
    if args.profile:
        result["profile"] = profile_recipe(manifest, args.batch, args.profile_batches)
        tables.append(profile_table(result["profile"]))
    out = args.json or str(RESULTS / f"bench_data_{torch.device(args.device).type}.json")
    write_result(out, result, "\n\n".join(tables))
    return result


if __name__ == "__main__":
    main()
