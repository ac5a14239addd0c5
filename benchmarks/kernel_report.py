"""Static resource report of the project's Triton kernels, compiled for sm_90 (H100/H200) without a GPU.

Usage::

    python benchmarks/kernel_report.py                  # markdown table on stdout
    python benchmarks/kernel_report.py --json           # the same rows as JSON
    python benchmarks/kernel_report.py --optimizer-only # or --loss-only
    python benchmarks/kernel_report.py --loss-dims 512 --loss-dtypes bf16
    python benchmarks/kernel_report.py --python /tmp/venv-triton36/bin/python --optimizer-only
                                                        # the same report under another Triton
    python benchmarks/kernel_report.py --optimizer-only --max-regs 64  # exit 1 over the budget

**Another Triton** (``--python PY`` or ``KERNEL_REPORT_PYTHON=PY``): the report is made by this
script run under the interpreter PY, whose own Triton (and its ptxas) compiles. PY needs no torch of
its own: this interpreter's site-packages are appended to PY's ``sys.path`` (after PY's own, so PY's
Triton wins), which works when both are the same Python minor version. E.g. the GPU machine's Triton
3.6 beside a newer local one::

    python3 -m venv /tmp/venv-triton36 && /tmp/venv-triton36/bin/pip install triton==3.6.0
    python benchmarks/kernel_report.py --python /tmp/venv-triton36/bin/python --optimizer-only

The markdown output starts with the Triton and ptxas versions; JSON rows carry ``triton``.

How the runtime specialisation is obtained (nothing is re-typed where the host code can say it):

* **Launch arguments** come from the host code itself. Every launch of a ``@triton.jit`` kernel
  (``kernel[grid](*args, **kwargs)``) ends in ``JITFunction.run``; :func:`recording` replaces that
  method by a recorder for the duration of a host call, so *all* launches are recorded whatever path
  issues them (one launch per parameter group, several per step, an extra helper kernel), and no
  kernel or argument name is assumed. The optimizer: an :class:`optim.SRAdamW` on CPU tensors of each
  weight/state dtype route (:data:`OPTIM_ROUTES`) takes one ``step`` routed to the fused (CUDA) path,
  with the device-only guards of :mod:`optim.triton_kernel` disabled and ``_defers`` returning True as
  on a GPU (check_finite's skip flag stays on the device, so the kernel's skip argument is set as at
  run time). The loss: ``ClipLoss(mode="fused")`` forward and backward on CPU tensors, the SM count
  set to an H200's (132) and the two cuBLAS GEMMs of the backward skipped (they do not reach the
  kernels' arguments). Each *distinct* compiled variant (kernel and Triton specialisation) of a route
  is one row.
* **Specialisation** of the recorded arguments is Triton's own: the JIT function's binder
  (``create_function_from_signature``, the code ``JITFunction.run`` executes: 16-byte pointer
  alignment, integers divisible by 16 or equal to 1) and ``JITFunction._pack_args``, with the CUDA
  backend of ``GPUTarget("cuda", 90, 32)``; the result goes to ``triton.compile``.

Per variant: registers per thread, spill bytes (stores + loads, from ``ptxas -v``), static shared
memory plus Triton's dynamic shared memory, and for kernels launched with a ``BLOCK`` constexpr (the
optimizer's streaming kernels) SASS instructions per element, see :func:`sass_per_element`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

os.environ["TRITON_INTERPRET"] = "0"  # compile (the project's policy would pick the interpreter without CUDA)
ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
# run under --python: the calling interpreter's site-packages, after this interpreter's own (see the docstring)
_BORROW_ENV = "KERNEL_REPORT_BORROW"
for _p in filter(None, os.environ.get(_BORROW_ENV, "").split(os.pathsep)):
    if _p not in sys.path:
        sys.path.append(_p)

import torch

try:
    import triton
    import triton.language as tl

    _TRITON_ERROR = ""
except Exception as exc:  # noqa: BLE001  (any broken install: tools_missing() says why)
    triton = tl = None
    _TRITON_ERROR = f"{type(exc).__name__}: {exc}"

SM90_SMS = 132  # H200 / H100 SXM streaming multiprocessors (the loss's forward grid depends on it)


def tools_missing() -> str:
    """Why the report cannot be made here ("" when Triton, its CUDA backend, ptxas and nvdisasm are present)."""
    if triton is None:
        return f"Triton is not importable: {_TRITON_ERROR}"
    try:
        from triton import knobs

        _backend()  # Triton's CUDA backend for sm_90
    except Exception as exc:  # noqa: BLE001
        return f"Triton's CUDA backend is not usable: {type(exc).__name__}: {exc}"
    for tool in ("ptxas", "nvdisasm"):
        try:
            path = getattr(knobs.nvidia, tool).path
        except Exception as exc:  # noqa: BLE001
            return f"Triton's {tool} is missing: {exc}"
        if not path or not os.path.exists(path):
            return f"Triton's {tool} is missing"
    return ""


# ------------------------------------------------------------------------------------------------
# Recording launches
# ------------------------------------------------------------------------------------------------
Launch = tuple[Any, tuple, dict]  # (JITFunction, positional args, keyword args incl. constexprs/options)


@contextmanager
def recording():
    """Records every ``@triton.jit`` launch made inside the block instead of running it.

    Yields the list the ``(kernel, args, kwargs)`` triples are appended to, in launch order.
    """
    from triton.runtime.jit import JITFunction

    calls: list[Launch] = []

    def run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        calls.append((self, args, kwargs))

    with _patched(JITFunction, run=run):
        yield calls


@contextmanager
def _patched(obj: Any, **attrs: Any):
    """Sets attributes for the duration of the block; names ``obj`` does not have are skipped (the host
    code changes under this report: a guard that no longer exists needs no disabling)."""
    attrs = {k: v for k, v in attrs.items() if hasattr(obj, k)}
    old = {k: getattr(obj, k) for k in attrs}
    for k, v in attrs.items():
        setattr(obj, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(obj, k, v)


def kernel_name(fn: Any) -> str:
    inner = getattr(fn, "fn", fn)
    return getattr(inner, "__name__", type(fn).__name__)


def distinct(calls: list[Launch]) -> list[Launch]:
    """The launches that compile to distinct kernels (same function and same Triton specialisation,
    constexprs and options: one compiled kernel), first occurrence kept, order of launch."""
    seen, out = set(), []
    for fn, args, kwargs in calls:
        try:
            key = (id(fn), repr(_bind(fn, args, kwargs)[1:]))
        except Exception:  # noqa: BLE001  (compile_sm90 will report the error)
            key = (id(fn), len(out))
        if key not in seen:
            seen.add(key)
            out.append((fn, args, kwargs))
    return out


def _named(prefix: str, calls: list[Launch]) -> dict[str, Launch]:
    """Rows for one route: the route name alone when it launches one distinct kernel, else the kernel's
    name (and a counter for several specialisations of one kernel) appended."""
    calls = distinct(calls)
    if len(calls) == 1:
        return {prefix: calls[0]}
    out, counts = {}, {}
    for c in calls:
        kname = kernel_name(c[0])
        counts[kname] = counts.get(kname, 0) + 1
        name = f"{prefix} [{kname}]" if counts[kname] == 1 else f"{prefix} [{kname} #{counts[kname]}]"
        out[name] = c
    return out


#: name: (param dtype, SRAdamW keyword arguments, grad scaler?) -- the optimizer's weight/state routes. A
#: tuple of dtypes makes one parameter of each (several dtype groups, so several launches in one step).
OPTIM_ROUTES: dict[str, tuple[torch.dtype | tuple[torch.dtype, ...], dict, bool]] = {
    "fp32 weights, fp32 states": (torch.float32, {}, False),
    "bf16 weights, bf16 SR states": (torch.bfloat16, {}, False),
    "bf16 weights, fp32 states": (torch.bfloat16, {"state_dtype": torch.float32}, False),
    "bf16 weights + fp32 master, bf16 SR states": (torch.bfloat16, {"master_weights": True,
                                                                     "master_format": "fp32"}, False),
    "bf16 weights + fp32 master, fp32 states": (torch.bfloat16, {"master_weights": True, "master_format": "fp32",
                                                                   "state_dtype": torch.float32}, False),
    "bf16 weights + split master (bf16 + int16), fp32 states": (
        torch.bfloat16, {"master_weights": True, "state_dtype": torch.float32}, False),
    "fp16 weights, fp16 scaled SR states": (torch.float16, {}, False),
    "fp16 weights, fp16 scaled SR states, GradScaler": (torch.float16, {}, True),
    "fp16 weights, fp32 states, GradScaler": (torch.float16, {"state_dtype": torch.float32}, True),
}


def optimizer_launches(routes: dict = OPTIM_ROUTES) -> dict[str, Launch]:
    """name -> (kernel, args, kwargs) of each distinct kernel one ``SRAdamW.step`` launches per route."""
    from optim import SRAdamW
    from optim import triton_kernel as tk

    assert not tk.interpreting(), "TRITON_INTERPRET must be 0 before optim.triton_kernel is imported"
    block = int(getattr(tk, "DEFAULT_BLOCK", 2048))
    out = {}
    for name, (dtypes, kw, scaler) in routes.items():
        params = []
        for dtype in dtypes if isinstance(dtypes, tuple) else (dtypes,):
            params.append(torch.nn.Parameter(torch.zeros(3 * block, dtype=dtype)))
            params[-1].grad = torch.full_like(params[-1], 0.5)
        opt = SRAdamW(params, lr=1e-3, **kw)
        opt._defers = lambda flag: True  # the flag stays on the device, as on a GPU
        opt._update_for = lambda device: tk.sradamw_fused_  # the CUDA route
        with _patched(tk, _check_ready=lambda device: None), recording() as calls:
            if scaler:
                opt.step(grad_scale=torch.tensor(1024.0), found_inf=torch.zeros(()))
            else:
                opt.step()
        assert calls, f"{name}: SRAdamW.step launched no Triton kernel"
        out.update(_named(name, calls))
    return out


LOSS_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def loss_launches(dims: tuple[int, ...] = (512, 1024), batch: int = 4096,
                  dtypes: tuple[str, ...] = tuple(LOSS_DTYPES)) -> dict[str, Launch]:
    """name -> (kernel, args, kwargs) of the fused loss's forward and backward launches at world size 1.

    ``batch`` rows and columns: 4,096 gives the same forward grid (22 x 23 programs on 132 SMs) and so
    the same argument specialisation as the 32k-131k batches of the benchmarks.
    """
    from recipe.loss import ClipLoss
    from recipe.loss import fused as lk

    assert not lk.interpreting(), "TRITON_INTERPRET must be 0 before recipe.loss.fused is imported"
    out = {}
    for dname in dtypes:
        dtype = LOSS_DTYPES[dname]
        for dim in dims:
            gen = torch.Generator().manual_seed(0)
            img = torch.randn(batch, dim, generator=gen).to(dtype).requires_grad_()
            txt = torch.randn(batch, dim, generator=gen).to(dtype).requires_grad_()
            with _patched(lk, _check_ready=lambda device: None,
                          _target_programs=lambda cfg, device: cfg.programs or 4 * SM90_SMS,
                          mm_f32=lambda a, b: torch.zeros(a.shape[0], b.shape[1]),
                          addmm_f32_=lambda acc, a, b: acc), recording() as calls:
                ClipLoss(mode="fused")(img, txt, torch.tensor(10.0)).loss.backward()
            assert calls, (dname, dim)
            for c in distinct(calls):
                short = kernel_name(c[0]).removesuffix("_kernel")
                name, k = f"loss {short} {dname} D={dim}", 2
                while name in out:
                    name, k = f"loss {short} #{k} {dname} D={dim}", k + 1
                out[name] = c
    return out


# ------------------------------------------------------------------------------------------------
# Compiling with Triton's own specialisation
# ------------------------------------------------------------------------------------------------
def _backend() -> tuple[Any, Any]:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    target = GPUTarget("cuda", 90, 32)
    return target, make_backend(target)


def _bind(fn: Any, args: tuple, kwargs: dict) -> tuple:
    """``(kwargs, bound, specialization, options)`` as ``JITFunction.run`` computes them on sm_90."""
    from triton.runtime.jit import create_function_from_signature

    _, backend = _backend()
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(kwargs, debug=False)
    bound, specialization, options = binder(*args, **kwargs)
    return kwargs, bound, specialization, options


def compile_sm90(fn: Any, args: tuple, kwargs: dict) -> Any:
    """Compiles ``fn`` for sm_90 as ``JITFunction.run`` would for this call on an sm_90 device."""
    from triton.compiler import ASTSource

    target, backend = _backend()
    kwargs, bound, specialization, options = _bind(fn, args, kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


# ------------------------------------------------------------------------------------------------
# SASS
# ------------------------------------------------------------------------------------------------
# One instruction per line, in either disassembly format: ``/*0070*/  FFMA R1, R2, R3, R4 ;`` (nvdisasm,
# cuobjdump) or ``--:-:-:Y:4\tFFMA R1, R2, R3, R4;`` (Triton's control-code listing).
_SASS_LINE = re.compile(r"^\s*(?:/\*[0-9a-f]+\*/\s*|[0-9a-fA-F-]{2}:[0-9a-fA-F-]:[0-9a-fA-F-]:[A-Za-z-]:[0-9a-fA-F]\s+)"
                        r"([@A-Z].*?)\s*;", re.MULTILINE)
_GLOBAL_MEMORY = ("LDG", "STG", "LD", "ST", "ATOMG", "ATOM", "REDG", "RED")


def opcode(ins: str) -> str:
    """``@!P0 LDG.E.128 R4, [R2.64]`` -> ``LDG``."""
    return re.sub(r"^@!?U?P\w+\s+", "", ins).split(None, 1)[0].split(".", 1)[0]


_BRANCH_TARGET = re.compile(r"(\.?L[\w.]+)\W*$")


def _cfg(sass: str) -> tuple[list[list[str]], list[list[int]]]:
    """The kernel's SASS as basic blocks of instructions (opcode with predicate and operands; NOPs
    dropped) and their successors. Blocks start at labels and after branches, calls, returns and exits;
    a ``CALL`` returns to the next block (the called subroutine is not an edge: it is not per element)."""
    blocks: list[list[str]] = [[]]
    labels: dict[str, int] = {}
    for line in sass.splitlines():
        lab = re.match(r"^\s*(\.?L[\w.]+):", line)
        if lab:
            if blocks[-1]:
                blocks.append([])
            labels[lab.group(1)] = len(blocks) - 1
            continue
        m = _SASS_LINE.match(line)
        if not m or opcode(m.group(1)) == "NOP":
            continue
        blocks[-1].append(m.group(1))
        if opcode(m.group(1)) in ("BRA", "BRX", "JMP", "CALL", "RET", "EXIT"):
            blocks.append([])
    succ: list[list[int]] = []
    for i, b in enumerate(blocks):
        last = b[-1] if b else ""
        op, conditional = (opcode(last) if last else ""), last.startswith("@")
        nxt = [i + 1] if i + 1 < len(blocks) else []
        if op in ("BRA", "JMP"):
            t = _BRANCH_TARGET.search(last)
            tgt = [labels[t.group(1)]] if t and t.group(1) in labels else []
            succ.append(tgt + nxt if conditional else tgt)
        elif op in ("EXIT", "RET", "BRX"):
            succ.append(nxt if conditional else [])
        else:
            succ.append(nxt)
    return blocks, succ


def sass_blocks(sass: str) -> list[list[str]]:
    """The non-empty basic blocks of :func:`_cfg`, the trailing self-branch (``BRA`` to its own label
    after the last ``EXIT``/``RET``) dropped."""
    blocks = [b for b in _cfg(sass)[0] if b]
    if blocks and len(blocks[-1]) == 1 and opcode(blocks[-1][0]) == "BRA":  # the end-of-kernel self-loop
        blocks.pop()
    return blocks


def sass_instructions(sass: str) -> list[str]:
    return [i for b in sass_blocks(sass) for i in b]


def _reach(succ: list[list[int]], start: int) -> set[int]:
    seen, todo = set(), [start]
    while todo:
        i = todo.pop()
        if i not in seen:
            seen.add(i)
            todo += succ[i]
    return seen


def _is_masked_mem(ins: str) -> bool:
    return ins.startswith("@") and opcode(ins) in _GLOBAL_MEMORY


def sass_copies(sass: str) -> list[list[list[str]]]:
    """The copies of the kernel body: the first conditional branch whose two sides never meet again and
    both store to global memory (``if full block: body(unmasked) else: body(masked)``) splits the kernel
    into two copies, returned as their basic blocks, the one with fewer predicated global loads/stores
    (the unmasked, full-block copy) first. Without such a branch: one copy, the whole kernel (the
    prologue and the out-of-line subroutines then cancel in the marginal count)."""
    blocks, succ = _cfg(sass)
    stores = lambda side: any(opcode(i) in ("STG", "ST", "ATOMG", "REDG", "RED") for j in side for i in blocks[j])
    for k, b in enumerate(blocks):
        if b and b[-1].startswith("@") and opcode(b[-1]) == "BRA" and len(succ[k]) == 2:
            a, c = (_reach(succ, s) for s in succ[k])
            if not a & c and stores(a) and stores(c):
                sides = [[blocks[j] for j in sorted(side) if blocks[j]] for side in (a, c)]
                return sorted(sides, key=lambda side: sum(_is_masked_mem(i) for bb in side for i in bb))
    return [sass_blocks(sass)]


def _counts(blocks: list[list[str]]) -> dict[str, int]:
    """Static counts: ``all`` instructions, ``mem`` global-memory ones (LDG/STG/LD/ST/atomics), and
    ``fast`` = ``all`` less the basic blocks that contain a ``CALL`` (the set-up of an out-of-line slow
    path, e.g. the correctly rounded ``div``/``sqrt`` for operands outside the fast range)."""
    ins = [i for b in blocks for i in b]
    return {"all": len(ins), "mem": sum(opcode(i) in _GLOBAL_MEMORY for i in ins),
            "fast": sum(len(b) for b in blocks if not any(opcode(i) == "CALL" for i in b))}


_TENSOR_STORE = re.compile(r"tt\.store\s+([^:]*?)\s*(?:\b\w+\s*=[^:]*)?:\s*tensor<")


def body_copies(ttir: str) -> tuple[int, int, int]:
    """``(copies, masked, unmasked)`` judged from the TTIR's block stores: a kernel that branches between
    an unmasked full-block path and a masked partial-block path has as many masked (``tt.store ptr, val,
    mask``) as unmasked (``tt.store ptr, val``) tensor stores: 2 copies; otherwise 1. A cross-check of
    :func:`sass_copies`."""
    masked = unmasked = 0
    for m in _TENSOR_STORE.finditer(ttir):
        operands = [o for o in m.group(1).split(",") if o.strip().startswith("%")]
        if len(operands) >= 3:
            masked += 1
        else:
            unmasked += 1
    return (2 if masked and masked == unmasked else 1), masked, unmasked


def _widened(sass_b: str, sass_2b: str) -> bool:
    """Whether some global access is narrower at B than at 2B: a memory mnemonic (``LDG.E.64``, ...)
    occurs fewer times at 2B (a widened access replaced it)."""
    def mnemonics(sass: str) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in sass_instructions(sass):
            if opcode(i) in _GLOBAL_MEMORY:
                m = re.sub(r"^@!?U?P\w+\s+", "", i).split(None, 1)[0]
                out[m] = out.get(m, 0) + 1
        return out

    n1, n2 = mnemonics(sass_b), mnemonics(sass_2b)
    return any(n2.get(m, 0) < k for m, k in n1.items())


def sass_per_element(fn: Any, args: tuple, kwargs: dict, kernel: Any | None = None) -> dict:
    """SASS instructions per element of a streaming kernel launched with a ``BLOCK`` constexpr.

    Method (marginal count: what does not depend on the elements per thread cancels). The launch is
    compiled at ``BLOCK`` = B (as recorded), 2B and (when needed) 4B, same ``num_warps`` and everything else equal;
    ``e = B / (32 * num_warps)`` elements per thread at B, and B -> 2B adds ``e`` elements per thread.

    * Copies: a kernel ``if full block: body(unmasked) else: body(masked)`` holds every per-element
      instruction twice. :func:`sass_copies` splits the SASS at that branch (the two sides never meet
      again) and each copy is counted on its own; the figures are those of the unmasked copy, the one
      every full block runs (the masked copy, which only the last block of a tensor runs, is reported as
      ``sass_per_elem_masked``). The TTIR must agree (:func:`body_copies`). A one-copy kernel is counted
      whole (its prologue and out-of-line subroutines cancel).
    * Non-memory instructions grow linearly with the elements per thread: ``(other(2B) - other(B)) / e``.
    * Global loads and stores do not: a thread moves its elements of one stream with vector accesses of
      up to 16 bytes, so a 16-bit stream at 4 elements per thread (8 bytes) takes one access at B and
      still one (16 bytes) at 2B. They are counted at the real launch: ``(mem(B) - P) / e``, where ``P``
      (the copy's per-program scalar loads: metadata row, flags, scales) is extrapolated from 2B and 4B,
      ``P = 2 mem(2B) - mem(4B)``, exact once every stream's accesses are 16 bytes wide at 2B (true for
      16- and 32-bit data at >= 8 elements per thread) and when accesses are scalar. When no access is
      wider at 2B than at B (no memory mnemonic such as ``LDG.E.64`` is rarer at 2B), the 4B compile is
      skipped and ``P = 2 mem(B) - mem(2B)``.

    Returns ``sass_per_elem`` (all per-element code, including the set-up of slow-path calls that are
    normally not taken), ``sass_per_elem_fast`` (without the basic blocks holding a ``CALL``), the global
    load/store part ``mem_per_elem``, ``sass_per_elem_masked``, ``copies``, ``elems_per_thread`` and the
    static total at B. Checked on toy kernels with a known count (:func:`toy_check`).
    """
    block = int(kwargs["BLOCK"])
    warps = int(kwargs.get("num_warps", 4))
    e = block // (32 * warps)
    k1 = kernel if kernel is not None else compile_sm90(fn, args, kwargs)
    k2 = compile_sm90(fn, args, dict(kwargs, BLOCK=2 * block))
    split = [sass_copies(k.asm["sass"]) for k in (k1, k2)]
    if _widened(k1.asm["sass"], k2.asm["sass"]):  # P from 2B and 4B
        split.append(sass_copies(compile_sm90(fn, args, dict(kwargs, BLOCK=4 * block)).asm["sass"]))
        lin = (1, 2)
    else:  # every access as wide at B as at 2B: memory is linear from B on, P = 2 mem(B) - mem(2B)
        lin = (0, 1)
    copies = len(split[0])
    ttir_copies = body_copies(k1.asm["ttir"])[0]
    if {len(s) for s in split} != {ttir_copies}:
        raise RuntimeError(f"{kernel_name(fn)}: body copies in SASS at B, 2B(, 4B) {[len(s) for s in split]}, "
                           f"in TTIR {ttir_copies}: the marginal count cannot pair them")
    out = {"copies": copies, "elems_per_thread": e, "sass_total": len(sass_instructions(k1.asm["sass"]))}
    for j, suffix in enumerate(("", "_masked")[:copies]):
        c = [_counts(s[j]) for s in split]
        mem = (c[0]["mem"] - (2 * c[lin[0]]["mem"] - c[lin[1]]["mem"])) / e
        other = ((c[1]["all"] - c[1]["mem"]) - (c[0]["all"] - c[0]["mem"])) / e
        other_fast = ((c[1]["fast"] - c[1]["mem"]) - (c[0]["fast"] - c[0]["mem"])) / e
        out.update({f"sass_per_elem{suffix}": other + mem, f"sass_per_elem_fast{suffix}": other_fast + mem,
                    f"mem_per_elem{suffix}": mem})
    return out


# ------------------------------------------------------------------------------------------------
# Validation of the method on kernels whose per-element count is known
# ------------------------------------------------------------------------------------------------
if triton is not None:

    @triton.jit
    def _toy_axpb(x_ptr, y_ptr, a, b, BLOCK: tl.constexpr):
        """y = x * a + b on full blocks: per element one FFMA, and per 4 fp32 elements one 16-byte load
        and one 16-byte store: 1.5 instructions per element."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs) * a + b)

    @triton.jit
    def _toy_axpb_two_copies(x_ptr, y_ptr, a, b, n, BLOCK: tl.constexpr):
        """The same with an unmasked full-block copy and a masked partial-block copy."""
        start = tl.program_id(0) * BLOCK
        offs = start + tl.arange(0, BLOCK)
        if start + BLOCK <= n:
            tl.store(y_ptr + offs, tl.load(x_ptr + offs) * a + b)
        else:
            mask = offs < n
            tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=mask) * a + b, mask=mask)


