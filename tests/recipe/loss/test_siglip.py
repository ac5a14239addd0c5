"""Tests of recipe.loss.SigLipLoss: the sharded SigLIP sigmoid loss.

The central check runs real gloo ranks on CPU (world sizes 1, 2 and 4, one spawn per world size with
every case run inside the workers) and compares, after the data-parallel mean over ranks, the loss,
the gradients of the image features, text features, logit scale and logit bias, and the accuracies
with a single-process float64 implementation of the definition
``L = -(1/B) sum_ij log sigmoid(z_ij (s x_i.y_j + b))``. As in test_clip.py every rank holds the same
replicated leaf ``(B, D)`` feature matrix and feeds its own rows to the loss; the mean over ranks of
that leaf's gradient (what DeepSpeed's gradient averaging computes) must equal the reference gradient.
open_clip's ``SigLipLoss`` (which divides each rank's loss by its local batch size, i.e. ``N / B``
for equal ranks: the same share as ours) is compared rank by rank with equal local batches.

Tolerances (feature gradients relative to the largest reference entry; the rest elementwise):
* fp32 features: loss rtol 1e-5, feature gradients 2e-5, scale and bias gradients rtol 1e-4;
* bf16 features: loss rtol 1e-5 (fp32 logits of bf16 inputs are exact products), feature gradients
  1.5e-2 (returned in bf16, rounding 2^-9, plus bf16 reduce-scatter sums over ranks and the bf16
  logit-gradient matrix in the feature products), scale and bias gradients rtol 1e-4 (fp32);
* fp16 features at scale 100: loss rtol 1e-5, feature gradients 3e-3.
The reference uses the same dtype-rounded inputs, so the tolerances measure the loss, not the cast.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.loss import SIGLIP_MODES, ClipLoss, SigLipLoss

from ...clip_reference import assert_grad_close, siglip_reference
from ...dist_utils import run_distributed
from . import harness
from .harness import WORLD_SIZES
from .harness import assert_matches_open_clip, assert_matches_reference, cases_for, check_cases, check_errors
from .harness import check_input_errors, check_known_sizes, error_checks, inputs, largest_tensors, run_cases

MODES = sorted(SIGLIP_MODES)


@dataclasses.dataclass(frozen=True)
class Case(harness.Case):
    """One configuration checked on every world size."""

    scale: float = 10.0
    bias: float | None = -10.0  # SigLIP's initialisation

    @property
    def bias_label(self) -> str:
        return f"b{self.bias:g}" if self.bias is not None else "nobias"


CASES = (
    Case("plain", "float32"),
    Case("chunked", "float32", chunk=5),
    Case("plain", "float32", scale=14.3, bias=-2.5),
    Case("chunked", "float32", chunk=3, scale=14.3, bias=-2.5),
    Case("chunked", "float32", chunk=4, bias=None),
    Case("plain", "bfloat16"),
    Case("chunked", "bfloat16", chunk=5),
    Case("plain", "float16", scale=100.0, bias=-20.0),
    Case("chunked", "float16", chunk=5, scale=100.0, bias=-20.0),
    Case("plain", "float32", uneven=True),
    Case("chunked", "float32", chunk=4, uneven=True),
    Case("chunked", "bfloat16", chunk=4, scale=14.3, bias=-2.5, uneven=True),
)
RUN = {"param_shape": (1,), "details": True}  # the model's (1,) parameters; rank shares and metric keys


def _reference(case: Case, world: int) -> dict:
    image, text = inputs(case, world)
    return siglip_reference(image, text, case.scale, case.bias)


def _open_clip_loss(module, case: Case, rank: int, world: int):
    if case.dtype == "float32" and not case.uneven and case.bias is not None:
        return module.SigLipLoss(rank=rank, world_size=world)  # its default ring exchange
    return None


def _worker(rank: int, world: int) -> dict:
    results = run_cases(rank, world, SigLipLoss, CASES, _open_clip_loss, **RUN)
    results["errors"] = error_checks(rank, world, SigLipLoss, MODES, torch.tensor(-10.0)) if world > 1 else None
    return results


@functools.cache
def _world_results(world: int) -> list[dict]:
    return run_distributed(_worker, world, timeout_s=240)


def _metadata(got: dict, ref: dict, case: Case) -> None:
    assert got["grad_scale_shape"] == (1,)
    assert got["metric_keys"] == ["acc_i2t", "acc_t2i"] and not got["metrics_grad"]


# --------------------------------------------------------------------------------------------------
# Multi-process tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_float64_reference_after_data_parallel_mean(world: int) -> None:
    results = _world_results(world)
    refs = check_cases(results, world, CASES, _reference, extra=_metadata)
    if world > 1:  # the shares differ: each rank returns its own block, not the full loss
        for case in cases_for(CASES, world):
            shares = torch.stack([r["cases"][case.name]["rank_loss"] for r in results])
            assert not torch.allclose(shares, shares[0].expand_as(shares)), case.name
    informative = [0.0 < ref["acc_i2t"] < 1.0 and 0.0 < ref["acc_t2i"] < 1.0 for ref in refs]
    assert sum(informative) >= len(informative) // 2, "inputs should make the accuracies informative"


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_open_clip_rank_by_rank(world: int) -> None:
    assert importlib.util.find_spec("open_clip") is not None, "open_clip_torch is part of the test extra"
    results = _world_results(world)
    assert results[0]["open_clip"], "open_clip is installed here but was not found in the spawned ranks"
    for rank, res in enumerate(results):
        for case_name, theirs in res["open_clip"].items():
            case = next(c for c in CASES if c.name == case_name)
            ours = res["cases"][case_name]
            if rank == 0:  # open_clip itself is right in this setup
                assert_matches_reference(theirs, _reference(case, world), case)
            # equal local batches: open_clip's 1 / M is our N / B, so even the rank shares agree
            torch.testing.assert_close(ours["rank_loss"], theirs["rank_loss"], rtol=1e-5, atol=1e-7)
            assert_matches_open_clip(ours, theirs, f"rank {rank} {case_name}", ("grad_scale", "grad_bias"))


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_known_sizes_skip_the_exchange_with_identical_results(world: int) -> None:
    check_known_sizes(_world_results(world))


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_bad_input_on_one_rank_raises_on_every_rank(world: int) -> None:
    check_errors(_world_results(world), world, MODES)


# --------------------------------------------------------------------------------------------------
# Single-process tests
# --------------------------------------------------------------------------------------------------


def _single(mode: str, image, text, scale: float, bias: float | None, chunk: int = 8, **kw) -> dict:
    """One process, no process group: the loss, its gradients (float64) and the metrics."""
    x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
    s = torch.tensor(scale, requires_grad=True)
    b = None if bias is None else torch.tensor(bias, requires_grad=True)
    loss, metrics = SigLipLoss(mode=mode, chunk_size=chunk, **kw)(x, y, s, b)
    loss.backward()
    out = {"loss": loss.detach().double(), "grad_image": x.grad.double(), "grad_text": y.grad.double(),
           "grad_scale": s.grad.double(), "metrics": metrics}
    if b is not None:
        out["grad_bias"] = b.grad.double()
    return out


@pytest.mark.parametrize("mode", MODES)
def test_without_process_group_matches_reference(mode: str) -> None:
    assert not dist.is_initialized()
    case = Case(mode, "float32", chunk=8, scale=12.0, bias=-4.0)
    image, text = inputs(case, 5)  # 35 rows, one process
    got = _single(mode, image, text, case.scale, case.bias, chunk=case.chunk)
    ref = siglip_reference(image, text, case.scale, case.bias)
    assert_matches_reference(got, ref, case)
    metrics = got["metrics"]
    assert set(metrics) == {"acc_i2t", "acc_t2i"}
    torch.testing.assert_close(metrics["acc_i2t"].double(), ref["acc_i2t"], rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["acc_t2i"].double(), ref["acc_t2i"], rtol=0, atol=1e-6)
    # without a bias the loss is the one at b = 0, and no bias gradient is asked for
    nobias = _single(mode, image, text, case.scale, None, chunk=case.chunk)
    assert_matches_reference(nobias, siglip_reference(image, text, case.scale, 0.0), Case(mode, "float32", bias=None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_and_chunked_agree_on_a_larger_batch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(3)
    image = F.normalize(torch.randn(300, 64, generator=gen), dim=1).to(dtype)
    text = F.normalize(image.float() + 0.7 * torch.randn(300, 64, generator=gen), dim=1).to(dtype)
    plain, chunked = (_single(mode, image, text, 30.0, -8.0, chunk=128) for mode in ("plain", "chunked"))
    torch.testing.assert_close(chunked["loss"], plain["loss"], rtol=1e-5, atol=0)
    for key in ("grad_scale", "grad_bias"):
        torch.testing.assert_close(chunked[key], plain[key], rtol=1e-4, atol=1e-7)
    tol = 2e-5 if dtype == torch.float32 else 1e-2
    assert_grad_close(chunked["grad_image"], plain["grad_image"], tol, "image grad")
    assert_grad_close(chunked["grad_text"], plain["grad_text"], tol, "text grad")
    for key in ("acc_i2t", "acc_t2i"):
        assert torch.equal(chunked["metrics"][key], plain["metrics"][key]), key


def test_chunked_never_materialises_the_logit_block() -> None:
    rows, dim, chunk = 512, 8, 64
    largest = largest_tensors(SigLipLoss, ("plain", "chunked"), rows, dim, chunk, seed=4, scale=10.0, bias=-10.0)
    assert largest["plain"] >= rows * rows * 4  # the probe does see the fp32 block when it exists
    assert largest["chunked"] <= max(chunk * chunk, 2 * rows * dim) * 4, largest


@pytest.mark.parametrize("mode", MODES)
def test_extreme_logits_stay_finite_and_exact(mode: str) -> None:
    # (1) logits of +-110: fp32 sigmoid(-110) underflows, so log(sigmoid) would be -inf
    gen = torch.Generator().manual_seed(5)
    image = F.normalize(torch.randn(24, 16, generator=gen), dim=1)
    text = F.normalize(image + 0.3 * torch.randn(24, 16, generator=gen), dim=1)
    naive = torch.log(torch.sigmoid(-(100.0 * image @ text.T + 10.0)))
    assert not torch.isfinite(naive).all()
    ref = siglip_reference(image, text, 100.0, 10.0)
    got = _single(mode, image, text, 100.0, 10.0, chunk=7)
    assert_matches_reference(got, ref, Case(mode, "float32"))
    # (2) a confidently solved batch (positives at +30, negatives at -30): every logit gradient is
    # ~1e-13; a positive's sigmoid(l) - 1 computed as written would be exactly 0 in fp32
    eye = torch.eye(8)
    assert torch.sigmoid(torch.tensor(30.0)) - 1 == 0
    ref = siglip_reference(eye, eye, 60.0, -30.0)
    got = _single(mode, eye, eye, 60.0, -30.0, chunk=3)
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=1e-5, atol=0)
    for key in ("grad_image", "grad_text", "grad_scale", "grad_bias"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-4, atol=0, msg=key)


@pytest.mark.parametrize("mode", MODES)
def test_autocast_region_keeps_fp32_logits(mode: str) -> None:
    gen = torch.Generator().manual_seed(6)
    image = F.normalize(torch.randn(40, 32, generator=gen), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(40, 32, generator=gen), dim=1)
    plain = _single(mode, image, text, 80.0, -10.0, chunk=16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto = _single(mode, image, text, 80.0, -10.0, chunk=16)
    torch.testing.assert_close(auto["loss"], plain["loss"], rtol=1e-6, atol=0)  # bf16 logits: off by ~1e-2
    assert_grad_close(auto["grad_image"], plain["grad_image"], 1e-5, "image grad under autocast")
    torch.testing.assert_close(auto["grad_scale"], plain["grad_scale"], rtol=1e-5, atol=0)


def test_not_the_softmax_loss() -> None:
    """The bias matters here (it cancels in ClipLoss), and the loss differs from ClipLoss's."""
    image, text = inputs(Case("plain", "float32"), 2)
    for mode in MODES:
        a = _single(mode, image, text, 10.0, -10.0)
        b = _single(mode, image, text, 10.0, -5.0)
        assert not torch.allclose(a["loss"], b["loss"]) and a["grad_bias"].abs() > 0.1
    clip_loss, _ = ClipLoss()(image, text, torch.tensor(10.0), torch.tensor(-10.0))
    assert not torch.allclose(clip_loss.double(), a["loss"])


def test_input_errors() -> None:
    check_input_errors(SigLipLoss, MODES, "fused", bias=torch.tensor(-10.0))
