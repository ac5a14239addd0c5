"""Shared by the sharded-loss tests (test_clip.py, test_siglip.py, test_fused.py).

The multi-rank harness: a :class:`Case` (one configuration checked on every world size), its inputs,
one rank's run of a loss with the data-parallel mean of what it returns, the checks that every rank
raises the same error on one rank's bad input, and the checks on the collected results; and the
allocation probe of the modes that must not build the logit block. Each test module keeps its own
cases, reference and worker (the worker must be a module-level function of an importable module).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import zlib
from types import ModuleType
from typing import Callable, Iterable

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from recipe.loss import LossResult

from ...clip_reference import LargestTensor, assert_grad_close

DIM = 16
WORLD_SIZES = (1, 2, 4)
EQUAL_ROWS = 7  # per rank; the chunk sizes of the cases do not divide it nor the gathered batch
UNEVEN_ROWS = (5, 9, 3, 8)
TOLERANCES = {  # dtype: (loss rtol, feature-grad tol relative to max |ref|, scale(/bias)-grad rtol)
    "float32": (1e-5, 2e-5, 1e-4),
    "bfloat16": (1e-5, 1.5e-2, 1e-4),
    "float16": (1e-5, 3e-3, 1e-4),
}


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration checked on every world size (a loss's module may subclass it for its own
    defaults and bias label; the name seeds the inputs)."""

    mode: str
    dtype: str
    chunk: int = 4096
    scale: float = 14.3
    bias: float | None = None
    uneven: bool = False

    @property
    def bias_label(self) -> str:
        return "bias" if self.bias is not None else ""

    @property
    def name(self) -> str:
        parts = [self.mode, self.dtype, f"c{self.chunk}" if self.mode == "chunked" else "", f"s{self.scale:g}"]
        parts += [self.bias_label, "uneven" if self.uneven else ""]
        return "-".join(p for p in parts if p)

    def sizes(self, world: int) -> list[int]:
        return list(UNEVEN_ROWS[:world]) if self.uneven else [EQUAL_ROWS] * world


def cases_for(cases: Iterable[Case], world: int) -> list[Case]:
    """The cases a world size runs (uneven batches need two ranks at least)."""
    return [c for c in cases if not (c.uneven and world == 1)]


