"""The ``"fused"`` mode of :class:`recipe.loss.ClipLoss`: tiled Triton kernels, host side.

The similarity matrix is streamed through the GPU in ``block_m x block_n`` tiles and never stored:
the forward keeps, per row (and per column), a running maximum, a running ``sum exp(logit - max)``,
the maximum over the entries before the target (the accuracy: ``torch.argmax`` returns the first
maximum, so a row is right when ``positive == max > max before target``) and the positive logit;
the backward recomputes every tile from the features and the saved ``O(M + N)`` statistics.
Operands are bf16, fp16 or fp32 (``tl.dot`` on tensor cores for 16-bit inputs, IEEE fp32 for fp32
inputs, never TF32); accumulation, logits and exponentials are fp32.

Which blocks are computed
-------------------------
* **World size 1: one block serves both directions** (the DINOv3 observation). With ``S = s X Y^T``
  (``B x B``), image ``i`` against all texts is row ``i`` of ``S`` and text ``j`` against all images
  is column ``j``, so a single pass keeps row *and* column statistics. The forward runs on a
  ``p_r x p_c`` grid: program ``(pr, pc)`` owns the row tiles ``pr, pr + p_r, ...`` and the
  ``pc``-th contiguous range of column tiles; its row statistics over its column range and its
  column statistics over its row tiles are written to ``(p_c, B)`` and ``(p_r, B)`` partial buffers
  (read-modify-write of its own column slice, no atomics, deterministic), which a few O(B) torch
  ops merge. The backward
  recomputes ``S`` once and forms ``dS = g_i (P_ij - [i=j]) + h_j (Q_ij - [i=j])`` with
  ``P = softmax`` over rows and ``Q`` over columns. Matrix-multiply work: ``2B^2D`` forward,
  ``2B^2D`` recompute, ``4B^2D`` for the two feature gradients: the ``8 B^2 D`` floor of a loss
  that keeps ``O(B D)`` memory.
* **Sharded (world size > 1): two blocks.** Rank ``r`` needs rows ``r`` of ``S`` (its images against
  all texts) and columns ``r`` (its texts against all images, i.e. ``Y_r XA^T``); these are different
  ``M x B`` blocks, so each direction is one row-statistics pass over its own block (local rows
  against the gathered side, target column ``offset + i``) and the gathered side's gradient goes
  through the reduce-scatter backward of :func:`recipe.loss.gather.all_gather_with_grad`. Sharing one block
  across ranks would need every rank's partial statistics of every row (an extra collective in the
  forward and a cross-rank backward) for a 2x saving; it is not done. Work per rank: ``16 M B D``.

Backward: recomputed tiles, bands of ``dS``, cuBLAS
---------------------------------------------------
CLIP embeddings are wide (``D`` = 512 ... 1,024). A FlashAttention-style backward keeps the
``(tile, D)`` gradient accumulators in registers, which needs ``D <= 256``; holding them in global
memory instead costs a read-modify-write of ``block_m x D`` fp32 per tile pair, several TB/s at
these sizes. The backward therefore walks the gathered side in **column bands** of ``band_cols``
columns: a Triton kernel recomputes each tile of the band (same tiles and K-steps as the forward, so
the same fp32 logits) and writes ``s * dS`` for the band (bf16 for bf16 features, fp32 otherwise:
fp16 would underflow ``p / B``), together with per-tile partial sums of ``dS * (x . y)`` for the
logit-scale gradient; two cuBLAS GEMMs then give the band's column gradients
``d cols[band] = dS_band^T rows`` (complete, fp32 accumulation, one rounding) and add
``dS_band cols[band]`` into an fp32 ``(M, D)`` accumulator of the row gradients. A band entry costs
6 bytes of traffic against ``6 D`` flops, so the GEMMs stay compute-bound; ``band_cols`` is at least
1,024 on the GPU so that the accumulator update is too. Extra memory: the band (``M x band_cols``),
the fp32 row accumulator and the partial statistics: ``O(B D)``, the logits block never exists.

The logit bias is not applied inside the kernels: softmax cross-entropy is invariant to a constant
added to a row, so it changes neither the loss nor any other gradient and its own gradient is exactly
zero (as in the chunked mode).

Running the kernels
-------------------
The kernels (:mod:`recipe.loss.fused_kernels`) get Triton through :mod:`optim._triton`, the one
policy for the optimizer's and the loss's kernels: compiled kernels run on CUDA tensors; under
``TRITON_INTERPRET=1`` (set automatically on a machine without a CUDA device) they run in Triton's
numpy interpreter on CPU tensors, which is how the tests check them without a GPU (slow; tests
only). :mod:`recipe.loss` imports this module on the first fused call, never before.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
from torch import Tensor

from optim import _triton

from .base import GatheredBatch, ModeOutput, with_bias
from .fused_kernels import bwd_kernel, fwd_kernel
from .matmul import addmm_f32_, mm_f32

__all__ = [
    "FusedConfig",
    "default_config",
    "fused_cross_entropy",
    "fused_mode",
    "fused_symmetric_cross_entropy",
    "interpreting",
]


def interpreting() -> bool:
    """Whether the kernels run in Triton's interpreter (on CPU tensors) in this process."""
    return _triton.interpreting(fwd_kernel)


