"""Tests of recipe.loss: the sharded gathered-embedding contrastive loss.

The central check runs real gloo ranks on CPU (world sizes 1, 2 and 4, one spawn per world size with
every case run inside the workers) and compares, after the data-parallel mean over ranks, the loss,
the gradients of the image features, text features, logit scale and logit bias, and the accuracies
with a single-process float64 full-batch reference. The "feature gradient after the data-parallel
mean" is measured exactly as DeepSpeed would see it: every rank holds the same replicated leaf
``(B, D)`` feature matrix and feeds its own rows to the loss; the mean over ranks of that leaf's
gradient must equal the reference gradient of the full-batch loss (a rank's raw gradient of its rows
is N times that, being the sum over every rank's loss).

Tolerances (relative to the largest reference gradient entry; loss and accuracies are compared
elementwise):
* fp32 features: loss rtol 1e-5, gradients 2e-5, logit-scale gradient rtol 1e-4;
* bf16 features: loss rtol 1e-5 (the fp32 logits of bf16 inputs are exact), feature gradients 1.5e-2
  (returned in bf16: rounding 2^-9, plus bf16 reduce-scatter sums over ranks and the bf16 softmax
  gradient in the feature matmuls), logit-scale gradient rtol 1e-4 (computed in fp32);
* fp16 features at logit scale 100: loss rtol 1e-5, feature gradients 3e-3.
The reference uses the same dtype-rounded inputs, so the tolerances measure the loss, not the cast.
"""

from __future__ import annotations

import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.loss import (
    LOSS_MODES,
    ClipLoss,
    all_gather_with_grad,
    chunked_cross_entropy,
    symmetric_chunked_cross_entropy,
)

from ...clip_reference import assert_grad_close, clip_reference
from ...dist_utils import run_distributed
from .harness import TOLERANCES, UNEVEN_ROWS, WORLD_SIZES, Case
from .harness import assert_matches_open_clip, assert_matches_reference, check_cases, check_errors
from .harness import check_input_errors, check_known_sizes, error_checks, inputs, largest_tensors, run_cases


def _cpu_modes() -> list[str]:
    """The modes that run on CPU tensors here: "fused" only when its Triton kernels run interpreted
    (on a CUDA machine they are compiled and refuse CPU tensors; tests/test_loss_fused.py and the
    GPU test below cover them there)."""
    modes = sorted(LOSS_MODES)
    try:
        from recipe.loss import fused

        interpreted = fused.interpreting()
    except ImportError:
        interpreted = False
    return modes if interpreted else [m for m in modes if m != "fused"]


CPU_MODES = _cpu_modes()

CASES = (
    Case("plain", "float32"),
    Case("chunked", "float32", chunk=5),
    Case("plain", "float32", bias=-2.5),
    Case("chunked", "float32", chunk=3, bias=-2.5),
    Case("plain", "bfloat16"),
    Case("chunked", "bfloat16", chunk=5),
    Case("plain", "float16", scale=100.0),
    Case("chunked", "float16", chunk=5, scale=100.0),
    Case("plain", "float32", uneven=True),
    Case("chunked", "float32", chunk=4, uneven=True),
    Case("chunked", "bfloat16", chunk=4, bias=-2.5, uneven=True),
)
BIAS_TOL = (0, 1e-6)  # (rtol, atol): softmax CE is shift invariant, the reference bias gradient is ~0


def _reference(case: Case, world: int) -> dict:
    image, text = inputs(case, world)
    return clip_reference(image, text, float(torch.tensor(case.scale)), case.bias)


def _open_clip_loss(module, case: Case, rank: int, world: int):
    if case.mode == "plain" and case.dtype == "float32" and not case.uneven:
        return module.ClipLoss(local_loss=True, gather_with_grad=True, rank=rank, world_size=world)
    return None


