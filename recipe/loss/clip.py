"""Sharded gathered-embedding contrastive (CLIP) loss, exact at every world size.

With ``N`` data-parallel ranks holding ``M_r`` image-text pairs each (``B = sum(M_r)``), every rank
all-gathers the image and text embeddings, computes only its own ``M_r x B`` block in each direction
(local images against all texts, local texts against all images) with targets offset by the number
of rows held by lower ranks, and returns its share of the full ``B x B`` loss::

    loss_r = N / B * sum_{local rows i} (CE_i2t(i) + CE_t2i(i)) / 2

so that the data-parallel *mean* over ranks (what DeepSpeed and DDP do with gradients) is exactly the
full-batch loss ``mean_i (CE_i2t(i) + CE_t2i(i)) / 2``. With equal local batches ``N / B = 1 / M``,
i.e. each rank returns the mean over its local rows.

The all-gather carries a full backward: the gradient of the gathered tensor is reduce-scattered
(summed) to the rank that owns each row. The gradient a rank sees for its local features is therefore
``sum_s d loss_s / d x_r = N * d loss_full / d x_r``, and after the data-parallel mean of the parameter
gradients (the ``1 / N``) every parameter gradient equals the gradient of the full-batch loss. The
logit scale (and bias) are not gathered: their per-rank gradients are ``d loss_r / d s`` and their
data-parallel mean is ``d loss_full / d s``.

Ranks with **different local batch sizes are handled exactly** (not rejected): the local sizes are
exchanged with one small all-gather, the features are padded to the largest local size for the
collective and unpadded afterwards, targets are offset by the sizes of the lower ranks, and the
``N / B`` weight above keeps the data-parallel mean equal to the full-batch loss. The exchanged table
also carries the feature dim/dtype and a flag for non-finite inputs, so that every rank raises the
same ``ValueError`` instead of one rank raising and the others hanging in the next collective. Only
the first call (and a call in which every rank's local batch shape changes) reads it on the host;
later calls reuse the cached sizes and check the table on the device, so the steady-state step has no
host synchronisation (:mod:`recipe.loss.inputs` gives the protocol and its one rule: a local batch
size may change after the first call only in a call where every rank's changes, else pass
``sizes=``). A caller that knows every rank's size (the training loop: every rank's loader yields
exactly the micro-batch) passes ``sizes=`` with ``validate=False`` and the exchange is skipped
altogether.

Three modes are provided (see :data:`LOSS_MODES`; a new mode is one more entry in that dict):

* ``"plain"``: materialises the two ``M x B`` logit blocks in fp32 and uses ``F.cross_entropy``.
* ``"chunked"``: a custom :class:`torch.autograd.Function` computes each row's log-sum-exp over the
  gathered side in tiles of ``chunk_size x chunk_size`` with an online (running max) log-sum-exp, and
  its backward recomputes each tile. Extra memory is ``O(min(M, chunk)·chunk + B·D)``: the ``M x B``
  block is never materialised. At world size 1 one product per tile serves both directions (rows:
  image to text, columns: text to image), forward and backward (:mod:`recipe.loss.chunked`).
* ``"fused"``: Triton kernels streaming tiles of the block with online row (and, at world size 1,
  column) log-sum-exp statistics and a tile-recomputing backward; see :mod:`recipe.loss.fused`.

Numerics (every mode): logits, log-sum-exp, softmax and the logit-scale gradient are computed in
fp32 whatever the feature dtype (:mod:`recipe.loss.matmul`), so a logit scale of 100 with fp16
features neither overflows nor loses the logits' precision; for fp32 features the modes are exact to
fp32 rounding.

A scalar ``logit_bias`` (SigLIP style) is added to every logit in both modes. Softmax cross-entropy
is invariant to a constant added to all logits of a row, so the bias changes neither the loss nor the
feature gradients and its own gradient is zero (exactly zero in the chunked mode, fp32 rounding in the
plain mode); it is accepted so that models carrying a bias can share the loss call.
"""

from __future__ import annotations

from typing import NamedTuple

import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from .base import GatheredBatch, ModeFn, ModeOutput
from .chunked import chunked_mode
from .gather import all_gather_with_grad
from .inputs import SizeCache, check_inputs, rank_sizes
from .matmul import MatmulF32, no_autocast

__all__ = ["ClipLoss", "LossResult", "LOSS_MODES"]


