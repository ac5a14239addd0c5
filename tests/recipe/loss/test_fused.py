"""The fused Triton contrastive-loss kernels (``ClipLoss(mode="fused")``) against a float64 reference.

Without CUDA the kernels run in Triton's interpreter on CPU tensors: this module sets
``TRITON_INTERPRET=1`` before :mod:`recipe.loss.fused` (and so Triton) is first imported, and the
gloo ranks get it through their environment. Sizes are tiny and tiles are 16 (``chunk_size`` caps the
tile edge), so that every size below leaves partial tiles, the forward runs several programs whose
partial row and column statistics are merged, and the backward walks several column bands. With CUDA
the same comparisons run on the compiled kernels (``gpu`` marker) at larger sizes, and the
interpreter variant runs in a subprocess without CUDA.

Reference: the full-batch CLIP loss in float64 on the same dtype-rounded inputs, its gradients with
respect to both feature matrices, the logit scale and the logit bias, and its accuracies (first
arg-max, as ``torch.argmax``). Tolerances (loss: relative; feature gradients: relative to the largest
reference entry; scale gradient: relative):
* fp32 features: 5e-6, 1e-5, 2e-5 (fp32 rounding of the logits, exponentials and sums);
* bf16 features: 5e-6 (the logits of bf16 inputs are exact products summed in fp32), 1.5e-2 (bf16
  gradients, bf16 ``dS`` in the gradient matmuls), 2e-5;
* fp16 features: 5e-6, 2e-3 (fp16 gradients: rounding 2^-11; fp16 ``dS``, range-scaled by a power
  of two, rounding 2^-11), 2e-5.
On the GPU (longer dot products, ``ex2.approx`` exponentials) the tolerances of tests/test_loss.py's
CUDA test apply: loss 1e-5, feature gradients 2e-5 / 1.5e-2 / 3e-3, scale gradient 1e-4.
The bias gradient is exactly zero (softmax cross-entropy is shift invariant).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import subprocess
import sys
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[3]

if not CUDA:  # read when the kernels are decorated (optim._triton would set it too)
    os.environ["TRITON_INTERPRET"] = "1"
from optim import _triton
from recipe.loss import ClipLoss
from recipe.loss import fused as lk

from ...clip_reference import LiveBytes, assert_grad_close, clip_reference
from ...dist_utils import run_distributed
from ...precompile import precompile
from .harness import largest_tensors

HAVE_TRITON = _triton.is_available()
INTERPRETED = HAVE_TRITON and lk.interpreting()
on_cpu = pytest.mark.skipif(
    not INTERPRETED, reason="kernels compiled in this process; test_interpreter_variant_in_subprocess runs these"
)
on_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA or not HAVE_TRITON or INTERPRETED, reason="needs CUDA and compiled Triton"),
]

TILE = 16
TOLERANCES = {  # dtype: (loss rtol, feature-grad tol relative to max |ref|, scale-grad rtol)
    "float32": (5e-6, 1e-5, 2e-5),
    "bfloat16": (5e-6, 1.5e-2, 2e-5),
    "float16": (5e-6, 2e-3, 2e-5),
}
GPU_TOLERANCES = {
    "float32": (1e-5, 2e-5, 1e-4),
    "bfloat16": (1e-5, 1.5e-2, 1e-4),
    "float16": (1e-5, 3e-3, 1e-4),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One loss configuration."""

    dtype: str
    scale: float
    rows: tuple[int, ...]  # local rows per rank
    dim: int
    bias: float | None = None

    @property
    def name(self) -> str:
        bias = "" if self.bias is None else "-bias"
        return f"{self.dtype}-s{self.scale:g}-{'x'.join(map(str, self.rows))}-d{self.dim}{bias}"