def inputs(case: Case, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-batch features, rounded to the case dtype (same on every process)."""
    gen = torch.Generator().manual_seed(zlib.crc32(f"{case.name}/{world}".encode()))
    total = sum(case.sizes(world))
    image = F.normalize(torch.randn(total, DIM, generator=gen, dtype=torch.float64), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(total, DIM, generator=gen, dtype=torch.float64), dim=1)
    dtype = getattr(torch, case.dtype)
    return image.to(dtype), text.to(dtype)


def open_clip_loss_module() -> ModuleType | None:
    """open_clip's ``loss.py`` loaded on its own, or None when open_clip_torch is not installed.

    The module only imports torch; loading it by path skips the package ``__init__`` (timm, models,
    tokenizers: seconds per spawned rank) while running the installed open_clip code unchanged.
    """
    spec = importlib.util.find_spec("open_clip")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "loss.py")
    loss_spec = importlib.util.spec_from_file_location("_open_clip_loss_under_test", path)
    module = importlib.util.module_from_spec(loss_spec)
    loss_spec.loader.exec_module(module)
    return module


def dp_mean(t: torch.Tensor) -> torch.Tensor:
    """Data-parallel mean over ranks, as DeepSpeed/DDP average gradients (computed in float64)."""
    t = t.detach().double().clone()
    dist.all_reduce(t)
    return t / dist.get_world_size()


def run_case(
    loss_fn,
    case: Case,
    rank: int,
    world: int,
    known_sizes: bool = False,
    *,
    param_shape: tuple[int, ...] = (),
    unused_bias: bool = False,
    details: bool = False,
) -> dict:
    """One rank's share of ``case`` through ``loss_fn`` (ours or open_clip's), backward, and the
    data-parallel means of the loss and the gradients of the replicated full-batch leaves.

    ``param_shape``: the shape of the logit scale and bias tensors; ``unused_bias``: a loss may leave
    the bias without a gradient (counted as zero); ``details``: also the rank's own loss share, the
    scale gradient's shape and the metric keys and whether any metric requires a gradient.
    """
    image_full, text_full = (t.clone().requires_grad_() for t in inputs(case, world))
    sizes = case.sizes(world)
    lo = sum(sizes[:rank])
    rows = slice(lo, lo + sizes[rank])
    scale = torch.full(param_shape, case.scale, requires_grad=True)
    bias = None if case.bias is None else torch.full(param_shape, case.bias, requires_grad=True)
    kwargs = {"sizes": sizes} if known_sizes else {}
    out = loss_fn(image_full[rows], text_full[rows], scale, bias, **kwargs)
    metrics = None
    if isinstance(out, LossResult):
        out, metrics = out
    elif isinstance(out, dict):  # open_clip with output_dict
        out = out["contrastive_loss"]
    out.backward()
    result = {
        "loss": dp_mean(out),
        "loss_dtype": out.dtype,
        "grad_image": dp_mean(image_full.grad),
        "grad_text": dp_mean(text_full.grad),
        "grad_scale": dp_mean(scale.grad),
        "grad_dtype": image_full.grad.dtype,
    }
    if details:
        result["rank_loss"] = out.detach().clone()
        result["grad_scale_shape"] = scale.grad.shape
    if bias is not None:
        missing = unused_bias and bias.grad is None
        result["grad_bias"] = dp_mean(torch.zeros(param_shape) if missing else bias.grad)
    if metrics is not None:
        if details:
            result["metric_keys"] = sorted(metrics)
            result["metrics_grad"] = any(v.requires_grad for v in metrics.values())
        result["acc_i2t"] = dp_mean(metrics["acc_i2t"])
        result["acc_t2i"] = dp_mean(metrics["acc_t2i"])
    return result


def run_cases(
    rank: int,
    world: int,
    loss_cls: type,
    cases: Iterable[Case],
    open_clip_loss: Callable[[ModuleType, Case, int, int], object | None],
    **run_kwargs,
) -> dict:
    """Every case of this world size through ``loss_cls``, again with the sizes known to the caller
    for the uneven ones (world > 1), and through open_clip's loss where ``open_clip_loss(module,
    case, rank, world)`` gives one (``"open_clip"`` is None without open_clip)."""
    results: dict = {"cases": {}, "known_sizes": {}, "open_clip": {}}
    for case in cases_for(cases, world):
        loss_fn = loss_cls(mode=case.mode, chunk_size=case.chunk)
        results["cases"][case.name] = run_case(loss_fn, case, rank, world, **run_kwargs)
        if world > 1 and case.uneven:  # sizes known to the caller: no exchange, same result
            known = loss_cls(mode=case.mode, chunk_size=case.chunk, validate=False)
            results["known_sizes"][case.name] = run_case(known, case, rank, world, known_sizes=True, **run_kwargs)
    module = open_clip_loss_module()
    if module is None:
        results["open_clip"] = None
    else:
        for case in cases_for(cases, world):
            theirs = open_clip_loss(module, case, rank, world)
            if theirs is not None:
                results["open_clip"][case.name] = run_case(theirs, case, rank, world, **run_kwargs)
    return results


def error_checks(rank: int, world: int, loss_cls: type, modes: Iterable[str], *params: torch.Tensor) -> dict:
    """Every rank must raise the same ValueError when one rank's inputs are bad (a non-finite
    feature on the last rank per mode, a feature size that differs on rank 0); ``params`` follow the
    logit scale 10 in the loss call (SigLIP's bias)."""
    messages = {}
    image, text = inputs(Case("plain", "float32"), world)
    rows = slice(rank * EQUAL_ROWS, (rank + 1) * EQUAL_ROWS)
    for mode in modes:
        x = image[rows].clone()
        if rank == world - 1:
            x[0, 0] = float("nan")
        try:
            loss_cls(mode=mode)(x, text[rows], torch.tensor(10.0), *params)
            messages[f"nonfinite-{mode}"] = None
        except ValueError as err:
            messages[f"nonfinite-{mode}"] = str(err)
    dim = DIM if rank else DIM // 2
    try:
        loss_cls()(image[rows, :dim], text[rows, :dim], torch.tensor(10.0), *params)
        messages["dim"] = None
    except ValueError as err:
        messages["dim"] = str(err)
    return messages


# --------------------------------------------------------------------------------------------------
# Checks on the results
# --------------------------------------------------------------------------------------------------


def assert_matches_reference(got: dict, ref: dict, case: Case, bias_tol: tuple[float, float] | None = None) -> None:
    """Loss, feature, scale and (with a bias) bias gradients within :data:`TOLERANCES`; ``bias_tol``
    (rtol, atol) replaces the bias gradient's (scale rtol, 1e-7)."""
    loss_rtol, grad_tol, scalar_rtol = TOLERANCES[case.dtype]
    torch.testing.assert_close(got["loss"], ref["loss"], rtol=loss_rtol, atol=1e-7)
    assert_grad_close(got["grad_image"], ref["grad_image"], grad_tol, "image grad")
    assert_grad_close(got["grad_text"], ref["grad_text"], grad_tol, "text grad")
    torch.testing.assert_close(got["grad_scale"].reshape(()), ref["grad_scale"], rtol=scalar_rtol, atol=1e-7)
    if case.bias is not None:
        rtol, atol = (scalar_rtol, 1e-7) if bias_tol is None else bias_tol
        torch.testing.assert_close(got["grad_bias"].reshape(()), ref["grad_bias"], rtol=rtol, atol=atol)


def check_cases(
    results: list[dict],
    world: int,
    cases: Iterable[Case],
    reference: Callable[[Case, int], dict],
    *,
    bias_tol: tuple[float, float] | None = None,
    extra: Callable[[dict, dict, Case], None] | None = None,
) -> list[dict]:
    """Rank 0's data-parallel means of every case against ``reference(case, world)`` (with
    ``extra(got, ref, case)`` checks), fp32 loss, gradients in the input dtype, the accuracies, and
    the same loss on every rank; returns the references (for the caller's informativeness check)."""
    refs = []
    for case in cases_for(cases, world):
        ref = reference(case, world)
        got = results[0]["cases"][case.name]
        try:
            assert_matches_reference(got, ref, case, bias_tol)
            assert got["loss_dtype"] == torch.float32
            assert got["grad_dtype"] == getattr(torch, case.dtype)
            if extra is not None:
                extra(got, ref, case)
            # accuracies: the mean over ranks of each rank's share is the full-batch accuracy
            torch.testing.assert_close(got["acc_i2t"], ref["acc_i2t"], rtol=0, atol=1e-6)
            torch.testing.assert_close(got["acc_t2i"], ref["acc_t2i"], rtol=0, atol=1e-6)
        except AssertionError as err:
            raise AssertionError(f"world {world}, case {case.name}: {err}") from err
        for other in results[1:]:  # the data-parallel mean is the same on every rank
            torch.testing.assert_close(other["cases"][case.name]["loss"], got["loss"], rtol=0, atol=0)
        refs.append(ref)
    return refs


def assert_matches_open_clip(ours: dict, theirs: dict, what: str, scalar_keys: Iterable[str]) -> None:
    """Our loss and feature gradients against open_clip's (rtol 1e-5, 2e-5), and ``scalar_keys``
    (rtol 1e-4)."""
    torch.testing.assert_close(ours["loss"], theirs["loss"], rtol=1e-5, atol=1e-7)
    for key in ("grad_image", "grad_text"):
        assert_grad_close(ours[key], theirs[key], 2e-5, f"{what} {key} vs open_clip")
    for key in scalar_keys:
        torch.testing.assert_close(ours[key], theirs[key], rtol=1e-4, atol=1e-7)


def check_known_sizes(results: list[dict]) -> None:
    """Known sizes skip the exchange with identical results: every tensor bit for bit."""
    for rank, res in enumerate(results):
        assert res["known_sizes"], "no uneven case ran with known sizes"
        for name, got in res["known_sizes"].items():
            exchanged = res["cases"][name]
            for key, value in exchanged.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(got[key], value), (rank, name, key)


def check_errors(results: list[dict], world: int, modes: Iterable[str]) -> None:
    """Bad input on the last rank raised, on every rank, an error naming it; so did the differing size."""
    for rank, res in enumerate(results):
        errors = res["errors"]
        for mode in modes:
            msg = errors[f"nonfinite-{mode}"]
            assert msg is not None and f"rank(s) [{world - 1}]" in msg, f"rank {rank}, {mode}: {msg}"
        assert errors["dim"] is not None and "differ across ranks" in errors["dim"], f"rank {rank}"


# --------------------------------------------------------------------------------------------------
# Single process
# --------------------------------------------------------------------------------------------------


def largest_tensors(
    loss_cls: type,
    modes: Iterable[str],
    rows: int,
    dim: int,
    chunk: int,
    seed: int,
    scale: float,
    bias: float | None = None,
) -> dict[str, int]:
    """Per mode, the largest tensor (bytes) one forward and backward of ``loss_cls`` produces on
    ``rows`` random unit features (a bias parameter only where ``bias`` is given)."""
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(rows, dim, generator=gen), dim=1)
    text = F.normalize(torch.randn(rows, dim, generator=gen), dim=1)
    largest = {}
    for mode in modes:
        x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
        params = [torch.tensor(scale, requires_grad=True)]
        if bias is not None:
            params.append(torch.tensor(bias, requires_grad=True))
        with LargestTensor() as probe:
            loss_cls(mode=mode, chunk_size=chunk)(x, y, *params).loss.backward()
        largest[mode] = probe.largest
    return largest