def _gather_check(rank: int, world: int) -> dict:
    """all_gather_with_grad on two tensors of different trailing shapes and uneven rows."""
    sizes = list(UNEVEN_ROWS[:world])
    lo = sum(sizes[:rank])
    a_full = torch.arange(sum(sizes) * 3, dtype=torch.float64).reshape(-1, 3)
    b_full = -torch.arange(sum(sizes) * 4, dtype=torch.float64).reshape(-1, 2, 2)
    a = a_full[lo : lo + sizes[rank]].clone().requires_grad_()
    b = b_full[lo : lo + sizes[rank]].clone().requires_grad_()
    ga, gb = all_gather_with_grad(a, b)
    # integer weights keep every sum exact, so the gradients must match exactly
    weight_a = (torch.arange(a_full.numel(), dtype=torch.float64) % 7 - 3).reshape(a_full.shape)
    weight_b = (torch.arange(b_full.numel(), dtype=torch.float64) % 5 + 1).reshape(b_full.shape)
    # rank-dependent upstream gradients: rank s sends (s + 1) * weight
    ((ga * weight_a).sum() * (rank + 1) + (gb * weight_b).sum() * (rank + 1)).backward()
    factor = world * (world + 1) / 2
    return {
        "forward_ok": torch.equal(ga, a_full) and torch.equal(gb, b_full),
        "grad_a_err": (a.grad - factor * weight_a[lo : lo + sizes[rank]]).abs().max().item(),
        "grad_b_err": (b.grad - factor * weight_b[lo : lo + sizes[rank]]).abs().max().item(),
    }


def _worker(rank: int, world: int) -> dict:
    results = run_cases(rank, world, ClipLoss, CASES, _open_clip_loss, unused_bias=True)
    results["gather"] = _gather_check(rank, world) if world > 1 else None
    results["errors"] = error_checks(rank, world, ClipLoss, CPU_MODES) if world > 1 else None
    return results


@functools.lru_cache(maxsize=None)
def _world_results(world: int) -> list[dict]:
    return run_distributed(_worker, world, timeout_s=240)


# --------------------------------------------------------------------------------------------------
# Multi-process tests
# --------------------------------------------------------------------------------------------------



def _assert_matches_reference(got: dict, ref: dict, case: Case) -> None:
    assert_matches_reference(got, ref, case, bias_tol=BIAS_TOL)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_full_batch_reference_after_data_parallel_mean(world: int) -> None:
    refs = check_cases(_world_results(world), world, CASES, _reference, bias_tol=BIAS_TOL)
    informative = [0.0 < ref["acc_i2t"] < 1.0 for ref in refs]
    assert sum(informative) >= len(informative) // 2, "inputs should make the accuracies informative"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_open_clip(world: int) -> None:
    if importlib.util.find_spec("open_clip") is None:
        pytest.skip("open_clip_torch is not installed (bench extra)")
    results = _world_results(world)
    assert results[0]["open_clip"], "open_clip is installed here but was not found in the spawned ranks"
    for case_name, theirs in results[0]["open_clip"].items():
        case = next(c for c in CASES if c.name == case_name)
        _assert_matches_reference(theirs, _reference(case, world), case)  # open_clip itself is right in this setup
        assert_matches_open_clip(results[0]["cases"][case_name], theirs, case_name, ("grad_scale",))


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_known_sizes_skip_the_exchange_with_identical_results(world: int) -> None:
    check_known_sizes(_world_results(world))


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_all_gather_backward_is_reduce_scatter_sum(world: int) -> None:
    for rank, res in enumerate(_world_results(world)):
        check = res["gather"]
        assert check["forward_ok"], f"rank {rank}: gathered values differ from the concatenation"
        assert check["grad_a_err"] == 0.0 and check["grad_b_err"] == 0.0, f"rank {rank}: {check}"


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_bad_input_on_one_rank_raises_on_every_rank(world: int) -> None:
    check_errors(_world_results(world), world, CPU_MODES)


