"""Shared by the loss tests: the float64 full-batch CLIP and SigLIP loss references and allocation probes."""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _full_batch_reference(image, text, scale, bias, loss_of_logits) -> dict:
    """``loss_of_logits(logits)`` in float64 on the full batch, its gradients and both accuracies."""
    image = image.double().requires_grad_()
    text = text.double().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.0 if bias is None else bias, dtype=torch.float64, requires_grad=True)
    logits = s * image @ text.T + b
    loss = loss_of_logits(logits)
    loss.backward()
    targets = torch.arange(image.shape[0])
    return {
        "loss": loss.detach(),
        "grad_image": image.grad,
        "grad_text": text.grad,
        "grad_scale": s.grad,
        "grad_bias": b.grad,
        "acc_i2t": (logits.argmax(1) == targets).double().mean(),
        "acc_t2i": (logits.T.argmax(1) == targets).double().mean(),
    }


def _clip_loss(logits: torch.Tensor) -> torch.Tensor:
    targets = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2


def _siglip_loss(logits: torch.Tensor) -> torch.Tensor:
    n = logits.shape[0]
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    return -F.logsigmoid(z * logits).sum() / n  # log(sigmoid(30)) would lose 1e-3 of it even in float64


def clip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float | None) -> dict:
    """Single-process float64 full-batch CLIP loss, its gradients and both accuracies."""
    return _full_batch_reference(image, text, scale, bias, _clip_loss)


def siglip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float | None) -> dict:
    """SigLIP's definition ``L = -(1/B) sum_ij log sigmoid(z_ij (s x_i.y_j + b))`` in float64 on the
    full batch: loss, its gradients and both accuracies."""
    return _full_batch_reference(image, text, scale, bias, _siglip_loss)


def assert_grad_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str) -> None:
    """Max absolute error within ``tol`` times the largest reference entry; finite."""
    assert torch.isfinite(actual).all(), f"{what}: non-finite gradient"
    err = (actual.double() - expected).abs().max().item()
    bound = tol * expected.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3g} > {bound:.3g}"


class LiveBytes(TorchDispatchMode):
    """Tracks the bytes of the tensor storages created by torch operators while it is active that are
    still alive, and their peak (a storage counts until its last tensor or view is gone; works on the
    meta device, where shapes are real and nothing is computed)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage id -> [tensors alive, bytes]

    def _release(self, key: int) -> None:
        entry = self._refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self._refs[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {torch._C._storage_id(t) for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                key = torch._C._storage_id(t)
                entry = self._refs.get(key)
                if entry is None:
                    if key in inputs:  # a view (or in-place result) of a storage made before the probe
                        continue
                    entry = self._refs[key] = [0, t.untyped_storage().nbytes()]
                    self.live += entry[1]
                    self.peak = max(self.peak, self.live)
                entry[0] += 1
                weakref.finalize(t, self._release, key)
        return out


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