def check_input_errors(
    loss_cls: type, modes: Iterable[str], unknown_mode: str, bias: torch.Tensor | None = None
) -> None:
    """``loss_cls``'s ValueErrors: an unknown mode, a bad chunk size, and per mode mismatched shapes or
    dtypes, a scale or bias of several values, an empty batch, sizes of the wrong length, non-finite
    features or scale, and (with a ``bias`` passed on every call) a non-finite bias."""
    x = F.normalize(torch.randn(4, 8), dim=1)
    s = torch.tensor(10.0)
    b = () if bias is None else (bias,)
    with pytest.raises(ValueError, match=f"unknown {loss_cls.__name__} mode"):
        loss_cls(mode=unknown_mode)
    with pytest.raises(ValueError, match="chunk_size"):
        loss_cls(mode="chunked", chunk_size=0)
    for mode in modes:
        loss_fn = loss_cls(mode=mode)
        with pytest.raises(ValueError, match=r"\(M, D\)"):
            loss_fn(x, x[:3], s, *b)
        with pytest.raises(ValueError, match="dtype"):
            loss_fn(x, x.double(), s, *b)
        with pytest.raises(ValueError, match="single value"):
            loss_fn(x, x, torch.ones(2), *b)
        with pytest.raises(ValueError, match="single value"):
            loss_fn(x, x, s, torch.zeros(3))
        with pytest.raises(ValueError, match="empty"):
            loss_fn(x[:0], x[:0], s, *b)
        with pytest.raises(ValueError, match="sizes"):
            loss_fn(x, x, s, *b, sizes=[3])
        bad = x.clone()
        bad[1, 2] = float("inf")
        with pytest.raises(ValueError, match="non-finite"):
            loss_fn(bad, x, s, *b)
        with pytest.raises(ValueError, match="non-finite"):
            loss_fn(x, x, torch.tensor(float("nan")), *b)
        if bias is not None:
            with pytest.raises(ValueError, match="non-finite"):
                loss_fn(x, x, s, torch.tensor(float("inf")))
