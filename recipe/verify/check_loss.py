"""The sharded loss at the real world size against a float64 full-batch reference.

Every rank draws ``rows`` random L2-normalised embedding pairs of the run's width (seeded per rank;
texts correlated with their images so that the loss is neither trivial nor saturated), rounded to
the dtype under test. The ranks all-gather these inputs (a plain collective, not the loss's own) and
each computes the float64 full-batch loss and its gradients with autograd. The sharded loss runs as
in training (``ClipLoss``/``SigLipLoss``, the mode under test); its data-parallel mean is compared
with the reference (see :mod:`recipe.loss.clip`: the mean of the rank losses is the full-batch loss,
a rank's feature gradient is ``N`` times the full-batch gradient of its rows, and the mean of the
rank gradients of the logit scale and bias is theirs).

Modes: ``plain`` and ``chunked`` everywhere (chunked with a tile that divides neither the local nor
the gathered batch); ``fused`` (CLIP only) where its Triton kernels compile: CUDA. Logit scales:
1/0.07 (the initial value) and 100 (the clamp); SigLIP adds its initial bias -10.

Tolerances (errors relative to the largest reference entry of the same quantity; loss: relative):

======  ========  ==================  ===================
dtype   loss      feature gradients   scale/bias gradient
======  ========  ==================  ===================
fp32    1e-5      1e-4                1e-4
bf16    1e-4      2e-2                1e-3
fp16    1e-4      5e-3                1e-3
======  ========  ==================  ===================

The loss is computed in fp32 from the rounded inputs (exact products), so its error is fp32
accumulation; 16-bit feature gradients are returned in their dtype (bf16: 2**-9 relative rounding,
plus the bf16 softmax-gradient products and the bf16 reduce-scatter sum); a wrong offset, a missing
reduce-scatter or a wrong normalisation gives errors of order 1.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.loss import ClipLoss, SigLipLoss

from .common import Row, Run, dtype_name, max_over_ranks

__all__ = ["TOLERANCES", "available_modes", "check_loss", "clip_reference", "siglip_reference"]

#: dtype: (loss rtol, feature-gradient tolerance, scale/bias-gradient rtol), relative to the reference.
TOLERANCES = {
    torch.float32: (1e-5, 1e-4, 1e-4),
    torch.bfloat16: (1e-4, 2e-2, 1e-3),
    torch.float16: (1e-4, 5e-3, 1e-3),
}
#: Rows per rank by device type.
DEFAULT_ROWS = {"cuda": 256, "cpu": 32}
_SCALES = (1 / 0.07, 100.0)
_SIGLIP_BIAS = -10.0


def available_modes(loss: str, device: torch.device) -> list[str]:
    """The modes that run on ``device``: fused only for CLIP on CUDA with Triton importable."""
    modes = ["plain", "chunked"]
    if loss == "clip" and device.type == "cuda":
        from optim import _triton

        if _triton.is_available():
            modes.append("fused")
    return modes


def clip_reference(image: torch.Tensor, text: torch.Tensor, scale: float) -> dict[str, torch.Tensor]:
    """float64 full-batch CLIP loss (mean of both directions' cross-entropies) and its gradients."""
    x = image.double().detach().requires_grad_()
    y = text.double().detach().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, device=x.device, requires_grad=True)
    logits = s * (x @ y.T)
    targets = torch.arange(x.shape[0], device=x.device)
    loss = (F.cross_entropy(logits, targets) + F.cross_entropy(logits.T, targets)) / 2
    loss.backward()
    return {"loss": loss.detach(), "image": x.grad, "text": y.grad, "scale": s.grad}


def siglip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float) -> dict[str, torch.Tensor]:
    """float64 full-batch SigLIP loss ``-(1/B) sum_ij log sigmoid(z_ij (s x_i.y_j + b))`` and its gradients."""
    x = image.double().detach().requires_grad_()
    y = text.double().detach().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, device=x.device, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float64, device=x.device, requires_grad=True)
    z = 2 * torch.eye(x.shape[0], dtype=torch.float64, device=x.device) - 1
    loss = -F.logsigmoid(z * (s * (x @ y.T) + b)).sum() / x.shape[0]
    loss.backward()
    return {"loss": loss.detach(), "image": x.grad, "text": y.grad, "scale": s.grad, "bias": b.grad}


