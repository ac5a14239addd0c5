"""SRAdamW's step plans (optim/_plan.py): a step over the same tensors as the step before runs on a
cached plan instead of the general path. The plan must be invisible: every parameter and state bit,
every step counter and every skip count equal the general path's (``_use_plans = False``) on the C++
CPU kernel and on the Triton kernel (interpreted), over mixed groups, dtypes, masters, float16 scales,
gradient multipliers, skipped steps, missing gradients; and it must retire when what it cached may
have changed (a replaced or resized parameter, states loaded or written by hand, groups added or
re-specialised, non-contiguous gradients)."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from optim import SRAdamW, _cpu_kernel, _triton

from .sr_reference import assert_same_optimizer_bits, defer_skips

SHAPES = [(5, 7), (0,), (33,), (4, 4, 3), (1,), (300,)]

#: (param dtype, state dtype of group 0, master weights of group 0)
ROUTES = [
    (torch.bfloat16, torch.bfloat16, False),  # SR weights and states
    (torch.float16, torch.float16, False),  # scaled float16 statistics
    (torch.bfloat16, torch.float32, True),  # split exact master
    (torch.float16, None, True),  # float32 master, float16 statistics with scales
    (torch.float32, None, False),
    (torch.bfloat16, torch.float16, False),
]

#: what varies from step to step
CASES = {
    "plain": {},
    "float multiplier": {"gmul": "float"},
    "tensor multiplier, clamp": {"gmul": "tensor", "clamp": (-0.5, 0.5)},
    "missing gradients, NaN": {"none_every": 3, "nan_at": 4},
    "found_inf, no check": {"found_at": 5, "check": False},
    "deferred skips": {"defer": True, "nan_at": 3, "found_at": 6},
}


def kernel_routes() -> list:
    """The C++ CPU kernel, and the Triton kernel where it runs on CPU tensors (interpreted: the policy
    of optim._triton on a machine without CUDA; the ``gpu`` tests cover the compiled kernel)."""
    interp = False
    if _triton.is_available():
        from optim import triton_kernel

        interp = triton_kernel.interpreting()
    return [pytest.param("cpu", id="cpu-kernel"),
            pytest.param("triton", id="triton-interpreted", marks=pytest.mark.skipif(
                not interp, reason="Triton compiled for CUDA in this process: the gpu-marked tests cover it"))]


@pytest.fixture(autouse=True)
def cpu_kernel() -> None:
    if not _cpu_kernel.available():
        pytest.fail(f"the C++ CPU kernel is needed here: {_cpu_kernel.unavailable_reason()}")


def build(route: str, dtype: torch.dtype, state_dtype: torch.dtype | None, master: bool, case: dict,
          use_plans: bool) -> tuple[SRAdamW, list[torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    groups = [{"params": params[:3], "state_dtype": state_dtype, "master_weights": master},
              {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0, "clamp": case.get("clamp")}]
    opt = SRAdamW(groups, lr=1e-2, seed=3, fused=True if route == "triton" else None,
                  check_finite=case.get("check", True))
    opt._use_plans = use_plans
    if case.get("defer"):
        defer_skips(opt)
    return opt, params


def run(opt: SRAdamW, params: list[torch.nn.Parameter], case: dict, steps: int, start: int = 0) -> None:
    gen = torch.Generator().manual_seed(1 + start)
    for k in range(start, start + steps):
        for p in params:
            if case.get("none_every") and k % case["none_every"] == 1 and p is params[0]:
                p.grad = None
                continue
            p.grad = (torch.randn(p.shape, generator=gen) * (1e-3 if k % 2 else 10.0)).to(p.dtype)
            if k == case.get("nan_at") and p is params[2]:
                p.grad.view(-1)[0] = float("nan")
        for i, group in enumerate(opt.param_groups):
            group["lr"] = 1e-2 * (1 + k) / (1 + i)
        kw: dict = {}
        if case.get("gmul") == "float":
            kw["inv_grad_scale"] = 0.5
        elif case.get("gmul") == "tensor":
            kw["inv_grad_scale"] = torch.tensor(0.25)
        if k == case.get("found_at"):
            kw["found_inf"] = torch.tensor(1.0)
        opt.step(**kw)


def count_plan_steps(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    taken = []
    original = SRAdamW._plan_step

    def counting(self, *args, **kwargs):
        done = original(self, *args, **kwargs)
        taken.append(int(done))
        return done

    monkeypatch.setattr(SRAdamW, "_plan_step", counting)
    return taken


#: the interpreted Triton kernel is slow: on it, the cases that change the plan's bookkeeping
TRITON_CASES = ("plain", "missing gradients, NaN", "deferred skips")


@pytest.mark.parametrize("route, case", [pytest.param(r.values[0], c, id=f"{r.id}-{c}", marks=r.marks)
                                         for r in kernel_routes() for c in CASES
                                         if r.values[0] == "cpu" or c in TRITON_CASES])
@pytest.mark.parametrize("dtype, state_dtype, master", ROUTES)
def test_plans_give_the_general_paths_bits(route: str, dtype, state_dtype, master, case: str,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    spec = CASES[case]
    taken = count_plan_steps(monkeypatch)
    a, pa = build(route, dtype, state_dtype, master, spec, use_plans=True)
    b, pb = build(route, dtype, state_dtype, master, spec, use_plans=False)
    for k in range(8):
        run(a, pa, spec, 1, start=k)
        run(b, pb, spec, 1, start=k)
        assert_same_optimizer_bits(b, pb, a, pa, f"{case} step {k}")
        assert a.skipped_steps == b.skipped_steps
    assert sum(taken) >= 2, taken  # the plan did run (and the general path only where it must)


def test_a_plan_runs_every_steady_step_with_one_launch_per_specialisation(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = count_plan_steps(monkeypatch)
    calls = []
    real = _cpu_kernel.run
    monkeypatch.setattr(_cpu_kernel, "run", lambda table, launches, *a: (calls.append(len(launches)), real(table, launches, *a)))
    opt, params = build("cpu", torch.bfloat16, torch.bfloat16, False, {}, use_plans=True)
    run(opt, params, {}, 6)
    assert taken == [1] * 5 and calls[1:] == [1] * 5  # the first step leaves the plan; one kernel call each


def test_the_plan_retires_when_what_it_cached_changes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each change under a live plan: the next step takes the general path (no plan step), and the
    results stay the general path's bits."""
    taken = count_plan_steps(monkeypatch)
    a, pa = build("cpu", torch.bfloat16, torch.bfloat16, True, {}, use_plans=True)
    b, pb = build("cpu", torch.bfloat16, torch.bfloat16, True, {}, use_plans=False)
    changes = {
        "parameter moved": lambda opt, ps: setattr(ps[2], "data", ps[2].data.clone()),
        "state written by hand": lambda opt, ps: opt.state[ps[3]].__setitem__("exp_avg", opt.state[ps[3]]["exp_avg"].clone()),
        "state entry updated": lambda opt, ps: opt.state[ps[0]].update(exp_avg_sq=opt.state[ps[0]]["exp_avg_sq"].clone()),
        "rounding changed": lambda opt, ps: opt.param_groups[1].__setitem__("weight_rounding", "nearest"),
        "clamp added": lambda opt, ps: opt.param_groups[1].__setitem__("clamp", (-1.0, 1.0)),
        "state loaded": lambda opt, ps: opt.load_state_dict(opt.state_dict()),
    }
    k = 0
    for name, change in changes.items():
        run(a, pa, {}, 2, start=k)
        run(b, pb, {}, 2, start=k)
        k += 2
        change(a, pa)
        change(b, pb)
        taken.clear()
        run(a, pa, {}, 2, start=k)
        run(b, pb, {}, 2, start=k)
        k += 2
        # retired (found unusable, or dropped with the states), then a new plan
        assert taken in ([0, 1], [1]) and not (name == "state loaded" and taken != [1]), (name, taken)
        assert_same_optimizer_bits(b, pb, a, pa, name)


