"""Matrix products with fp32 results for the contrastive losses, whatever the feature dtype.

Products of 16-bit features are exact in fp32 and are accumulated in fp32: ``torch.mm(...,
out_dtype=torch.float32)`` on CUDA where this torch supports it (probed once per dtype with the
layouts the losses use), an upcast elsewhere. In the backward, the softmax-gradient matrix is cast
to bf16 for the feature-gradient products when the features are bf16 (tensor-core speed, fp32
accumulation, an error of the order of the bf16 rounding of the returned gradient itself); for fp16
features it stays fp32 (fp16 would underflow ``p_ij / B``), as for fp32 features.
"""

from __future__ import annotations

import functools

import torch
from torch import Tensor

__all__ = ["mm_f32", "addmm_f32_", "grad_matmul_dtype", "no_autocast", "MatmulF32"]


@functools.lru_cache(maxsize=None)
def _cuda_out_dtype_ok(dtype: torch.dtype) -> bool:
    """Whether ``mm``/``addmm`` with ``out_dtype=float32`` work on CUDA for 16-bit ``dtype`` operands
    in the layouts used here (column slices of wider buffers, transposed, row slices, in-place
    accumulation)."""
    # host reads (bool) of a one-time probe, cached per dtype: a loss's first call, never a steady step
    try:
        a = torch.ones(3, 8, dtype=dtype, device="cuda")[:, :4]
        b = torch.ones(6, 5, dtype=dtype, device="cuda")[1:5]
        rows_ok = bool((torch.mm(a, a.mT, out_dtype=torch.float32) == 4).all())
        cols = torch.mm(a.mT, a, out_dtype=torch.float32)
        acc = torch.full((3, 5), 2.0, device="cuda")
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return rows_ok and cols.dtype == torch.float32 and bool((cols == 3).all()) and bool((acc == 6).all())
    except (RuntimeError, TypeError):
        return False


def mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with an fp32 result and fp32 accumulation."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and _cuda_out_dtype_ok(a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def addmm_f32_(acc: Tensor, a: Tensor, b: Tensor, rows_per_step: int = 16384) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` (accumulation in fp32 whatever the operand dtype)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and a.dtype == b.dtype and _cuda_out_dtype_ok(a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # fp32 temporaries of bounded size
        for r0 in range(0, a.shape[0], rows_per_step):
            acc[r0 : r0 + rows_per_step] += mm_f32(a[r0 : r0 + rows_per_step], b)


def no_autocast(device: torch.device) -> torch.autocast:
    """Context disabling autocast: the losses choose their own precisions."""
    return torch.autocast(device_type=device.type, enabled=False)


def grad_matmul_dtype(feature_dtype: torch.dtype) -> torch.dtype:
    """Dtype of the softmax-gradient matrix in the feature-gradient products (module docstring)."""
    return torch.bfloat16 if feature_dtype == torch.bfloat16 else torch.float32


class MatmulF32(torch.autograd.Function):
    """``a @ b`` with an fp32 result, and a backward that follows :func:`grad_matmul_dtype`."""

    @staticmethod
    def forward(ctx, a, b):  # noqa: D102
        ctx.save_for_backward(a, b)
        return mm_f32(a, b)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        a, b = ctx.saved_tensors
        with no_autocast(a.device):
            g = grad.to(grad_matmul_dtype(a.dtype))
            grad_a = mm_f32(g, b.mT).to(a.dtype) if ctx.needs_input_grad[0] else None
            grad_b = mm_f32(a.mT, g).to(b.dtype) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b
