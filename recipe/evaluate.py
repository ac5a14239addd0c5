"""Zero-shot classification and image<->text retrieval on held-out data.

In training every rank embeds its share of the data and the features are gathered, so it works
under every ZeRO stage; standalone::

    python -m recipe.evaluate --checkpoint runs/demo            # latest checkpoint of a run
    python -m recipe.evaluate --checkpoint runs/demo/checkpoints/step00000300 --val-data DIR/val.csv
    python -m recipe.evaluate --checkpoint runs/demo --zeroshot imagenet --val-data /data/imagenet/val
    python -m recipe.evaluate --checkpoint runs/demo --zeroshot classes.json --val-data DIR
    python -m recipe.evaluate --checkpoint runs/demo --ema      # the EMA weights (--ema-decay runs)
    # CLIP_benchmark's datasets, class names, templates and metrics (recipe/benchmark/, the [eval] extra)
    python -m recipe.evaluate --checkpoint runs/demo --benchmark wds/cifar10,mscoco_captions --benchmark-root DIR
    python -m recipe.evaluate --checkpoint runs/demo --weights module   # the bf16 module weights

Which weights (``--weights``, as ``python -m recipe.export``): ``master`` (the default) evaluates what an
export holds, in fp32: the optimizer's exact fp32 masters for mastered groups (the image tower and the
logit scale by default), the module weights (an exact upcast) elsewhere; ``module`` the checkpoint's
module weights in the run's dtype, as training's own evaluation saw them (the default with ``--ema``).

What is evaluated:

* Retrieval (recall@1/5/10 both ways) where the data has captions.
* Zero-shot classification (``<name>_top1``, ``<name>_top5``, ``<name>_chance``) where the images
  have labels and there are class names: ``--zeroshot imagenet`` (built in, metric names
  ``imagenet_*``), ``--zeroshot FILE`` or a ``zeroshot.json`` found next to the data (``zeroshot_*``;
  file format in :mod:`recipe.zeroshot`). The labels are a table's label column, or the class
  folders of an imagefolder without metadata (``DIR/<class>/*.jpg``; ImageNet: ``DIR/<wnid>/*.JPEG``,
  any subset of the 1000 folders, every image still classified among all 1000 classes). No
  captions are needed.
* ``--zeroshot-data DIR`` (and the training flag of that name) classifies a second set of images,
  the validation data then giving retrieval only.

Unreadable or corrupt images are skipped and counted (``eval_skipped``, ``<name>_skipped`` for the
zero-shot data). Standalone evaluation prints one JSON line of metrics and writes them, with what was
evaluated, to ``RUN_DIR/eval_<name>_step<N>.json`` (``eval_<name>_ema_step<N>.json`` with ``--ema``,
``eval_<name>_module_step<N>.json`` with ``--weights module``).
``<name>`` is named by the data: the zero-shot class names given (``imagenet``, a ``--zeroshot`` file's
stem), each dataset's folder and file stem, and 8 hex digits of a SHA-1 of what identifies the data (the
resolved paths, format, split, columns and zero-shot class names of each dataset), e.g.
``eval_imagenet-val-1f0c2a9e_step300.json`` for ``/data/imagenet/val``. Two different datasets never
share a file; evaluating the same data at the same step again replaces its own file. The JSON records
the datasets under ``datasets`` (the same fields, and which role each had: ``val_data``, ``zeroshot_data``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.distributed as dist

from .config import DataConfig
from .data import SKIP_REASONS, build_eval_loader, expand_paths
from .data.paths import canonical_format, detect_format
from .training.distributed import rank_world
from .zeroshot import IMAGENET, ZeroShotPrompts, find_zeroshot_file, get_zeroshot_prompts
from .zeroshot.classifier import zero_shot_classifier  # re-exported: recipe.evaluate.zero_shot_classifier

__all__ = [
    "zero_shot_classifier",
    "zero_shot_accuracy",
    "retrieval_recall",
    "embed_split",
    "evaluate",
    "evaluate_data",
    "load_prompts",
    "evaluated_datasets",
    "dataset_record",
    "result_name",
    "main",
]


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _progress(items: Iterable | None, enabled: bool, **kw: Any) -> Any:
    """``items`` with a progress bar on stderr (a bare bar for ``items=None``) when ``enabled``."""
    if not enabled:
        return items
    from tqdm.auto import tqdm

    return tqdm(items, file=sys.stderr, dynamic_ncols=True, **kw)


def zero_shot_accuracy(
    image_features: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor, prefix: str = "zeroshot"
) -> dict[str, float]:
    """Top-1 and top-5 accuracy of ``argmax(image_features @ classifier.T)`` (``<prefix>_top1``, ``_top5``).

    Raises:
        ValueError: A label outside ``[0, num_classes)``.
    """
    num_classes = classifier.shape[0]
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= num_classes):
        raise ValueError(
            f"labels range over {int(labels.min())}..{int(labels.max())}, but the zero-shot class names "
            f"have {num_classes} classes"
        )
    logits = image_features.float() @ classifier.float().T.to(image_features.device)
    top = logits.topk(min(5, num_classes), dim=1).indices
    hit = top == labels.view(-1, 1).to(top.device)
    return {f"{prefix}_top1": hit[:, 0].float().mean().item(), f"{prefix}_top5": hit.any(1).float().mean().item()}


def retrieval_recall(
    image_features: torch.Tensor, text_features: torch.Tensor, ks: tuple[int, ...] = (1, 5, 10)
) -> dict[str, float]:
    """Recall@k of image->text and text->image retrieval where pair ``i`` is (image i, text i)."""
    sim = image_features.float() @ text_features.float().T
    n = sim.shape[0]
    target = torch.arange(n)
    out: dict[str, float] = {}
    for name, s in (("i2t", sim), ("t2i", sim.T)):
        # rank of the true match = number of candidates scoring strictly higher
        true = s[target, target].view(-1, 1)
        rank = (s > true).sum(1)
        for k in ks:
            out[f"{name}_r{k}"] = (rank < k).float().mean().item()
    out["retrieval_r1"] = (out["i2t_r1"] + out["t2i_r1"]) / 2
    return out


@torch.no_grad()
def embed_split(
    model: Any, loader: Any, progress: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Image features, text features (None without captions) and labels (None without) of this
    rank's share, gathered over all ranks."""
    device, dtype = _model_device(model), _model_dtype(model)
    imgs, txts, labels = [], [], []
    total = len(loader) if hasattr(loader, "__len__") else None
    for batch in _progress(loader, progress, desc="images", unit="batch", total=total):
        imgs.append(model.encode_image(batch["pixel_values"].to(device=device, dtype=dtype)).float().cpu())
        if batch.get("input_ids") is not None:
            ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
            txts.append(model.encode_text(ids, mask).float().cpu())
        if batch.get("labels") is not None:
            labels.append(batch["labels"].cpu())
    local = (
        torch.cat(imgs) if imgs else torch.empty(0),
        torch.cat(txts) if txts else None,
        torch.cat(labels) if labels else None,
    )
    if rank_world()[1] > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        parts = [g for g in gathered if g[0].numel()]
        if not parts:
            return local

        def cat(i: int) -> torch.Tensor | None:
            return torch.cat([g[i] for g in parts]) if all(g[i] is not None for g in parts) else None

        return cat(0), cat(1), cat(2)  # type: ignore[return-value]
    return local


