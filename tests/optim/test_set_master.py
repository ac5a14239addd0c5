"""``SRAdamW.set_master``: a parameter's float32 master seeded from a float32 value, against the definition.

The definition: a mastered group's update is the float32 update of its master, which is what SRAdamW does
to a float32 parameter with float32 statistics. So after ``set_master(p, w)`` the optimizer's master must
be ``w`` bit for bit, the parameter the rounding of ``w`` its form prescribes (split: the high half,
nearest with ties away from zero; a float32 master: nearest even), and every later step's master the
float32 parameter's that started from ``w``, on the eager path and the CPU kernel (with its step plans).
"""

from __future__ import annotations

import pytest
import torch

from optim import SRAdamW, _cpu_kernel
from optim.master16 import split_master

from .sr_reference import assert_same_bits

_KERNEL_BUILDS = _cpu_kernel.available  # before the conftest fixture replaces it


def _values(n: int, seed: int) -> torch.Tensor:
    """float32 values that no half format holds: random ones, exact bfloat16 ties (low half 0x8000, where
    the split high half and torch's round-to-nearest-even differ), values next to powers of two, tiny ones."""
    g = torch.Generator().manual_seed(seed)
    rand = torch.randn(n, generator=g) * 0.05
    ties = ((torch.randn(n, generator=g) * 0.05).view(torch.int32) & ~0xFFFF | 0x8000).view(torch.float32)
    pow2 = torch.exp2(torch.randint(-12, 4, (n,), generator=g).float()) * (1 - 2.0**-20 * torch.rand(n, generator=g))
    tiny = torch.randn(n, generator=g) * 1e-6
    return torch.cat([rand, ties, pow2, tiny])


def _grads(n: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g).to(torch.bfloat16) for _ in range(steps)]


ROUTES = {  # parameter dtype, group settings
    "bf16 split": (torch.bfloat16, {"master_weights": True}),
    "bf16 fp32 master": (torch.bfloat16, {"master_weights": True, "master_format": "fp32"}),
    "fp16": (torch.float16, {"master_weights": True}),
}


def _kernel(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "cpu kernel" and not _KERNEL_BUILDS():
        pytest.skip(f"the CPU kernel cannot be built here: {_cpu_kernel.unavailable_reason()}")
    monkeypatch.setattr(_cpu_kernel, "available", lambda: path == "cpu kernel")  # conftest forces eager otherwise


@pytest.mark.parametrize("path", ["eager", "cpu kernel"])
@pytest.mark.parametrize("route", list(ROUTES))
def test_a_seeded_master_is_the_value_and_steps_as_the_float32_parameter(
    route: str, path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _kernel(path, monkeypatch)
    dtype, settings = ROUTES[route]
    w = _values(250, seed=1)
    if dtype == torch.float16:
        w = w.clamp(-60000, 60000)
    grads = _grads(w.numel(), 6, seed=2)
    hp = dict(lr=3e-3, weight_decay=0.1, state_dtype=torch.float32)
    # the reference: a float32 parameter starting from w
    ref = torch.nn.Parameter(w.clone())
    ref_opt = SRAdamW([ref], **hp)
    # the parameter as a run built it (its cast, not yet its master), and another, SR, group
    p = torch.nn.Parameter(w.to(dtype))
    sr = torch.nn.Parameter(torch.randn(8).to(dtype))
    opt = SRAdamW([{"params": [sr]}, {"params": [p], **settings}], **hp)
    opt.set_master(p, w.view(10, -1))  # any shape with p's elements
    assert_same_bits(opt.master(p), w, "the master after set_master")
    st = opt.state[p]
    assert int(st["step"]) == 0 and not st["exp_avg"].any() and not st["exp_avg_sq"].any()
    assert ("master_low" in st) == (route == "bf16 split") and ("master" in st) == (route != "bf16 split")
    want = split_master(w)[0] if route == "bf16 split" else w.to(dtype)
    assert_same_bits(p.detach(), want, "the weight after set_master")
    if route == "bf16 split":  # the ties: what the split form needs and the plain cast does not give
        assert not torch.equal(p.detach(), w.to(dtype))
    assert sr not in opt.state  # nothing else was touched
    for t, g in enumerate(grads):
        p.grad, sr.grad, ref.grad = g.to(dtype), torch.ones_like(sr), g.float()
        opt.step()
        ref_opt.step()
        assert_same_bits(opt.master(p), ref.detach(), f"{route}, {path}: master at step {t + 1}")
    assert int(opt.state[p]["step"]) == len(grads)


@pytest.mark.parametrize("path", ["eager", "cpu kernel"])
def test_set_master_mid_run_replaces_the_master_and_keeps_the_statistics(path: str, monkeypatch) -> None:
    """After steps (on the CPU kernel a step plan holds the state tensors' addresses): the new master is
    stepped from, the statistics, step count and noise index are kept."""
    _kernel(path, monkeypatch)
    w0, w1 = _values(100, seed=3), _values(100, seed=4)
    grads = _grads(w0.numel(), 4, seed=5)
    p = torch.nn.Parameter(w0.to(torch.bfloat16))
    opt = SRAdamW([p], lr=1e-3, weight_decay=0.0, state_dtype=torch.float32, master_weights=True)
    for g in grads[:2]:
        p.grad = g.clone()
        opt.step()
    ref = torch.nn.Parameter(w1.clone())
    ref_opt = SRAdamW([ref], lr=1e-3, weight_decay=0.0, state_dtype=torch.float32)
    before = {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items() if k != "master_low"}
    ref_opt.load_state_dict({"state": {0: dict(before)}, "param_groups": [{**ref_opt.param_groups[0], "params": [0]}]})
    opt.set_master(p, w1)
    assert_same_bits(opt.master(p), w1)
    for k, v in before.items():
        assert torch.equal(torch.as_tensor(opt.state[p][k]), torch.as_tensor(v)), k
    for t, g in enumerate(grads[2:]):
        p.grad, ref.grad = g.clone(), g.float()
        opt.step()
        ref_opt.step()
        assert_same_bits(opt.master(p), ref.detach(), f"{path}: step {t + 3}")


def test_a_float32_parameter_is_its_own_master_and_errors_are_named() -> None:
    f = torch.nn.Parameter(torch.zeros(5))
    h = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
    opt = SRAdamW([{"params": [f]}, {"params": [h]}])  # no master_weights
    w = torch.randn(5)
    opt.set_master(f, w)
    assert_same_bits(f.detach(), w)
    with pytest.raises(ValueError, match="without master_weights keeps no master"):
        opt.set_master(h, w)
    with pytest.raises(ValueError, match="not a parameter of this optimizer"):
        opt.set_master(torch.nn.Parameter(torch.zeros(5)), w)
    with pytest.raises(ValueError, match="must be float32 with as many elements"):
        opt.set_master(f, w.double())
    with pytest.raises(ValueError, match="must be float32 with as many elements"):
        opt.set_master(f, torch.zeros(4))