# --------------------------------------------------------------------------------------------------
# Single-process tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", CPU_MODES)
def test_without_process_group_matches_reference(mode: str) -> None:
    assert not dist.is_initialized()
    case = Case(mode, "float32", chunk=8, bias=1.5)
    image, text = inputs(case, 5)  # 35 rows, one process
    x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale, bias = torch.tensor(case.scale, requires_grad=True), torch.tensor(case.bias, requires_grad=True)
    loss_fn = ClipLoss(mode=mode, chunk_size=case.chunk)
    loss, metrics = loss_fn(x, y, scale, bias)
    loss.backward()
    ref = clip_reference(image, text, case.scale, case.bias)
    got = {"loss": loss.double(), "grad_image": x.grad.double(), "grad_text": y.grad.double(),
           "grad_scale": scale.grad.double(), "grad_bias": bias.grad.double()}
    _assert_matches_reference(got, ref, case)
    assert set(metrics) == {"acc_i2t", "acc_t2i"}
    torch.testing.assert_close(metrics["acc_i2t"].double(), ref["acc_i2t"], rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["acc_t2i"].double(), ref["acc_t2i"], rtol=0, atol=1e-6)
    assert not metrics["acc_i2t"].requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_chunked_agree_on_a_larger_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    image = F.normalize(torch.randn(300, 64, generator=gen), dim=1).to(dtype)
    text = F.normalize(image.float() + 0.7 * torch.randn(300, 64, generator=gen), dim=1).to(dtype)
    outs = []
    for mode in ("plain", "chunked"):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(50.0, requires_grad=True)
        loss, _ = ClipLoss(mode=mode, chunk_size=128)(x, y, scale)
        loss.backward()
        outs.append((loss.detach(), x.grad.float(), y.grad.float(), scale.grad))
    (lp, xp, yp, sp), (lc, xc, yc, sc) = outs
    torch.testing.assert_close(lc, lp, rtol=1e-5, atol=0)
    torch.testing.assert_close(sc, sp, rtol=1e-4, atol=1e-7)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert_grad_close(xc, xp, tol, "image grad")
    assert_grad_close(yc, yp, tol, "text grad")



def test_chunked_never_materialises_the_logit_block() -> None:
    rows, dim, chunk = 512, 8, 64
    largest = largest_tensors(ClipLoss, ("plain", "chunked"), rows, dim, chunk, seed=4, scale=20.0)
    assert largest["plain"] >= rows * rows * 4  # the probe does see the fp32 block when it exists
    assert largest["chunked"] <= max(chunk * chunk, 2 * rows * dim) * 4, largest


