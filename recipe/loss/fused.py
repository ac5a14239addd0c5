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
the same fp32 logits) and writes ``s * dS`` for the band in the features' dtype (bf16; fp16 times a
power of two that keeps ``p / B`` out of fp16's underflow, undone exactly after the GEMMs; fp32),
together with per-tile partial sums of ``dS * (x . y)`` for the logit-scale gradient; two cuBLAS
GEMMs (tensor cores for 16-bit features) then give the band's column gradients
``d cols[band] = dS_band^T rows`` (complete, fp32 accumulation, one rounding) and add
``dS_band cols[band]`` into an fp32 ``(M, D)`` accumulator of the row gradients. A band entry costs
6 bytes of traffic against ``6 D`` flops, so the GEMMs stay compute-bound. The accumulator is the
one place where the band's width matters: every band reads and writes the whole fp32 ``(M, D)``
accumulator (``8 M D`` bytes) for ``2 M W D`` flops, ``W / 4`` flop per byte; the column gradient of
a row chunk of ``R`` rows likewise costs ``R / 4``. The H200's ridge is ~185 flop/byte (784 TFLOP/s
bf16, 4.23 TB/s), so ``band_cols`` is at least 4,096 on the GPU (1,024 flop/byte, whatever the
batch): a width derived from ``band_bytes / M`` alone shrank with the batch (4,096 columns at
``B = 32768``, 1,024 at 131,072: 256 flop/byte, at the ridge), which fits the growth of the time
over the FLOP floor with the batch measured on the H200 before (1.49x at 32k, 1.69x at 131k; the next
``benchmarks/gpu_check.sh`` measures the wider bands). A band taller than ``band_rows_bytes``
(128 MiB) of ``dS`` is computed a row chunk at a time, its column gradient summed over the chunks in
an fp32 ``band_cols x D`` buffer; at the end the fp32 row accumulator is converted to the features'
dtype inside its own storage (no second ``M x D`` tensor). Extra memory: one band chunk, the fp32
row accumulator, the column gradient and the partial statistics: ``O(B D)``, the logits block never
exists. At ``B = 131072``, ``D = 1024``, bf16: 933 MiB with 4,096-column bands (909 with 1,024),
including both inputs' gradients (was 1289; the census runs shape for shape on the meta device in
tests/recipe/loss/test_fused.py, and gave the H200's measured 1288 MiB for the earlier code).

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
    "CANDIDATES",
    "FusedConfig",
    "default_config",
    "fused_cross_entropy",
    "fused_mode",
    "fused_symmetric_cross_entropy",
    "interpreting",
    "launch_arguments",
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
        max_registers: Cap on registers per thread (``ptxas`` ``maxnreg``, GPU); ``None``: ptxas's
            choice. 128 lets two CTAs of 8 warps share an SM (65,536 registers).
        group_m: Row tiles per launch group of the backward kernel (L2 reuse of the row operand).
        programs: Forward programs to aim for; ``None``: four per streaming multiprocessor on the GPU,
            4 in the interpreter (so that the partial-statistics merges are exercised).
        band_cols: Columns per backward band (rounded up to a multiple of ``block_n``); ``None``:
            ``band_bytes`` worth of ``dS`` but at least ``min_band_cols`` (GPU) or one tile
            (interpreter, so that the band accumulation is exercised).
        band_bytes: Target size of one ``dS`` band (sets its width).
        min_band_cols: Smallest band on the GPU: the row-gradient accumulator's GEMM does ``W / 4``
            flop per byte of fp32 accumulator traffic, so 4,096 keeps it at ~5x the H200's ridge.
        band_rows: Rows of the band computed at a time (a multiple of ``block_m``); ``None``: at most
            ``band_rows_bytes`` of ``dS`` at once (the whole height when that fits). A band taller than
            that is walked in row chunks, its column gradient summed over them in fp32.
        band_rows_bytes: Most ``dS`` held at once (bounds the backward's memory at large batches).
    """

    block_m: int = 128
    block_n: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 3
    max_registers: int | None = None
    group_m: int = 8
    programs: int | None = None
    band_cols: int | None = None
    band_bytes: int = 256 * 2**20
    min_band_cols: int = 4096
    band_rows: int | None = None
    band_rows_bytes: int = 128 * 2**20

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        for name in ("num_warps", "num_stages", "group_m", "band_bytes", "min_band_cols", "band_rows_bytes"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.max_registers is not None and not 24 <= self.max_registers <= 255:
            raise ValueError(f"max_registers must be in [24, 255], got {self.max_registers}")
        if self.programs is not None and self.programs < 1:
            raise ValueError(f"programs must be positive, got {self.programs}")
        if self.band_cols is not None and self.band_cols < 1:
            raise ValueError(f"band_cols must be positive, got {self.band_cols}")
        if self.band_rows is not None and (self.band_rows < 1 or self.band_rows % self.block_m):
            raise ValueError(f"band_rows must be a positive multiple of block_m, got {self.band_rows}")


def _pow2_floor(x: int) -> int:
    return 1 << (max(1, int(x)).bit_length() - 1)


def _pow2_ceil(x: int) -> int:
    return 1 << max(0, int(x) - 1).bit_length()


#: Launch configurations worth timing on the GPU, per feature dtype class: ``(block_m, block_n,
#: block_k, num_warps, num_stages, max_registers)``; the first is :func:`default_config`'s. Chosen
#: statically (no run-time autotuning) from the sm_90 resources ``ptxas -v`` reports
#: (``python benchmarks/kernel_report.py``), CTAs per SM = min(65536 / (registers x threads),
#: 228 KiB / shared memory). Measure with ``python -m recipe.loss.fused --batch 65536 --dim 1024
#: --dtype bfloat16`` (and ``float16``, ``float32``) on an H100/H200 -- forward and forward +
#: backward milliseconds per candidate -- and move the fastest first.
#: * 16-bit: 128 x 64 over 8 warps capped at 128 registers (fwd 127, bwd 118 bf16 / 127 fp16, no
#:   spills; 72 KiB: 2 CTAs = 16 warps per SM, one CTA's exponentials overlapping the other's
#:   ``wgmma``); 64 x 64 over 4 warps (4 CTAs, half the operand reuse per tile); 128 x 128 over 8
#:   warps (the previous default: ~250 registers, 96 KiB: one CTA of 8 warps, twice the reuse); 128
#:   x 64 with 4 stages (96 KiB, 2 CTAs).
#: * fp32 (IEEE FMA dot): 64 x 64 over 4 warps, K step 16 (fwd 168 / bwd 128 registers: 3 and 4
#:   CTAs); 128 x 64 over 8 warps, K step 32 (the previous default: fwd ~210-255, one CTA).
CANDIDATES = {
    "16-bit": ((128, 64, 64, 8, 3, 128), (64, 64, 64, 4, 3, 128), (128, 128, 64, 8, 3, None), (128, 64, 64, 8, 4, 128)),
    "fp32": ((64, 64, 16, 4, 2, None), (128, 64, 32, 8, 2, None)),
}


def default_config(dtype: torch.dtype, dim: int, chunk_size: int | None = None,
                   candidate: int = 0) -> FusedConfig:
    """The configuration :func:`fused_mode` uses.

    The first of :data:`CANDIDATES` for the dtype (chosen for H100/H200 from the compiled kernels'
    resources, see there): 16-bit features take 128 x 64 tiles over 8 warps (two warp-groups of
    ``wgmma``) capped at 128 registers (two CTAs per SM), K steps of 64 and three pipeline stages;
    fp32 features (IEEE fp32 FMA dot, no tensor cores: TF32 would break the fp32 contract) 64 x 64
    tiles over 4 warps, K steps of 16, two stages. A tile edge capped below ``block_m`` takes one
    warp-group (4 warps).
    The forward and the backward use the same tiles and K steps, so the recomputed logits are the
    forward's. ``chunk_size`` (the ``ClipLoss`` argument) caps the tile edges (rounded down to a
    power of two, at least 16), so small problems in tests use small tiles.

    Args:
        dtype: Feature dtype.
        dim: Feature dimension ``D`` (the K step is not made larger than needed).
        chunk_size: Optional cap of the tile edges.
        candidate: Index into :data:`CANDIDATES` (timing the alternatives).
    """
    cand = CANDIDATES["fp32" if dtype == torch.float32 else "16-bit"][candidate]
    block_m, block_n, block_k, warps, stages, max_registers = cand
    edge = 128 if chunk_size is None else min(128, max(16, _pow2_floor(chunk_size)))
    if edge < block_m:  # small tiles: one warp-group
        block_m, warps = edge, 4
    block_n = min(block_n, edge)
    block_k = min(block_k, max(16, _pow2_ceil(dim)))
    return FusedConfig(block_m=block_m, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages,
                       max_registers=max_registers)


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


@functools.cache
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
    flags = {
        "EVEN_K": dim % cfg.block_k == 0,
        "UPCAST": interp,
        "PRECISION": "ieee" if (dtype == torch.float32 or interp) else "tf32",
        "BM": cfg.block_m,
        "BN": cfg.block_n,
        "BK": cfg.block_k,
    }
    if not interp:
        flags.update(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
        if cfg.max_registers is not None:
            flags.update(maxnreg=cfg.max_registers)
    return flags


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _merge(m: Tensor, l: Tensor, before: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Merges partial (max, sum exp(x - max), max before the target) along dim 0."""
    if m.shape[0] == 1:
        return m[0], l[0], before[0]
    top = m.max(dim=0).values
    return top, (l * torch.exp(m - top)).sum(dim=0), before.max(dim=0).values


