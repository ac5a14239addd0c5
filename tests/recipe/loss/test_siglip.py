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
import os
import zlib
from types import ModuleType

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.loss import SIGLIP_MODES, ClipLoss, LossResult, SigLipLoss

from ...clip_reference import LargestTensor, assert_grad_close
from ...dist_utils import run_distributed

DIM = 16
WORLD_SIZES = (1, 2, 4)
EQUAL_ROWS = 7  # per rank; the chunk sizes below do not divide it nor the gathered batch
UNEVEN_ROWS = (5, 9, 3, 8)
MODES = sorted(SIGLIP_MODES)


def siglip_reference(image: torch.Tensor, text: torch.Tensor, scale: float, bias: float | None) -> dict:
    """The definition in float64 on the full batch: loss, its gradients and both accuracies."""
    image = image.double().requires_grad_()
    text = text.double().requires_grad_()
    s = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(0.0 if bias is None else bias, dtype=torch.float64, requires_grad=True)
    logits = s * image @ text.T + b
    n = image.shape[0]
    z = 2 * torch.eye(n, dtype=torch.float64) - 1
    loss = -F.logsigmoid(z * logits).sum() / n  # log(sigmoid(30)) would lose 1e-3 of it even in float64
    loss.backward()
    targets = torch.arange(n)
    return {
        "loss": loss.detach(),
        "grad_image": image.grad,
        "grad_text": text.grad,
        "grad_scale": s.grad,
        "grad_bias": b.grad,
        "acc_i2t": (logits.argmax(1) == targets).double().mean(),
        "acc_t2i": (logits.argmax(0) == targets).double().mean(),
    }


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration checked on every world size."""

    mode: str
    dtype: str
    chunk: int = 4096
    scale: float = 10.0
    bias: float | None = -10.0  # SigLIP's initialisation
    uneven: bool = False

    @property
    def name(self) -> str:
        parts = [self.mode, self.dtype, f"c{self.chunk}" if self.mode == "chunked" else "", f"s{self.scale:g}"]
        parts += [f"b{self.bias:g}" if self.bias is not None else "nobias", "uneven" if self.uneven else ""]
        return "-".join(p for p in parts if p)

    def sizes(self, world: int) -> list[int]:
        return list(UNEVEN_ROWS[:world]) if self.uneven else [EQUAL_ROWS] * world


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
TOLERANCES = {  # dtype: (loss rtol, feature-grad tol relative to max |ref|, scale/bias-grad rtol)
    "float32": (1e-5, 2e-5, 1e-4),
    "bfloat16": (1e-5, 1.5e-2, 1e-4),
    "float16": (1e-5, 3e-3, 1e-4),
}


def _cases_for(world: int) -> list[Case]:
    return [c for c in CASES if not (c.uneven and world == 1)]


def _inputs(case: Case, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch features, rounded to the case dtype (same on every process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    total = sum(case.sizes(world))
    image = F.normalize(torch.randn(total, DIM, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(total, DIM, generator=gen, dtype=torch.float64), dim=1)
    dtype = getattr(torch, case.dtype)
    return image.to(dtype), text.to(dtype)


def _open_clip_loss_module() -> ModuleType | None:
    """open_clip's ``loss.py`` loaded on its own (it only imports torch), or None without open_clip."""
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "loss.py")
    loss_spec = importlib.util.spec_from_file_location("_open_clip_loss_under_test", path)
    module = importlib.util.module_from_spec(loss_spec)
    loss_spec.loader.exec_module(module)
    return module


def _dp_mean(t: torch.Tensor) -> torch.Tensor:
    """Data-parallel mean over ranks, as DeepSpeed/DDP average gradients (computed in float64)."""
    t = t.detach().double().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def _run_case(loss_fn, case: Case, rank: int, world: int, known_sizes: bool = False) -> dict:
    image_full, text_full = (t.clone().requires_grad_() for t in _inputs(case, world))
    sizes = case.sizes(world)
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    scale = torch.full((1,), case.scale, requires_grad=True)  # the model's (1,) parameters
    bias = None if case.bias is None else torch.full((1,), case.bias, requires_grad=True)
    kwargs = {"sizes": sizes} if known_sizes else {}
    out = loss_fn(image_full[rows], text_full[rows], scale, bias, **kwargs)
    metrics = None
    if isinstance(out, LossResult):
        out, metrics = out
    out.backward()
    result = {
        "rank_loss": out.detach().clone(),
        "loss": _dp_mean(out),
        "loss_dtype": out.dtype,
        "grad_image": _dp_mean(image_full.grad),
        "grad_text": _dp_mean(text_full.grad),
        "grad_scale": _dp_mean(scale.grad),
        "grad_scale_shape": scale.grad.shape,
        "grad_dtype": image_full.grad.dtype,
    }
    if bias is not None:
        result["grad_bias"] = _dp_mean(bias.grad)
    if metrics is not None:
        result["metric_keys"] = sorted(metrics)
        result["metrics_grad"] = any(v.requires_grad for v in metrics.values())
        result["acc_i2t"] = _dp_mean(metrics["acc_i2t"])
        result["acc_t2i"] = _dp_mean(metrics["acc_t2i"])
    return result


