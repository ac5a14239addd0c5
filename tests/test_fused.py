"""The fused Triton SRAdamW kernel against the PyTorch path, bit for bit.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (this module sets the
variable before ``optim.triton_kernel`` is first imported: Triton reads it when the kernels are
decorated). With CUDA the kernel is compiled and the same checks run on GPU tensors (``gpu`` marker)
against the same CPU reference, and the interpreter variant runs in a subprocess without CUDA.

The reference is the PyTorch path (``fused=False``) on the CPU with one substitution: torch's CPU
``Tensor.sqrt`` for float32 goes through a vector math library and is not always correctly rounded
(about one result in five is one ulp off the IEEE square root), while the kernel uses the IEEE
``sqrt_rn``; the reference therefore takes its square root from numpy (IEEE). Everything else
(``lerp`` and ``addcmul`` with a fused multiply-add, the division orders, the noise, the rounding
decisions, the float16 state scales) is the unmodified PyTorch path.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from optim import SRAdamW, sradamw_update_
from optim.rounding import derive_key, random_bits, round_with_bits

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[1]

if not CUDA and "optim.triton_kernel" not in sys.modules:
    # Stays set for the whole process: Triton decorates its own library kernels at import and some of
    # its lazily imported modules check that they match the current setting.
    os.environ["TRITON_INTERPRET"] = "1"
from optim import triton_kernel as tk  # noqa: E402

HAVE_TRITON = tk.is_available()
INTERPRETED = HAVE_TRITON and tk.interpreting()
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=f"Triton is not importable: {tk.unavailable_reason()}")
on_cpu = pytest.mark.skipif(
    not INTERPRETED, reason="kernels compiled for CUDA in this process; test_interpreter_variant_in_subprocess runs these"
)
on_gpu = [
    pytest.mark.gpu,
    pytest.mark.skipif(not CUDA or INTERPRETED or not HAVE_TRITON, reason="needs CUDA and compiled Triton"),
]
DEVICES = [pytest.param("cpu", marks=[needs_triton, on_cpu]), pytest.param("cuda", marks=on_gpu)]
# numpy warns when the interpreter casts an infinity to float16; the values are checked below
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK = 256  # small blocks: every tensor below has full blocks and a partial tail block


@pytest.fixture
def ieee_sqrt(monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the PyTorch path's float32 CPU square root correctly rounded (see the module doc)."""
    original = torch.Tensor.sqrt

    def sqrt(self: torch.Tensor) -> torch.Tensor:
        if self.dtype == torch.float32 and self.device.type == "cpu":
            return torch.from_numpy(np.sqrt(self.detach().contiguous().numpy())).view(self.shape)
        return original(self)

    monkeypatch.setattr(torch.Tensor, "sqrt", sqrt)


@pytest.fixture
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "DEFAULT_BLOCK", BLOCK)