def _inputs(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch L2-normalised features rounded to the case dtype (same in every process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(case.name.encode()))
    total = sum(case.rows)
    image = F.normalize(torch.randn(total, case.dim, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.6 * torch.randn(total, case.dim, generator=gen, dtype=torch.float64), dim=1)
    dtype = getattr(torch, case.dtype)
    return image.to(dtype), text.to(dtype)




def _assert_matches(got: dict, ref: dict, dtype: str, what: str, tolerances: dict = TOLERANCES) -> None:
    loss_rtol, grad_tol, scale_rtol = tolerances[dtype]
    try:
        torch.testing.assert_close(got["loss"].double(), ref["loss"], rtol=loss_rtol, atol=0)
        assert_grad_close(got["grad_image"], ref["grad_image"], grad_tol, "image grad")
        assert_grad_close(got["grad_text"], ref["grad_text"], grad_tol, "text grad")
        torch.testing.assert_close(got["grad_scale"].double(), ref["grad_scale"], rtol=scale_rtol, atol=0)
        if "grad_bias" in got:
            assert got["grad_bias"].item() == 0.0, got["grad_bias"]
        torch.testing.assert_close(got["acc_i2t"].double(), ref["acc_i2t"], rtol=0, atol=1e-6)
        torch.testing.assert_close(got["acc_t2i"].double(), ref["acc_t2i"], rtol=0, atol=1e-6)
    except AssertionError as err:
        raise AssertionError(f"{what}: {err}") from err


def _run_loss(image: torch.Tensor, text: torch.Tensor, case: Case, chunk: int, device: str = "cpu") -> dict:
    """World size 1: one ClipLoss(mode="fused") call on ``device``; loss, gradients, accuracies."""
    x = image.to(device, copy=True).requires_grad_()
    y = text.to(device, copy=True).requires_grad_()
    scale = torch.tensor(case.scale, device=device, requires_grad=True)
    bias = None if case.bias is None else torch.tensor(case.bias, device=device, requires_grad=True)
    loss_fn = ClipLoss(mode="fused", chunk_size=chunk)
    loss, metrics = loss_fn(x, y, scale, bias)
    loss.backward()
    assert loss.dtype == torch.float32 and x.grad.dtype == image.dtype
    out = {"loss": loss.detach().cpu(), "grad_image": x.grad.cpu(), "grad_text": y.grad.cpu(),
           "grad_scale": scale.grad.cpu(), **{k: v.cpu() for k, v in metrics.items()}}
    if bias is not None:
        out["grad_bias"] = bias.grad.cpu()
    return out


# --------------------------------------------------------------------------------------------------
# World size 1 (one block serves both directions), interpreted on the CPU
# --------------------------------------------------------------------------------------------------

SINGLE_CASES = (
    Case("float32", 1.0, (37,), 20),
    Case("float32", 100.0, (40,), 32, bias=-2.5),
    Case("float32", 14.3, (5,), 8),  # fewer rows than one tile
    Case("bfloat16", 100.0, (37,), 24),
    Case("float16", 100.0, (35,), 16),
)


@on_cpu
@pytest.mark.parametrize("case", SINGLE_CASES, ids=lambda c: c.name)
def test_single_block_matches_float64_reference(case: Case) -> None:
    image, text = _inputs(case)
    got = _run_loss(image, text, case, chunk=TILE)
    ref = clip_reference(image, text, case.scale, case.bias)
    _assert_matches(got, ref, case.dtype, case.name)


@on_cpu
def test_row_blocks_with_offsets_and_rectangular_tiles() -> None:
    """The sharded building block alone: 13 local rows against 50 gathered columns, target offset
    29 (not a tile multiple), 32 x 16 tiles, one-tile bands; loss terms and all three gradients."""
    gen = torch.Generator().manual_seed(11)
    cols = F.normalize(torch.randn(50, 24, generator=gen, dtype=torch.float64), dim=1)
    rows = F.normalize(cols[29:42] + 0.4 * torch.randn(13, 24, generator=gen, dtype=torch.float64), dim=1)
    cfg = lk.FusedConfig(block_m=32, block_n=16, block_k=16, programs=5, band_cols=16)
    for scale_value in (1.0, 100.0):
        a = rows.float().requires_grad_()
        b = cols.float().requires_grad_()
        scale = torch.tensor(scale_value, requires_grad=True)
        ce, correct = lk.fused_cross_entropy(a, b, scale, 29, cfg)
        weights = torch.linspace(0.5, 1.5, 13, dtype=torch.float64)  # distinct upstream gradients
        (ce * weights.float()).sum().backward()

        ra, rb = rows.clone().requires_grad_(), cols.clone().requires_grad_()
        rs = torch.tensor(scale_value, dtype=torch.float64, requires_grad=True)
        logits = rs * ra @ rb.T
        targets = torch.arange(13) + 29
        ref_ce = F.cross_entropy(logits, targets, reduction="none")
        (ref_ce * weights).sum().backward()
        torch.testing.assert_close(ce.double(), ref_ce.detach(), rtol=5e-6, atol=1e-7)
        assert torch.equal(correct, logits.argmax(1) == targets)
        assert_grad_close(a.grad, ra.grad, 1e-5, f"rows grad, scale {scale_value}")
        assert_grad_close(b.grad, rb.grad, 1e-5, f"cols grad, scale {scale_value}")
        torch.testing.assert_close(scale.grad.double(), rs.grad, rtol=2e-5, atol=0)


@on_cpu
def test_accuracy_uses_the_first_maximum_on_exact_ties() -> None:
    """Duplicated texts tie exactly (entries in {0, +-1/4, +-1/2}: exact products and sums); a tie
    before the target makes the row wrong, after it right, as with ``torch.argmax``."""
    gen = torch.Generator().manual_seed(12)
    image = (torch.randint(-2, 3, (33, 16), generator=gen) / 4).float()
    text = image.clone()
    text[7] = text[20]  # column 7 ties column 20 for every row: row 20 loses, row 7 keeps its max
    text[25] = text[3]  # column 25 ties column 3: row 3 keeps (first), row 25 loses
    image[30] = image[31]  # rows 30, 31 tie for every column: column 31 loses (t2i)
    scale = torch.tensor(1.0)
    cfg = lk.FusedConfig(block_m=16, block_n=16, block_k=16, programs=4)
    _, _, ok_rows, ok_cols = lk.fused_symmetric_cross_entropy(image, text, scale, cfg)
    logits = image.double() @ text.double().T
    targets = torch.arange(33)
    assert torch.equal(ok_rows, logits.argmax(1) == targets)
    assert torch.equal(ok_cols, logits.argmax(0) == targets)
    assert not ok_rows[20] and not ok_rows[25] and not ok_cols[31]  # the ties do decide



@on_cpu
def test_never_materialises_the_logit_block() -> None:
    rows, dim, tile = 192, 8, 32
    largest = largest_tensors(ClipLoss, ("plain", "fused"), rows, dim, tile, seed=13, scale=20.0)
    assert largest["plain"] >= rows * rows * 4  # the probe sees the fp32 block when it exists
    # fp32: one-tile dS bands, (M, D) accumulators, 4-program partial statistics
    assert largest["fused"] <= rows * max(tile, dim, 4) * 4, largest


@on_cpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("symmetric", [True, False], ids=["one block", "row block"])
def test_bands_walked_in_row_chunks_match_float64(dtype: str, symmetric: bool) -> None:
    """A band taller than ``band_rows`` is computed a row chunk at a time (the targets' offsets move
    with the chunk; the band's column gradient is summed over the chunks in fp32): loss, accuracy and
    all three gradients match float64, as the one-chunk walk does."""
    gen = torch.Generator().manual_seed(21)
    n, m, off = 70, (70 if symmetric else 37), (0 if symmetric else 19)
    cols = F.normalize(torch.randn(n, 24, generator=gen, dtype=torch.float64), dim=1)
    rows = F.normalize(cols[off:off + m] + 0.4 * torch.randn(m, 24, generator=gen, dtype=torch.float64), dim=1)
    tol = {"float32": 1e-5, "bfloat16": 2e-2, "float16": 3e-3}[dtype]
    weights = torch.linspace(0.5, 1.5, m, dtype=torch.float64)
    for band_rows in (16, None):  # three-and-a-bit chunks of 16 rows, then the whole height at once
        cfg = lk.FusedConfig(block_m=16, block_n=16, block_k=16, programs=4, band_cols=32, band_rows=band_rows)
        a = rows.to(getattr(torch, dtype)).requires_grad_()
        b = cols.to(getattr(torch, dtype)).requires_grad_()
        scale = torch.tensor(30.0, requires_grad=True)
        if symmetric:
            ce, ce_cols, correct, _ = lk.fused_symmetric_cross_entropy(a, b, scale, cfg)
            (ce * weights.float()).sum().add_((ce_cols * weights.flip(0).float()).sum()).backward()
        else:
            ce, correct = lk.fused_cross_entropy(a, b, scale, off, cfg)
            (ce * weights.float()).sum().backward()
        ra, rb = a.detach().double().requires_grad_(), b.detach().double().requires_grad_()
        rs = torch.tensor(30.0, dtype=torch.float64, requires_grad=True)
        logits = rs * ra @ rb.T
        targets = torch.arange(m) + off
        ref = F.cross_entropy(logits, targets, reduction="none")
        total = (ref * weights).sum()
        if symmetric:
            total = total + (F.cross_entropy(logits.T, targets, reduction="none") * weights.flip(0)).sum()
        total.backward()
        what = f"{dtype}, band_rows {band_rows}"
        torch.testing.assert_close(ce.double(), ref.detach(), rtol=tol, atol=1e-6, msg=what)
        assert torch.equal(correct, logits.argmax(1) == targets), what
        assert_grad_close(a.grad, ra.grad, tol, f"rows grad, {what}")
        assert_grad_close(b.grad, rb.grad, tol, f"cols grad, {what}")
        torch.testing.assert_close(scale.grad.double(), rs.grad, rtol=tol, atol=0, msg=what)


class _Launch:
    """A kernel whose launches do nothing (the memory census runs on the meta device)."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def _meta_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return torch.empty(a.shape[0], b.shape[1], dtype=torch.float32, device=a.device)  # cuBLAS's fp32 result


def test_backward_memory_at_a_131072_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27's memory goal, shape for shape: the fused loss's forward and backward at B = 131072,
    D = 1024, bf16, world size 1, with the GPU's band sizes and 528 forward programs (4 per SM of an
    H200), on the meta device with the kernel launches stubbed and the fp32-result GEMMs allocating
    only their result (as ``torch.mm(..., out_dtype=float32)`` on CUDA): the peak of the tensors it
    creates, the inputs' gradients included, stays <= 1 GiB (was ~1.3 GiB: a full-height band and the
    row gradient converted beside its fp32 accumulator)."""
    monkeypatch.setattr(lk, "fwd_kernel", _Launch())
    monkeypatch.setattr(lk, "bwd_kernel", _Launch())
    monkeypatch.setattr(lk, "_check_ready", lambda device: None)
    monkeypatch.setattr(lk, "interpreting", lambda: False)
    monkeypatch.setattr(lk, "mm_f32", _meta_mm)
    monkeypatch.setattr(lk, "addmm_f32_", lambda acc, a, b: None)
    monkeypatch.setattr(torch, "autocast", lambda *args, **kwargs: contextlib.nullcontext())  # no meta autocast
    batch, dim = 131072, 1024
    cfg = dataclasses.replace(lk.default_config(torch.bfloat16, dim), programs=528)
    a = torch.empty(batch, dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    b = torch.empty(batch, dim, dtype=torch.bfloat16, device="meta", requires_grad=True)
    scale = torch.empty((), dtype=torch.float32, device="meta", requires_grad=True)
    with LiveBytes() as probe:
        ce_rows, ce_cols, _, _ = lk.fused_symmetric_cross_entropy(a, b, scale, cfg)
        ((ce_rows.sum() + ce_cols.sum()) / (2 * batch)).backward()
        grads = a.grad.untyped_storage().nbytes() + b.grad.untyped_storage().nbytes()
    assert a.grad.shape == (batch, dim) and a.grad.dtype == torch.bfloat16
    assert grads >= 2 * batch * dim * 2  # the inputs' gradients are inside the peak
    print(f"peak {probe.peak / 2**20:.0f} MiB, of which the inputs' gradients {grads / 2**20:.0f} MiB")
    assert probe.peak <= 2**30, f"peak {probe.peak / 2**20:.0f} MiB"


def test_input_errors() -> None:
    x = torch.zeros(4, 16)
    s = torch.tensor(1.0)
    with pytest.raises(ValueError, match="power of two"):
        lk.FusedConfig(block_m=24)
    with pytest.raises(ValueError, match="band_cols"):
        lk.FusedConfig(band_cols=0)
    with pytest.raises(ValueError, match="offset"):
        lk.fused_cross_entropy(x, x[:6].repeat(2, 1)[:6], s, 3)
    with pytest.raises(ValueError, match="dtype"):
        lk.fused_cross_entropy(x, x.double(), s, 0)
    with pytest.raises(ValueError, match="square"):
        lk.fused_symmetric_cross_entropy(x, x[:3], s)
    with pytest.raises(ValueError, match="single fp32"):
        lk.fused_symmetric_cross_entropy(x, x, torch.ones(2))


def test_loss_imports_triton_lazily_and_fails_clearly_without_it() -> None:
    code = (
        "import sys\n"
        "import recipe.loss\n"
        "assert 'triton' not in sys.modules, 'recipe.loss imported triton eagerly'\n"
        "sys.modules['triton'] = None  # from here on, importing triton fails\n"
        "import torch\n"
        "from recipe.loss import ClipLoss\n"
        "x = torch.nn.functional.normalize(torch.randn(6, 8), dim=1)\n"
        "ClipLoss(mode='chunked')(x, x, 10.0)\n"
        "try:\n"
        "    ClipLoss(mode='fused')(x, x, 10.0)\n"
        "except RuntimeError as e:\n"
        "    assert 'Triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('fused mode ran without Triton')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], check=False, cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


_COMPILE_CHECK = """
import json, os
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
try:  # Triton's own binder: the specialisation JITFunction.run computes for these arguments
    from triton.runtime.jit import create_function_from_signature
except ImportError as exc:
    print(json.dumps({"skip": f"this Triton has no create_function_from_signature: {exc}"}))
    raise SystemExit(0)
from recipe.loss import fused as lk
assert not lk.interpreting()
target = GPUTarget("cuda", 90, 32)
backend = make_backend(target)
report = []
for dtype, name in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"), (torch.float32, "fp32")):
    gen = torch.Generator().manual_seed(0)
    x, y = (torch.randn(4096, 1024, generator=gen).to(dtype) for _ in range(2))
    for symmetric in (True, False):  # world size 1; a row block (local rows against gathered columns)
        a, offset = (x, 0) if symmetric else (x[:2048], 2048)
        launches = lk.launch_arguments(a, y, symmetric=symmetric, offset=offset, programs=4 * 132)
        for which, (fn, grid, args, kwargs) in launches.items():
            kwargs = dict(kwargs, debug=False)
            binder = create_function_from_signature(fn.signature, fn.params, backend)
            bound, specialization, options = binder(*args, **kwargs)
            options, sig, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            kernel = triton.compile(ASTSource(fn, sig, constexprs, attrs), target=target, options=options.__dict__)
            ptx = kernel.asm["ptx"]
            report.append([name, which, symmetric, "wgmma.mma_async" in ptx, "cp.async" in ptx,
                           len(kernel.asm["cubin"]) > 0])
print(json.dumps(report))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason=f"Triton is not importable: {_triton.unavailable_reason()}")
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """The interpreter does not lower the kernels: compile every variant for sm_90 (Triton's own
    compiler and ptxas, no device needed) with the runtime's exact launches
    (:func:`recipe.loss.fused.launch_arguments`: default configurations, argument specialisation
    by Triton's binder, an H200's 132 SMs); 16-bit variants must use ``wgmma`` tensor-core
    instructions, all must pipeline their operand loads (``cp.async``)."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], check=False, cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    if isinstance(report, dict):
        pytest.skip(report["skip"])
    assert len(report) == 12
    for dtype, kernel, symmetric, wgmma, pipelined, cubin in report:
        assert cubin and pipelined, (dtype, kernel, symmetric)
        assert wgmma == (dtype != "fp32"), (dtype, kernel, symmetric)


# --------------------------------------------------------------------------------------------------
# World size 2 (row blocks against the gathered side), interpreted, real gloo ranks
# --------------------------------------------------------------------------------------------------

DIST_CASES = (
    Case("float32", 1.0, (21, 21), 20),
    Case("float32", 100.0, (5, 19), 16, bias=1.5),  # uneven: offsets 0 and 5, not tile multiples
    Case("bfloat16", 100.0, (18, 13), 24),
)


def _dp_mean(t: torch.Tensor) -> torch.Tensor:
    """Data-parallel mean over ranks (in float64), as DeepSpeed/DDP average gradients."""
    t = t.detach().double().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _dist_worker(rank: int, world: int) -> dict:
    results = {}
    for case in DIST_CASES:
        image_full, text_full = (t.clone().requires_grad_() for t in _inputs(case))
        lo = sum(case.rows[:rank])
        rows = slice(lo, lo + case.rows[rank])
        scale = torch.tensor(case.scale, requires_grad=True)
        bias = None if case.bias is None else torch.tensor(case.bias, requires_grad=True)
        loss_fn = ClipLoss(mode="fused", chunk_size=TILE)
        loss, metrics = loss_fn(image_full[rows], text_full[rows], scale, bias)
        loss.backward()
        got = {
            "loss": _dp_mean(loss),
            "grad_image": _dp_mean(image_full.grad),
            "grad_text": _dp_mean(text_full.grad),
            "grad_scale": _dp_mean(scale.grad),
            "acc_i2t": _dp_mean(metrics["acc_i2t"]),
            "acc_t2i": _dp_mean(metrics["acc_t2i"]),
            "interpreted": lk.interpreting(),
        }
        if bias is not None:
            got["grad_bias"] = _dp_mean(bias.grad)
        results[case.name] = got
    return results


@functools.cache
def _dist_results() -> list[dict]:
    return run_distributed(_dist_worker, 2, env={"TRITON_INTERPRET": "1"}, timeout_s=240)


@pytest.mark.skipif(not HAVE_TRITON, reason=f"Triton is not importable: {_triton.unavailable_reason()}")
@pytest.mark.parametrize("case", DIST_CASES, ids=lambda c: c.name)
def test_world_size_2_matches_float64_reference_after_data_parallel_mean(case: Case) -> None:
    results = _dist_results()
    image, text = _inputs(case)
    ref = clip_reference(image, text, case.scale, case.bias)
    got = results[0][case.name]
    assert got["interpreted"]
    _assert_matches(got, ref, case.dtype, f"world 2, {case.name}")
    torch.testing.assert_close(results[1][case.name]["loss"], got["loss"], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
# GPU: the compiled kernels
# --------------------------------------------------------------------------------------------------

GPU_CASES = (
    Case("float32", 1.0, (1000,), 64),
    Case("float32", 100.0, (777,), 96, bias=-1.0),
    Case("bfloat16", 100.0, (1000,), 64),
    Case("bfloat16", 1.0, (777,), 1024),
    Case("float16", 100.0, (600,), 48),
)


def _gpu_dry_run() -> None:
    """The GPU tests' launches, results unchecked (each case on its own: one that trips over the outputs
    of the launches the dry run skips does not hide the others)."""
    for case in GPU_CASES:
        image, text = _inputs(case)
        for chunk in (4096, 32):
            try:
                _run_loss(image, text, case, chunk=chunk, device="cuda")
            except Exception:  # noqa: BLE001
                pass
    for dtype in ("float32", "bfloat16"):
        try:
            image, text = _inputs(Case(dtype, 100.0, (300, 700), 128))
            cfg = dataclasses.replace(lk.default_config(image.dtype, 128), band_cols=256)
            x, y = image.cuda().requires_grad_(), text.cuda().requires_grad_()
            scale = torch.tensor(100.0, device="cuda", requires_grad=True)
            terms = []
            for offset, n in ((0, 300), (300, 700)):  # as test_gpu_row_blocks_and_bands
                terms += [lk.fused_cross_entropy(x[offset : offset + n], y, scale, offset, cfg)[0].sum(),
                          lk.fused_cross_entropy(y[offset : offset + n], x, scale, offset, cfg)[0].sum()]
            sum(terms).backward()
        except Exception:  # noqa: BLE001
            pass


@pytest.fixture(scope="module")
def gpu_kernels_compiled_ahead() -> None:
    """The GPU tests' kernel specialisations (~40), compiled in parallel processes before the first of
    them runs (tests/precompile.py); each test then finds its kernels in Triton's cache."""
    precompile(_gpu_dry_run)


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("chunk", [4096, 32], ids=["tile128", "tile32"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_gpu)])
@pytest.mark.usefixtures("gpu_kernels_compiled_ahead")
def test_gpu_matches_float64_reference(case: Case, chunk: int, device: str) -> None:
    image, text = _inputs(case)
    got = _run_loss(image, text, case, chunk=chunk, device=device)
    ref = clip_reference(image, text, case.scale, case.bias)
    _assert_matches(got, ref, case.dtype, f"{case.name} chunk {chunk}", GPU_TOLERANCES)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_gpu)])
@pytest.mark.usefixtures("gpu_kernels_compiled_ahead")
def test_gpu_row_blocks_and_bands(dtype: str, device: str) -> None:
    """The sharded path (two row blocks) with several bands, against the float64 reference."""
    case = Case(dtype, 100.0, (300, 700), 128)
    image, text = _inputs(case)
    ref = clip_reference(image, text, case.scale, None)
    cfg = dataclasses.replace(lk.default_config(image.dtype, 128), band_cols=256)
    x, y = image.to(device, copy=True).requires_grad_(), text.to(device, copy=True).requires_grad_()
    scale = torch.tensor(case.scale, device=device, requires_grad=True)
    terms, ok_i2t, ok_t2i = [], [], []
    for offset, n in ((0, 300), (300, 700)):  # what ranks 0 and 1 compute, summed
        ce_i2t, ok = lk.fused_cross_entropy(x[offset : offset + n], y, scale, offset, cfg)
        ok_i2t.append(ok)
        ce_t2i, ok = lk.fused_cross_entropy(y[offset : offset + n], x, scale, offset, cfg)
        ok_t2i.append(ok)
        terms += [ce_i2t.sum(), ce_t2i.sum()]
    loss = sum(terms) / (2 * 1000)
    loss.backward()
    got = {"loss": loss.detach().cpu(), "grad_image": x.grad.cpu(), "grad_text": y.grad.cpu(),
           "grad_scale": scale.grad.cpu(), "acc_i2t": torch.cat(ok_i2t).double().mean().cpu(),
           "acc_t2i": torch.cat(ok_t2i).double().mean().cpu()}
    _assert_matches(got, ref, dtype, f"row blocks {dtype}", GPU_TOLERANCES)


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_gpu)])
def test_gpu_memory_stays_linear_in_the_batch(device: str) -> None:
    rows, dim = 16384, 256
    x = F.normalize(torch.randn(rows, dim, device=device), dim=1).bfloat16().requires_grad_()
    y = F.normalize(torch.randn(rows, dim, device=device), dim=1).bfloat16().requires_grad_()
    scale = torch.tensor(100.0, device=device, requires_grad=True)
    ClipLoss(mode="fused")(x, y, scale).loss.backward()  # compile outside the measurement
    x.grad = y.grad = scale.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ClipLoss(mode="fused")(x, y, scale).loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    block = rows * rows * 4  # one fp32 logit block: 1 GiB
    # gradients (2 x bf16) + fp32 row accumulator + one 256 MiB dS band + statistics
    assert extra <= 2 * rows * dim * 2 + rows * dim * 4 + 256 * 2**20 + 64 * 2**20, extra
    assert extra < block / 3