def _error_checks(rank: int, world: int) -> dict:
    """Every rank must raise the same ValueError when one rank's inputs are bad."""
    messages = {}
    image, text = _inputs(Case("plain", "float32"), world)
    rows = slice(rank * EQUAL_ROWS, (rank + 1) * EQUAL_ROWS)
    for mode in MODES:
        x = image[rows].clone()
        if rank == world - 1:
            x[0, 0] = float("nan")
        try:
            SigLipLoss(mode=mode)(x, text[rows], torch.tensor(10.0), torch.tensor(-10.0))
            messages[f"nonfinite-{mode}"] = None
        except ValueError as err:
            messages[f"nonfinite-{mode}"] = str(err)
    dim = DIM if rank else DIM // 2
    try:
        SigLipLoss()(image[rows, :dim], text[rows, :dim], torch.tensor(10.0), torch.tensor(-10.0))
        messages["dim"] = None
    except ValueError as err:
        messages["dim"] = str(err)
    return messages


def _worker(rank: int, world: int) -> dict:
    results: dict = {"cases": {}, "open_clip": {}, "known_sizes": {}}
    for case in _cases_for(world):
        loss_fn = SigLipLoss(mode=case.mode, chunk_size=case.chunk)
        results["cases"][case.name] = _run_case(loss_fn, case, rank, world)
        if world > 1 and case.uneven:  # sizes known to the caller: no exchange, same result
            known = SigLipLoss(mode=case.mode, chunk_size=case.chunk, validate=False)
            results["known_sizes"][case.name] = _run_case(known, case, rank, world, known_sizes=True)
    open_clip_loss = _open_clip_loss_module()
    if open_clip_loss is None:
        results["open_clip"] = None
    else:
        for case in _cases_for(world):
            if case.dtype == "float32" and not case.uneven and case.bias is not None:
                oc = open_clip_loss.SigLipLoss(rank=rank, world_size=world)  # its default ring exchange
                results["open_clip"][case.name] = _run_case(oc, case, rank, world)
    results["errors"] = _error_checks(rank, world) if world > 1 else None
    return results


@functools.cache
def _world_results(world: int) -> list[dict]:
    return run_distributed(_worker, world, timeout_s=240)


def _assert_matches_reference(got: dict, ref: dict, case: Case) -> None:
    loss_rtol, grad_tol, scalar_rtol = TOLERANCES[case.dtype]
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=loss_rtol, atol=1e-7)
    assert_grad_close(got["grad_image"], ref["grad_image"], grad_tol, "image grad")
    assert_grad_close(got["grad_text"], ref["grad_text"], grad_tol, "text grad")
    torch.testing.assert_close(got["grad_scale"].reshape(()), ref["grad_scale"], rtol=scalar_rtol, atol=1e-7)
    if case.bias is not None:
        torch.testing.assert_close(got["grad_bias"].reshape(()), ref["grad_bias"], rtol=scalar_rtol, atol=1e-7)


# --------------------------------------------------------------------------------------------------
# Multi-process tests
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_matches_float64_reference_after_data_parallel_mean(world: int) -> None:
    results = _world_results(world)
    informative = []
    for case in _cases_for(world):
        image, text = _inputs(case, world)
        ref = siglip_reference(image, text, case.scale, case.bias)
        got = results[0]["cases"][case.name]
        try:
            _assert_matches_reference(got, ref, case)
            assert got["loss_dtype"] == torch.float32
            assert got["grad_dtype"] == getattr(torch, case.dtype)
            assert got["grad_scale_shape"] == (1,)
            assert got["metric_keys"] == ["acc_i2t", "acc_t2i"] and not got["metrics_grad"]
            # accuracies: the mean over ranks of each rank's share is the full-batch accuracy
            torch.testing.assert_close(got["acc_i2t"], ref["acc_i2t"], rtol=0, atol=1e-6)
            torch.testing.assert_close(got["acc_t2i"], ref["acc_t2i"], rtol=0, atol=1e-6)
            informative.append(0.0 < ref["acc_i2t"] < 1.0 and 0.0 < ref["acc_t2i"] < 1.0)
        except AssertionError as err:
            raise AssertionError(f"world {world}, case {case.name}: {err}") from err
        for other in results[1:]:  # the data-parallel mean is the same on every rank
            torch.testing.assert_close(other["cases"][case.name]["loss"], got["loss"], rtol=0, atol=0)
        if world > 1:  # the shares differ: each rank returns its own block, not the full loss
            shares = torch.stack([r["cases"][case.name]["rank_loss"] for r in results])
            assert not torch.allclose(shares, shares[0].expand_as(shares)), case.name
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
                image, text = _inputs(case, world)
                _assert_matches_reference(theirs, siglip_reference(image, text, case.scale, case.bias), case)
            # equal local batches: open_clip's 1 / M is our N / B, so even the rank shares agree
            torch.testing.assert_close(ours["rank_loss"], theirs["rank_loss"], rtol=1e-5, atol=1e-7)
            torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-5, atol=1e-7)
            for key in ("grad_image", "grad_text"):
                assert_grad_close(ours[key], theirs[key], 2e-5, f"rank {rank} {case_name} {key} vs open_clip")
            for key in ("grad_scale", "grad_bias"):
                torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_known_sizes_skip_the_exchange_with_identical_results(world: int) -> None:
    for rank, res in enumerate(_world_results(world)):
        assert res["known_sizes"], "no uneven case ran with known sizes"
        for name, got in res["known_sizes"].items():
            exchanged = res["cases"][name]
            for key, value in exchanged.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(got[key], value), (rank, name, key)


