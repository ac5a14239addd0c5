"""Fused multi-tensor Triton kernel for the SRAdamW step.

One launch per *dtype group* (tensors sharing parameter / gradient / state dtypes, master and
state-scale presence, rounding modes and pointer alignment) updates every tensor of that group in a
single pass: it reads ``p, g, m, v`` (and the float32 master and the float16 state scales when
present), computes the AdamW update of :func:`optim.functional.update_block_` (the definition: one
correctly rounded float32 operation per step of the formula, no contraction) and writes ``p, m, v``
back, rounding half-precision values stochastically with the counter-based noise of
:mod:`optim.rounding` (one hash per element for the two statistics, one for the weight), generated in
the kernel: no noise tensor is read or written.

Multi-tensor launch (the chosen design): per step the host builds one small int64 *metadata table*,
a row per tensor holding its data pointers (p, g, m, v, master, the four scale scalars), its length,
its first noise index, the key words of its two noise keys and its float32 hyperparameters (bit-packed
in the same row; the layout is defined by name in :mod:`optim._rows`, shared with the CPU kernel), with
each group's rows contiguous, and uploads it with one asynchronous copy. A cached *block table*
maps each program to ``(tensor row, block within the tensor)``. Every program loads its row (a few
scalars, cached), turns the addresses into typed pointers and streams one block of ``BLOCK``
elements with 64-bit offsets. Full blocks take an unmasked path so the loads and stores vectorise
(pointers that are 16-byte aligned are annotated as such; tensors with unaligned pointers form their
own group without the hint). Hundreds of small tensors therefore cost one launch per dtype group.

Bit-exactness: the kernel computes the definition's bits on every device: under
``TRITON_INTERPRET=1`` against the eager path on the CPU (tests/optim/test_triton_kernel.py), compiled
on a GPU against the same CPU results (``gpu``-marked tests). Division and square root are the
correctly rounded ``div_rn``/``sqrt_rn``, and the compiler may not contract products into fused
multiply-adds (``enable_fp_fusion=False``), as the definition rounds each operation.

Triton is imported through :func:`optim._triton.load` (the one availability policy) when this module
is imported, which :mod:`optim` does lazily (the first fused step). ``TRITON_INTERPRET`` is read when
the kernels are decorated, i.e. at that import; on a machine without CUDA the policy sets it to ``1``
when unset. Interpreted kernels run on CPU tensors only (the metadata table holds raw host
addresses); compiled kernels run on CUDA tensors only.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import torch

from . import _sradamw_jit as _jit
from . import _triton
from ._rows import call_arguments, copy_back, metadata, prepare, specialisation
from .functional import TensorStep

__all__ = [
    "TensorStep",
    "sradamw_fused_",
    "sradamw_update_fused_",
    "interpreting",
    "DEFAULT_BLOCK",
    "DEFAULT_NUM_WARPS",
    "GradAmax",
]

#: Elements per program and warps per program on the GPU. 2048 elements over 16 warps is 4 per
#: thread: an 8-byte vector per 16-bit tensor and a 16-byte one per float32 tensor. Compiled for
#: sm_90, every dtype group then needs 36-60 registers under Triton 3.6 and 3.8 (8 per thread would need ~155;
#: benchmarks/kernel_report.py --max-regs 64), so at least two programs (32 warps) stay resident per SM.
DEFAULT_BLOCK = 2048
DEFAULT_NUM_WARPS = 16

_ALIGN = 16  # bytes


def interpreting() -> bool:
    """Whether the kernel was decorated under ``TRITON_INTERPRET=1`` (it then runs on CPU tensors)."""
    return _triton.interpreting(_jit.sradamw_kernel)


def _check_ready(device: torch.device) -> None:
    if _jit.sradamw_kernel is None:
        raise RuntimeError(f"the fused SRAdamW kernel needs Triton ({_triton.unavailable_reason()})")
    if interpreting():
        if device.type != "cpu":
            raise RuntimeError("under TRITON_INTERPRET=1 the fused SRAdamW kernel runs on CPU tensors only")
    elif device.type != "cuda":
        raise RuntimeError(
            f"the fused SRAdamW kernel needs CUDA tensors (got {device.type}); set TRITON_INTERPRET=1 before "
            "optim.triton_kernel is imported to run it on CPU tensors"
        )


# ----------------------------------------------------------------------------------------------
# Launch
# ----------------------------------------------------------------------------------------------
_BLOCK_TABLES: OrderedDict[tuple, torch.Tensor] = OrderedDict()


def _upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on ``device``, copied asynchronously through pinned memory (no host sync)."""
    if device.type == "cpu":
        return host
    return host.pin_memory().to(device, non_blocking=True)