def test_a_non_contiguous_gradient_takes_the_general_path(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = count_plan_steps(monkeypatch)
    a, pa = build("cpu", torch.bfloat16, torch.bfloat16, False, {}, use_plans=True)
    b, pb = build("cpu", torch.bfloat16, torch.bfloat16, False, {}, use_plans=False)
    run(a, pa, {}, 3)
    run(b, pb, {}, 3)
    for opt, ps in ((a, pa), (b, pb)):
        g = torch.randn(7, 5, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
        for p in ps:
            p.grad = torch.full_like(p, 0.01)
        ps[0].grad = g.t()  # the right size, transposed strides
        opt.step()
    assert taken[-1] == 0
    assert_same_optimizer_bits(b, pb, a, pa, "non-contiguous gradient")


def test_a_resized_parameter_under_a_plan_is_refused_before_any_write() -> None:
    opt, params = build("cpu", torch.bfloat16, torch.bfloat16, False, {}, use_plans=True)
    run(opt, params, {}, 3)
    assert opt._plans
    params[2].data = torch.randn(40).bfloat16()  # its states have 33 elements
    params[2].grad = torch.zeros(40, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match="has 33 elements, param 40"):
        opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before))


def test_counters_are_views_and_the_state_dict_is_plain(tmp_path) -> None:
    """Under a plan the states' step counters are views of one vector: reading a state shows the
    current step; state_dict() holds plain dicts that load with weights_only=True and give the same
    next step; an optimizer loaded from it continues bit-identically."""
    a, pa = build("cpu", torch.float16, torch.float16, False, {}, use_plans=True)
    run(a, pa, {}, 4)
    plan = a._plans[0]
    assert all(a.state[p]["step"]._base is plan.steps for p in pa)
    assert [int(a.state[p]["step"]) for p in pa] == [4] * len(pa)
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    buf.seek(0)
    saved = torch.load(buf, weights_only=True)
    assert all(type(v) is dict for v in saved["state"].values())
    b, pb = build("cpu", torch.float16, torch.float16, False, {}, use_plans=True)
    for p, q in zip(pb, pa):
        p.data.copy_(q.data)
    b.load_state_dict(saved)
    run(a, pa, {}, 3, start=4)
    run(b, pb, {}, 3, start=4)
    assert_same_optimizer_bits(a, pa, b, pb, "after load")
    pickle.loads(pickle.dumps(a.state_dict()))


def test_overlapping_plans_retire_each_other(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps alternating between all tensors and a subset (one parameter without a gradient): two
    plans share tensors, so each retires the other; counters stay those of the general path."""
    spec = {"none_every": 2}
    a, pa = build("cpu", torch.bfloat16, torch.bfloat16, False, spec, use_plans=True)
    b, pb = build("cpu", torch.bfloat16, torch.bfloat16, False, spec, use_plans=False)
    run(a, pa, spec, 9)
    run(b, pb, spec, 9)
    assert_same_optimizer_bits(b, pb, a, pa, "alternating subsets")
    assert len(a._plans) == 1