def plain_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Materialises both ``M x B`` fp32 logit blocks; ``chunk_size`` is unused."""
    del chunk_size
    targets = batch.targets()
    out = []
    for local, other in ((batch.image, batch.all_text), (batch.text, batch.all_image)):
        logits = MatmulF32.apply(local, other.mT) * scale
        if bias is not None:
            logits = logits + bias
        ce = F.cross_entropy(logits, targets, reduction="none")
        out.append((ce, logits.detach().argmax(dim=1) == targets))
    return ModeOutput(out[0][0], out[1][0], out[0][1], out[1][1])


def fused_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """Fused tiled Triton kernels (:mod:`recipe.loss.fused`, imported on first use: it imports Triton)."""
    from .fused import fused_mode as run

    return run(batch, scale, bias, chunk_size)


#: Loss modes by name. A new implementation is one more entry (and its name in
#: ``recipe.config.LOSS_MODE_NAMES``).
LOSS_MODES: dict[str, ModeFn] = {"plain": plain_mode, "chunked": chunked_mode, "fused": fused_mode}


class LossResult(NamedTuple):
    """What a contrastive loss returns: ``loss, metrics = loss_fn(...)``.

    Attributes:
        loss: This rank's share of the full-batch loss (scalar fp32, differentiable); the mean over
            ranks is the full-batch loss.
        metrics: Detached fp32 scalars in the same convention (their mean over ranks is the
            full-batch value): ``acc_i2t`` (images whose most similar text is their own) and
            ``acc_t2i``.
    """

    loss: Tensor
    metrics: dict[str, Tensor]


class ShardedLoss(nn.Module):
    """What :class:`ClipLoss` and ``SigLipLoss`` share: the mode (a key of the subclass's ``MODES``,
    documented there with ``chunk_size``), the process group, input validation and the cache of
    exchanged sizes.

    Args:
        group: Process group; ``None`` for the default group (or no torch.distributed at all).
        validate: Check that inputs are finite. The first call (and a call with a new local batch
            shape) reads the check on the host and raises ``ValueError`` on every rank; later calls
            check on the device without a host synchronisation (``torch._assert_async``: a
            ``RuntimeError`` at once on the CPU, a device-side assertion on CUDA), see
            :mod:`recipe.loss.inputs`.
        cache_sizes: Keep the exchanged sizes between calls (no host synchronisation in a steady
            step; a local batch size may then change only in a call where every rank's does).
            ``False`` reads the exchanged sizes on the host every call (one synchronisation per
            call), for ranks whose batch sizes vary independently and are not known to the caller.
    """

    MODES: dict = {}

    def __init__(
        self,
        mode: str = "plain",
        chunk_size: int = 4096,
        group: dist.ProcessGroup | None = None,
        validate: bool = True,
        cache_sizes: bool = True,
    ) -> None:
        super().__init__()
        if mode not in self.MODES:
            raise ValueError(f"unknown {type(self).__name__} mode {mode!r}; available: {sorted(self.MODES)}")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        self.mode = mode
        self.chunk_size = int(chunk_size)
        self.group = group
        self.validate = validate
        # the ranks' sizes after the first call (recipe.loss.inputs); None: read them every call
        self._size_cache = SizeCache() if cache_sizes else None

    def extra_repr(self) -> str:  # noqa: D102
        return f"mode={self.mode!r}, chunk_size={self.chunk_size}"


class ClipLoss(ShardedLoss):
    """CLIP's symmetric contrastive loss over the embeddings gathered from all ranks.

    Call ``loss, metrics = loss_fn(image_features, text_features, logit_scale, logit_bias=None)`` on
    every rank of the group with that rank's features; ``loss`` is this rank's share of the
    full-batch loss such that the mean over ranks is the full-batch loss and the data-parallel mean
    of the gradients is the full-batch gradient (see the module docstring); ``metrics`` holds the
    accuracies (:class:`LossResult`). Ranks may hold different numbers of pairs.

    Args:
        mode: A key of :data:`LOSS_MODES` (``"plain"``, ``"chunked"`` or ``"fused"``: Triton kernels
            on CUDA tensors, see :mod:`recipe.loss.fused`).
        chunk_size: Tile edge of the chunked mode; caps the tile edge of the fused mode.
        group, validate, cache_sizes: As :class:`ShardedLoss`.
    """

    MODES = LOSS_MODES

    def forward(
        self,
        image_features: Tensor,
        text_features: Tensor,
        logit_scale: Tensor | float,
        logit_bias: Tensor | float | None = None,
        sizes: list[int] | None = None,
    ) -> LossResult:
        """Computes this rank's share of the loss and its accuracies.

        Args:
            image_features: Local, L2-normalised image embeddings ``(M, D)``.
            text_features: Local, L2-normalised text embeddings ``(M, D)``, pair ``i`` matching image
                ``i``; same dtype and device.
            logit_scale: The multiplier (already exponentiated), a single value.
            logit_bias: Optional single value added to every logit.
            sizes: Every rank's number of pairs in rank order, when the caller knows them; with
                ``validate=False`` this skips the size exchange (no collective).

        Returns:
            ``(loss, metrics)``, a :class:`LossResult`.

        Raises:
            ValueError: Malformed inputs, non-finite inputs (``validate``), an empty local batch or
                mismatched feature dimensions/dtypes across ranks (raised on every rank).
        """
        image, text = image_features, text_features
        scale, bias, bad = check_inputs(image, text, logit_scale, logit_bias, self.validate)
        sizes, world, rank = rank_sizes(image, bad, sizes, self.group, "contrastive loss", self._size_cache)
        if world == 1:
            all_image, all_text = image, text
        else:
            all_image, all_text = all_gather_with_grad(image, text, group=self.group, sizes=sizes)

        batch = GatheredBatch(image, text, all_image, all_text, sum(sizes[:rank]))
        with no_autocast(image.device):  # keep the fp32 logits even inside an autocast region
            out = LOSS_MODES[self.mode](batch, scale, bias, self.chunk_size)
        weight = world / sum(sizes)
        loss = (out.ce_i2t.sum() + out.ce_t2i.sum()) * (weight / 2)
        metrics = {
            "acc_i2t": out.correct_i2t.sum().float() * weight,
            "acc_t2i": out.correct_t2i.sum().float() * weight,
        }
        return LossResult(loss, metrics)
