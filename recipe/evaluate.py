"""Zero-shot classification and image<->text retrieval on a held-out split.

In training every rank embeds its share of the split and the features are gathered, so it works
under every ZeRO stage; standalone::

    python -m recipe.evaluate --checkpoint runs/demo            # latest checkpoint of a run
    python -m recipe.evaluate --checkpoint runs/demo/checkpoints/step00000300 --val-data DIR/val.csv
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .config import DataConfig
from .data import build_eval_loader
from .zeroshot import ZeroShotPrompts, find_zeroshot_file, load_zeroshot_prompts

__all__ = ["zero_shot_classifier", "zero_shot_accuracy", "retrieval_recall", "embed_split", "evaluate", "main"]


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


@torch.no_grad()
def zero_shot_classifier(model: Any, prompts: ZeroShotPrompts, tokenize: Any) -> torch.Tensor:
    """``[num_classes, D]`` class embeddings: the normalised mean of each class's normalised
    template embeddings (as in the CLIP paper's prompt ensembling)."""
    device = _model_device(model)
    rows = []
    for class_prompts in prompts.prompts():
        tok = tokenize(class_prompts)
        emb = model.encode_text(tok["input_ids"].to(device), tok["attention_mask"].to(device)).float()
        rows.append(F.normalize(emb.mean(0), dim=-1))
    return torch.stack(rows)


def zero_shot_accuracy(
    image_features: torch.Tensor, labels: torch.Tensor, classifier: torch.Tensor
) -> dict[str, float]:
    """Top-1 and top-5 accuracy of ``argmax(image_features @ classifier.T)``."""
    logits = image_features.float() @ classifier.float().T
    k = min(5, classifier.shape[0])
    top = logits.topk(k, dim=1).indices
    hit = top == labels.view(-1, 1)
    return {"zeroshot_top1": hit[:, 0].float().mean().item(), "zeroshot_top5": hit.any(1).float().mean().item()}


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
def embed_split(model: Any, loader: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Image features, text features and labels of this rank's share, gathered over all ranks."""
    device, dtype = _model_device(model), _model_dtype(model)
    imgs, txts, labels = [], [], []
    for batch in loader:
        imgs.append(model.encode_image(batch["pixel_values"].to(device=device, dtype=dtype)).float().cpu())
        txts.append(model.encode_text(batch["input_ids"].to(device), batch["attention_mask"].to(device)).float().cpu())
        if batch.get("labels") is not None:
            labels.append(batch["labels"].cpu())
    local = (
        torch.cat(imgs) if imgs else torch.empty(0),
        torch.cat(txts) if txts else torch.empty(0),
        torch.cat(labels) if labels else None,
    )
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, local)
        parts = [g for g in gathered if g[0].numel()]
        return (
            torch.cat([g[0] for g in parts]),
            torch.cat([g[1] for g in parts]),
            torch.cat([g[2] for g in parts]) if parts and parts[0][2] is not None else None,
        )
    return local


def evaluate(model: Any, loader: Any, tokenize: Any, prompts: ZeroShotPrompts | None) -> dict[str, float]:
    """Zero-shot accuracy (when labels and prompts exist) and retrieval recall on ``loader``."""
    was_training = model.training
    model.eval()
    try:
        img, txt, labels = embed_split(model, loader)
        metrics: dict[str, float] = {"eval_samples": float(img.shape[0])}
        metrics.update(retrieval_recall(img, txt))
        if prompts is not None and labels is not None:
            classifier = zero_shot_classifier(model, prompts, tokenize)
            metrics.update(zero_shot_accuracy(img, labels, classifier))
            metrics["zeroshot_chance"] = 1.0 / len(prompts.classnames)
    finally:
        model.train(was_training)
    return metrics


def load_prompts(data: DataConfig) -> ZeroShotPrompts | None:
    """The zero-shot prompts of the validation data: ``data.zeroshot`` or a ``zeroshot.json`` found
    next to it; None when there is none (retrieval only)."""
    path = data.zeroshot or find_zeroshot_file(data.val_data)
    return load_zeroshot_prompts(path) if path else None


def main(argv: list[str] | None = None) -> dict[str, float]:
    """Evaluates a saved checkpoint on one process and prints one JSON line of metrics."""
    from . import checkpoint
    from .config import config_from_dict
    from .model import CLIPConfig, create_model
    from .tokenizer import load_tokenizer

    ap = argparse.ArgumentParser(
        prog="python -m recipe.evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--checkpoint", required=True, help="run directory, its checkpoints/ directory, or one tag directory"
    )
    ap.add_argument("--val-data", default=None, help="held-out split (default: the run's)")
    ap.add_argument("--batch-size", type=int, default=256)
    args = ap.parse_args(argv)
    path = Path(args.checkpoint)
    tag_dir = checkpoint.resolve(str(path), path / "checkpoints")
    run_dir = tag_dir.parent.parent
    cfg = config_from_dict(json.loads((run_dir / "config.json").read_text()))
    data = dataclasses.replace(cfg.data, val_data=args.val_data or cfg.data.val_data)
    if not data.val_data:
        raise SystemExit("no validation data: pass --val-data")
    tokenizer = load_tokenizer(run_dir / "tokenizer")
    model = create_model(
        config=CLIPConfig.from_dict(json.loads((run_dir / "model_config.json").read_text())),
        tokenizer=tokenizer,
        text_load_weights=False,
    )
    state = torch.load(tag_dir / checkpoint.MODEL_WEIGHTS, map_location="cpu", weights_only=True)
    model.to(state["logit_scale"].dtype)  # evaluate in the precision the run trained in
    model.load_state_dict(state)
    loader = build_eval_loader(data, tokenizer, model.image_data_config(), args.batch_size)
    metrics = evaluate(model, loader, tokenizer, load_prompts(data))
    metrics["step"] = json.loads((tag_dir / checkpoint.COMPLETE).read_text())["step"]
    print(
        json.dumps({k: (round(v, 5) if isinstance(v, float) and math.isfinite(v) else v) for k, v in metrics.items()})
    )
    return metrics


if __name__ == "__main__":
    main()