# --------------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FusedConfig:
    """Tile sizes and launch parameters of the fused kernels.

    Attributes:
        block_m: Rows per tile (power of two, >= 16).
        block_n: Columns per tile (power of two, >= 16).
        block_k: Feature-dimension step of the ``tl.dot`` loop (power of two, >= 16). The forward and
            the backward use the same tiles and step, so the recomputed logits are the forward's.
        num_warps: Warps per program (GPU).
        num_stages: Software-pipelining stages of the K loop (GPU).
        group_m: Row tiles per launch group of the backward kernel (L2 reuse of the row operand).
        programs: Forward programs to aim for; ``None``: four per streaming multiprocessor on the GPU,
            4 in the interpreter (so that the partial-statistics merges are exercised).
        band_cols: Columns per backward band (rounded up to a multiple of ``block_n``); ``None``:
            ``band_bytes`` worth of ``dS`` but at least ``min_band_cols`` (GPU) or one tile
            (interpreter, so that the band accumulation is exercised).
        band_bytes: Target size of one ``dS`` band.
        min_band_cols: Smallest band on the GPU (keeps the accumulating GEMM compute-bound).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    programs: int | None = None
    band_cols: int | None = None
    band_bytes: int = 256 * 2**20
    min_band_cols: int = 1024

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("num_warps", "num_stages", "group_m", "band_bytes", "min_band_cols"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs must be positive, got {self.programs}")
        if self.band_cols is not None and self.band_cols < 1:
            raise ValueError(f"band_cols must be positive, got {self.band_cols}")


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


def default_config(dtype: torch.dtype, dim: int, chunk_size: int | None = None) -> FusedConfig:
    """The configuration :func:`fused_mode` uses.

    Chosen for H100/H200 (sm_90) from the compiled kernels' resource use (``ptxas -v``: no register
    spills, pipelined ``cp.async`` operand loads): 16-bit features take 128 x 128 tiles over 8 warps
    (two warp-groups of ``wgmma``), K steps of 64 and three pipeline stages (96 KiB of shared
    memory); fp32 features (IEEE fp32 FMA dot, no tensor cores) 128 x 64 tiles, K steps of 32, two
    stages. ``chunk_size`` (the ``ClipLoss`` argument) caps the tile edge (rounded down to a power
    of two, at least 16), so small problems in tests use small tiles.

    Args:
        dtype: Feature dtype.
        dim: Feature dimension ``D`` (the K step is not made larger than needed).
        chunk_size: Optional cap of the tile edge.
    """
    edge = 128 if chunk_size is None else min(128, max(16, _pow2_floor(chunk_size)))
    if dtype == torch.float32:
        block_n, block_k, stages = min(64, edge), 32, 2
    else:
        block_n, block_k, stages = edge, 64, 3
    block_k = min(block_k, max(16, _pow2_ceil(dim)))
    warps = 8 if edge >= 128 else 4
    return FusedConfig(block_m=edge, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def _check_ready(device: torch.device) -> None:
    if fwd_kernel is None:
        raise RuntimeError(f'ClipLoss(mode="fused") needs Triton ({_triton.unavailable_reason()})')
    if interpreting():
        return  # the interpreter copies CUDA tensors to the host and back: slow but correct
    if device.type != "cuda":
        raise RuntimeError(
            f'ClipLoss(mode="fused") runs compiled Triton kernels on CUDA tensors (got {device.type}); '
            "CPU tensors need Triton's interpreter: TRITON_INTERPRET=1 set before Triton is first imported "
            "(tests only; use mode='chunked' on the CPU)"
        )


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _target_programs(cfg: FusedConfig, device: torch.device) -> int:
    if cfg.programs is not None:
        return cfg.programs
    if interpreting() or device.type != "cuda":
        return 4
    return 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def _kernel_flags(dtype: torch.dtype, dim: int, cfg: FusedConfig) -> dict:
    interp = interpreting()
    flags = dict(
        EVEN_K=dim % cfg.block_k == 0,
        UPCAST=interp,
        PRECISION="ieee" if (dtype == torch.float32 or interp) else "tf32",
        BM=cfg.block_m,
        BN=cfg.block_n,
        BK=cfg.block_k,
    )
    if not interp:
        flags.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return flags


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _merge(m: Tensor, l: Tensor, before: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merges partial (max, sum exp(x - max), max before the target) along dim 0."""
    if m.shape[0] == 1:
        return m[0], l[0], before[0]
    top = m.max(dim=0).values
    return top, (l * torch.exp(m - top)).sum(dim=0), before.max(dim=0).values