def _flag_on(x: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A 1-element tensor as float32 ``[1]`` on ``device``, never read on the host."""
    x = x.detach().reshape(1).to(torch.float32)
    return _upload(x, device) if x.device.type == "cpu" else x.to(device)


def _block_table(numels: tuple[int, ...], block: int, device: torch.device) -> torch.Tensor:
    """int32 ``[n_blocks, 2]``: (tensor row, block index) per program; cached by layout."""
    key = (numels, block, str(device))
    hit = _BLOCK_TABLES.get(key)
    if hit is not None:
        _BLOCK_TABLES.move_to_end(key)
        return hit
    counts = torch.tensor([max(1, -(-n // block)) if n else 0 for n in numels], dtype=torch.int64)
    rows = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int64), counts)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(rows.numel(), dtype=torch.int64) - torch.repeat_interleave(starts, counts)
    table = _upload(torch.stack([rows, local], 1).to(torch.int32), device)
    _BLOCK_TABLES[key] = table
    while len(_BLOCK_TABLES) > 64:
        _BLOCK_TABLES.popitem(last=False)
    return table


def _launch(blocks: torch.Tensor, device: torch.device, *args: Any, kernel: Any = None, **kwargs: Any) -> None:
    """Launches one program per row of ``blocks`` on ``device`` (Triton uses the current device): the
    update kernel, or ``kernel`` (the one place that launches either; a host-time benchmark records here)."""
    kernel = kernel if kernel is not None else _jit.sradamw_kernel
    if device.type == "cuda":
        with torch.cuda.device(device):
            kernel[(blocks.shape[0],)](*args, **kwargs)
    else:
        kernel[(blocks.shape[0],)](*args, **kwargs)


def sradamw_fused_(
    steps: Sequence[TensorStep],
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    block_size: int | None = None,
    num_warps: int | None = None,
    states_checked: bool = False,
) -> int:
    """Applies one SRAdamW step to many tensors with one kernel launch per dtype group.

    Args:
        steps: The tensors and their per-tensor hyperparameters, all on one device.
        grad_mul: Multiplies every gradient first (an inverse loss scale): a Python float or a
            1-element tensor (read on the device, no synchronisation).
        found_inf: Optional 1-element tensor; when nonzero at run time the kernels change nothing
            (read on the device, no synchronisation).
        block_size: Elements per program (a power of two, default :data:`DEFAULT_BLOCK`).
        num_warps: Warps per program on the GPU (default :data:`DEFAULT_NUM_WARPS`).
        states_checked: The caller checked the states and options once (``SRAdamW``); each call then
            checks the gradients and sizes only (:func:`optim._rows.check`).

    Returns:
        The number of kernel launches issued.

    Raises:
        RuntimeError: Triton missing, or tensors on a device the kernel cannot run on.
        ValueError: Unsupported dtypes, mismatched sizes or devices, bad rounding names.
    """
    steps = [s for s in steps if s.param.numel() > 0]
    if not steps:
        return 0
    device = steps[0].param.device
    _check_ready(device)
    block = DEFAULT_BLOCK if block_size is None else int(block_size)
    if block < 16 or block & (block - 1):
        raise ValueError(f"block_size must be a power of two >= 16, got {block}")
    warps = DEFAULT_NUM_WARPS if num_warps is None else int(num_warps)

    gmul_mode, gmul_value, gmul_tensor, skip = call_arguments(grad_mul, found_inf, lambda x: _flag_on(x, device))

    groups: dict[tuple, list[tuple[TensorStep, torch.Tensor, torch.Tensor]]] = {}
    for s in steps:
        if s.param.device != device:
            raise ValueError(f"all tensors must be on one device ({device}); got {s.param.device}")
        param, grad = prepare(s, states_checked)
        groups.setdefault(specialisation(s, grad, gmul_mode, ALIGNED=_aligned(s, param, grad)), []).append(
            (s, param, grad))

    # one table for every group (its rows contiguous per group) and one upload; each launch reads its rows
    ordered = [item for items in groups.values() for item in items]
    launches = plan_launches([(spec, [param.numel() for _, param, _ in items]) for spec, items in groups.items()],
                             block, device)
    launch(metadata(ordered, gmul_value), launches, device, skip, gmul_tensor, block, warps)
    copy_back(ordered)
    return len(groups)


def _aligned(s: TensorStep, param: torch.Tensor, grad: torch.Tensor) -> bool:
    """Whether every address of a row is 16-byte aligned (the kernel's vector hint)."""
    ptrs = [param, grad, s.exp_avg, s.exp_avg_sq] + ([s.master] if s.master is not None else [])
    return all(t.data_ptr() % _ALIGN == 0 for t in ptrs)


def plan_launches(groups: Sequence[tuple[tuple, Sequence[int]]], block: int, device: torch.device) -> list[tuple]:
    """``(constexprs, first row, rows, block table)`` per launch, for groups given as ``(constexprs,
    numels of its rows)`` whose rows follow each other in the table in that order."""
    out, start = [], 0
    for constexprs, numels in groups:
        out.append((constexprs, start, len(numels), _block_table(tuple(numels), block, device)))
        start += len(numels)
    return out


def launch(host_table: torch.Tensor, launches: Sequence[tuple], device: torch.device, skip: torch.Tensor | None,
           gmul_tensor: torch.Tensor | None, block: int = DEFAULT_BLOCK, warps: int = DEFAULT_NUM_WARPS) -> None:
    """Uploads the metadata table (one asynchronous copy) and issues one launch per group of
    :func:`plan_launches` (the one place that launches; a host-time benchmark records here)."""
    all_rows = _upload(host_table, device)
    for constexprs, start, count, blocks in launches:
        table = all_rows[start:start + count]
        floats = table.view(torch.float32)
        _launch(
            blocks, device, table, floats, blocks,
            skip if skip is not None else floats,  # unused without HAS_SKIP
            gmul_tensor if gmul_tensor is not None else floats,  # unused unless GMUL == 2
            **dict(constexprs), HAS_SKIP=skip is not None, BLOCK=block,
            num_warps=warps, enable_fp_fusion=False,
        )


def sradamw_update_fused_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    grad_mul: torch.Tensor | float | None = None,
    found_inf: torch.Tensor | None = None,
    block_size: int | None = None,
    **fields: Any,
) -> None:
    """The fused kernel on one tensor, called like :func:`optim.sradamw_update_`.

    ``fields`` are :class:`TensorStep`'s keyword fields (``step``, ``lr``, ``beta1``, ``beta2``,
    ``eps``, ``weight_decay``, ``keys``, optional ``master``, scales, roundings, ``clamp``,
    ``index_offset``); ``found_inf`` is a device flag (nonzero means do nothing).
    """
    sradamw_fused_(
        [TensorStep(param, grad, exp_avg, exp_avg_sq, **fields)],
        grad_mul=grad_mul,
        found_inf=found_inf,
        block_size=block_size,
    )


# ----------------------------------------------------------------------------------------------
# A step plan's gradient maxima
# ----------------------------------------------------------------------------------------------
AMAX_BLOCK = 4096
AMAX_NUM_WARPS = 8
_AMAX_WIDE = {torch.float32: True, torch.bfloat16: False, torch.float16: False}


class GradAmax:
    """The largest magnitude of each of a plan's gradients (NaN when one holds a NaN), as float32 ``[n]``
    on their device: one launch per element width over all of them, reading the addresses the plan's
    walk found (uploaded with one copy). Equal to ``optim.sradamw._grad_amax`` (exact maxima of
    magnitudes), at a fixed host cost however many tensors: no per-tensor Python objects (the general
    path's ``_foreach_norm`` returns one tensor per gradient).

    Built once per plan from that step's gradients (their dtypes and lengths stay: autograd's ``.grad``
    setter keeps a parameter's dtype and size)."""

    def __init__(self, grads: Sequence[torch.Tensor], device: torch.device) -> None:
        _check_ready(device)
        self.device = device
        dtypes = [g.dtype for g in grads]
        if any(d not in _AMAX_WIDE for d in dtypes):
            raise ValueError(f"gradient maxima take float32/bfloat16/float16 gradients, got {sorted(set(map(str, dtypes)))}")
        self.numels = _upload(torch.tensor([g.numel() for g in grads], dtype=torch.int64), device)
        self.bits = torch.zeros(len(grads), dtype=torch.int32, device=device)
        self.launches = []
        for wide in (True, False):
            index = [j for j, d in enumerate(dtypes) if _AMAX_WIDE[d] == wide and grads[j].numel()]
            if index:
                blocks = _block_table(tuple(grads[j].numel() for j in index), AMAX_BLOCK, device)
                self.launches.append((wide, _upload(torch.tensor(index, dtype=torch.int32), device), blocks))
        kinds = set(dtypes)
        self.single = dtypes[0] if len(kinds) == 1 else None
        if self.single is None:  # mixed dtypes: each tensor's pattern widened by its dtype
            self.is_bf16 = _upload(torch.tensor([d == torch.bfloat16 for d in dtypes]), device)
            self.is_f16 = _upload(torch.tensor([d == torch.float16 for d in dtypes]), device)

    def __call__(self, addresses: torch.Tensor) -> torch.Tensor:
        """float32 ``[n]`` for the gradients at ``addresses`` (int64 CPU ``[n]``); never read on the host."""
        addrs = _upload(addresses, self.device)
        self.bits.zero_()
        for wide, index, blocks in self.launches:
            _launch(blocks, self.device, addrs, self.numels, index, blocks, self.bits, WIDE=wide, BLOCK=AMAX_BLOCK,
                    num_warps=AMAX_NUM_WARPS, kernel=_jit.grad_amax_kernel)
        return self._widen(self.bits)

    def tensors(self) -> list[torch.Tensor]:
        out = [self.numels, self.bits, *(t for _, index, blocks in self.launches for t in (index, blocks))]
        return out + ([self.is_bf16, self.is_f16] if self.single is None else [])

    def _widen(self, bits: torch.Tensor) -> torch.Tensor:
        """The patterns as float32 values (exact)."""
        if self.single is torch.float32:
            return bits.view(torch.float32)
        if self.single is torch.bfloat16:
            return (bits << 16).view(torch.float32)
        if self.single is torch.float16:
            return bits.to(torch.int16).view(torch.float16).to(torch.float32)
        wide = bits.view(torch.float32)
        return torch.where(self.is_bf16, (bits << 16).view(torch.float32),
                           torch.where(self.is_f16, bits.to(torch.int16).view(torch.float16).to(torch.float32), wide))
