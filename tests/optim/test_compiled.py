"""The compiled CPU path (``optim._compiled``, ``SRAdamW``'s default on CPU tensors) against the eager
definition, bit for bit, on every weight/state route; and it compiles once per route.

Each route is compiled once for the whole module (~10 s each on two cores).
"""

from __future__ import annotations

import pytest
import torch

from optim import SRAdamW, _compiled

from .sr_reference import assert_same_bits, assert_same_optimizer_bits, defer_skips

pytestmark = pytest.mark.skipif(not _compiled.available(), reason=f"no C++ compiler for torch.compile: "
                                f"{_compiled.unavailable_reason()}")


def params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(37, 11), (1000,), (3,), (1,)]
    return [torch.nn.Parameter((torch.randn(s, generator=g) * 0.5).to(dtype)) for s in shapes]


def grads(ps: list[torch.nn.Parameter], step: int, scale: float = 1.0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    out = [torch.randn(p.shape, generator=g) * scale for p in ps]
    out[0][0, :3] = 0.0  # zero gradients: zero second moments
    out[1][:50] *= 1e-6  # tiny ones: float16 subnormal states
    return out


ROUTES = {
    "bf16 weights, bf16 SR states": (torch.bfloat16, {}),
    "fp16 weights, fp16 scaled SR states": (torch.float16, {}),
    "bf16 weights, fp32 states": (torch.bfloat16, {"state_dtype": torch.float32}),
    "bf16 weights + fp32 master, bf16 SR states": (torch.bfloat16, {"master_weights": True}),
    "fp32": (torch.float32, {}),
    "bf16, nearest rounding": (torch.bfloat16, {"weight_rounding": "nearest", "state_rounding": "nearest"}),
    "bf16 clamped, fp16 states": (torch.bfloat16, {"state_dtype": torch.float16, "clamp": (-0.3, 0.3)}),
}


@pytest.mark.parametrize("route", list(ROUTES))
def test_compiled_equals_eager(route: str) -> None:
    dtype, kw = ROUTES[route][0], dict(ROUTES[route][1])
    clamp = kw.pop("clamp", None)
    ref_ps, ps = params(dtype), params(dtype)
    groups = lambda xs: [{"params": xs, **({"clamp": clamp} if clamp else {})}]  # noqa: E731
    ref = SRAdamW(groups(ref_ps), lr=1e-2, weight_decay=0.1, seed=3, fused=False, **kw)
    opt = SRAdamW(groups(ps), lr=1e-2, weight_decay=0.1, seed=3, **kw)
    assert opt._update_for(torch.device("cpu")) is _compiled.compiled_updates_
    for t in range(4):
        for a, b, g in zip(ref_ps, ps, grads(ps, t)):
            a.grad, b.grad = g.to(dtype), g.to(dtype)
        ref.step()
        opt.step()
        assert_same_optimizer_bits(ref, ref_ps, opt, ps, f"{route}, step {t}")


def test_loss_scale_skip_flag_and_noise_offsets() -> None:
    # A tensor grad scale and a device-style skip flag (masked stores), and ZeRO-style noise offsets
    # crossing 2**32 through the functional interface.
    ref_ps, ps = params(torch.float16, 1), params(torch.float16, 1)
    ref = defer_skips(SRAdamW(ref_ps, lr=1e-2, fused=False))
    opt = defer_skips(SRAdamW(ps, lr=1e-2))
    for t, found in enumerate([0.0, 1.0, 0.0]):
        for a, b, g in zip(ref_ps, ps, grads(ps, t, scale=1024.0)):
            a.grad, b.grad = g.half(), g.half()
        ref.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor(found))
        opt.step(grad_scale=torch.tensor([1024.0]), found_inf=torch.tensor(found))
        assert opt.skipped_steps == ref.skipped_steps
        assert_same_optimizer_bits(ref, ref_ps, opt, ps, f"step {t}")

    from optim.functional import TensorStep, apply_update_

    gen = torch.Generator().manual_seed(5)
    n = 3000
    tensors = [torch.randn(n, generator=gen).bfloat16() for _ in range(4)]
    for offset in ((1 << 32) - 1000, (1 << 40) + 17):
        a, b = [x.clone() for x in tensors], [x.clone() for x in tensors]
        kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, keys=(7, 8), index_offset=offset)
        apply_update_(TensorStep(*a, **kw), chunk_size=512)
        _compiled.compiled_updates_([TensorStep(*b, **kw)])
        for x, y in zip(a, b):
            assert_same_bits(x, y, f"offset {offset}")  # exp_avg_sq < 0 here: NaNs in the weights


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_one_compilation_per_route_serves_every_size_and_step(dtype: torch.dtype) -> None:
    """One graph per dtype route for every size and step: neither a 1-element tensor (Dynamo
    specialises length 1; CLIP's logit scale) nor the first real call after the route's priming
    (float16: two scale vectors, which the priming must not pass as one object) compiles again."""
    from torch._dynamo.utils import counters

    ps = [torch.nn.Parameter(torch.randn(n).to(dtype)) for n in (1, 5, 77, 4096)]
    opt = SRAdamW(ps, lr=1e-3)
    for p in ps:
        p.grad = torch.randn_like(p)
    before = counters["stats"]["unique_graphs"]
    opt.step()  # compiles this route, unless an earlier test did (sizes are dynamic: one graph)
    graphs = counters["stats"]["unique_graphs"]
    assert graphs - before <= 1, "the route compiled more than once"
    for _ in range(3):
        opt.step()
    assert counters["stats"]["unique_graphs"] == graphs, "recompiled on a later step"