def _skipped(loader: Any) -> int | None:
    """Bad samples the loader skipped, over all ranks (a collective); None for a plain iterable."""
    if not hasattr(loader, "global_stats"):
        return None
    return sum(v for k, v in loader.global_stats().items() if k in SKIP_REASONS)


def evaluate(
    model: Any, loader: Any, tokenize: Any, prompts: ZeroShotPrompts | None, progress: bool = False
) -> dict[str, float]:
    """Retrieval recall (where the batches carry captions) and zero-shot accuracy (where they carry
    labels and ``prompts`` is given; metric names start with ``prompts.name``) on ``loader``."""
    was_training = model.training
    model.eval()
    try:
        img, txt, labels = embed_split(model, loader, progress)
        metrics: dict[str, float] = {"eval_samples": float(img.shape[0])}
        skipped = _skipped(loader)
        if skipped is not None:
            metrics["eval_skipped"] = float(skipped)
        if txt is not None and img.shape[0]:
            metrics.update(retrieval_recall(img, txt))
        if prompts is not None and labels is not None:
            classifier = zero_shot_classifier(model, prompts, tokenize, progress=progress)
            metrics.update(zero_shot_accuracy(img, labels, classifier, prompts.name))
            metrics[f"{prompts.name}_chance"] = 1.0 / len(prompts.classnames)
    finally:
        model.train(was_training)
    return metrics


def load_prompts(data: DataConfig, images: str | None = None) -> ZeroShotPrompts | None:
    """The zero-shot prompts for the images ``images`` (default: ``data.val_data``): ``data.zeroshot``
    (``imagenet`` or a file) or a ``zeroshot.json`` found next to the images; None when there is none."""
    spec = _prompt_spec(data, images)
    return get_zeroshot_prompts(spec) if spec else None


