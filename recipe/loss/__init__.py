"""Sharded gathered-embedding contrastive losses.

``loss, metrics = ClipLoss(mode=...)(image_features, text_features, logit_scale)`` on every rank;
the data-parallel mean of the rank losses (and gradients) is exactly the full-batch loss. One file
per job: :mod:`~recipe.loss.gather` (all-gather with a reduce-scatter backward),
:mod:`~recipe.loss.clip` (the module and its mode registry), :mod:`~recipe.loss.chunked` and
:mod:`~recipe.loss.fused` (+ :mod:`~recipe.loss.fused_kernels`) (the memory-lean modes),
:mod:`~recipe.loss.matmul` (fp32-result products), :mod:`~recipe.loss.base` (what a mode sees and
returns), :mod:`~recipe.loss.inputs` (input checks and the ranks' batch sizes, for both losses; read
on the host only on a loss module's first call, so that a steady-state step has no host
synchronisation).
:class:`~recipe.loss.siglip.SigLipLoss` (:mod:`~recipe.loss.siglip`) is SigLIP's sigmoid loss,
sharded the same way (modes ``plain`` and ``chunked``). Triton is imported only by the fused mode,
on its first use.
"""

from .base import GatheredBatch, ModeOutput
from .chunked import chunked_cross_entropy, symmetric_chunked_cross_entropy
from .clip import LOSS_MODES, ClipLoss, LossResult
from .gather import all_gather_with_grad
from .siglip import SIGLIP_MODES, SigLipLoss, chunked_sigmoid_loss

__all__ = [
    "ClipLoss",
    "GatheredBatch",
    "LOSS_MODES",
    "LossResult",
    "ModeOutput",
    "SIGLIP_MODES",
    "SigLipLoss",
    "all_gather_with_grad",
    "chunked_cross_entropy",
    "chunked_sigmoid_loss",
    "symmetric_chunked_cross_entropy",
]
