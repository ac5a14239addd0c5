"""Fused tiled contrastive-loss Triton kernels: the ``"fused"`` mode of :class:`recipe.loss.ClipLoss`.

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
  through the reduce-scatter backward of :func:`recipe.loss.all_gather_with_grad`. Sharing one block
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
Compiled kernels run on CUDA tensors. Under ``TRITON_INTERPRET=1`` (read when kernels are
decorated, i.e. when this module is imported) they run in Triton's numpy interpreter on CPU tensors:
that is how the tests check them without a GPU; it is slow and meant for tests only. This module
imports Triton; :mod:`recipe.loss` imports it lazily, the first time the fused mode is used. On a
machine without a CUDA device, importing this module sets ``TRITON_INTERPRET=1`` when it is unset
(compiled Triton cannot run anything there, so the interpreter is the only way the kernels can
run). The kernels call only Triton builtins, so they also run interpreted in a process that
imported Triton before the variable was set (``torch._dynamo``, imported by torchvision and timm,
imports Triton), where Triton's own library functions stay compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os

import torch
from torch import Tensor

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # see the module docstring, "Running the kernels"

try:  # the only place Triton is imported for the loss
    import triton
    import triton.language as tl

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # ImportError, or a broken install
    triton = None
    tl = None
    _IMPORT_ERROR = exc

__all__ = [
    "FusedConfig",
    "default_config",
    "fused_cross_entropy",
    "fused_mode",
    "fused_symmetric_cross_entropy",
    "interpreting",
    "is_available",
    "unavailable_reason",
]


def is_available() -> bool:
    """Whether Triton imported (the kernels can be built)."""
    return triton is not None


def unavailable_reason() -> str:
    """Why Triton is not usable ("" when it is)."""
    return "" if _IMPORT_ERROR is None else f"{type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"


def interpreting() -> bool:
    """Whether the kernels were decorated under ``TRITON_INTERPRET=1`` (they then run on CPU tensors)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_fwd_kernel, InterpretedFunction)


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
# Kernels
# --------------------------------------------------------------------------------------------------
if triton is not None:
    # The kernels call only Triton builtins, never Triton's own @jit library functions (tl.max,
    # tl.sum, tl.zeros, tl.cdiv): those are decorated when Triton is imported, compiled or
    # interpreted, and a process that imported Triton before TRITON_INTERPRET=1 was set (torch's
    # dynamo imports it) would mix the two. Reductions go through the builtin tl.reduce with the
    # library's combine functions, which the interpreter recognises and runs as numpy reductions.
    _MAX = getattr(tl.standard, "_elementwise_max", None)
    _SUM = getattr(tl.standard, "_sum_combine", None)
    if _MAX is None or _SUM is None:  # pragma: no cover - other Triton versions (slow interpreter path)

        @triton.jit
        def _MAX(a, b):
            return tl.maximum(a, b)

        @triton.jit
        def _SUM(a, b):
            return a + b

    @triton.jit
    def _expm1(x):
        """``exp(x) - 1`` without cancellation (|x| < 0.5: Taylor to x^8, error < 2e-8 relative)."""
        poly = x * (1.0 + x * (0.5 + x * (1.0 / 6 + x * (1.0 / 24 + x * (1.0 / 120 + x * (
            1.0 / 720 + x * (1.0 / 5040 + x * (1.0 / 40320))))))))
        return tl.where(tl.abs(x) < 0.5, poly, tl.exp(x) - 1.0)

    @triton.jit
    def _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D,
                  BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                  EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr):
        """fp32 ``a_tile @ b_tile^T`` over the whole feature dimension, K step ``BK``."""
        offs_k = tl.arange(0, BK)
        acc = tl.full((BM, BN), 0.0, dtype=tl.float32)
        for k in range(0, D, BK):
            if EVEN_K:
                a = tl.load(a_ptrs + k, mask=row_ok[:, None], other=0.0)
                b = tl.load(b_ptrs + k, mask=col_ok[:, None], other=0.0)
            else:
                k_ok = (k + offs_k) < D
                a = tl.load(a_ptrs + k, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
                b = tl.load(b_ptrs + k, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            if UPCAST:  # the interpreter multiplies 16-bit operands as raw bits: give it fp32
                a = a.to(tl.float32)
                b = b.to(tl.float32)
            acc = tl.dot(a, tl.trans(b), acc, input_precision=PRECISION)
        return acc

    @triton.jit
    def _fwd_kernel(
        a_ptr, b_ptr, scale_ptr,
        row_m_ptr, row_l_ptr, row_mb_ptr, pos_ptr,
        col_m_ptr, col_l_ptr, col_mb_ptr,
        M, N, D, stride_a, stride_b, offset, P_R, P_C,
        COL_STATS: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    ):
        """Online row (and column) log-sum-exp statistics of ``scale * a @ b^T``.

        Program ``(pr, pc)``: row tiles ``pr, pr + P_R, ...``; the ``pc``-th of ``P_C`` near-equal
        contiguous ranges of column tiles. Per row, over its column range, it
        writes to row ``pc`` of the row buffers the running max, ``sum exp(logit - max)`` and the
        max over the columns *before* the row's target (``offset + row``); it stores the positive
        logit of the rows whose target it meets. With ``COL_STATS`` it merges the same statistics
        per column over its row tiles (the "before" max over rows above the diagonal) into row
        ``pr`` of the column buffers (initialised to ``-inf``, 0, ``-inf`` by the host).
        The arg-max of a row is its target exactly when ``positive == max > max before target``
        (``torch.argmax`` returns the first maximum), which needs no index bookkeeping per element.
        """
        pr = tl.program_id(0)
        pc = tl.program_id(1)
        n_row_tiles = (M + BM - 1) // BM
        n_col_tiles = (N + BN - 1) // BN
        ct_lo = pc * n_col_tiles // P_C
        ct_hi = (pc + 1) * n_col_tiles // P_C
        scale = tl.load(scale_ptr)
        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        for rt in range(pr, n_row_tiles, P_R):
            rows = rt * BM + offs_m
            row_ok = rows < M
            targets = rows + offset
            first_target = rt * BM + offset
            a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
            run_m = tl.full((BM,), float("-inf"), dtype=tl.float32)
            run_l = tl.full((BM,), 0.0, dtype=tl.float32)
            run_mb = tl.full((BM,), float("-inf"), dtype=tl.float32)
            for ct in range(ct_lo, ct_hi):
                cols = ct * BN + offs_n
                col_ok = cols < N
                b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
                dots = _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D, BM, BN, BK, EVEN_K, UPCAST, PRECISION)
                logits = dots * scale
                # rows: padding columns are -inf
                s_r = tl.where(col_ok[None, :], logits, float("-inf"))
                t_m = tl.reduce(s_r, 1, _MAX)
                new_m = tl.maximum(run_m, t_m)
                run_l = run_l * tl.exp(run_m - new_m) + tl.reduce(tl.exp(s_r - new_m[:, None]), 1, _SUM)
                run_m = new_m
                if ct * BN + BN <= first_target:  # every column precedes every target of the tile
                    run_mb = tl.maximum(run_mb, t_m)
                elif ct * BN < first_target + BM:  # the tile meets the targets of some rows
                    before = tl.where(cols[None, :] < targets[:, None], s_r, float("-inf"))
                    run_mb = tl.maximum(run_mb, tl.reduce(before, 1, _MAX))
                    hit = cols[None, :] == targets[:, None]
                    pos = tl.reduce(tl.where(hit, logits, 0.0), 1, _SUM)
                    mine = row_ok & (targets >= ct * BN) & (targets < ct * BN + BN)
                    tl.store(pos_ptr + rows, pos, mask=mine)
                if COL_STATS:  # columns: padding rows are -inf; square block, offset 0
                    s_c = tl.where(row_ok[:, None], logits, float("-inf"))
                    c_m = tl.reduce(s_c, 0, _MAX)
                    c_off = pr.to(tl.int64) * N + cols
                    old_m = tl.load(col_m_ptr + c_off, mask=col_ok, other=0.0)
                    old_l = tl.load(col_l_ptr + c_off, mask=col_ok, other=0.0)
                    new_cm = tl.maximum(old_m, c_m)
                    new_l = old_l * tl.exp(old_m - new_cm) + tl.reduce(tl.exp(s_c - new_cm[None, :]), 0, _SUM)
                    tl.store(col_m_ptr + c_off, new_cm, mask=col_ok)
                    tl.store(col_l_ptr + c_off, new_l, mask=col_ok)
                    if rt * BM + BM <= ct * BN:  # every row precedes every column's target row
                        old_mb = tl.load(col_mb_ptr + c_off, mask=col_ok, other=0.0)
                        tl.store(col_mb_ptr + c_off, tl.maximum(old_mb, c_m), mask=col_ok)
                    elif rt * BM < ct * BN + BN:
                        old_mb = tl.load(col_mb_ptr + c_off, mask=col_ok, other=0.0)
                        above = tl.reduce(tl.where(rows[:, None] < cols[None, :], s_c, float("-inf")), 0, _MAX)
                        tl.store(col_mb_ptr + c_off, tl.maximum(old_mb, above), mask=col_ok)
            r_off = pc.to(tl.int64) * M + rows
            tl.store(row_m_ptr + r_off, run_m, mask=row_ok)
            tl.store(row_l_ptr + r_off, run_l, mask=row_ok)
            tl.store(row_mb_ptr + r_off, run_mb, mask=row_ok)

    @triton.jit
    def _bwd_kernel(
        a_ptr, b_ptr, scale_ptr, pos_ptr,
        row_m_ptr, row_ll_ptr, row_g_ptr,
        col_m_ptr, col_ll_ptr, col_g_ptr,
        ds_ptr, sgrad_ptr,
        M, D, stride_a, stride_b, stride_ds, offset, col0, band_w,
        SYMMETRIC: tl.constexpr, EVEN_K: tl.constexpr, UPCAST: tl.constexpr, PRECISION: tl.constexpr,
        BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ):
        """One recomputed tile of the band ``[col0, col0 + band_w)``: writes ``scale * dS`` and the
        tile's ``sum dS * dots`` (the logit-scale gradient's share).

        ``dS_ij = g_i (P_ij - [j = offset + i])`` with ``P_ij = exp(logit_ij - max_i - log sum_i)``,
        plus, with ``SYMMETRIC``, ``h_j (Q_ij - [i = j])`` with ``Q`` the column softmax. The target
        entries are ``g_i expm1(log P_ii)`` with ``log P_ii`` from the positive logit the forward
        saved (no cancellation, and no per-element bookkeeping of the diagonal).
        """
        pid = tl.program_id(0)
        n_rt = (M + BM - 1) // BM
        n_ct = (band_w + BN - 1) // BN
        per_group = GROUP_M * n_ct
        first_rt = (pid // per_group) * GROUP_M
        group_size = tl.minimum(n_rt - first_rt, GROUP_M)
        rt = first_rt + (pid % per_group) % group_size
        ct = (pid % per_group) // group_size

        offs_m = tl.arange(0, BM)
        offs_n = tl.arange(0, BN)
        offs_k = tl.arange(0, BK)
        rows = rt * BM + offs_m
        row_ok = rows < M
        lcols = ct * BN + offs_n
        col_ok = lcols < band_w
        cols = col0 + lcols
        a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + offs_k[None, :]
        b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_b + offs_k[None, :]
        dots = _dot_tile(a_ptrs, b_ptrs, row_ok, col_ok, D, BM, BN, BK, EVEN_K, UPCAST, PRECISION)
        scale = tl.load(scale_ptr)
        logits = dots * scale

        m_r = tl.load(row_m_ptr + rows, mask=row_ok, other=0.0)
        ll_r = tl.load(row_ll_ptr + rows, mask=row_ok, other=0.0)
        g_r = tl.load(row_g_ptr + rows, mask=row_ok, other=0.0)
        ds = g_r[:, None] * tl.exp((logits - m_r[:, None]) - ll_r[:, None])
        if SYMMETRIC:
            m_c = tl.load(col_m_ptr + cols, mask=col_ok, other=0.0)
            ll_c = tl.load(col_ll_ptr + cols, mask=col_ok, other=0.0)
            g_c = tl.load(col_g_ptr + cols, mask=col_ok, other=0.0)
            ds += g_c[None, :] * tl.exp((logits - m_c[None, :]) - ll_c[None, :])
        first_target = rt * BM + offset
        if (col0 + ct * BN < first_target + BM) & (col0 + ct * BN + BN > first_target):
            pos_r = tl.load(pos_ptr + rows, mask=row_ok, other=0.0)
            d_target = g_r * _expm1((pos_r - m_r) - ll_r)
            if SYMMETRIC:  # square block, offset 0: row i's target is column i
                d_target += tl.load(col_g_ptr + rows, mask=row_ok, other=0.0) * _expm1(
                    (pos_r - tl.load(col_m_ptr + rows, mask=row_ok, other=0.0))
                    - tl.load(col_ll_ptr + rows, mask=row_ok, other=0.0)
                )
            ds = tl.where(cols[None, :] == (rows + offset)[:, None], d_target[:, None], ds)
        ds = tl.where(row_ok[:, None] & col_ok[None, :], ds, 0.0)
        tl.store(sgrad_ptr + pid, tl.reduce(tl.reduce(ds * dots, 1, _SUM), 0, _SUM))
        out = ds_ptr + rows.to(tl.int64)[:, None] * stride_ds + lcols[None, :]
        tl.store(out, (ds * scale).to(ds_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])

else:  # pragma: no cover - exercised only without Triton
    _fwd_kernel = _bwd_kernel = None


# --------------------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------------------


def _check_ready(device: torch.device) -> None:
    if triton is None:
        raise RuntimeError(f'ClipLoss(mode="fused") needs Triton ({unavailable_reason()})')
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
        ``*_before`` the maximum over the entries preceding the target (see :func:`_fwd_kernel`).
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
    _fwd_kernel[(p_r, p_c)](
        rows, cols, scale,
        *row_stats, pos,
        *col_stats,
        m_rows, n_cols, dim, rows.stride(0), cols.stride(0), offset, p_r, p_c,
        COL_STATS=symmetric,
        **_kernel_flags(rows.dtype, dim, cfg),
    )
    if symmetric:
        return pos, _merge(*row_stats), _merge(*col_stats)
    return pos, _merge(*row_stats)


@functools.lru_cache(maxsize=None)
def _cuda_addmm_f32_ok(dtype: torch.dtype) -> bool:
    """Whether ``torch.addmm(acc_f32, a16, b16, out_dtype=float32, out=acc_f32)`` accumulates in place."""
    try:  # the layouts used here: a column slice of a wider buffer, a row slice
        a = torch.ones(3, 8, dtype=dtype, device="cuda")[:, :4]
        b = torch.ones(6, 5, dtype=dtype, device="cuda")[1:5]
        acc = torch.full((3, 5), 2.0, device="cuda")
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
        return acc.dtype == torch.float32 and bool((acc == 6).all())
    except (RuntimeError, TypeError):
        return False


@functools.lru_cache(maxsize=None)
def _cuda_mm_f32_ok(dtype: torch.dtype) -> bool:
    try:
        a = torch.ones(3, 8, dtype=dtype, device="cuda")[:, :4]
        out = torch.mm(a.mT, a, out_dtype=torch.float32)
        return out.dtype == torch.float32 and bool((out == 3).all())
    except (RuntimeError, TypeError):
        return False


def _mm_f32(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with an fp32 result and fp32 accumulation (one rounding of 16-bit results later)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        return a @ b
    if a.is_cuda and a.dtype == b.dtype and _cuda_mm_f32_ok(a.dtype):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _addmm_f32_(acc: Tensor, a: Tensor, b: Tensor, rows_per_step: int = 16384) -> None:
    """``acc += a @ b`` for an fp32 ``acc`` (accumulation in fp32 whatever the operand dtype)."""
    if a.dtype == torch.float32 and b.dtype == torch.float32:
        acc.addmm_(a, b)
    elif a.is_cuda and a.dtype == b.dtype and _cuda_addmm_f32_ok(a.dtype):
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:  # fp32 temporaries of bounded size
        for r0 in range(0, a.shape[0], rows_per_step):
            acc[r0 : r0 + rows_per_step] += _mm_f32(a[r0 : r0 + rows_per_step], b)


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
            _bwd_kernel[(tiles,)](
                rows, cols, scale_buf, pos,
                row_max, row_ll, g_r,
                col_max if symmetric else row_max, col_ll if symmetric else row_ll, g_c,
                band, partial,
                m_rows, dim, rows.stride(0), cols.stride(0), band.stride(0), ctx.offset, c0, w,
                SYMMETRIC=symmetric, GROUP_M=cfg.group_m, **flags,
            )
            ds = band[:, :w]
            if need_cols:
                grad_c[c0 : c0 + w] = _mm_f32(ds.mT, mm_rows).to(cols.dtype)
            if need_rows:
                _addmm_f32_(acc, ds, mm_cols[c0 : c0 + w])
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


def fused_mode(batch, scale: Tensor, bias: Tensor | None, chunk_size: int):
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
    from .loss import ModeOutput

    image, text = batch.image, batch.text
    cfg = default_config(image.dtype, image.shape[1], chunk_size)
    if batch.all_image is image and batch.all_text is text and batch.offset == 0:
        ce_i2t, ce_t2i, ok_i2t, ok_t2i = fused_symmetric_cross_entropy(image, text, scale, cfg)
    else:
        ce_i2t, ok_i2t = fused_cross_entropy(image, batch.all_text, scale, batch.offset, cfg)
        ce_t2i, ok_t2i = fused_cross_entropy(text, batch.all_image, scale, batch.offset, cfg)
    if bias is not None:  # in the graph, with its exactly zero gradient (see recipe.loss)
        zero = bias - bias
        ce_i2t, ce_t2i = ce_i2t + zero, ce_t2i + zero
    return ModeOutput(ce_i2t, ce_t2i, ok_i2t, ok_t2i)