def toy_check() -> dict[str, dict]:
    """:func:`sass_per_element` on the toy kernels (fp32, fp fusion on, 4 elements per thread): both
    must give 1.5 (1 FFMA + 2 x 1/4 vector accesses) for the one / the unmasked copy."""
    x, y = torch.zeros(4096), torch.zeros(4096)
    kw = {"BLOCK": 512, "num_warps": 4}
    out = {}
    for name, fn, args in (("y = a x + b", _toy_axpb, (x, y, 2.0, 3.0)),
                           ("y = a x + b, masked + unmasked copies", _toy_axpb_two_copies, (x, y, 2.0, 3.0, 4096))):
        out[name] = sass_per_element(fn, args, kw)
    return out


# ------------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------------
def resources(kernel: Any) -> dict:
    """Registers and spills from ``ptxas -v`` on the kernel's PTX with the options Triton used (the
    loaded-kernel attributes ``n_regs``/``n_spills`` need a device); shared memory from the metadata."""
    import subprocess
    import tempfile

    from triton import knobs

    md = kernel.metadata
    fmad = [] if md.enable_fp_fusion else ["--fmad=false"]
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp, "k.ptx")
        ptx.write_text(kernel.asm["ptx"])
        log = subprocess.run([knobs.nvidia.ptxas.path, "-v", *fmad, "--gpu-name=sm_90a", str(ptx), "-o",
                              str(Path(tmp, "k.cubin"))], capture_output=True, text=True, check=True).stderr
    num = lambda pat: int(m.group(1)) if (m := re.search(pat, log)) else 0
    return {"regs": num(r"Used (\d+) registers"),
            "spills": num(r"(\d+) bytes spill stores") + num(r"(\d+) bytes spill loads"),
            "smem": int(md.shared) + num(r"(\d+) bytes smem"), "warps": int(md.num_warps),
            "stages": int(getattr(md, "num_stages", 0))}


