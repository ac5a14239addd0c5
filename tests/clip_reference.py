"""Shared by the loss tests: the float64 full-batch CLIP loss reference and an allocation probe."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode


def clip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float | None) -> dict:
    """Single-process float64 full-batch CLIP loss, its gradients and both accuracies."""
    image = image.double().requires_grad_()
    text = text.double().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.0 if bias is None else bias, dtype=torch.float64, requires_grad=True)
    logits = s * image @ text.T + b
    targets = torch.arange(image.shape[0])
    loss = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
    loss.backward()
    return {
        "loss": loss.detach(),
        "grad_image": image.grad,
        "grad_text": text.grad,
        "grad_scale": s.grad,
        "grad_bias": b.grad,
        "acc_i2t": (logits.argmax(1) == targets).double().mean(),
        "acc_t2i": (logits.T.argmax(1) == targets).double().mean(),
    }


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max absolute error within ``tol`` times the largest reference entry; finite."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite gradient"
    err = (actual.double() - expected).abs().max().item()
    bound = tol * expected.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


class LargestTensor(TorchDispatchMode):
    """Records the largest size in bytes of any tensor produced by a torch operator (including the
    byte views of storages the Triton interpreter makes when it copies kernel arguments)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out
