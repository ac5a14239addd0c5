"""No host synchronisation in a steady-state loss step (issue 17).

A loss module reads the exchanged batch sizes (and the non-finite check) on the host only on its first
call and when every rank's local batch shape changes (:mod:`recipe.loss.inputs`); afterwards a forward
and backward of :class:`~recipe.loss.ClipLoss` and :class:`~recipe.loss.SigLipLoss` reads nothing on
the host. On the CPU this is checked by counting every Python-level host read of a tensor
(``item``, ``tolist``, ``__bool__``, ``__float__``, ``__int__``, ``__index__``, ``numpy``) and the
host-read path of the size exchange, at world size 1 and on two gloo ranks; on CUDA by running the
steady step under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from recipe.loss import ClipLoss, SigLipLoss
from recipe.loss import gather as gather_mod
from recipe.loss import inputs as inputs_mod

from ...dist_utils import run_distributed

_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__", "numpy")


@contextlib.contextmanager
def count_host_reads():
    """Counts host reads of tensors and calls of the size exchange's host-read paths."""
    counts: Counter = Counter()
    saved = {name: getattr(torch.Tensor, name) for name in _READS}

    def wrap(name, fn):
        @functools.wraps(fn)
        def counted(self, *args, **kwargs):
            counts[name] += 1
            return fn(self, *args, **kwargs)

        return counted

    check_table, exchange_sizes = inputs_mod._check_table, gather_mod._exchange_sizes
    try:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, wrap(name, fn))
        inputs_mod._check_table = wrap("size table read", check_table)
        gather_mod._exchange_sizes = wrap("size exchange", exchange_sizes)
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        inputs_mod._check_table, gather_mod._exchange_sizes = check_table, exchange_sizes


def _features(rows: int, dim: int = 16, seed: int = 0, dtype: torch.dtype = torch.float32):
    gen = torch.Generator().manual_seed(seed)
    image = F.normalize(torch.randn(rows, dim, generator=gen), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(rows, dim, generator=gen), dim=1)
    return image.to(dtype), text.to(dtype)


def _losses(validate: bool) -> dict:
    return {
        "clip-plain": ClipLoss(mode="plain", validate=validate),
        "clip-chunked": ClipLoss(mode="chunked", chunk_size=5, validate=validate),
        "siglip-plain": SigLipLoss(mode="plain", validate=validate),
        "siglip-chunked": SigLipLoss(mode="chunked", chunk_size=5, validate=validate),
    }


def _step(loss_fn, image, text, scale, bias, sizes=None) -> tuple[torch.Tensor, ...]:
    """One forward + backward; returns the loss and the gradients (detached)."""
    x, y = image.clone().requires_grad_(), text.clone().requires_grad_()
    scale.grad = None
    if bias is not None:
        bias.grad = None
    kwargs = {} if sizes is None else {"sizes": sizes}
    if isinstance(loss_fn, SigLipLoss):
        loss, metrics = loss_fn(x, y, scale, bias, **kwargs)
    else:
        loss, metrics = loss_fn(x, y, scale, **kwargs)
    loss.backward()
    return loss.detach(), x.grad, y.grad, scale.grad.clone(), metrics["acc_i2t"], metrics["acc_t2i"]


@pytest.mark.parametrize("validate", [True, False])
def test_world_size_1_steady_step_reads_nothing_on_the_host(validate: bool) -> None:
    image, text = _features(13)
    scale = torch.tensor(20.0, requires_grad=True)
    bias = torch.tensor(-5.0, requires_grad=True)
    for name, loss_fn in _losses(validate).items():
        with count_host_reads() as first_counts:  # the first call validates on the host
            first = _step(loss_fn, image, text, scale, bias)
        assert (first_counts["__bool__"] == 1) == validate, (name, dict(first_counts))  # the counter works
        with count_host_reads() as counts:
            steady = [_step(loss_fn, image, text, scale, bias) for _ in range(2)]
        assert sum(counts.values()) == 0, (name, dict(counts))
        for got in steady:
            for a, b in zip(got, first):
                assert torch.equal(a, b), name
        # a new shape is validated again on the host, once
        reads = loss_fn._size_cache.host_reads
        _step(loss_fn, image[:9], text[:9], scale, bias)
        _step(loss_fn, image[:9], text[:9], scale, bias)
        assert loss_fn._size_cache.host_reads == reads + (1 if validate else 0), name