@pytest.mark.parametrize("world", [w for w in WORLD_SIZES if w > 1])
def test_bad_input_on_one_rank_raises_on_every_rank(world: int) -> None:
    for rank, res in enumerate(_world_results(world)):
        errors = res["errors"]
        for mode in MODES:
            msg = errors[f"nonfinite-{mode}"]
            assert msg is not None and f"rank(s) [{world - 1}]" in msg, f"rank {rank}, {mode}: {msg}"
        assert errors["dim"] is not None and "differ across ranks" in errors["dim"], f"rank {rank}"


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
    image, text = _inputs(case, 5)  # 35 rows, one process
    got = _single(mode, image, text, case.scale, case.bias, chunk=case.chunk)
    ref = siglip_reference(image, text, case.scale, case.bias)
    _assert_matches_reference(got, ref, case)
    metrics = got["metrics"]
    assert set(metrics) == {"acc_i2t", "acc_t2i"}
    torch.testing.assert_close(metrics["acc_i2t"].double(), ref["acc_i2t"], rtol=0, atol=1e-6)
    torch.testing.assert_close(metrics["acc_t2i"].double(), ref["acc_t2i"], rtol=0, atol=1e-6)
    # without a bias the loss is the one at b = 0, and no bias gradient is asked for
    nobias = _single(mode, image, text, case.scale, None, chunk=case.chunk)
    _assert_matches_reference(nobias, siglip_reference(image, text, case.scale, 0.0), Case(mode, "float32", bias=None))


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
    gen = torch.Generator().manual_seed(4)
    image = F.normalize(torch.randn(rows, dim, generator=gen), dim=1)
    text = F.normalize(torch.randn(rows, dim, generator=gen), dim=1)
    largest = {}
    for mode in ("plain", "chunked"):
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        scale, bias = torch.tensor(10.0, requires_grad=True), torch.tensor(-10.0, requires_grad=True)
        with LargestTensor() as probe:
            SigLipLoss(mode=mode, chunk_size=chunk)(x, y, scale, bias).loss.backward()
        largest[mode] = probe.largest
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
    _assert_matches_reference(got, ref, Case(mode, "float32"))
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
    image, text = _inputs(Case("plain", "float32"), 2)
    for mode in MODES:
        a = _single(mode, image, text, 10.0, -10.0)
        b = _single(mode, image, text, 10.0, -5.0)
        assert not torch.allclose(a["loss"], b["loss"]) and a["grad_bias"].abs() > 0.1
    clip_loss, _ = ClipLoss()(image, text, torch.tensor(10.0), torch.tensor(-10.0))
    assert not torch.allclose(clip_loss.double(), a["loss"])


def test_input_errors() -> None:
    x = F.normalize(torch.randn(4, 8), dim=1)
    s, b = torch.tensor(10.0), torch.tensor(-10.0)
    with pytest.raises(ValueError, match="unknown SigLipLoss mode"):
        SigLipLoss(mode="fused")
    with pytest.raises(ValueError, match="chunk_size"):
        SigLipLoss(mode="chunked", chunk_size=0)
    for mode in MODES:
        loss_fn = SigLipLoss(mode=mode)
        with pytest.raises(ValueError, match=r"\(M, D\)"):
            loss_fn(x, x[:3], s, b)
        with pytest.raises(ValueError, match="dtype"):
            loss_fn(x, x.double(), s, b)
        with pytest.raises(ValueError, match="single value"):
            loss_fn(x, x, torch.ones(2), b)
        with pytest.raises(ValueError, match="single value"):
            loss_fn(x, x, s, torch.zeros(3))
        with pytest.raises(ValueError, match="empty"):
            loss_fn(x[:0], x[:0], s, b)
        with pytest.raises(ValueError, match="sizes"):
            loss_fn(x, x, s, b, sizes=[3])
        bad = x.clone()
        bad[1, 2] = float("inf")
        with pytest.raises(ValueError, match="non-finite"):
            loss_fn(bad, x, s, b)
        with pytest.raises(ValueError, match="non-finite"):
            loss_fn(x, x, torch.tensor(float("nan")), b)
        with pytest.raises(ValueError, match="non-finite"):
            loss_fn(x, x, s, torch.tensor(float("inf")))