def _inputs(run: Run, rows: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's pairs, drawn in float64 on the CPU (the same on any device) and rounded to ``dtype``."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + run.rank)
    image = F.normalize(torch.randn(rows, run.embed_dim, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.7 * torch.randn(rows, run.embed_dim, generator=gen, dtype=torch.float64), dim=1)
    return image.to(run.device, dtype), text.to(run.device, dtype)


def _gather(t: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's rows in rank order, as float32 (exact for 16-bit values)."""
    t = t.float().contiguous()
    if world == 1:
        return t
    out = t.new_empty(world * t.shape[0], t.shape[1])
    dist.all_gather_into_tensor(out, t)
    return out


def _abs_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute error; a non-finite result is an infinite error."""
    if not bool(torch.isfinite(actual).all()):
        return math.inf
    return (actual.double() - expected.double().reshape(actual.shape)).abs().max().item()


def _one_case(run: Run, loss: str, mode: str, dtype: torch.dtype, scale: float, rows: int, chunk: int,
              seed: int) -> list[float]:
    """``[loss rel, feature abs, feature rel, scalar rel]`` errors of one configuration on this rank."""
    image, text = _inputs(run, rows, dtype, seed)
    all_image, all_text = _gather(image, run.world), _gather(text, run.world)
    bias = _SIGLIP_BIAS if loss == "siglip" else None
    ref = (siglip_reference(all_image, all_text, scale, bias) if loss == "siglip"
           else clip_reference(all_image, all_text, scale))

    fn = (SigLipLoss if loss == "siglip" else ClipLoss)(mode=mode, chunk_size=chunk)
    x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float32, device=run.device, requires_grad=True)
    b = torch.tensor(bias, dtype=torch.float32, device=run.device, requires_grad=True) if bias is not None else None
    value = fn(x, y, s, b).loss if b is not None else fn(x, y, s).loss
    value.backward()

    n, lo = run.world, run.rank * rows
    scalars = [value.detach().double().reshape(1), s.grad.double().reshape(1)]
    if b is not None:
        scalars.append(b.grad.double().reshape(1))
    mean = torch.cat(scalars)
    if n > 1:
        dist.all_reduce(mean)  # the data-parallel mean of loss and scalar gradients
    mean = mean / n
    loss_rel = _abs_err(mean[:1], ref["loss"]) / abs(ref["loss"].item())
    # the rank's rows against the reference's, relative to the largest entry of the whole reference
    feat_abs = max(_abs_err(g.double() / n, ref[k][lo:lo + rows]) for g, k in ((x.grad, "image"), (y.grad, "text")))
    feat_rel = feat_abs / max(ref["image"].abs().max().item(), ref["text"].abs().max().item())
    scalar_rel = _abs_err(mean[1:2], ref["scale"]) / abs(ref["scale"].item())
    if b is not None:
        scalar_rel = max(scalar_rel, _abs_err(mean[2:3], ref["bias"]) / abs(ref["bias"].item()))
    return [loss_rel, feat_abs, feat_rel, scalar_rel]


def check_loss(run: Run, rows: int, seed: int = 0) -> list[Row]:
    """One row per (mode, dtype): the worst errors over scales and ranks against the tolerances."""
    dtypes = [torch.float32] + ([run.precision.param_dtype] if run.precision.param_dtype != torch.float32 else [])
    # a tile dividing neither the local nor the gathered batch (ragged last tiles), capped by the run's
    chunk = max(1, min(run.chunk_size, rows // 2 + 3))
    out = []
    for mode in available_modes(run.loss, run.device):
        for dtype in dtypes:
            errors = [0.0] * 4
            for i, scale in enumerate(_SCALES):
                case = _one_case(run, run.loss, mode, dtype, scale, rows, chunk, seed + i)
                errors = [max(a, b) for a, b in zip(errors, case)]
            loss_rel, feat_abs, feat_rel, scalar_rel = max_over_ranks(errors, run.device)
            tol_loss, tol_feat, tol_scalar = TOLERANCES[dtype]
            bad = [name for name, e, t in (("loss", loss_rel, tol_loss), ("grad", feat_rel, tol_feat),
                                           ("scale grad", scalar_rel, tol_scalar)) if not e <= t]
            detail = (f"rel err/tol: loss {loss_rel:.0e}/{tol_loss:.0e}, grad {feat_rel:.0e}/{tol_feat:.0e}, "
                      f"{'scale+bias' if run.loss == 'siglip' else 'scale'} {scalar_rel:.0e}/{tol_scalar:.0e} "
                      f"(grad max abs {feat_abs:.0e}; B={rows * run.world}, D={run.embed_dim})")
            if bad:
                detail = "exceeds " + ", ".join(bad) + ": " + detail
            values = {"loss_rel": loss_rel, "grad_abs": feat_abs, "grad_rel": feat_rel, "scalar_grad_rel": scalar_rel,
                      "tolerances": [tol_loss, tol_feat, tol_scalar], "rows_per_rank": rows, "chunk_size": chunk}
            out.append(Row("loss", f"{run.loss} {mode} {dtype_name(dtype)}", "fail" if bad else "pass", detail,
                           values))
    return out