def _prompt_spec(data: DataConfig, images: str | None = None) -> str | None:
    """``data.zeroshot``, else the ``zeroshot.json`` found next to ``images`` (default: ``data.val_data``)."""
    return data.zeroshot or find_zeroshot_file(images or data.val_data)


def _eval_loader(data: DataConfig, tokenize: Any, image_cfg: Any, batch_size: int, rank: int, world: int,
                 prompts: ZeroShotPrompts | None) -> Any:
    """The evaluation loader of ``data.val_data``; class folders numbered by ``prompts``."""
    loader = build_eval_loader(data, tokenize, image_cfg, batch_size, rank, world,
                               classes=prompts.class_index() if prompts is not None else None)
    folders = loader.class_names  # class folders numbered in sorted order
    if prompts is not None and folders is not None and len(folders) != len(prompts.classnames):
        raise ValueError(
            f"{data.val_data} has {len(folders)} class folders ({', '.join(folders[:3])}...) but the zero-shot "
            f"class names are {len(prompts.classnames)}: a class-name list follows the sorted folders one to one; "
            'name the classes by folder instead ({"classnames": {"<folder>": "<name>", ...}})'
        )
    if prompts is None and not loader.has_captions:
        raise ValueError(
            f"{data.val_data} has labels but no captions, and no zero-shot class names were found: "
            "nothing to evaluate; give --zeroshot imagenet or --zeroshot FILE (or a zeroshot.json next to the data)"
        )
    return loader


def evaluate_data(
    model: Any, data: DataConfig, tokenize: Any, batch_size: int, rank: int = 0, world: int = 1,
    progress: bool = False,
) -> dict[str, float]:
    """Every evaluation ``data`` asks for (every rank calls it with its rank).

    Without ``data.zeroshot_data``: :func:`evaluate` on ``val_data`` with :func:`load_prompts`.
    With it: retrieval on ``val_data`` (when set), and zero-shot classification of
    ``zeroshot_data``, whose sample and skip counts are ``<name>_samples`` and ``<name>_skipped``.

    Raises:
        ValueError: Zero-shot data without class names, class names that do not fit its folders, or
            data that has neither captions nor class names.
    """
    image_cfg = model.image_data_config()
    metrics: dict[str, float] = {}
    if data.zeroshot_data:
        if data.val_data:
            loader = build_eval_loader(data, tokenize, image_cfg, batch_size, rank, world)
            metrics.update(evaluate(model, loader, tokenize, None, progress))
        prompts = load_prompts(data, data.zeroshot_data)
        if prompts is None:
            raise ValueError(
                f"no zero-shot class names for zeroshot_data {data.zeroshot_data}: set zeroshot "
                "('imagenet' or a file), or put a zeroshot.json next to the data"
            )
        zs_data = dataclasses.replace(data, val_data=data.zeroshot_data)
        loader = _eval_loader(zs_data, tokenize, image_cfg, batch_size, rank, world, prompts)
        found = evaluate(model, loader, tokenize, prompts, progress)
        metrics.update({(f"{prompts.name}_{k[5:]}" if k.startswith("eval_") else k): v for k, v in found.items()})
    elif data.val_data:
        prompts = load_prompts(data)
        loader = _eval_loader(data, tokenize, image_cfg, batch_size, rank, world, prompts)
        metrics.update(evaluate(model, loader, tokenize, prompts, progress))
    return metrics


def evaluated_datasets(data: DataConfig) -> list[tuple[str, str, str | None]]:
    """``(role, data path, zero-shot class names or None)`` of each dataset :func:`evaluate_data` reads,
    in its order: ``val_data`` (classified too unless there is ``zeroshot_data``), ``zeroshot_data``."""
    if data.zeroshot_data:
        retrieval = [("val_data", data.val_data, None)] if data.val_data else []
        return retrieval + [("zeroshot_data", data.zeroshot_data, _prompt_spec(data, data.zeroshot_data))]
    return [("val_data", data.val_data, _prompt_spec(data))] if data.val_data else []


def dataset_record(data: DataConfig, role: str, path: str, prompts: str | None) -> dict[str, Any]:
    """What identifies one evaluated dataset: its resolved paths (symbolic links followed), format,
    split, columns and the zero-shot class names (``imagenet``, or the resolved prompt file)."""
    paths = [os.path.realpath(p) for p in expand_paths(path)]
    return {
        "role": role,
        "paths": paths,
        "format": canonical_format(data.data_format) if data.data_format else detect_format(paths),
        "split": data.val_split,
        "columns": {"image": data.image_column, "caption": data.caption_column, "label": data.label_column},
        "zeroshot": prompts if prompts in (None, IMAGENET) else os.path.realpath(prompts),
        "zeroshot_from": None if prompts is None else ("--zeroshot" if data.zeroshot else "found next to the data"),
    }


