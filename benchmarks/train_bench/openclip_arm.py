"""The baseline arm: OpenCLIP's training step (``openclip``), or, without ``open_clip`` installed, the
recipe's model in the same fp32 + autocast + AdamW setting (``torch-amp``)."""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from _common import TextSpec  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)

from .runner import Runner

__all__ = ["OPENCLIP_TINY", "OpenClipRunner"]

#: open_clip keyword overrides that give the ``tiny`` preset's sizes.
OPENCLIP_TINY = dict(
    embed_dim=64,
    vision_cfg=dict(image_size=32, layers=2, width=64, patch_size=8, head_width=32),
    text_cfg=dict(context_length=32, vocab_size=4096, width=64, heads=2, layers=2),
)



def _openclip_param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """OpenCLIP's split: no decay for gains, biases, norms, embeddings' 1-d params and the logit scale."""
    no_decay, decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bn" in name or "ln" in name or "bias" in name or "logit_scale" in name
        (no_decay if exclude else decay).append(p)
    return [{"params": no_decay, "weight_decay": 0.0}, {"params": decay, "weight_decay": weight_decay}]


class OpenClipRunner(Runner):
    """OpenCLIP's training step: fp32 weights, bf16 autocast, torch AdamW, its ClipLoss, then the
    logit-scale clamp. Without ``open_clip`` (``fallback=True``): the recipe's model in the same
    setting with the recipe's plain loss."""

    def __init__(self, preset: str, ckpt: bool, device: torch.device, seed: int = 0, fallback: bool = False,
                 grad_clip: float = 0.0) -> None:
        torch.manual_seed(seed)
        self.grad_clip = grad_clip
        if fallback:
            from recipe.loss import ClipLoss
            from recipe.model import create_model

            model = create_model(preset)
            tcfg = model.text.config
            self.text = TextSpec(
                int(tcfg.vocab_size),
                int(model.context_length),
                int(tcfg.bos_token_id),
                int(tcfg.eos_token_id),
                int(tcfg.pad_token_id or 0),
            )
            self.image_size = int(model.image_data_config()["input_size"][-1])
            recipe_loss = ClipLoss(validate=False)
            self.loss_fn: Callable[..., torch.Tensor] = lambda *a: recipe_loss(*a).loss
            self.name = "torch-amp"
            self.description = (
                f"recipe {preset} model in fp32, bf16 autocast, torch AdamW, recipe plain loss "
                "(open_clip not installed)"
            )
            self._forward = lambda m, x: m(x["pixel_values"], x["input_ids"], x["attention_mask"])
        else:
            import open_clip
            from open_clip.loss import ClipLoss as OpenClipLoss

            kwargs = {} if preset == "ViT-B-32" else OPENCLIP_TINY
            if preset not in ("ViT-B-32", "tiny"):
                raise ValueError(f"no open_clip counterpart for preset {preset!r} (ViT-B-32 or tiny)")
            model = open_clip.create_model("ViT-B-32", **kwargs)
            cfg = open_clip.get_model_config("ViT-B-32")["text_cfg"] if not kwargs else kwargs["text_cfg"]
            vocab, ctx = int(cfg["vocab_size"]), int(cfg["context_length"])
            # OpenCLIP pools at the largest token id: end-of-text is the last id of the vocabulary.
            self.text = TextSpec(vocab, ctx, bos=vocab - 2, eos=vocab - 1)
            self.image_size = int(
                model.visual.image_size[0]
                if isinstance(model.visual.image_size, (tuple, list))
                else model.visual.image_size
            )
            self.loss_fn = OpenClipLoss()
            self.name = "openclip"
            sizes = "" if not kwargs else " (tiny sizes)"
            self.description = (
                f"open_clip {open_clip.__version__} ViT-B-32{sizes}, bf16 autocast, torch AdamW, open_clip ClipLoss"
            )
            self._forward = lambda m, x: m(x["pixel_values"], x["input_ids"])
        model.to(device)
        model.set_grad_checkpointing(ckpt)
        fused = {"fused": True} if device.type == "cuda" else {}
        self.opt = torch.optim.AdamW(_openclip_param_groups(model, 0.2), lr=5e-4, betas=(0.9, 0.98), eps=1e-6, **fused)
        self.model, self.device = model, device
        self.params = sum(p.numel() for p in model.parameters())
        if grad_clip:
            self.description += f", clip_grad_norm_ {grad_clip:g}"

    def clip(self) -> None:
        """OpenCLIP's ``--grad-clip-norm``: the global L2 norm of the gradients clipped to ``grad_clip``."""
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.grad_clip, norm_type=2.0)

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            img, txt, scale = self._forward(self.model, inputs)[:3]
            loss = self.loss_fn(img, txt, scale)
        loss.backward()
        if self.grad_clip:
            self.clip()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, math.log(100))
        # host read, once per step in every arm alike: the measurement checks that the losses are finite
        return float(loss.detach())
