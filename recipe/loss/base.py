"""What a contrastive-loss mode sees on one rank and what it returns (shared by every mode)."""

from __future__ import annotations

import dataclasses
from typing import Callable, NamedTuple

import torch
from torch import Tensor

__all__ = ["GatheredBatch", "ModeOutput", "ModeFn", "with_bias"]


@dataclasses.dataclass(frozen=True)
class GatheredBatch:
    """What a loss mode sees on one rank.

    Attributes:
        image: Local image features ``(M, D)``.
        text: Local text features ``(M, D)``.
        all_image: Gathered image features ``(B, D)`` (rows in rank order, grads reduce-scattered).
        all_text: Gathered text features ``(B, D)``.
        offset: Row of ``all_image`` / ``all_text`` holding local pair 0 (the target offset).
    """

    image: Tensor
    text: Tensor
    all_image: Tensor
    all_text: Tensor
    offset: int

    def targets(self) -> Tensor:
        """Column index of each local row's positive in the ``M x B`` blocks."""
        return torch.arange(self.image.shape[0], device=self.image.device) + self.offset


class ModeOutput(NamedTuple):
    """Per-local-row results of a loss mode.

    Attributes:
        ce_i2t: fp32 ``(M,)`` cross-entropy of each local image against all texts.
        ce_t2i: fp32 ``(M,)`` cross-entropy of each local text against all images.
        correct_i2t: bool ``(M,)``, the row's arg-max is its positive (not differentiable).
        correct_t2i: bool ``(M,)``, same for text to image.
    """

    ce_i2t: Tensor
    ce_t2i: Tensor
    correct_i2t: Tensor
    correct_t2i: Tensor


#: A loss mode: ``fn(batch, scale, bias, chunk_size) -> ModeOutput`` with ``scale`` a 0-d fp32
#: tensor and ``bias`` a 0-d fp32 tensor or ``None``.
ModeFn = Callable[[GatheredBatch, Tensor, "Tensor | None", int], ModeOutput]


def with_bias(out: ModeOutput, bias: Tensor | None) -> ModeOutput:
    """Keeps a logit bias in the graph of a mode that does not apply it.

    The bias shifts every logit of a row alike and cancels in the softmax cross-entropy; adding
    ``bias - bias`` gives it its (exactly zero) gradient like any parameter the loss uses.
    """
    if bias is None:
        return out
    zero = bias - bias
    return out._replace(ce_i2t=out.ce_i2t + zero, ce_t2i=out.ce_t2i + zero)