#: Path patterns (brace ranges, globs), left out of a result's name.
_PATTERN = re.compile(r"\{[^}]*\}|\[[^\]]*\]|[*?]")


def _name_token(text: str) -> str:
    """``text`` as a file-name token: letters, digits and dots, other runs one ``-`` (never ``_``, which
    separates the parts of ``eval_<name>_ema_step<N>``), at most 32 characters."""
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-.")[:32].strip("-.")


def _data_tokens(path: str) -> list[str]:
    """The folder and stem of a dataset's (first) path, patterns left out: ``/data/imagenet/val`` ->
    imagenet, val; ``/data/cc3m/val-{0000..0009}.tar`` -> cc3m, val."""
    first = Path(os.path.abspath(os.path.expanduser(str(path).split("::")[0])))
    stem = _PATTERN.sub("", first.name).split(".")[0]
    return [_name_token(_PATTERN.sub("", first.parent.name)), _name_token(stem)]


def result_name(data: DataConfig, datasets: list[dict[str, Any]]) -> str:
    """The ``<name>`` of ``eval_<name>_step<N>.json``: readable tokens (the ``--zeroshot`` class names,
    each dataset's folder and stem; a token equal to the one before it is left out) and 8 hex digits
    of the SHA-1 of ``datasets`` (:func:`dataset_record` of each), which tell any two datasets apart."""
    tokens: list[str] = []
    for _, path, prompts in evaluated_datasets(data):
        named = [_name_token(Path(prompts).stem)] if prompts and data.zeroshot else []  # "imagenet" is its stem
        for token in named + _data_tokens(path):
            if token and (not tokens or tokens[-1] != token):
                tokens.append(token)
    digest = hashlib.sha1(json.dumps(datasets, sort_keys=True).encode()).hexdigest()[:8]
    return "-".join(tokens + [digest])