def _forward_stats(rows: Tensor, cols: Tensor, scale: Tensor, offset: int, symmetric: bool, cfg: FusedConfig):
    """Runs the forward kernel.

    Returns:
        ``(pos, (row_max, row_sum, row_before)[, (col_max, col_sum, col_before)])``: fp32 vectors,
        ``*_before`` the maximum over the entries preceding the target (see :func:`fwd_kernel`).
    """
    m_rows, dim = rows.shape
    n_cols = cols.shape[0]
    row_tiles, col_tiles = _cdiv(m_rows, cfg.block_m), _cdiv(n_cols, cfg.block_n)
    target = _target_programs(cfg, rows.device)
    # At most `target` programs (a whole number of waves when it is a multiple of the SM count);
    # every program gets row and column tiles (p_r <= row tiles, p_c <= column tiles).
    if symmetric:  # p_r ~ p_c balances the (p_r + p_c) * B partial-statistics memory
        p_c = min(col_tiles, max(1, round(math.sqrt(target))))
        p_r = min(row_tiles, max(1, target // p_c))
    else:  # one program per row tile; split the columns only when row tiles are few
        p_r = row_tiles
        p_c = min(col_tiles, max(1, target // row_tiles))

    f32 = dict(dtype=torch.float32, device=rows.device)
    row_stats = [torch.empty(p_c, m_rows, **f32) for _ in range(3)]
    pos = torch.empty(m_rows, **f32)
    if symmetric:
        col_stats = [
            torch.full((p_r, n_cols), float("-inf"), **f32),
            torch.zeros(p_r, n_cols, **f32),
            torch.full((p_r, n_cols), float("-inf"), **f32),
        ]
    else:
        col_stats = row_stats  # unused
    fwd_kernel[(p_r, p_c)](
        rows,
        cols,
        scale,
        *row_stats,
        pos,
        *col_stats,
        m_rows,
        n_cols,
        dim,
        rows.stride(0),
        cols.stride(0),
        offset,
        p_r,
        p_c,
        COL_STATS=symmetric,
        **_kernel_flags(rows.dtype, dim, cfg),
    )
    if symmetric:
        return pos, _merge(*row_stats), _merge(*col_stats)
    return pos, _merge(*row_stats)


def _band_cols(cfg: FusedConfig, m_rows: int, n_cols: int, elem: int) -> int:
    if cfg.band_cols is not None:
        width = cfg.band_cols
    elif interpreting():
        width = cfg.block_n
    else:
        width = max(cfg.min_band_cols, cfg.band_bytes // max(1, m_rows * elem))
    width = _cdiv(width, cfg.block_n) * cfg.block_n
    return min(width, _cdiv(n_cols, cfg.block_n) * cfg.block_n)


class _FusedCrossEntropy(torch.autograd.Function):
    """Row (and, ``symmetric``, column) cross-entropies of ``scale * rows @ cols^T``.

    Outputs ``(ce_rows, correct_rows, ce_cols, correct_cols)``; without ``symmetric`` the last two
    are empty. ``correct``: the first arg-max is the target (as ``torch.argmax(...) == target``).
    """

    @staticmethod
    def forward(ctx, rows, cols, scale, offset, symmetric, cfg):  # noqa: D102
        scale_buf = scale.detach().reshape(1).to(torch.float32).contiguous()
        pos, *stats = _forward_stats(rows, cols, scale_buf, offset, symmetric, cfg)
        outs, saved = [], []
        for top, total, before in stats:
            log_sum = total.log()
            # (max - positive) first: a confident row's loss keeps its relative precision
            outs += [(top - pos) + log_sum, (pos == top) & (before < pos)]
            saved += [top, log_sum]
        if not symmetric:
            outs += [pos.new_empty(0), outs[1].new_empty(0)]
            saved += [pos.new_empty(0), pos.new_empty(0)]
        ctx.save_for_backward(rows, cols, scale_buf, pos, *saved)
        ctx.offset, ctx.symmetric, ctx.cfg = offset, symmetric, cfg
        ctx.scale_shape = scale.shape
        ctx.mark_non_differentiable(outs[1], outs[3])
        return tuple(outs)

    @staticmethod
    def backward(ctx, grad_rows, _grad_correct_rows, grad_cols, _grad_correct_cols):  # noqa: D102
        with torch.autocast(device_type=ctx.saved_tensors[0].device.type, enabled=False):
            return _FusedCrossEntropy._backward(ctx, grad_rows, grad_cols)

    @staticmethod
    def _backward(ctx, grad_rows, grad_cols):
        rows, cols, scale_buf, pos, row_max, row_ll, col_max, col_ll = ctx.saved_tensors
        need_rows, need_cols, need_scale = ctx.needs_input_grad[:3]
        cfg, symmetric = ctx.cfg, ctx.symmetric
        m_rows, dim = rows.shape
        n_cols = cols.shape[0]
        device = rows.device
        f32 = dict(dtype=torch.float32, device=device)
        g_r = torch.zeros(m_rows, **f32) if grad_rows is None else grad_rows.float().contiguous()
        if symmetric:
            g_c = torch.zeros(n_cols, **f32) if grad_cols is None else grad_cols.float().contiguous()
        else:
            g_c = g_r  # unused

        # dS in bf16 for bf16 features (tensor-core GEMMs, fp32 accumulation); fp32 otherwise
        # (fp16 would underflow p / B); fp16 features then take fp32 copies for the GEMMs.
        ds_dtype = torch.bfloat16 if rows.dtype == torch.bfloat16 else torch.float32
        mm_rows = rows if rows.dtype != torch.float16 else rows.float()
        mm_cols = cols if cols.dtype != torch.float16 else cols.float()
        width = _band_cols(cfg, m_rows, n_cols, torch.finfo(ds_dtype).bits // 8)
        band = torch.empty(m_rows, width, dtype=ds_dtype, device=device)
        acc = torch.zeros(m_rows, dim, **f32) if need_rows else None
        grad_c = torch.empty(n_cols, dim, dtype=cols.dtype, device=device) if need_cols else None
        grad_s = torch.zeros((), dtype=torch.float64, device=device)
        flags = _kernel_flags(rows.dtype, dim, cfg)
        row_tiles = _cdiv(m_rows, cfg.block_m)
        for c0 in range(0, n_cols, width):
            w = min(width, n_cols - c0)
            tiles = row_tiles * _cdiv(w, cfg.block_n)
            partial = torch.empty(tiles, **f32)
            bwd_kernel[(tiles,)](
                rows,
                cols,
                scale_buf,
                pos,
                row_max,
                row_ll,
                g_r,
                col_max if symmetric else row_max,
                col_ll if symmetric else row_ll,
                g_c,
                band,
                partial,
                m_rows,
                dim,
                rows.stride(0),
                cols.stride(0),
                band.stride(0),
                ctx.offset,
                c0,
                w,
                SYMMETRIC=symmetric,
                GROUP_M=cfg.group_m,
                **flags,
            )
            ds = band[:, :w]
            if need_cols:
                grad_c[c0 : c0 + w] = mm_f32(ds.mT, mm_rows).to(cols.dtype)
            if need_rows:
                addmm_f32_(acc, ds, mm_cols[c0 : c0 + w])
            grad_s += partial.sum(dtype=torch.float64)
        del band
        grad_r = acc.to(rows.dtype) if need_rows else None
        grad_scale = grad_s.float().reshape(ctx.scale_shape) if need_scale else None
        return grad_r, grad_c, grad_scale, None, None, None


def _prepare(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _check_inputs(a: Tensor, b: Tensor, scale: Tensor) -> None:
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1]:
        raise ValueError(f"expected (M, D) and (N, D) features, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != b.dtype or a.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"features must share a dtype among float32/bfloat16/float16, got {a.dtype}, {b.dtype}")
    if a.device != b.device or scale.device != a.device:
        raise ValueError("features and scale must be on one device")
    if a.shape[0] == 0 or b.shape[0] == 0 or a.shape[1] == 0:
        raise ValueError("empty features")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError("scale must be a single fp32 value")


def fused_cross_entropy(
    rows: Tensor, cols: Tensor, scale: Tensor, offset: int, config: FusedConfig | None = None
) -> tuple[Tensor, Tensor]:
    """Row-wise cross-entropy of ``scale * rows @ cols.T`` (target of row ``i``: column ``offset + i``).

    The sharded building block: local rows against the gathered side (the fused counterpart of
    :func:`recipe.loss.chunked_cross_entropy`). Differentiable in ``rows``, ``cols`` and ``scale``.

    Args:
        rows: ``(M, D)`` features (bf16, fp16 or fp32).
        cols: ``(N, D)`` features of the same dtype, ``N >= offset + M``.
        scale: fp32 single-value tensor multiplying the dot products.
        offset: Column of row 0's target.
        config: Tiles and launch parameters; ``None``: :func:`default_config`.

    Returns:
        ``(ce, correct)``: fp32 ``(M,)`` cross-entropies and bool ``(M,)``, whether the row's first
        maximum is its target (``argmax == target``; not differentiable).
    """
    _check_inputs(rows, cols, scale)
    if not 0 <= offset <= cols.shape[0] - rows.shape[0]:
        raise ValueError(f"targets offset {offset} + {rows.shape[0]} rows exceed {cols.shape[0]} columns")
    _check_ready(rows.device)
    cfg = config or default_config(rows.dtype, rows.shape[1])
    ce, correct, _, _ = _FusedCrossEntropy.apply(_prepare(rows), _prepare(cols), scale, int(offset), False, cfg)
    return ce, correct


def fused_symmetric_cross_entropy(
    a: Tensor, b: Tensor, scale: Tensor, config: FusedConfig | None = None
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Both directions of the contrastive loss from one ``B x B`` block ``scale * a @ b.T``.

    Row ``i``'s cross-entropy (``a_i`` against all of ``b``, target ``i``) and column ``j``'s
    (``b_j`` against all of ``a``, target ``j``), from a single streamed pass over the block.

    Args:
        a: ``(B, D)`` features (e.g. images).
        b: ``(B, D)`` features (e.g. texts), same dtype.
        scale: fp32 single-value tensor.
        config: Tiles and launch parameters; ``None``: :func:`default_config`.

    Returns:
        ``(ce_rows, ce_cols, correct_rows, correct_cols)``: fp32 ``(B,)`` cross-entropies and bool
        ``(B,)`` "first maximum is the target" flags (not differentiable).
    """
    _check_inputs(a, b, scale)
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"the symmetric loss needs a square block, got {a.shape[0]} x {b.shape[0]}")
    _check_ready(a.device)
    cfg = config or default_config(a.dtype, a.shape[1])
    ce_r, ok_r, ce_c, ok_c = _FusedCrossEntropy.apply(_prepare(a), _prepare(b), scale, 0, True, cfg)
    return ce_r, ce_c, ok_r, ok_c


def fused_mode(batch: GatheredBatch, scale: Tensor, bias: Tensor | None, chunk_size: int) -> ModeOutput:
    """The ``"fused"`` entry of :data:`recipe.loss.LOSS_MODES` (see the module docstring).

    At world size 1 (the gathered tensors are the local ones) one block serves both directions;
    otherwise each direction is its local rows against the gathered side. ``chunk_size`` caps the
    tile edge (:func:`default_config`).

    Args:
        batch: A :class:`recipe.loss.GatheredBatch`.
        scale: 0-d fp32 logit scale.
        bias: 0-d fp32 logit bias or ``None`` (cancels in the cross-entropy; exact zero gradient).
        chunk_size: Tile-edge cap.

    Returns:
        A :class:`recipe.loss.ModeOutput`.
    """
    image, text = batch.image, batch.text
    cfg = default_config(image.dtype, image.shape[1], chunk_size)
    if batch.all_image is image and batch.all_text is text and batch.offset == 0:
        ce_i2t, ce_t2i, ok_i2t, ok_t2i = fused_symmetric_cross_entropy(image, text, scale, cfg)
    else:
        ce_i2t, ok_i2t = fused_cross_entropy(image, batch.all_text, scale, batch.offset, cfg)
        ce_t2i, ok_t2i = fused_cross_entropy(text, batch.all_image, scale, batch.offset, cfg)
    return with_bias(ModeOutput(ce_i2t, ce_t2i, ok_i2t, ok_t2i), bias)