def assert_same_bits(a: torch.Tensor, b: torch.Tensor, what: str = "") -> None:
    """Equal dtypes and bit patterns; NaNs must match in position (their payloads may differ)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    assert a.dtype == b.dtype and a.shape == b.shape, what
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    assert torch.equal(nan_a, nan_b), what
    int_type = {2: torch.int16, 4: torch.int32}[a.element_size()]
    ia, ib = a.contiguous().view(int_type)[~nan_a], b.contiguous().view(int_type)[~nan_b]
    bad = (ia != ib).nonzero().flatten()
    assert bad.numel() == 0, f"{what}: {bad.numel()} of {ia.numel()} differ, e.g. {a[~nan_a][bad[:3]]} vs {b[~nan_b][bad[:3]]}"


def clone_to(ps: list[torch.nn.Parameter], device: str) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(device)) for p in ps]


def state_tensors(opt: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v for k, v in opt.state[p].items() if isinstance(v, torch.Tensor) and k != "step"}


# ----------------------------------------------------------------------------------------------
# The optimizer, every dtype combination, several steps
# ----------------------------------------------------------------------------------------------
def dtype_groups() -> list[dict]:
    """One group per (param dtype, state dtype, master, rounding modes) that changes the kernel."""
    gen = torch.Generator().manual_seed(0)
    roundings_half = [("stochastic", "stochastic"), ("nearest", "stochastic"), ("stochastic", "nearest"), ("nearest", "nearest")]
    groups = []
    for pd in DTYPES:
        for sd in DTYPES:
            for master in ([False, True] if pd != torch.float32 else [False]):
                weight_matters = pd != torch.float32 and not master
                state_matters = sd != torch.float32
                pairs = [
                    (wr, sr)
                    for wr, sr in roundings_half
                    if (weight_matters or wr == "stochastic") and (state_matters or sr == "stochastic")
                ]
                for wr, sr in pairs:
                    i = len(groups)
                    shape = (20, 15) if i % 2 else (300,)  # 300 elements: one full block and a tail
                    p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.3).to(pd))
                    group = dict(params=[p], state_dtype=sd, master_weights=master, weight_rounding=wr, state_rounding=sr)
                    group["weight_decay"] = 0.1 if i % 3 else 0.0
                    if i % 4 == 1:
                        group["clamp"] = (-0.35, 0.3)
                    groups.append(group)
    return groups


def grads(params: list[torch.Tensor], step: int, scale: float) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=gen) * scale).to(p.dtype) for p in params]


# step -> (gradient magnitude, step() keyword arguments): the magnitudes move the float16 state
# bounds (so their scales change between steps); the scales exercise both grad multiplier inputs.
STEPS = [
    (1e-3, {}),
    (1024.0 * 3.0, {"inv_grad_scale": 1 / 1024.0}),
    (512.0 * 1e-2, {"grad_scale": torch.tensor(512.0), "found_inf": torch.tensor(0.0)}),
    (1e-4, {}),
]


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_matches_pytorch_path_bit_exactly(device: str, ieee_sqrt: None, small_blocks: None) -> None:
    groups = dtype_groups()
    assert len(groups) == 35
    ref_params = [g["params"][0] for g in groups]
    dev_params = clone_to(ref_params, device)
    dev_groups = [dict(g, params=[p]) for g, p in zip(groups, dev_params)]
    ref = SRAdamW(groups, lr=2e-2, betas=(0.9, 0.99), fused=False, seed=7)
    fused = SRAdamW(dev_groups, lr=2e-2, betas=(0.9, 0.99), fused=True, seed=7)
    calls = []
    real = tk.sradamw_fused_

    def counting(*args, **kwargs):
        calls.append(real(*args, **kwargs))
        return calls[-1]

    tk_launch = pytest.MonkeyPatch()
    tk_launch.setattr(tk, "sradamw_fused_", counting)
    try:
        scales_seen: set[float] = set()
        for t, (scale, kwargs) in enumerate(STEPS):
            for p, q, g in zip(ref_params, dev_params, grads(ref_params, t, scale)):
                p.grad = g
                q.grad = g.to(device)
            dev_kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
            ref.step(**kwargs)
            fused.step(**dev_kwargs)
            for p in ref_params:
                if "exp_avg_bound" in ref.state[p]:
                    scales_seen.add(float(torch.frexp(ref.state[p]["exp_avg_sq_bound"]).exponent))
            for i, (p, q) in enumerate(zip(ref_params, dev_params)):
                what = f"step {t} group {i} ({p.dtype}, state {groups[i]['state_dtype']}, master {groups[i]['master_weights']})"
                assert_same_bits(p, q, what + " param")
                for name, value in state_tensors(ref, p).items():
                    assert_same_bits(value, state_tensors(fused, q)[name], f"{what} {name}")
    finally:
        tk_launch.undo()
    assert len(scales_seen) >= 3, scales_seen  # the float16 state scales did change between steps
    # one fused call per step, one launch per group: every group differs in dtypes, master or an
    # effective rounding mode
    assert calls == [len(groups)] * len(STEPS), calls


@pytest.mark.parametrize("device", DEVICES)
def test_many_small_tensors_take_one_launch(device: str, ieee_sqrt: None, small_blocks: None) -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(1, 90, (40,), generator=gen)] + [BLOCK, BLOCK + 1, 3 * BLOCK - 1]
    ref_params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in sizes]
    dev_params = clone_to(ref_params, device)
    ref = SRAdamW(ref_params, lr=1e-2, state_dtype=torch.bfloat16, fused=False)
    fused = SRAdamW(dev_params, lr=1e-2, state_dtype=torch.bfloat16, fused=True)
    launches = []
    real = tk.sradamw_fused_
    mp = pytest.MonkeyPatch()
    mp.setattr(tk, "sradamw_fused_", lambda *a, **k: launches.append(real(*a, **k)))
    try:
        for t in range(2):
            for p, q, g in zip(ref_params, dev_params, grads(ref_params, t, 1.0)):
                p.grad, q.grad = g, g.to(device)
            ref.step()
            fused.step()
    finally:
        mp.undo()
    assert launches == [1, 1]
    for p, q in zip(ref_params, dev_params):
        assert_same_bits(p, q)
        for name, value in state_tensors(ref, p).items():
            assert_same_bits(value, state_tensors(fused, q)[name], name)


# ----------------------------------------------------------------------------------------------
# Functional kernel: rounding decisions, 64-bit noise indices, skip flag, layouts
# ----------------------------------------------------------------------------------------------
def edge_values(n_random: int = 92) -> torch.Tensor:
    """float32 values over the whole range: tiny, subnormal, near and beyond both half maxima."""
    gen = torch.Generator().manual_seed(3)
    u = torch.rand(308, generator=gen, dtype=torch.float64)
    v = torch.cat(
        [
            torch.exp2(u[:100] * 60 - 30),
            u[100:150] * 2.0**-14,  # float16 subnormal range
            u[150:200] * 3 * 2.0**-24,  # around the smallest float16 subnormal
            65504 + u[200:250] * 40,  # float16 max and beyond (saturates)
            3.38e38 + u[250:300] * 0.02e38,  # near bfloat16 max (saturates)
            torch.tensor([0.0, 1e20, 1e25, 65520.0, 65519.99, 2.0**-25, 3 * 2.0**-26, 1.5]).double(),
            torch.randn(n_random, generator=gen, dtype=torch.float64),
        ]
    )
    sign = torch.where(torch.rand(v.numel(), generator=gen) < 0.5, -1.0, 1.0).double()
    out = (v * sign).float()
    out[300] = -0.0
    return out


@needs_triton
@on_cpu
@pytest.mark.parametrize("state_dtype", [torch.bfloat16, torch.float16])
def test_rounding_decisions_equal_round_with_bits(state_dtype: torch.dtype, ieee_sqrt: None) -> None:
    # beta1 = 0 makes m = g exactly, so the stored first moment is round_with_bits(g) with the
    # exp_avg key; v = g*g/2 overflows to inf for the largest gradients (kept as inf).
    g = edge_values()
    n = g.numel()
    keys = (derive_key(1), derive_key(2), derive_key(3))
    kw = dict(step=1, lr=0.0, beta1=0.0, beta2=0.5, eps=1e-8, weight_decay=0.0, keys=keys)
    ref = [torch.zeros(n), g, torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)]
    out = [t.clone() for t in ref]
    sradamw_update_(*ref, **kw)
    tk.sradamw_update_fused_(*out, block_size=BLOCK, **kw)
    assert_same_bits(out[2], round_with_bits(g, state_dtype, random_bits(keys[1], 0, n)), "exp_avg vs round_with_bits")
    assert_same_bits(out[2], ref[2], "exp_avg")
    assert_same_bits(out[3], ref[3], "exp_avg_sq")
    finfo = torch.finfo(state_dtype)
    assert bool((out[2].float().abs() == finfo.max).any()) and not bool(torch.isinf(out[2].float()).any())  # saturation
    assert bool(torch.isinf(out[3].float()).any())  # inf stays inf
    assert torch.signbit(out[2][300].float()) and out[2][300] == 0  # -0 kept


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fma_probe(a_ptr, b_ptr, c_ptr, out_ptr, EMULATE: tl.constexpr, N: tl.constexpr):
        offs = tl.arange(0, N)
        a, b, c = tl.load(a_ptr + offs), tl.load(b_ptr + offs), tl.load(c_ptr + offs)
        tl.store(out_ptr + offs, tk._fma(a, b, c, EMULATE))


@needs_triton
@on_cpu
def test_interpreter_fma_is_single_rounding() -> None:
    # Crafted double-rounding cases: a*b + c = 1 + 2**-24 + 2**-60 lies just above the midpoint of 1
    # and 1 + 2**-23; float64 rounding then float32 rounding ties to 1.0, one rounding gives
    # 1 + 2**-23. Reference: torch's CPU addcmul, which is a fused multiply-add (c + (1 * a) * b).
    t = 2.0**-18
    crafted = [(-(1 - t), 2.0**-24 * (1 + t), 1 + 2.0**-23), ((1 - t), -(2.0**-24) * (1 + t), -(1 + 2.0**-23))]
    crafted += [(1 - t, 2.0**-24 * (1 + t), 1.0), (1 + t, 2.0**-24 * (1 - t), 1.0)]  # just below midpoints
    gen = torch.Generator().manual_seed(9)
    n = 256
    a = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
    b = torch.randn(n, generator=gen) * torch.exp2(torch.randint(-60, 60, (n,), generator=gen).float())
    c = torch.where(torch.rand(n, generator=gen) < 0.5, -(a * b) * (1 + 2.0**-20), torch.randn(n, generator=gen))
    c[:8] = torch.randn(8, generator=gen) * 1e-40  # subnormal addends
    for i, (x, y, z) in enumerate(crafted):
        a[i + 8], b[i + 8], c[i + 8] = x, y, z
    out = torch.empty(n)
    _fma_probe[(1,)](a, b, c, out, EMULATE=True, N=n)
    assert out[8].item() == 1 + 2.0**-23 and out[9].item() == -(1 + 2.0**-23)
    assert_same_bits(out, torch.addcmul(c, a, b))
    plain = (a.double() * b.double() + c.double()).float()  # the naive double rounding differs here
    assert not torch.equal(plain[8:10], out[8:10])


@needs_triton
@on_cpu
def test_noise_index_is_64_bit(ieee_sqrt: None) -> None:
    # index_offset places element 0 anywhere in the noise space: across 2**31 and 2**32 and far
    # beyond, the stored values equal the PyTorch path's float32 results rounded with
    # random_bits(key, offset, n) (the reference float32 results come from a float32 master and
    # float32 states, updated with the same arithmetic).
    n = 3 * BLOCK + 50
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    m0 = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    v0 = (torch.rand(n, generator=gen) * 0.1).to(torch.bfloat16)
    keys = (derive_key(5), derive_key(6), derive_key(7))
    kw = dict(step=4, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, keys=keys)
    master, m32, v32 = p0.float(), m0.float(), v0.float()
    sradamw_update_(p0.clone(), g, m32, v32, master=master, **kw)
    for offset in (0, (1 << 31) - 100, (1 << 32) - BLOCK - 7, (1 << 40) + 3, (1 << 62) + (1 << 32) - 300):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        tk.sradamw_update_fused_(p, g, m, v, index_offset=offset, block_size=BLOCK, **kw)
        for got, exact, key in ((p, master, keys[0]), (m, m32, keys[1]), (v, v32, keys[2])):
            assert_same_bits(got, round_with_bits(exact, torch.bfloat16, random_bits(key, offset, n)), f"offset {offset}")


@needs_triton
@on_cpu
def test_found_inf_flag_and_grad_multiplier_tensor(ieee_sqrt: None) -> None:
    n = 300
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen).to(torch.float16)
    g = (torch.randn(n, generator=gen) * 256).to(torch.float16)
    keys = (derive_key(8), derive_key(9), derive_key(10))
    kw = dict(step=1, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, keys=keys)
    state = [torch.zeros(n, dtype=torch.bfloat16), torch.zeros(n, dtype=torch.bfloat16)]
    p = p0.clone()
    tk.sradamw_update_fused_(p, g, *state, found_inf=torch.tensor([1.0]), grad_mul=torch.tensor(1 / 256), **kw)
    assert torch.equal(p, p0) and all(not bool(s.any()) for s in state)  # skipped: nothing written
    ref = [p0.clone(), g, *[s.clone() for s in state]]
    sradamw_update_(*ref, grad_mul=torch.tensor(1 / 256), **kw)
    out = [p0.clone(), g, *[s.clone() for s in state]]
    tk.sradamw_update_fused_(*out, found_inf=torch.tensor(0.0), grad_mul=torch.tensor(1 / 256), block_size=BLOCK, **kw)
    for a, b in zip(ref, out):
        assert_same_bits(a, b)


@needs_triton
@on_cpu
def test_non_contiguous_unaligned_and_mixed_grad_dtypes(ieee_sqrt: None) -> None:
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3 * 301, generator=gen).to(torch.bfloat16)
    steps_ref, steps_out = [], []
    keys = (derive_key(11), derive_key(12), derive_key(13))
    kw = dict(step=2, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.05, keys=keys)

    def layouts() -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
        buf = base.clone()
        transposed = buf[:300].view(20, 15).t()  # non-contiguous param
        unaligned = buf[301:602]  # data pointer 602 bytes into the buffer
        grad_t = torch.randn(15, 20, generator=torch.Generator().manual_seed(7))  # float32 grad, bf16 param
        grad_u = torch.randn(602, generator=torch.Generator().manual_seed(8)).to(torch.float16)[::2]  # strided
        m = torch.zeros(2 * 301 + 1, dtype=torch.bfloat16)[1:302]  # unaligned state (contiguous)
        return [
            (transposed, grad_t, torch.zeros(15, 20, dtype=torch.bfloat16), torch.zeros(15, 20, dtype=torch.bfloat16)),
            (unaligned, grad_u, m, torch.zeros(301, dtype=torch.float32)),
        ]

    ref, out = layouts(), layouts()
    for p, g, m, v in ref:
        param = p.contiguous()
        sradamw_update_(param, g, m, v, **kw)
        p.copy_(param)
    n = tk.sradamw_fused_([tk.TensorStep(p, g, m, v, **kw) for p, g, m, v in out], block_size=BLOCK)
    assert n == 2  # different dtype groups (grad dtype, state dtype, alignment)
    for a, b in zip(ref, out):
        for x, y in zip(a, b):
            assert_same_bits(x, y)


# ----------------------------------------------------------------------------------------------
# Dispatch and packaging
# ----------------------------------------------------------------------------------------------
@needs_triton
@on_cpu
def test_fused_none_keeps_cpu_tensors_on_the_pytorch_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "sradamw_fused_", lambda *a, **k: pytest.fail("kernel used for CPU tensors with fused=None"))
    p = torch.nn.Parameter(torch.randn(10).to(torch.bfloat16))
    p.grad = torch.randn(10).to(torch.bfloat16)
    SRAdamW([p], fused=None).step()
    SRAdamW([p], fused=False).step()
    with pytest.raises(ValueError, match="fused"):
        SRAdamW([p], fused="yes")


@needs_triton
@on_cpu
def test_functional_arguments_are_validated() -> None:
    z = torch.zeros(4)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, keys=(1, 2, 3))
    with pytest.raises(ValueError, match="grad has 3 elements"):
        tk.sradamw_update_fused_(z.clone(), torch.zeros(3), z.clone(), z.clone(), **kw)
    with pytest.raises(ValueError, match="dtype"):
        tk.sradamw_update_fused_(z.clone(), z.double(), z.clone(), z.clone(), **kw)
    with pytest.raises(ValueError, match="state_rounding"):
        tk.sradamw_update_fused_(z.clone(), z, z.clone(), z.clone(), state_rounding="up", **kw)
    with pytest.raises(ValueError, match="clamp"):
        tk.sradamw_update_fused_(z.clone(), z, z.clone(), z.clone(), clamp=(1.0, 0.0), **kw)
    with pytest.raises(ValueError, match="block_size"):
        tk.sradamw_update_fused_(z.clone(), z, z.clone(), z.clone(), block_size=100, **kw)


def test_optim_imports_and_steps_without_triton() -> None:
    code = (
        "import sys\n"
        "import optim\n"
        "assert 'triton' not in sys.modules, 'optim imported triton eagerly'\n"
        "assert not any(m == 'recipe' or m.startswith(('recipe.', 'deepspeed')) for m in sys.modules)\n"
        "sys.modules['triton'] = None  # from here on, importing triton fails\n"
        "import torch\n"
        "p = torch.nn.Parameter(torch.ones(5, dtype=torch.bfloat16)); p.grad = torch.ones(5, dtype=torch.bfloat16)\n"
        "optim.SRAdamW([p], lr=0.1).step()\n"
        "assert bool((p < 1).all())\n"
        "try:\n"
        "    optim.SRAdamW([p], fused=True)\n"
        "except ValueError as e:\n"
        "    assert 'fused' in str(e) and 'Triton' in str(e), e\n"
        "else:\n"
        "    raise AssertionError('fused=True accepted without Triton')\n"
        "print('ok')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRETED or not HAVE_TRITON, reason="needs CUDA and compiled Triton in this process")
def test_interpreter_variant_in_subprocess() -> None:
    # This process compiled the kernels for CUDA; the CPU interpreter variant runs without CUDA.
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-x", "-m", "not gpu", str(Path(__file__))],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )
    assert res.returncode == 0, res.stdout[-3000:]


# ----------------------------------------------------------------------------------------------
# GPU only: a tensor beyond 2**31 elements
# ----------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRETED or not HAVE_TRITON, reason="needs CUDA and compiled Triton")
def test_tensor_beyond_2_31_elements_on_gpu() -> None:
    # 2**31 + 5000 bf16 elements (4 tensors, ~17 GB): the window across element 2**31 must equal the
    # same window updated on its own with index_offset = its start (verified on the CPU above).
    n = (1 << 31) + 5000
    if torch.cuda.get_device_properties(0).total_memory < 24 * n:
        pytest.skip("needs ~24 bytes per element of GPU memory")
    keys = (derive_key(21), derive_key(22), derive_key(23))
    kw = dict(step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, keys=keys)
    lo, hi = (1 << 31) - 3000, n
    gen = torch.Generator(device="cuda").manual_seed(0)
    p = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    g = torch.randn(n, device="cuda", generator=gen, dtype=torch.bfloat16)
    m = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    v = torch.zeros(n, device="cuda", dtype=torch.bfloat16)
    window = [t[lo:hi].clone() for t in (p, g, m, v)]
    tk.sradamw_update_fused_(p, g, m, v, **kw)
    tk.sradamw_update_fused_(*window, index_offset=lo, **kw)
    for whole, part in zip((p, m, v), (window[0], window[2], window[3])):
        assert_same_bits(whole[lo:hi], part)