def test_world_size_1_non_finite_input_in_the_steady_state_still_raises() -> None:
    image, text = _features(8)
    scale = torch.tensor(20.0, requires_grad=True)
    bias = torch.tensor(-5.0, requires_grad=True)
    for loss_fn in _losses(True).values():
        _step(loss_fn, image, text, scale, bias)
        bad = image.clone()
        bad[3, 1] = float("nan")
        # the device-side check: RuntimeError at once on the CPU (ValueError on a first call)
        with pytest.raises(RuntimeError, match="non-finite"):
            _step(loss_fn, bad, text, scale, bias)
        with pytest.raises(ValueError, match="non-finite"):
            _step(type(loss_fn)(mode=loss_fn.mode), bad, text, scale, bias)


# --------------------------------------------------------------------------------------------------
# Two gloo ranks
# --------------------------------------------------------------------------------------------------

SIZES = (5, 9)
CHANGED = (4, 6)  # every rank's size changes in the same call: one host read, then steady again


def _outcome(fn) -> str:
    try:
        fn()
        return "ok"
    except ValueError as err:
        return f"ValueError: {err}"
    except RuntimeError as err:
        return f"RuntimeError: {err}"


def _two_rank_worker(rank: int, world: int) -> dict:
    out: dict = {}
    scale = torch.tensor(14.0, requires_grad=True)
    bias = torch.tensor(-3.0, requires_grad=True)
    for validate in (True, False):
        for name, loss_fn in _losses(validate).items():
            key = f"{name}-validate{int(validate)}"
            res: dict = {}
            image, text = _features(SIZES[rank], seed=rank)
            with count_host_reads() as counts:
                first = _step(loss_fn, image, text, scale, bias)
            res["first_reads"] = dict(counts)
            with count_host_reads() as counts:
                steady = [_step(loss_fn, image, text, scale, bias) for _ in range(2)]
            res["steady_reads"] = dict(counts)
            res["steady_same"] = all(torch.equal(a, b) for got in steady for a, b in zip(got, first))
            reads = loss_fn._size_cache.host_reads
            image2, text2 = _features(CHANGED[rank], seed=10 + rank)
            changed = _step(loss_fn, image2, text2, scale, bias)
            fresh = _step(type(loss_fn)(mode=loss_fn.mode, chunk_size=loss_fn.chunk_size), image2, text2, scale, bias)
            res["changed_reads"] = loss_fn._size_cache.host_reads - reads
            res["changed_matches_fresh"] = all(torch.equal(a, b) for a, b in zip(changed, fresh))
            with count_host_reads() as counts:
                _step(loss_fn, image2, text2, scale, bias)
            res["steady_again_reads"] = dict(counts)
            # only rank 1's size changes: every rank fails instead of using stale sizes
            image3, text3 = (image2, text2) if rank == 0 else _features(3, seed=20)
            res["one_rank_changed"] = _outcome(functools.partial(_step, loss_fn, image3, text3, scale, bias))
            # declared sizes: the caller's list is the cache key
            declared = functools.partial(_step, loss_fn, image2, text2, scale, bias, sizes=list(CHANGED))
            res["declared"] = _outcome(declared)
            if validate:  # a non-finite input on rank 1 in the steady state: every rank fails
                bad = image2.clone()
                if rank == 1:
                    bad[0, 0] = float("inf")
                nonfinite = functools.partial(_step, loss_fn, bad, text2, scale, bias, sizes=list(CHANGED))
                res["nonfinite_steady"] = _outcome(nonfinite)
            out[key] = res
    # without the cache every call reads the sizes: one rank may change alone
    for cls in (ClipLoss, SigLipLoss):
        loss_fn = cls(mode="chunked", chunk_size=5, cache_sizes=False)
        image, text = _features(SIZES[rank], seed=rank)
        _step(loss_fn, image, text, scale, bias)
        image3, text3 = (image, text) if rank == 0 else _features(3, seed=20)
        got = _step(loss_fn, image3, text3, scale, bias)
        fresh = _step(cls(mode="chunked", chunk_size=5), image3, text3, scale, bias)
        out[f"uncached-{cls.__name__}"] = all(torch.equal(a, b) for a, b in zip(got, fresh))
    return out