def row(name: str, launch: Launch, kind: str) -> dict:
    """One report row: compiles the launch (and, with a ``BLOCK`` constexpr, its 2x and 4x variants)."""
    fn, args, kwargs = launch
    kernel = compile_sm90(fn, args, kwargs)
    r = dict(name=name, kind=kind, kernel=kernel_name(fn), **resources(kernel), triton=triton.__version__)
    if "BLOCK" in kwargs:
        try:
            r.update(sass_per_element(fn, args, kwargs, kernel))
        except Exception as err:  # noqa: BLE001  (the row says why; the other figures stand)
            r["sass_error"] = f"{type(err).__name__}: {err}"
    return r


_JOBS: list[tuple[str, Launch, str]] = []  # what forked workers compile (inherited, not pickled)


def _row_job(i: int) -> dict:
    return row(*_JOBS[i])


def report(optim_routes: dict | None = OPTIM_ROUTES, loss_dims: tuple[int, ...] = (512, 1024),
           loss_dtypes: tuple[str, ...] = tuple(LOSS_DTYPES), jobs: int = 1) -> list[dict]:
    """The rows of the report, in order: the optimizer routes' kernels, then the loss kernels.

    ``jobs`` > 1 processes compile the rows (forked after the launches are recorded; without ``fork``,
    or with 1, the default: in this process)."""
    import multiprocessing

    global _JOBS
    work = []
    if optim_routes:
        work += [(n, launch, "optimizer") for n, launch in optimizer_launches(optim_routes).items()]
    if loss_dims and loss_dtypes:
        work += [(n, launch, "loss") for n, launch in loss_launches(loss_dims, dtypes=loss_dtypes).items()]
    jobs = min(jobs, len(work))
    if jobs <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [row(*w) for w in work]
    _JOBS = work
    try:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            return pool.map(_row_job, range(len(work)), chunksize=1)
    finally:
        _JOBS = []