@pytest.mark.parametrize("device", [pytest.param("cuda", marks=on_gpu)])
def test_gpu_compiled_kernels_reject_cpu_tensors(device: str) -> None:
    x = torch.zeros(4, 16)
    with pytest.raises(RuntimeError, match="CUDA tensors"):
        lk.fused_symmetric_cross_entropy(x, x, torch.tensor(1.0))


@pytest.mark.skipif(INTERPRETED or not HAVE_TRITON, reason="the interpreter tests ran in this process")
def test_interpreter_variant_in_subprocess() -> None:
    # This process compiled the kernels (CUDA, or Triton imported before this module could ask for
    # the interpreter): the CPU variants run in a fresh process without CUDA.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not gpu", "-p", "no:cacheprovider", str(Path(__file__))],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:]


H200_RIDGE = 784e12 / 4.23e12  # flop per byte where the H200's bf16 matmul stops being memory-bound


@pytest.mark.parametrize("batch", [32768, 65536, 131072])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_backward_accumulators_stay_compute_bound_at_every_batch(batch: int, dtype: torch.dtype,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27.4's CPU proxy for "the time over the FLOP floor does not grow with the batch": the two
    accumulating GEMMs of the backward read and write fp32 accumulators once per band (rows: ``8 M D``
    bytes for ``2 M W D`` flops) or per row chunk (columns: ``8 W D`` bytes for ``2 R W D`` flops), so
    their flop per byte is ``W / 4`` and ``R / 4``. With the GPU's band choice both stay >= 4x the
    H200's ridge (~185) at every batch, D = 1024 (the width once shrank as 1/B: 256 at B = 131072)."""
    monkeypatch.setattr(lk, "interpreting", lambda: False)
    cfg = lk.default_config(dtype, 1024)
    elem = torch.finfo(dtype).bits // 8
    width = lk._band_cols(cfg, batch, batch, elem)
    rows = lk._band_rows(cfg, batch, width, elem)
    row_acc, col_acc = width / 4, rows / 4
    assert row_acc >= 4 * H200_RIDGE and col_acc >= 4 * H200_RIDGE, (width, rows)
    assert rows * width * elem <= cfg.band_rows_bytes  # the band chunk still bounds the memory