@functools.cache
def _two_rank_results() -> list[dict]:
    return run_distributed(_two_rank_worker, 2, timeout_s=240)


def _cached(results: dict) -> dict:
    return {k: v for k, v in results.items() if not k.startswith("uncached")}


def test_two_ranks_without_the_cache_one_rank_may_change_alone() -> None:
    for rank, results in enumerate(_two_rank_results()):
        for cls in ("ClipLoss", "SigLipLoss"):
            assert results[f"uncached-{cls}"], (rank, cls)


def test_two_ranks_steady_step_reads_nothing_on_the_host() -> None:
    for rank, results in enumerate(_two_rank_results()):
        for key, res in _cached(results).items():
            where = f"rank {rank}, {key}"
            # the first call reads the exchanged table on the host (and the counter sees it)
            assert res["first_reads"].get("size table read") == 1, (where, res["first_reads"])
            assert res["first_reads"].get("tolist") == 1, (where, res["first_reads"])
            assert res["steady_reads"] == {}, (where, res["steady_reads"])
            assert res["steady_same"], where
            assert res["steady_again_reads"] == {}, (where, res["steady_again_reads"])


def test_two_ranks_sizes_changing_everywhere_are_exchanged_again() -> None:
    for rank, results in enumerate(_two_rank_results()):
        for key, res in _cached(results).items():
            assert res["changed_reads"] == 1, (rank, key, res["changed_reads"])
            assert res["changed_matches_fresh"], (rank, key)
            assert res["declared"] == "ok", (rank, key, res["declared"])


def test_two_ranks_size_changing_on_one_rank_fails_on_every_rank() -> None:
    for rank, results in enumerate(_two_rank_results()):
        for key, res in _cached(results).items():
            got = res["one_rank_changed"]
            if rank == 0:  # kept its size: its device-side check fails
                assert got.startswith("RuntimeError") and "sizes=" in got, (key, got)
            else:  # changed: reads the table and sees a rank on stale sizes
                assert got.startswith("ValueError") and "some ranks only" in got, (key, got)
            if "nonfinite_steady" in res:
                got = res["nonfinite_steady"]
                assert got.startswith("RuntimeError") and "not finite" in got, (rank, key, got)


# --------------------------------------------------------------------------------------------------
# CUDA
# --------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_steady_step_has_no_sync(dtype: torch.dtype) -> None:
    """Forward + backward after a warm-up call under ``set_sync_debug_mode("error")``."""
    device = torch.device("cuda")
    image, text = (t.to(device) for t in _features(300, dim=64, dtype=dtype))
    scale = torch.tensor(30.0, device=device, requires_grad=True)
    bias = torch.tensor(-5.0, device=device, requires_grad=True)
    losses = {
        "clip-plain": ClipLoss(mode="plain"),
        "clip-chunked": ClipLoss(mode="chunked", chunk_size=128),
        "clip-fused": ClipLoss(mode="fused", chunk_size=128),
        "siglip-plain": SigLipLoss(mode="plain"),
        "siglip-chunked": SigLipLoss(mode="chunked", chunk_size=128),
    }
    checked = []
    for name, loss_fn in losses.items():
        try:
            first = _step(loss_fn, image, text, scale, bias)
        except Exception as err:  # Triton missing or not compiling here
            if name == "clip-fused":
                continue
            raise AssertionError(f"{name}: warm-up failed: {err}") from err
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            steady = _step(loss_fn, image, text, scale, bias)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        for a, b in zip(steady, first):
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
        checked.append(name)
    assert {"clip-plain", "clip-chunked", "siglip-plain", "siglip-chunked"} <= set(checked), checked
