"""The step plans' walk over the parameters (optim/_host.py): the C++ walk and the Python walk give the
same codes and write the same addresses, for every way a step can differ from its plan; a machine
where the C++ walk cannot be built warns once and runs the Python walk with the same bits."""

from __future__ import annotations


import pytest
import torch

from optim import SRAdamW, _host

from .sr_reference import assert_same_optimizer_bits

ROW_WORDS, G_WORD = 4, 1  # a small table for the walk alone: 4 words a row, the address in word 1


@pytest.fixture(params=["native", "python"])
def walk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Forces one walk for the test: the C++ one (built here; a machine of this project has a compiler)
    or the Python one."""
    if request.param == "native":
        if not _host.wait():
            pytest.fail(f"the C++ walk cannot be built here: {_host.unavailable_reason()}")
    else:
        monkeypatch.setattr(_host, "_native", None)
        monkeypatch.setattr(_host, "_error", "the Python walk, forced by the test")
    return request.param


def setup(n: int = 6):
    g = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3 + i, generator=g)) for i in range(n)]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    lists = [params[:2], params[2:]]
    plan_params = list(params)
    # rows: every tensor but #3 has one, in the order 0, 1, 2, 4, 5 (as a plan without empty tensors)
    row_of = [0, 1, 2, 4, 5]
    g_words = [-1] * n
    for r, i in enumerate(row_of):
        g_words[i] = r * ROW_WORDS + G_WORD
    return params, lists, plan_params, row_of, g_words


def call(lists, plan_params, row_of, g_words):
    n = len(plan_params)
    ptrs = [p.data_ptr() for p in plan_params]
    table = torch.zeros(len(row_of), ROW_WORDS, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    code = _host.gather(lists, plan_params, torch.tensor(ptrs, dtype=torch.int64), table,
                        torch.tensor(g_words, dtype=torch.int64), out)
    return code, table, out


def test_the_walk_writes_every_gradient_address(walk: str) -> None:
    params, lists, plan_params, row_of, g_words = setup()
    code, table, out = call(lists, plan_params, row_of, g_words)
    assert code == _host.OK
    assert out.tolist() == [p.grad.data_ptr() for p in params]
    assert table[:, G_WORD].tolist() == [params[i].grad.data_ptr() for i in row_of]
    assert table[:, [0, 2, 3]].eq(0).all()  # no other word touched
    # a parameter without a gradient outside the plan is passed over
    extra = torch.nn.Parameter(torch.zeros(2))
    code, _, out = call([lists[0] + [extra], lists[1]], plan_params, row_of, g_words)
    assert code == _host.OK and out.tolist() == [p.grad.data_ptr() for p in params]


def another_parameter_has_a_gradient(ps, lists) -> None:
    extra = torch.nn.Parameter(torch.ones(2))
    extra.grad = torch.ones(2)
    lists[1].append(extra)


CHANGES = {
    "a gradient is missing": (lambda ps, lists: setattr(ps[2], "grad", None), _host.OTHER_TENSORS),
    "another parameter has a gradient": (another_parameter_has_a_gradient, _host.OTHER_TENSORS),
    "the order changed": (lambda ps, lists: lists[1].reverse(), _host.OTHER_TENSORS),
    "a parameter left": (lambda ps, lists: lists[0].pop(), _host.OTHER_TENSORS),
    "a parameter's storage moved": (lambda ps, lists: setattr(ps[4], "data", ps[4].data.clone()), _host.MOVED),
    "a gradient is not contiguous": (lambda ps, lists: setattr(ps[5], "grad", torch.randn(2 * ps[5].numel())[::2]),
                                     _host.NOT_CONTIGUOUS),
    "a gradient is sparse": (lambda ps, lists: setattr(ps[0], "grad", torch.zeros(3).to_sparse()), _host.NOT_CONTIGUOUS),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_difference_from_the_plan_has_its_code(walk: str, change: str) -> None:
    params, lists, plan_params, row_of, g_words = setup()
    ptrs_before = [p.data_ptr() for p in plan_params]
    apply, want = CHANGES[change]
    apply(params, lists)
    n = len(plan_params)
    table = torch.zeros(len(row_of), ROW_WORDS, dtype=torch.int64)
    out = torch.zeros(n, dtype=torch.int64)
    code = _host.gather(lists, plan_params, torch.tensor(ptrs_before, dtype=torch.int64), table,
                        torch.tensor(g_words, dtype=torch.int64), out)
    assert code == want, (walk, change, code)


def test_both_walks_give_the_same_optimizer_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two SRAdamW runs over the same gradients, one per walk, mixed groups and an empty tensor: the
    same bits at every step (the walk only finds addresses)."""
    if not _host.wait():
        pytest.fail(f"the C++ walk cannot be built here: {_host.unavailable_reason()}")

    def make():
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g).bfloat16()) for s in [(5, 7), (0,), (33,), (300,)]]
        return SRAdamW([{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3, "master_weights": True}], lr=1e-2,
                       seed=3), ps

    runs = {}
    for name in ("native", "python"):
        with monkeypatch.context() as m:
            if name == "python":
                m.setattr(_host, "_native", None)
                m.setattr(_host, "_error", "forced")
            opt, ps = make()
            gen = torch.Generator().manual_seed(1)
            taken = []
            original = opt._plan_step
            opt._plan_step = lambda *a, **k: taken.append(original(*a, **k)) or taken[-1]
            for _ in range(6):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=gen).bfloat16()
                opt.step()
            assert taken.count(True) == 5, (name, taken)  # the first step leaves the plan, the rest use it
            runs[name] = (opt, ps)
    (a, pa), (b, pb) = runs["native"], runs["python"]
    assert_same_optimizer_bits(b, pb, a, pa, "native vs python walk")


def test_no_compiler_warns_once_and_walks_in_python(tmp_path, no_compiler) -> None:
    with no_compiler(_host) as fresh:
        with pytest.warns(RuntimeWarning, match="no-such-compiler"):
            assert not fresh.wait()
        assert "no-such-compiler" in fresh.unavailable_reason()
        params, lists, plan_params, row_of, g_words = setup()
        code, _, out = call(lists, plan_params, row_of, g_words)  # the Python walk
        assert code == _host.OK and out.tolist() == [p.grad.data_ptr() for p in params]
        assert not any((tmp_path / "cache").glob("*.so"))


def test_the_walk_is_built_without_a_thread() -> None:
    """The C++ walk is built or loaded in the calling thread: a training process forks DataLoader
    workers, and a fork while another Python thread ends can hang the child (seen with a build thread)."""
    import importlib
    import threading

    before = set(threading.enumerate())
    fresh = importlib.reload(_host)
    try:
        params, lists, plan_params, row_of, g_words = setup()
        assert call(lists, plan_params, row_of, g_words)[0] == _host.OK
        assert fresh.native(), fresh.unavailable_reason()  # loaded by that first call, not later
        assert set(threading.enumerate()) == before
    finally:
        importlib.reload(_host)