def test_fp16_at_scale_100_stays_finite_where_fp16_logits_overflow() -> None:
    gen = torch.Generator().manual_seed(5)
    image = F.normalize(torch.randn(64, 32, generator=gen), dim=1)
    text = F.normalize(image + 0.3 * torch.randn(64, 32, generator=gen), dim=1)
    x16, y16 = image.half(), text.half()
    naive = (100.0 * x16 @ y16.T).exp().sum(1)  # what an fp16 log-sum-exp without a max would do
    assert not torch.isfinite(naive).all()
    ref = clip_reference(x16, y16, 100.0, None)
    for mode in CPU_MODES:
        x, y = x16.clone().requires_grad_(), y16.clone().requires_grad_()
        scale = torch.tensor(100.0, requires_grad=True)
        loss, _ = ClipLoss(mode=mode, chunk_size=24)(x, y, scale)
        loss.backward()
        torch.testing.assert_close(loss.double(), ref["loss"], rtol=1e-5, atol=1e-7)
        assert_grad_close(x.grad.double(), ref["grad_image"], 3e-3, f"{mode} image grad")
        torch.testing.assert_close(scale.grad.double(), ref["grad_scale"], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("mode", CPU_MODES)
def test_autocast_region_keeps_fp32_logits(mode: str) -> None:
    gen = torch.Generator().manual_seed(6)
    image = F.normalize(torch.randn(40, 32, generator=gen), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(40, 32, generator=gen), dim=1)
    results = []
    for autocast in (False, True):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(80.0, requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss, _ = ClipLoss(mode=mode, chunk_size=16)(x, y, scale)
        loss.backward()
        results.append((loss.detach(), x.grad, scale.grad))
    (l0, g0, s0), (l1, g1, s1) = results
    torch.testing.assert_close(l1, l0, rtol=1e-6, atol=0)  # bf16 logits would be off by ~1e-2
    assert_grad_close(g1, g0, 1e-5, "image grad under autocast")
    torch.testing.assert_close(s1, s0, rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_matches_reference_and_chunked_saves_memory(dtype: str) -> None:
    """The CUDA paths (fp32-output 16-bit matmuls) against the float64 reference; memory order."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(7)
    image = F.normalize(torch.randn(1000, 64, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(1000, 64, generator=gen, dtype=torch.float64), dim=1)
    image, text = image.to(getattr(torch, dtype)), text.to(getattr(torch, dtype))
    ref = clip_reference(image, text, 100.0, None)
    loss_rtol, grad_tol, scale_rtol = TOLERANCES[dtype]
    for mode in LOSS_MODES:
        x, y = image.to(device).requires_grad_(), text.to(device).requires_grad_()
        scale = torch.tensor(100.0, device=device, requires_grad=True)
        loss, _ = ClipLoss(mode=mode, chunk_size=256)(x, y, scale)
        loss.backward()
        torch.testing.assert_close(loss.double().cpu(), ref["loss"], rtol=loss_rtol, atol=1e-7)
        assert_grad_close(x.grad.double().cpu(), ref["grad_image"], grad_tol, f"{mode} image grad")
        assert_grad_close(y.grad.double().cpu(), ref["grad_text"], grad_tol, f"{mode} text grad")
        torch.testing.assert_close(scale.grad.double().cpu(), ref["grad_scale"], rtol=scale_rtol, atol=1e-7)
    rows, dim, chunk = 8192, 64, 512
    x = F.normalize(torch.randn(rows, dim, device=device), dim=1).to(getattr(torch, dtype)).requires_grad_()
    y = F.normalize(torch.randn(rows, dim, device=device), dim=1).to(getattr(torch, dtype)).requires_grad_()
    scale = torch.tensor(100.0, device=device, requires_grad=True)
    extra = {}
    for mode in LOSS_MODES:
        x.grad = y.grad = scale.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ClipLoss(mode=mode, chunk_size=chunk)(x, y, scale).loss.backward()
        torch.cuda.synchronize()
        extra[mode] = torch.cuda.max_memory_allocated() - base
    block = rows * rows * 4  # one fp32 logit block
    assert extra["plain"] >= block, extra
    # tiles plus fp32 (B, D) accumulators plus the feature gradients: far below one block
    assert extra["chunked"] <= 8 * chunk * chunk * 4 + 8 * rows * dim * 4, extra


def test_input_errors() -> None:
    check_input_errors(ClipLoss, CPU_MODES, "nope")


# --------------------------------------------------------------------------------------------------
# The chunked kernels (issue 17: one product per tile at world size 1)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_symmetric_chunked_kernel_matches_two_directional_passes(dtype: torch.dtype, chunk: int) -> None:
    """World size 1 takes the symmetric kernel; it must give what the rectangular kernel gives per
    direction (targets on the diagonal), with an upstream gradient that differs per row."""
    gen = torch.Generator().manual_seed(8)
    image = F.normalize(torch.randn(45, 24, generator=gen), dim=1).to(dtype)
    text = F.normalize(image.float() + 0.6 * torch.randn(45, 24, generator=gen), dim=1).to(dtype)
    w_i2t, w_t2i = torch.rand(45, generator=gen), torch.rand(45, generator=gen) - 0.5
    outs = []
    for symmetric in (True, False):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale = torch.tensor(40.0, requires_grad=True)
        if symmetric:
            ce_i2t, ce_t2i, ok_i2t, ok_t2i = symmetric_chunked_cross_entropy(x, y, scale, chunk)
        else:
            ce_i2t, ok_i2t = chunked_cross_entropy(x, y, scale, 0, chunk)
            ce_t2i, ok_t2i = chunked_cross_entropy(y, x, scale, 0, chunk)
        ((ce_i2t * w_i2t).sum() + (ce_t2i * w_t2i).sum()).backward()
        outs.append((ce_i2t.detach(), ce_t2i.detach(), ok_i2t, ok_t2i, x.grad.float(), y.grad.float(), scale.grad))
    (a_i, a_t, ok_ai, ok_at, gx_a, gy_a, gs_a), (b_i, b_t, ok_bi, ok_bt, gx_b, gy_b, gs_b) = outs
    torch.testing.assert_close(a_i, b_i, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a_t, b_t, rtol=1e-5, atol=1e-6)
    assert torch.equal(ok_ai, ok_bi) and torch.equal(ok_at, ok_bt)
    assert 0 < int(ok_ai.sum()) < 45  # informative accuracies
    tol = {torch.float32: 2e-5, torch.bfloat16: 1.5e-2, torch.float16: 3e-3}[dtype]
    assert_grad_close(gx_a, gx_b, tol, "image grad")
    assert_grad_close(gy_a, gy_b, tol, "text grad")
    torch.testing.assert_close(gs_a, gs_b, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("world_size_1", [True, False])
def test_chunked_accuracy_is_first_argmax_with_exact_ties(world_size_1: bool) -> None:
    """Duplicated rows tie exactly; "correct" means the *first* maximum is the positive (as argmax)."""
    gen = torch.Generator().manual_seed(9)
    image = F.normalize(torch.randn(20, 8, generator=gen), dim=1)
    text = image.clone()
    text[11], text[3] = text[2], text[17]  # ties before (11) and after (3) the target column
    image[5], image[14] = image[13], image[6]
    scale = torch.tensor(30.0)
    targets = torch.arange(20)
    logits = scale * image @ text.T
    want_i2t, want_t2i = logits.argmax(1) == targets, logits.T.argmax(1) == targets
    assert not want_i2t.all() and not want_t2i.all()  # the ties make some rows wrong
    for chunk in (3, 8, 32):
        if world_size_1:
            _, _, ok_i2t, ok_t2i = symmetric_chunked_cross_entropy(image, text, scale, chunk)
        else:
            _, ok_i2t = chunked_cross_entropy(image, text, scale, 0, chunk)
            _, ok_t2i = chunked_cross_entropy(text, image, scale, 0, chunk)
        assert torch.equal(ok_i2t, want_i2t), chunk
        assert torch.equal(ok_t2i, want_t2i), chunk


def test_chunked_gradients_of_a_subset_of_inputs() -> None:
    """Only some inputs need a gradient (frozen text tower, fixed scale, or only the scale)."""
    gen = torch.Generator().manual_seed(10)
    image = F.normalize(torch.randn(30, 16, generator=gen), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(30, 16, generator=gen), dim=1)
    ref = clip_reference(image, text, 25.0, None)
    for need in ({"image"}, {"text", "scale"}, {"scale"}):
        x = image.clone().requires_grad_("image" in need)
        y = text.clone().requires_grad_("text" in need)
        scale = torch.tensor(25.0, requires_grad="scale" in need)
        ClipLoss(mode="chunked", chunk_size=7)(x, y, scale).loss.backward()
        for name, t, key in (("image", x, "grad_image"), ("text", y, "grad_text")):
            if name in need:
                assert_grad_close(t.grad.double(), ref[key], 2e-5, f"{name} grad ({need})")
            else:
                assert t.grad is None
        if "scale" in need:
            torch.testing.assert_close(scale.grad.double(), ref["grad_scale"], rtol=1e-4, atol=1e-7)