def _summary(metrics: dict[str, float]) -> str:
    lines = []
    for key in metrics:
        if key.endswith("_top1"):
            name = key[: -len("_top1")]
            count = metrics.get(f"{name}_samples", metrics.get("eval_samples", 0))
            skipped = metrics.get(f"{name}_skipped", metrics.get("eval_skipped", 0))
            lines.append(f"{name} zero-shot: top-1 {metrics[key]:.4f}, top-5 {metrics[f'{name}_top5']:.4f} "
                         f"(chance {metrics[f'{name}_chance']:.4f}) on {int(count)} images, {int(skipped)} skipped")
    if "retrieval_r1" in metrics:
        lines.append(f"retrieval: R@1 {metrics['retrieval_r1']:.4f} (image->text {metrics['i2t_r1']:.4f}, "
                     f"text->image {metrics['t2i_r1']:.4f}) on {int(metrics['eval_samples'])} pairs")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Evaluates a saved checkpoint on one process, prints one JSON line of metrics and writes them
    to ``<run>/eval_<name>_step<N>.json`` (``<name>``: :func:`result_name`), replacing that file atomically."""
    from .config import config_from_dict
    from .model.clip import CLIPConfig, create_model
    from .model.tokenizer import load_tokenizer
    from .run import checkpoint

    ap = argparse.ArgumentParser(
        prog="python -m recipe.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint", required=True, help="run directory, its checkpoints/ directory, or one tag directory"
    )
    ap.add_argument("--val-data", default=None, help="held-out data (default: the run's)")
    ap.add_argument(
        "--zeroshot", default=None,
        help="zero-shot class names: 'imagenet' (built in; --val-data is a folder DIR/<wnid>/*.JPEG) or a "
             "zeroshot.json (default: the run's, or a zeroshot.json found next to the data; '' for the latter)",
    )
    ap.add_argument(
        "--zeroshot-data", default=None,
        help="labelled images for zero-shot classification besides --val-data, which then gives retrieval only "
             "(default: the run's unless --val-data is given)",
    )
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--workers", type=int, default=None, help="DataLoader worker processes (default: the run's)")
    ap.add_argument("--no-progress", action="store_true", help="no progress bars")
    ap.add_argument("--ema", action="store_true", help="evaluate the checkpoint's EMA weights (runs with --ema-decay)")
    ap.add_argument("--weights", choices=("master", "module"), default=None,
                    help="master (default): the weights export writes, evaluated in fp32: the exact fp32 masters the "
                         "optimizer keeps for mastered groups (the image tower and the logit scale by default), the "
                         "module weights elsewhere; module: the checkpoint's module weights in the run's dtype, as "
                         "training evaluated them (the default with --ema: the EMA weights have no master)")
    # CLIP_benchmark's datasets and metrics instead of the run's data (recipe/benchmark/, the [eval] extra)
    ap.add_argument("--benchmark", default=None, metavar="NAME[,NAME...]",
                    help="CLIP_benchmark datasets (wds/<name> or its names, e.g. cifar10,mscoco_captions) read from "
                         "--benchmark-root, scored with its class names, templates and metrics")
    ap.add_argument("--benchmark-root", default=None, metavar="DIR",
                    help="folder of the --benchmark datasets (wds_<name>/ as CLIP_benchmark's converter writes them)")
    ap.add_argument("--dtype", default=None, choices=("fp32", "bf16", "fp16"),
                    help="with --benchmark: the evaluation precision (default: fp32 for --weights master, the "
                         "run's for module)")
    args = ap.parse_args(argv)
    if args.benchmark is not None:
        from .benchmark.cli import run as run_benchmark

        return run_benchmark(args)
    path = Path(args.checkpoint)
    tag_dir = checkpoint.resolve(str(path), path / "checkpoints")
    run_dir = tag_dir.parent.parent
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    changes: dict[str, Any] = {"val_data": args.val_data or cfg.data.val_data}
    if args.val_data or args.zeroshot_data is not None:  # the images given are the ones to classify
        changes["zeroshot_data"] = args.zeroshot_data or None
    if args.zeroshot is not None:
        changes["zeroshot"] = args.zeroshot or None
    if args.workers is not None:
        changes["eval_workers"] = args.workers
    data = dataclasses.replace(cfg.data, **changes)
    if not (data.val_data or data.zeroshot_data):
        raise SystemExit("no validation data: pass --val-data")
    if data.zeroshot and data.zeroshot != IMAGENET and not os.path.isfile(data.zeroshot):
        raise SystemExit(f"--zeroshot must be 'imagenet' or an existing zeroshot.json file, got {data.zeroshot!r}")
    source = args.weights or ("module" if args.ema else "master")
    masters = 0
    if source == "master":  # what export writes (recipe.export.run.load_run), evaluated in fp32
        from .export.run import load_run

        run = load_run(tag_dir, torch.float32, ema=args.ema, weights="master")
        tokenizer, model, masters = run.tokenizer, run.model, len(run.master_names)
        weights = tag_dir / run.weights_file
    else:
        tokenizer = load_tokenizer(run_dir / "tokenizer")
        model = create_model(
            config=CLIPConfig.from_dict(json.loads((run_dir / "model_config.json").read_text())),
            tokenizer=tokenizer,
            text_load_weights=False,
        )
        weights = tag_dir / (checkpoint.EMA_WEIGHTS if args.ema else checkpoint.MODEL_WEIGHTS)
        if not weights.is_file():
            raise checkpoint.CheckpointError(f"{weights} not found" + (" (train with --ema-decay)" if args.ema else ""))
        state = torch.load(weights, map_location="cpu", weights_only=True)
        model.to(state["logit_scale"].dtype)  # evaluate in the precision the run trained in
        model.load_state_dict(state)
    metrics = evaluate_data(model, data, tokenizer, args.batch_size, progress=not args.no_progress)
    metrics["step"] = json.loads((tag_dir / checkpoint.COMPLETE).read_text())["step"]
    shown = {k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v) for k, v in metrics.items()}
    datasets = [dataset_record(data, *d) for d in evaluated_datasets(data)]
    record = {
        **metrics, "checkpoint": str(tag_dir), "val_data": data.val_data, "zeroshot_data": data.zeroshot_data,
        "zeroshot": data.zeroshot, "weights": weights.name, "weights_source": source, "master_params": masters,
        "datasets": datasets,
    }
    kind = "_ema" if args.ema else "_module" if source == "module" else ""
    out = run_dir / f"eval_{result_name(data, datasets)}{kind}_step{metrics['step']}.json"
    checkpoint.atomic_write_bytes(out, json.dumps(record, indent=1).encode())
    text = _summary(metrics)
    print((text + "\n" if text else "") + f"written to {out}", file=sys.stderr, flush=True)
    print(json.dumps(shown), flush=True)
    return metrics


def _cli() -> int:
    """``python -m recipe.evaluate``: a user error (missing data, unknown class folder, ...) is one line."""
    from .run.checkpoint import CheckpointError

    try:
        main()
    except (ValueError, FileNotFoundError, CheckpointError) as e:
        if os.environ.get("RECIPE_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_cli())