def _fwd_launch(rows: Tensor, cols: Tensor, scale: Tensor, offset: int, symmetric: bool, cfg: FusedConfig,
                target: int) -> tuple[tuple, tuple, dict, tuple]:
    """The forward kernel's launch: ``(grid, args, kwargs, (pos, row_stats, col_stats))`` with the
    statistics buffers allocated (``target``: programs to aim for, see :class:`FusedConfig`)."""
    m_rows, dim = rows.shape
    n_cols = cols.shape[0]
    row_tiles, col_tiles = _cdiv(m_rows, cfg.block_m), _cdiv(n_cols, cfg.block_n)
    # At most `target` programs (a whole number of waves when it is a multiple of the SM count);
    # every program gets row and column tiles (p_r <= row tiles, p_c <= column tiles).
    if symmetric:  # p_r ~ p_c balances the (p_r + p_c) * B partial-statistics memory
        p_c = min(col_tiles, max(1, round(math.sqrt(target))))
        p_r = min(row_tiles, max(1, target // p_c))
    else:  # one program per row tile; split the columns only when row tiles are few
        p_r = row_tiles
        p_c = min(col_tiles, max(1, target // row_tiles))

    f32 = {"dtype": torch.float32, "device": rows.device}
    row_stats = [torch.empty(p_c, m_rows, **f32) for _ in range(3)]
    pos = torch.empty(m_rows, **f32)
    if symmetric:  # (max, sum, max before) records per column, padded to whole tiles; tile scratch
        # filled on the device (a torch.tensor of Python values would be a blocking host-to-device copy)
        col_stats = torch.full((p_r, col_tiles * cfg.block_n, 3), float("-inf"), **f32)
        col_stats[..., 1] = 0.0
        scratch = torch.empty(p_r * p_c, 3 * cfg.block_n, **f32)
    else:
        col_stats = scratch = pos  # unused
    args = (rows, cols, scale, *row_stats, pos, col_stats, scratch, m_rows, n_cols, dim, rows.stride(0),
            cols.stride(0), offset, p_r, p_c)
    kwargs = dict(COL_STATS=symmetric, **_kernel_flags(rows.dtype, dim, cfg))
    return (p_r, p_c), args, kwargs, (pos, row_stats, col_stats)


def _forward_stats(rows: Tensor, cols: Tensor, scale: Tensor, offset: int, symmetric: bool, cfg: FusedConfig):
    """Runs the forward kernel.

    Returns:
        ``(pos, (row_max, row_sum, row_before)[, (col_max, col_sum, col_before)])``: fp32 vectors,
        ``*_before`` the maximum over the entries preceding the target (see :func:`fwd_kernel`).
    """
    grid, args, kwargs, (pos, row_stats, col_stats) = _fwd_launch(
        rows, cols, scale, offset, symmetric, cfg, _target_programs(cfg, rows.device))
    fwd_kernel[grid](*args, **kwargs)
    if symmetric:
        n_cols = cols.shape[0]
        return pos, _merge(*row_stats), _merge(*col_stats[:, :n_cols].permute(2, 0, 1).contiguous())
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


def _band_rows(cfg: FusedConfig, m_rows: int, width: int, elem: int) -> int:
    """Rows of ``dS`` computed at a time: ``band_rows``, else as many whole row tiles as fit in
    ``band_rows_bytes`` (at least one tile; all rows when they fit)."""
    if cfg.band_rows is not None:
        rows = cfg.band_rows
    else:
        rows = max(cfg.block_m, cfg.band_rows_bytes // max(1, width * elem) // cfg.block_m * cfg.block_m)
    return min(rows, _cdiv(m_rows, cfg.block_m) * cfg.block_m)


def _into_own_storage(acc: Tensor, dtype: torch.dtype, rows_per_step: int = 8192) -> Tensor:
    """``acc.to(dtype)`` for an fp32 ``(M, D)`` ``acc`` written into the first half (bf16, fp16) of
    ``acc``'s own storage, a row block at a time, so that the conversion allocates no second ``(M, D)``
    tensor (the result is a view keeping that storage). In row order each block's destination lies in
    blocks already read (block 0's in itself: it is read whole first)."""
    if dtype == torch.float32:
        return acc
    m, d = acc.shape
    out = acc.reshape(-1).view(dtype)[: m * d].view(m, d)
    for r0 in range(0, m, rows_per_step):
        out[r0 : r0 + rows_per_step].copy_(acc[r0 : r0 + rows_per_step].to(dtype))
    return out


def _ds_dtype(feature_dtype: torch.dtype) -> torch.dtype:
    """dtype of the ``dS`` bands: the features' (tensor-core GEMMs with fp32 accumulation; fp16 with
    the range scaling of :func:`_ds_range`), fp32 for fp32 features (exact fp32 contract)."""
    return feature_dtype


def _ds_range(ds_dtype: torch.dtype, g_r: Tensor, g_c: Tensor, scale: Tensor) -> tuple[Tensor, Tensor | None]:
    """``(out_scale, unscale)``: the kernel stores ``dS * out_scale``; the GEMM results are multiplied
    by ``unscale`` (``None``: 1).

    fp16 ``dS`` would underflow (entries ``~ g p``, with ``g ~ 1 / B`` and ``p ~ 1 / B``): it is stored
    times the power of two ``f`` that takes its bound ``|dS * scale| <= 2 max|g| |scale|`` to
    ``2^15 <= 65504`` (device tensors, no synchronisation); ``f`` and ``1 / f`` are exact, so
    ``unscale * (dS f)^T x`` is the fp32 product of the fp16-rounded ``dS`` (relative rounding
    ``2^-11``, ``2^14`` times finer than the bound before subnormals).
    """
    if ds_dtype != torch.float16:
        return scale, None
    bound = 2.0 * torch.maximum(g_r.abs().max(), g_c.abs().max()) * scale.abs().reshape(())
    exp = torch.ceil(torch.log2(bound.clamp(min=2.0**-100, max=2.0**100))).to(torch.int32)
    one = torch.ones((), dtype=torch.float32, device=scale.device)
    return scale * torch.ldexp(one, 15 - exp), torch.ldexp(one, exp - 15)


def _bwd_launch(rows: Tensor, cols: Tensor, scale: Tensor, out_scale: Tensor, pos: Tensor, row_stats: tuple,
                col_stats: tuple, band: Tensor, partial: Tensor, offset: int, c0: int, w: int, symmetric: bool,
                cfg: FusedConfig) -> tuple[tuple, tuple, dict]:
    """The backward kernel's launch for the band ``[c0, c0 + w)``: ``(grid, args, kwargs)``;
    ``row_stats`` / ``col_stats``: ``(max, log sum, upstream gradient)`` vectors."""
    m_rows, dim = rows.shape
    grid = (_cdiv(m_rows, cfg.block_m) * _cdiv(w, cfg.block_n),)
    args = (rows, cols, scale, out_scale, pos, *row_stats, *col_stats, band, partial, m_rows, dim,
            rows.stride(0), cols.stride(0), band.stride(0), offset, c0, w)
    kwargs = dict(SYMMETRIC=symmetric, GROUP_M=cfg.group_m, **_kernel_flags(rows.dtype, dim, cfg))
    return grid, args, kwargs


def launch_arguments(a: Tensor, b: Tensor, symmetric: bool = True, offset: int = 0,
                     config: FusedConfig | None = None, programs: int | None = None) -> dict:
    """The kernels' launches as the runtime issues them for ``a`` against ``b``, without running them.

    For tools and tests that compile the kernels with the runtime's exact specialisation (argument
    dtypes, 16-divisible integers and pointers, constexprs, ``num_warps``/``num_stages``), e.g. for
    sm_90 on a machine without a GPU (``TRITON_INTERPRET=0``): ``{"fwd": (kernel, grid, args,
    kwargs), "bwd": (...)}``, the backward's for its first band, with buffers of the runtime's shapes
    and dtypes on ``a``'s device (statistics uninitialised: for compiling only).

    Args:
        a: ``(M, D)`` row features (the runtime's dtype and strides).
        b: ``(N, D)`` column features.
        symmetric: The world-size-1 block (both directions, square, offset 0) or a row block.
        offset: Column of row 0's target (row blocks).
        config: ``None``: :func:`default_config` for ``a``'s dtype and ``D``.
        programs: Forward programs to aim for; ``None``: the runtime's (four per SM on the current GPU).
    """
    cfg = config or default_config(a.dtype, a.shape[1])
    if programs is not None:
        cfg = dataclasses.replace(cfg, programs=programs)
    a, b = _prepare(a), _prepare(b)
    scale = torch.ones(1, dtype=torch.float32, device=a.device)
    grid, args, kwargs, (pos, _, _) = _fwd_launch(a, b, scale, offset, symmetric, cfg, _target_programs(cfg, a.device))
    m_rows, n_cols = a.shape[0], b.shape[0]
    ds_dtype = _ds_dtype(a.dtype)
    width = _band_cols(cfg, m_rows, n_cols, torch.finfo(ds_dtype).bits // 8)
    f32 = {"dtype": torch.float32, "device": a.device}
    row_stats = tuple(torch.empty(m_rows, **f32) for _ in range(3))
    col_stats = tuple(torch.empty(n_cols, **f32) for _ in range(3)) if symmetric else row_stats
    band = torch.empty(m_rows, width, dtype=ds_dtype, device=a.device)
    w = min(width, n_cols)
    partial = torch.empty(_cdiv(m_rows, cfg.block_m) * _cdiv(w, cfg.block_n), **f32)
    bwd = _bwd_launch(a, b, scale, scale.clone(), pos, row_stats, col_stats, band, partial, offset, 0, w,
                      symmetric, cfg)
    return {"fwd": (fwd_kernel, grid, args, kwargs), "bwd": (bwd_kernel, *bwd)}


class _FusedCrossEntropy(torch.autograd.Function):
    """Row (and, ``symmetric``, column) cross-entropies of ``scale * rows @ cols^T``.

    Outputs ``(ce_rows, correct_rows, ce_cols, correct_cols)``; without ``symmetric`` the last two
    are empty. ``correct``: the first arg-max is the target (as ``torch.argmax(...) == target``).
    """

    @staticmethod
    def forward(ctx, rows, cols, scale, offset, symmetric, cfg):
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
    def backward(ctx, grad_rows, _grad_correct_rows, grad_cols, _grad_correct_cols):
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
        f32 = {"dtype": torch.float32, "device": device}
        g_r = torch.zeros(m_rows, **f32) if grad_rows is None else grad_rows.float().contiguous()
        if symmetric:
            g_c = torch.zeros(n_cols, **f32) if grad_cols is None else grad_cols.float().contiguous()
            col_stats = (col_max, col_ll, g_c)
        else:
            g_c = g_r
            col_stats = (row_max, row_ll, g_r)  # unused

        # dS in the features' dtype: bf16 and fp16 (range-scaled) feed tensor-core GEMMs with fp32
        # accumulation, fp32 stays fp32
        ds_dtype = _ds_dtype(rows.dtype)
        out_scale, unscale = _ds_range(ds_dtype, g_r, g_c, scale_buf)
        elem = torch.finfo(ds_dtype).bits // 8
        width = _band_cols(cfg, m_rows, n_cols, elem)
        height = _band_rows(cfg, m_rows, width, elem)
        band = torch.empty(height, width, dtype=ds_dtype, device=device)
        acc = torch.zeros(m_rows, dim, **f32) if need_rows else None
        grad_c = torch.empty(n_cols, dim, dtype=cols.dtype, device=device) if need_cols else None
        chunked = height < m_rows  # the band's column gradient is then summed over its row chunks in fp32
        band_grad = torch.empty(width, dim, **f32) if need_cols and chunked else None
        grad_s = torch.zeros((), dtype=torch.float64, device=device)
        for c0 in range(0, n_cols, width):
            w = min(width, n_cols - c0)
            for r0 in range(0, m_rows, height):
                h = min(height, m_rows - r0)
                partial = torch.empty(_cdiv(h, cfg.block_m) * _cdiv(w, cfg.block_n), **f32)
                stats = (row_max[r0 : r0 + h], row_ll[r0 : r0 + h], g_r[r0 : r0 + h])
                grid, args, kwargs = _bwd_launch(rows[r0 : r0 + h], cols, scale_buf, out_scale, pos[r0 : r0 + h],
                                                 stats, col_stats, band, partial, ctx.offset + r0, c0, w, symmetric,
                                                 cfg)
                bwd_kernel[grid](*args, **kwargs)
                ds = band[:h, :w]
                if need_cols and not chunked:
                    g = mm_f32(ds.mT, rows)
                    grad_c[c0 : c0 + w] = (g if unscale is None else g.mul_(unscale)).to(cols.dtype)
                elif need_cols:
                    if r0 == 0:
                        band_grad[:w] = mm_f32(ds.mT, rows[:h])
                    else:
                        addmm_f32_(band_grad[:w], ds.mT, rows[r0 : r0 + h])
                if need_rows:
                    addmm_f32_(acc[r0 : r0 + h], ds, cols[c0 : c0 + w])
                grad_s += partial.sum(dtype=torch.float64)
            if need_cols and chunked:
                g = band_grad[:w]
                grad_c[c0 : c0 + w] = (g if unscale is None else g.mul_(unscale)).to(cols.dtype)
        del band, band_grad, ds, args  # (the views and the launch arguments kept the band alive)
        if need_rows:
            if unscale is not None:
                acc.mul_(unscale)
            grad_r = _into_own_storage(acc, rows.dtype)  # no second (M, D) tensor at the peak
        else:
            grad_r = None
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


def _time_candidates(argv: list[str] | None = None) -> None:
    """``python -m recipe.loss.fused``: milliseconds of the symmetric forward and forward + backward
    for each of :data:`CANDIDATES` (CUDA; ``triton.testing.do_bench`` medians)."""
    import argparse

    import triton.testing

    parser = argparse.ArgumentParser(description=_time_candidates.__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=65536)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x, y = (torch.nn.functional.normalize(torch.randn(args.batch, args.dim, device="cuda", generator=gen), dim=1)
            .to(dtype).requires_grad_() for _ in range(2))
    scale = torch.tensor(100.0, device="cuda", requires_grad=True)
    for i, cand in enumerate(CANDIDATES["fp32" if dtype == torch.float32 else "16-bit"]):
        cfg = default_config(dtype, args.dim, candidate=i)

        def fwd(cfg=cfg):
            return fused_symmetric_cross_entropy(x, y, scale, cfg)

        def fwd_bwd(cfg=cfg):
            ce_r, ce_c, _, _ = fused_symmetric_cross_entropy(x, y, scale, cfg)
            (ce_r.sum() + ce_c.sum()).backward()

        print(f"{cand} (BM, BN, BK, warps, stages): fwd {triton.testing.do_bench(fwd):.3f} ms, "
              f"fwd + bwd {triton.testing.do_bench(fwd_bwd):.3f} ms", flush=True)


if __name__ == "__main__":
    _time_candidates()