#: Issue rate of an H200 / H100 SXM: 132 SMs x 4 schedulers x 32 lanes per clock at 1.98 GHz (boost).
ISSUE_PER_S = SM90_SMS * 4 * 32 * 1.98e9
PARAMS_1B07 = 1.07e9  # the optimizer benchmark's largest layout


def issue_floor_ms(per_elem: float, elements: float = PARAMS_1B07) -> float:
    """Lower bound of a kernel's time from instruction issue alone: ``elements * per_elem`` lane
    instructions at :data:`ISSUE_PER_S` (no stalls, every scheduler issuing every clock)."""
    return elements * per_elem / ISSUE_PER_S * 1e3


def markdown(rows: list[dict]) -> str:
    lines = [("| kernel variant (sm_90) | warps | regs/thread | spills (bytes) | shared mem (bytes) "
              "| SASS instr./element | fast path | of which global ld/st | masked copy "
              "| issue floor, 1.07 B elements (ms) | SASS instr. (static) |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    def per(r: dict, k: str) -> str:
        return f"{r[k]:.2f}" if k in r else "-"

    for r in rows:
        floor = f"{issue_floor_ms(r['sass_per_elem_fast']):.2f}" if "sass_per_elem_fast" in r else "-"
        tot = str(r["sass_total"]) if "sass_total" in r else "-"
        sass = f"n/a ({r['sass_error'][:80]})" if "sass_error" in r else per(r, "sass_per_elem")
        lines.append(f"| {r['name']} | {r['warps']} | {r['regs']} | {r['spills']} | {r['smem']} "
                     f"| {sass} | {per(r, 'sass_per_elem_fast')} | {per(r, 'mem_per_elem')} "
                     f"| {per(r, 'sass_per_elem_masked')} | {floor} | {tot} |")
    lines.append("")
    lines.append("SASS instr./element: marginal static count of the full-block (unmasked) copy of the body, "
                 "including the set-up of slow-path calls; fast path: without those; masked copy: the "
                 "partial block's; issue floor: fast path x 1.07e9 elements at 132 SMs x 128 lanes x 1.98 GHz "
                 "(see sass_per_element and issue_floor_ms).")
    return "\n".join(lines)


def versions() -> str:
    """``Triton X (path), ptxas Y``: what compiled the report."""
    from triton import knobs

    try:
        ptxas = knobs.nvidia.ptxas.version or "?"
    except Exception:  # noqa: BLE001
        ptxas = "?"
    return f"Triton {triton.__version__} ({Path(triton.__file__).parent}), ptxas {ptxas}, sm_90a"


def over_budget(rows: list[dict], max_regs: int) -> list[str]:
    """Rows of optimizer kernels above ``max_regs`` registers, and any row that spills."""
    return [f"{r['name']}: {r['regs']} registers, {r['spills']} spill bytes" for r in rows
            if r["spills"] or (r["kind"] == "optimizer" and r["regs"] > max_regs)]


def _without_python_flag(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--python":
            skip = True
        elif not a.startswith("--python="):
            out.append(a)
    return out


def run_under(python: str, argv: list[str]) -> int:
    """This script with ``argv`` under another interpreter (its Triton), borrowing this one's packages."""
    import subprocess

    borrow = [p for p in sys.path if Path(p).name in ("site-packages", "dist-packages")]
    env = dict(os.environ, TRITON_INTERPRET="0", **{_BORROW_ENV: os.pathsep.join(borrow)})
    env.pop("KERNEL_REPORT_PYTHON", None)
    return subprocess.run([python, str(Path(__file__).resolve()), *_without_python_flag(argv)], env=env,
                          check=False).returncode


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", default=os.environ.get("KERNEL_REPORT_PYTHON") or None,
                    help="make the report under this Python interpreter's Triton (env KERNEL_REPORT_PYTHON)")
    ap.add_argument("--max-regs", type=int, default=None,
                    help="exit 1 when an optimizer kernel needs more registers, or any kernel spills")
    ap.add_argument("--json", action="store_true", help="print JSON rows instead of a markdown table")
    only = ap.add_mutually_exclusive_group()
    only.add_argument("--optimizer-only", action="store_true", help="only the optimizer kernels")
    only.add_argument("--loss-only", action="store_true", help="only the fused loss kernels")
    ap.add_argument("--loss-dims", type=int, nargs="+", default=[512, 1024], help="embedding widths of the loss")
    ap.add_argument("--loss-dtypes", nargs="+", default=list(LOSS_DTYPES), choices=list(LOSS_DTYPES))
    ap.add_argument("--toy-check", action="store_true", help="also print the method's check on toy kernels")
    ap.add_argument("--jobs", type=int, default=1, help="compile in this many forked processes")
    a = ap.parse_args(argv)
    if a.python:  # (the child runs without the flag)
        sys.exit(run_under(a.python, sys.argv[1:] if argv is None else list(argv)))
    why = tools_missing()
    if why:
        sys.exit(why)
    rows = report(None if a.loss_only else OPTIM_ROUTES, () if a.optimizer_only else tuple(a.loss_dims),
                  tuple(a.loss_dtypes), jobs=a.jobs)
    toys = toy_check() if a.toy_check else None
    if a.json:
        print(json.dumps({"rows": rows, "toy": toys} if toys else rows, indent=1))
    else:
        print(versions() + "\n")
        print(markdown(rows))
        if toys:
            print("\nMethod check on toy kernels (expected: 1.5 SASS/element, of the unmasked copy):")
            for name, t in toys.items():
                print(f"- {name}: {t['sass_per_elem']:.2f} SASS/element ({t['copies']} body copies)")
    if a.max_regs is not None:
        over = over_budget(rows, a.max_regs)
        for line in over:
            print(f"over budget ({a.max_regs} registers, no spills): {line}", file=sys.stderr)
        if over:
            sys.exit(1)


if __name__ == "__main__":
    main()
