"""The fused Triton SRAdamW kernel against the PyTorch path, bit for bit, and its sm_90 code.

Without CUDA the kernel runs under ``TRITON_INTERPRET=1`` on CPU tensors (the Triton policy of
:mod:`optim._triton` sets the variable on such a machine before Triton is first imported: Triton reads
it when the kernels are decorated). With CUDA the kernel is compiled and the same checks run on GPU
tensors (``gpu`` marker) against the same CPU reference, and the interpreter variant runs in a
subprocess without CUDA. Compiling for sm_90 needs no GPU: a subprocess with ``TRITON_INTERPRET=0``
checks the generated code.

The reference is the eager PyTorch path (``fused=False``, the definition in ``optim.functional``) on
the CPU, unmodified.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from optim import SRAdamW, _rows, _triton, sradamw_update_
from optim import _sradamw_jit as jit
from optim import triton_kernel as tk
from optim._rows import INT_WORDS, ROW_WORDS, Slot, Word
from optim.functional import HYPERPARAMETERS
from optim.rounding import _segment_word, derive_key, key_words, random_bits, round_with_bits

from ..precompile import precompile
from .sr_reference import assert_same_bits, assert_same_optimizer_bits

CUDA = torch.cuda.is_available()
ROOT = Path(__file__).resolve().parents[2]

HAVE_TRITON = _triton.is_available()
INTERPRETED = tk.interpreting()
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=f"Triton is not importable: {_triton.unavailable_reason()}")
on_cpu = pytest.mark.skipif(
    not INTERPRETED,
    reason="kernels compiled for CUDA in this process; test_interpreter_variant_in_subprocess runs these",
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
def small_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tk, "DEFAULT_BLOCK", BLOCK)


def clone_to(ps: list[torch.nn.Parameter], device: str) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone().to(device)) for p in ps]


def count_fused_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Records the number of kernel launches of every step from now on (``triton_kernel.launch``, the
    one place that launches: the general path's ``sradamw_fused_`` and SRAdamW's step plans call it)."""
    calls: list[int] = []
    real = tk.launch

    def counting(table, launches, *args, **kwargs) -> None:
        calls.append(len(launches))
        real(table, launches, *args, **kwargs)

    monkeypatch.setattr(tk, "launch", counting)
    return calls


# ----------------------------------------------------------------------------------------------
# The optimizer, every dtype combination, several steps
# ----------------------------------------------------------------------------------------------
def dtype_groups() -> list[dict]:
    """One group per (param dtype, state dtype, master, rounding modes) that changes the kernel."""
    gen = torch.Generator().manual_seed(0)
    roundings_half = [(w, s) for s in ("stochastic", "nearest") for w in ("stochastic", "nearest")]
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
                    group = dict(params=[p], state_dtype=sd, master_weights=master, weight_rounding=wr,
                                 state_rounding=sr)
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


def step_both(ref: SRAdamW, ref_params: list, fused: SRAdamW, dev_params: list, device: str, t: int, scale: float,
              **kwargs) -> None:
    """One step of both optimizers on the same gradients, then every stored bit compared."""
    for p, q, g in zip(ref_params, dev_params, grads(ref_params, t, scale)):
        p.grad, q.grad = g, g.to(device)
    ref.step(**kwargs)
    fused.step(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})
    assert_same_optimizer_bits(ref, ref_params, fused, dev_params, f"step {t}")


def fused_steps(groups: list[dict], device: str) -> None:
    """The fused optimizer's steps of the test below on copies of its groups, results unchecked: the dry
    run :func:`tests.precompile.precompile` records the kernels from."""
    params = clone_to([g["params"][0] for g in groups], device)
    fused = SRAdamW([dict(g, params=[p]) for g, p in zip(groups, params)], lr=2e-2, betas=(0.9, 0.99), fused=True,
                    seed=7)
    for t, (scale, kwargs) in enumerate(STEPS):
        for q, g in zip(params, grads(params, t, scale)):
            q.grad = g.to(device)
        fused.step(**{k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()})


@pytest.mark.parametrize("device", DEVICES)
def test_optimizer_matches_pytorch_path_bit_exactly(device: str, small_blocks: None,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    groups = dtype_groups()
    assert len(groups) == 35
    if device == "cuda":  # ~100 kernel specialisations (35 groups x 3 grad multiplier modes): compiled ahead
        precompile(lambda: fused_steps(groups, device))
    ref_params = [g["params"][0] for g in groups]
    dev_params = clone_to(ref_params, device)
    dev_groups = [dict(g, params=[p]) for g, p in zip(groups, dev_params)]
    ref = SRAdamW(groups, lr=2e-2, betas=(0.9, 0.99), fused=False, seed=7)
    fused = SRAdamW(dev_groups, lr=2e-2, betas=(0.9, 0.99), fused=True, seed=7)
    calls = count_fused_calls(monkeypatch)
    scales_seen: set[float] = set()
    for t, (scale, kwargs) in enumerate(STEPS):
        step_both(ref, ref_params, fused, dev_params, device, t, scale, **kwargs)
        for p in ref_params:
            if "exp_avg_bound" in ref.state[p]:
                scales_seen.add(float(torch.frexp(ref.state[p]["exp_avg_sq_bound"]).exponent))
    assert len(scales_seen) >= 3, scales_seen  # the float16 state scales did change between steps
    # one table per step, one launch per group: every group differs in dtypes, master or an effective
    # rounding mode (the first step on the general path, the others on its plan)
    assert calls == [len(groups)] * len(STEPS), calls


@pytest.mark.parametrize("device", DEVICES)
def test_many_small_tensors_take_one_launch(device: str, small_blocks: None,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    sizes = [int(s) for s in torch.randint(1, 90, (40,), generator=gen)] + [BLOCK, BLOCK + 1, 3 * BLOCK - 1]
    ref_params = [torch.nn.Parameter(torch.randn(n, generator=gen).to(torch.bfloat16)) for n in sizes]
    dev_params = clone_to(ref_params, device)
    ref = SRAdamW(ref_params, lr=1e-2, state_dtype=torch.bfloat16, fused=False)
    fused = SRAdamW(dev_params, lr=1e-2, state_dtype=torch.bfloat16, fused=True)
    launches = count_fused_calls(monkeypatch)
    for t in range(2):
        step_both(ref, ref_params, fused, dev_params, device, t, 1.0)
    assert launches == [1, 1]


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
def test_rounding_decisions_equal_round_with_bits(state_dtype: torch.dtype) -> None:
    # beta1 = 0 makes m = g exactly, so the stored first moment is round_with_bits(g) with the
    # exp_avg key; v = g*g/2 overflows to inf for the largest gradients (kept as inf).
    g = edge_values()
    n = g.numel()
    keys = (derive_key(1), derive_key(2))
    kw = dict(step=1, lr=0.0, beta1=0.0, beta2=0.5, eps=1e-8, weight_decay=0.0, keys=keys)
    ref = [torch.zeros(n), g, torch.zeros(n, dtype=state_dtype), torch.zeros(n, dtype=state_dtype)]
    out = [t.clone() for t in ref]
    sradamw_update_(*ref, **kw)
    tk.sradamw_update_fused_(*out, block_size=BLOCK, **kw)
    m_exact = g + 0.0  # m * 0 + g * 1: exactly g, except -0 + 0 = +0 (IEEE)
    assert_same_bits(out[2], round_with_bits(m_exact, state_dtype, random_bits(keys[1], 0, n)), "exp_avg vs round_with_bits")
    assert_same_bits(out[2], ref[2], "exp_avg")
    assert_same_bits(out[3], ref[3], "exp_avg_sq")
    finfo = torch.finfo(state_dtype)
    assert bool((out[2].float().abs() == finfo.max).any()) and not bool(torch.isinf(out[2].float()).any())  # saturation
    assert bool(torch.isinf(out[3].float()).any())  # inf stays inf
    assert not torch.signbit(out[2][300].float()) and out[2][300] == 0  # the -0 gradient's m is +0


@needs_triton
@on_cpu
def test_noise_index_is_64_bit() -> None:
    # index_offset places element 0 anywhere in the noise space: across 2**31 and 2**32 and far
    # beyond, the stored values equal the PyTorch path's float32 results rounded with
    # random_bits(key, offset, n) (the reference float32 results come from a float32 master and
    # float32 states, updated with the same arithmetic), and the PyTorch path with the same offset.
    n = 3 * BLOCK + 50
    gen = torch.Generator().manual_seed(4)
    p0 = torch.randn(n, generator=gen).to(torch.bfloat16)
    g = torch.randn(n, generator=gen).to(torch.bfloat16)
    m0 = (torch.randn(n, generator=gen) * 0.1).to(torch.bfloat16)
    v0 = (torch.rand(n, generator=gen) * 0.1).to(torch.bfloat16)
    keys = (derive_key(5), derive_key(6))
    kw = dict(step=4, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, keys=keys)
    master, m32, v32 = p0.float(), m0.float(), v0.float()
    sradamw_update_(p0.clone(), g, m32, v32, master=master, **kw)
    for offset in (0, (1 << 31) - 100, (1 << 32) - BLOCK - 7, (1 << 40) + 3, (1 << 62) + (1 << 32) - 300):
        p, m, v = p0.clone(), m0.clone(), v0.clone()
        tk.sradamw_update_fused_(p, g, m, v, index_offset=offset, block_size=BLOCK, **kw)
        ref = [p0.clone(), g, m0.clone(), v0.clone()]
        sradamw_update_(*ref, index_offset=offset, chunk_size=BLOCK + 3, **kw)
        state_bits = random_bits(keys[1], offset, n)  # high half: exp_avg, low half: exp_avg_sq
        noise = (random_bits(keys[0], offset, n), state_bits, state_bits << 16)
        for got, exact, bits, pytorch in zip((p, m, v), (master, m32, v32), noise, (ref[0], ref[2], ref[3])):
            expected = round_with_bits(exact, torch.bfloat16, bits)
            assert_same_bits(got, expected, f"offset {offset}")
            assert_same_bits(got, pytorch, f"offset {offset}, PyTorch path")


@needs_triton
@on_cpu
def test_found_inf_flag_and_grad_multiplier_tensor() -> None:
    n = 300
    gen = torch.Generator().manual_seed(5)
    p0 = torch.randn(n, generator=gen).to(torch.float16)
    g = (torch.randn(n, generator=gen) * 256).to(torch.float16)
    keys = (derive_key(8), derive_key(9))
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
def test_non_contiguous_unaligned_and_mixed_grad_dtypes() -> None:
    gen = torch.Generator().manual_seed(6)
    base = torch.randn(3 * 301, generator=gen).to(torch.bfloat16)
    keys = (derive_key(11), derive_key(12))
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
    def fail(*args, **kwargs) -> None:
        pytest.fail("kernel used for CPU tensors with fused=None")

    monkeypatch.setattr(tk, "sradamw_fused_", fail)
    p = torch.nn.Parameter(torch.randn(10).to(torch.bfloat16))
    p.grad = torch.randn(10).to(torch.bfloat16)
    SRAdamW([p], fused=None).step()
    SRAdamW([p], fused=False).step()
    with pytest.raises(ValueError, match="fused"):
        SRAdamW([p], fused="yes")


@needs_triton
@on_cpu
@pytest.mark.parametrize(
    "change, match",
    [
        (dict(grad=torch.zeros(3)), "grad has 3 elements"),
        (dict(grad=torch.zeros(4, dtype=torch.float64)), "dtype"),
        (dict(state_rounding="up"), "state_rounding"),
        (dict(clamp=(1.0, 0.0)), "clamp"),
        (dict(block_size=100), "block_size"),
        (dict(index_offset=-1), "index_offset"),
    ],
)
def test_functional_arguments_are_validated(change: dict, match: str) -> None:
    z = torch.zeros(4)
    kw = dict(step=1, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, keys=(1, 2))
    grad = change.pop("grad", z)
    with pytest.raises(ValueError, match=match):
        tk.sradamw_update_fused_(z.clone(), grad, z.clone(), z.clone(), **kw, **change)


def test_metadata_rows_are_filled_by_name() -> None:
    # The host table read back through the named layout (Word, Slot): every address, count, key and
    # hyperparameter sits where the kernel reads it (that the kernel reads these names is what the
    # bit-exact tests above check).
    gen = torch.Generator().manual_seed(11)
    p, g, w = torch.randn(7, generator=gen).half(), torch.randn(7, generator=gen).half(), torch.zeros(7)
    m, v = torch.zeros(7, dtype=torch.float16), torch.zeros(7, dtype=torch.float16)
    scales = [torch.tensor(2.0**k) for k in range(4)]
    keys = (derive_key(1), derive_key(2))
    s = tk.TensorStep(p, g, m, v, step=3, lr=1e-2, beta1=0.6, beta2=0.99, eps=1e-6, weight_decay=0.5, keys=keys,
                      master=w, exp_avg_scales=(scales[0], scales[1]), exp_avg_sq_scales=(scales[2], scales[3]),
                      clamp=(-1.0, 2.0), index_offset=5 << 33)
    table = _rows.metadata([(s, p, g)], grad_mul=0.25)
    assert table.shape == (1, ROW_WORDS) and table.dtype == torch.int64
    row = table[0].tolist()
    tensors = {Word.P: p, Word.G: g, Word.M: m, Word.V: v, Word.MASTER: w, Word.M_SCALE_OLD: scales[0],
               Word.M_SCALE_NEW: scales[1], Word.V_SCALE_OLD: scales[2], Word.V_SCALE_NEW: scales[3]}
    for word, t in tensors.items():
        assert row[word] == t.data_ptr(), word
    assert (row[Word.NUMEL], row[Word.NOISE_BASE]) == (7, 5 << 33)
    for (a_word, b_word), key in zip(((Word.A_P, Word.B_P), (Word.A_S, Word.B_S)), keys):
        a, b = key_words(key)
        assert (row[a_word], row[b_word]) == (a, b)  # the kernel adds the index's high half to a
        assert _segment_word(a, 0) == a
    floats = table[0, INT_WORDS:].view(torch.float32).tolist()

    def f32(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    bc2 = math.sqrt(1 - 0.99**3)
    expected = {
        Slot.DECAY: 1 - 1e-2 * 0.5, Slot.BETA1: 0.6, Slot.ONE_MINUS_BETA1: 1 - 0.6, Slot.BETA2: 0.99,
        Slot.ONE_MINUS_BETA2: 1 - 0.99, Slot.EPS_HAT: 1e-6 * bc2, Slot.NEG_STEP: -1e-2 * bc2 / (1 - 0.6**3),
        Slot.GRAD_MUL: 0.25, Slot.CLAMP_MIN: -1.0, Slot.CLAMP_MAX: 2.0,
    }
    assert [slot.name.lower() for slot in Slot] == list(HYPERPARAMETERS)
    assert {slot: floats[slot] for slot in Slot} == {slot: f32(x) for slot, x in expected.items()}
    if HAVE_TRITON:  # the kernel's constexpr globals carry the same names and positions
        for member in (*Word, *Slot):
            assert getattr(jit, f"_{member.name}").value == member, member


_COMPILE_CHECK = """
import json, os, re, subprocess, tempfile
os.environ["TRITON_INTERPRET"] = "0"
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from optim import triton_kernel as tk
from optim._sradamw_jit import Kind, sradamw_kernel
assert not tk.interpreting()
SR, NO_SR = dict(SR_P=True, SR_M=True, SR_V=True), dict(SR_P=False, SR_M=False, SR_V=False)
variants = {  # name: (kinds of p, g, m, v; master and float16 state scales; rounding; aligned)
    "bf16": ((Kind.BF16,) * 4, dict(MASTER=False, SCALE_M=False, SCALE_V=False), SR, True),
    "fp16": ((Kind.F16,) * 4, dict(MASTER=False, SCALE_M=True, SCALE_V=True), SR, True),
    "bf16-master": ((Kind.BF16, Kind.BF16, Kind.F32, Kind.F32), dict(MASTER=True, SCALE_M=False, SCALE_V=False),
                    NO_SR, True),
    "fp32": ((Kind.F32,) * 4, dict(MASTER=False, SCALE_M=False, SCALE_V=False), NO_SR, True),
    "bf16-unaligned": ((Kind.BF16,) * 4, dict(MASTER=False, SCALE_M=False, SCALE_V=False), SR, False),
}
report = {}
for name, (kinds, state, rounding, aligned) in variants.items():
    consts = dict(zip(("P_KIND", "G_KIND", "M_KIND", "V_KIND"), map(int, kinds)), **state, **rounding, GMUL=2,
                  CLAMP=False, HAS_SKIP=True, ALIGNED=aligned, BLOCK=tk.DEFAULT_BLOCK)
    sig = {a: "constexpr" if a in consts else {"table_ptr": "*i64", "blocks_ptr": "*i32"}.get(a, "*fp32")
           for a in sradamw_kernel.arg_names}
    kernel = triton.compile(ASTSource(fn=sradamw_kernel, signature=sig, constexprs=consts),
                            target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": tk.DEFAULT_NUM_WARPS, "enable_fp_fusion": False})
    ptx = kernel.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:  # ptxas as Triton ran it, verbose
        f.write(ptx)
        f.flush()
        log = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--fmad=false", "--gpu-name=sm_90a", f.name, "-o",
                              os.devnull], capture_output=True, text=True, check=True).stderr
    report[name] = dict(
        regs=int(re.search(r"Used (\\d+) registers", log).group(1)),
        spill_stores=int(re.search(r"(\\d+) bytes spill stores", log).group(1)),
        cubin=len(kernel.asm["cubin"]),
        ld_v2=len(re.findall(r"ld\\.global\\S*\\.v2\\.b32", ptx)),
        ld_v4=len(re.findall(r"ld\\.global\\S*\\.v4\\.b32", ptx)),
        st_v2=len(re.findall(r"st\\.global\\S*\\.v2\\.b32", ptx)),
        st_v4=len(re.findall(r"st\\.global\\S*\\.v4\\.b32", ptx)),
        fma=ptx.count("fma.rn.f32"),
    )
from optim._sradamw_jit import grad_amax_kernel  # a step plan's gradient maxima: both element widths
for wide in (True, False):
    sig = dict(addr_ptr="*i64", numel_ptr="*i64", index_ptr="*i32", blocks_ptr="*i32", out_ptr="*i32",
               WIDE="constexpr", BLOCK="constexpr")
    kernel = triton.compile(ASTSource(fn=grad_amax_kernel, signature=sig, constexprs=dict(WIDE=wide, BLOCK=tk.AMAX_BLOCK)),
                            target=GPUTarget("cuda", 90, 32), options={"num_warps": tk.AMAX_NUM_WARPS})
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(kernel.asm["ptx"])
        f.flush()
        log = subprocess.run([knobs.nvidia.ptxas.path, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                             capture_output=True, text=True, check=True).stderr
    report["amax-32" if wide else "amax-16"] = dict(
        cubin=len(kernel.asm["cubin"]), regs=int(re.search(r"Used (\\d+) registers", log).group(1)),
        spills=int(re.search(r"(\\d+) bytes spill stores", log).group(1)), atom=kernel.asm["ptx"].count("atom.global"))
print(json.dumps(report))
"""


@pytest.mark.skipif(not HAVE_TRITON, reason=f"Triton is not importable: {_triton.unavailable_reason()}")
def test_kernel_compiles_for_sm90_without_a_gpu() -> None:
    """The interpreter does not lower the kernel: compile dtype groups for sm_90 (Triton's compiler and
    ptxas, no device needed) with the default block and warps. Full blocks must move 16-bit tensors
    in 8-byte and float32 tensors in 16-byte vectors (4 elements per thread) when the pointers are
    16-byte aligned, and not without that hint; aligned groups keep to 64 registers (two programs
    of 16 warps per SM) and spill nothing; no product is contracted into a fused multiply-add (the
    definition rounds every operation; ``sqrt_rn``/``div_rn`` use FMA only inside their IEEE
    sequences, which PTX keeps as ``sqrt.rn``/``div.rn``)."""
    env = dict(os.environ, TRITON_INTERPRET="0", CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-c", _COMPILE_CHECK], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(res.stdout.strip().splitlines()[-1])
    per_thread = tk.DEFAULT_BLOCK // (32 * tk.DEFAULT_NUM_WARPS)
    assert per_thread == 4
    amax = {name: report.pop(name) for name in ("amax-32", "amax-16")}
    for name, r in amax.items():  # compiled, no spills, one atomic max per program
        assert r["cubin"] > 0 and r["spills"] == 0 and r["regs"] <= 64 and r["atom"] >= 1, (name, r)
    for name, r in report.items():
        assert r["cubin"] > 0, name
        assert r["fma"] == 0, (name, r)
        assert r["spill_stores"] == 0, (name, r)
        assert r["regs"] <= 64 or name == "bf16-unaligned", (name, r)
    vectors = {n: (r["ld_v2"], r["st_v2"], r["ld_v4"], r["st_v4"]) for n, r in report.items()}
    # (8-byte loads, 8-byte stores, 16-byte loads, 16-byte stores): g, p or master, m, v read; p, m, v
    # (and master) written
    assert vectors["bf16"] == vectors["fp16"] == (4, 3, 0, 0), vectors
    assert vectors["bf16-master"] == (1, 1, 3, 3), vectors
    assert vectors["fp32"] == (0, 0, 4, 3), vectors
    assert vectors["bf16-unaligned"] == (0, 0, 0, 0), vectors


_INTERPRETER_RUN: dict[str, tuple[subprocess.Popen, Any]] = {}


def _start_interpreter_run() -> tuple[subprocess.Popen, Any]:
    """This file's CPU tests (``-m "not gpu"``) in a subprocess with CUDA hidden: the interpreter variant
    and the sm_90 compile check, under this machine's Triton. Output to a temporary file."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", TRITON_INTERPRET="1")
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-x", "-m", "not gpu", str(Path(__file__))],
                            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    return proc, log


@pytest.fixture(scope="session", autouse=True)
def interpreter_run_beside_the_gpu_tests(request: pytest.FixtureRequest):
    """On a GPU run that selected test_interpreter_variant_in_subprocess, its subprocess (CPU only, ~25 s
    on the GPU machine) starts with this module's first test and runs beside the GPU tests; the test
    waits for it (tests/conftest.py runs it after the rest of tests/optim under ``-m gpu``)."""
    selected = any(item.name == "test_interpreter_variant_in_subprocess" for item in request.session.items)
    if CUDA and not INTERPRETED and HAVE_TRITON and selected:
        _INTERPRETER_RUN["run"] = _start_interpreter_run()
    yield
    run = _INTERPRETER_RUN.pop("run", None)
    if run is not None:
        if run[0].poll() is None:
            run[0].kill()
        run[0].wait()
        run[1].close()


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or INTERPRETED or not HAVE_TRITON, reason="needs CUDA and compiled Triton in this process")
def test_interpreter_variant_in_subprocess() -> None:
    # This process compiled the kernels for CUDA; the CPU interpreter variant runs without CUDA.
    proc, log = _INTERPRETER_RUN.get("run") or _INTERPRETER_RUN.setdefault("run", _start_interpreter_run())
    returncode = proc.wait(timeout=600)
    log.seek(0)
    assert returncode == 0, log.read()[-3000:]


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
    keys = (derive_key(21), derive_key(22))
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mixed", [False, True], ids=["one dtype", "mixed dtypes"])
def test_plan_gradient_maxima_equal_the_general_paths(device: str, mixed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step plan's gradient maxima (tk.GradAmax: one launch per element width, from the gradients'
    addresses) equal the general path's ``_grad_amax`` bit for bit: finite values, an infinity, a NaN
    (it must win over the infinity), an empty tensor, tensors of several blocks and a partial block."""
    from optim.sradamw import _grad_amax

    monkeypatch.setattr(tk, "AMAX_BLOCK", 64)  # several blocks per tensor at these sizes
    gen = torch.Generator().manual_seed(5)
    sizes = [300, 0, 64, 1, 129, 1000]
    dtypes = [DTYPES[i % 3] if mixed else torch.bfloat16 for i in range(len(sizes))]
    grads = [(torch.randn(n, generator=gen) * 10 ** (i - 2)).to(d).to(device) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    grads[2][17] = -float("inf")
    grads[5][3], grads[5][900] = float("inf"), float("nan")
    amax = tk.GradAmax(grads, torch.device(device))
    addresses = torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)
    got, want = amax(addresses).cpu(), _grad_amax(grads).cpu()
    assert torch.isnan(got[5]) and torch.isinf(got[2])
    assert_same_bits(torch.nan_to_num(got, nan=-1.0), torch.nan_to_num(want, nan=-1.0))
    # the next step: new values at new addresses, the same buffers
    grads = [g.clone() * 0.5 for g in grads]
    got = amax(torch.tensor([g.data_ptr() for g in grads], dtype=torch.int64)).cpu()
    assert_same_bits(torch.nan_to_num(got, nan=-1.0), torch.nan_to_num(_grad_amax(grads).cpu(), nan=-1.0))
