"""AdamW step time, state bytes per parameter and achieved bandwidth, side by side in one run.

Compares on the same parameters and gradients:
  * torch AdamW, float32 weights and states (fused on CUDA, foreach on CPU);
  * torch AdamW on bf16 weights and states (round-to-nearest everywhere);
  * SRAdamW: bf16 weights + bf16 SR states; fp16 weights + scaled fp16 SR states; bf16 weights with
    an fp32 master and fp32 states; each on the eager PyTorch path, (CPU) with the C++ kernel (the
    default there) and (CUDA) with the fused Triton kernel,
    and the fused kernel once more with ``check_finite=False`` (no separate inf/NaN pass over the
    gradients: the kernel's own time plus the per-step host work; neither variant synchronises with
    the host, the checked one skips on its flag on the GPU);
  * torchao ``_AdamW(bf16_stochastic_round=True)`` (bf16 weights, fp32 master-free SR) if installed;
  * optimi ``AdamW(kahan_sum=True)`` on bf16 weights if installed.

"GB/s" counts the bytes an ideal single pass must move: read weight, gradient and every state
tensor, write weight and every state tensor; it is the same formula for every optimizer, from the
dtypes of the tensors that optimizer actually holds.

Usage:
    python benchmarks/bench_optim.py                       # CPU: 8 tensors of 2**20
    python benchmarks/bench_optim.py --layout gpu-1b       # CUDA: 64 tensors of 2**24 (1.07 B)
    python benchmarks/bench_optim.py --layout vit-b-32     # the ViT-B-32 preset's tensor shapes
    python benchmarks/bench_optim.py --layout gpu-1b,vit-b-32   # both, one table each, one run
    python benchmarks/bench_optim.py --layout gpu-1b --exclude "PyTorch path" --json rows.json

``--json`` rows (written again after every row, so a run cut short keeps what it measured): ``optimizer``,
``layout``, ``ms`` (per step), ``state_bytes_per_param``, ``weight_bytes_per_param``, ``GB/s``,
``params``, or ``error``. Parameters and gradients are drawn on the benchmark's device (a seeded
generator there), the same for every optimizer.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from optim import SRAdamW  # noqa: E402


def layout(name: str, n_tensors: int, size: int) -> list[tuple[int, ...]]:
    if name == "uniform":
        return [(size,)] * n_tensors
    if name == "gpu-1b":
        return [(1 << 24,)] * 64
    if name.endswith("-flat"):  # the same elements as one tensor (what ZeRO-1/2 hand the optimizer at one rank)
        return [(sum(math.prod(s) for s in layout(name[: -len("-flat")], n_tensors, size)),)]
    if name in ("vit-b-32", "tiny"):  # a preset's parameter shapes (ZeRO-0: the module's own tensors)
        from recipe.model import create_model

        with torch.device("meta"):
            model = create_model("ViT-B-32" if name == "vit-b-32" else name)
        return [tuple(p.shape) for p in model.parameters()]
    raise ValueError(f"unknown layout {name!r}")


def state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = []
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                out.append(v)
    return out


def nbytes(ts: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in ts)


def prepare(
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: str,
    warmup: int,
) -> tuple[torch.optim.Optimizer, list[torch.nn.Parameter]]:
    """Parameters, gradients and the optimizer after ``warmup`` steps (compilation happens there)."""
    gen = torch.Generator(device=device).manual_seed(0)  # on the device: 2 x 1.07 B CPU draws per row take minutes
    params = [torch.nn.Parameter((torch.randn(s, generator=gen, device=device) * 0.02).to(dtype)) for s in shapes]
    for p in params:
        p.grad = (torch.randn(p.shape, generator=gen, device=device) * 1e-3).to(dtype)
    opt = make(params)
    for _ in range(warmup):
        opt.step()
    if device == "cuda":
        torch.cuda.synchronize()
    return opt, params


def timed_steps(opt: torch.optim.Optimizer, device: str, iters: int) -> float:
    """Seconds per step over ``iters`` consecutive steps."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        opt.step()
    sync()
    return (time.perf_counter() - t0) / iters


def result_row(name: str, opt: torch.optim.Optimizer, params: list[torch.nn.Parameter], dt: float) -> dict:
    n = sum(p.numel() for p in params)
    states = state_tensors(opt)
    moved = 2 * nbytes(params) + nbytes([p.grad for p in params]) + 2 * nbytes(states)
    return {
        "optimizer": name,
        "ms": dt * 1e3,
        "state_bytes_per_param": nbytes(states) / n,
        "weight_bytes_per_param": nbytes(params) / n,
        "GB/s": moved / dt / 1e9,
        "params": n,
    }


def bench_one(
    name: str,
    make: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
    shapes: list[tuple[int, ...]],
    dtype: torch.dtype,
    device: str,
    warmup: int,
    iters: int,
) -> dict:
    opt, params = prepare(make, shapes, dtype, device, warmup)
    return result_row(name, opt, params, timed_steps(opt, device, iters))


def bench_interleaved(
    cands: list[tuple[str, torch.dtype, Callable]], shapes: list[tuple[int, ...]], device: str, warmup: int, iters: int
) -> list[dict]:
    """Every optimizer prepared first, then one step of each in turn, ``iters`` rounds; the median per
    optimizer. On a shared CPU a load change then hits every row alike, so the ratios hold; each row
    also gets ``paired``: the median over rounds of its step time over torch bf16 AdamW's in the same
    round (a slow spell then cancels out of the ratio instead of shifting one row's median)."""
    ready, rows = [], {}
    for label, dtype, make in cands:
        try:
            ready.append((label, *prepare(make, shapes, dtype, device, warmup)))
        except Exception as e:  # a comparison optimizer that cannot run here is reported, not hidden
            rows[label] = {"optimizer": label, "error": f"{type(e).__name__}: {e}"[:120]}
    times: dict[str, list[float]] = {label: [] for label, _, _ in ready}
    for _ in range(iters):
        for label, opt, _ in ready:
            times[label].append(timed_steps(opt, device, 1))
    base = next((times[label] for label, _, _ in ready if label.startswith("torch AdamW bf16")), None)
    for label, opt, params in ready:
        rows[label] = result_row(label, opt, params, statistics.median(times[label]))
        if base is not None:
            rows[label]["paired"] = statistics.median(t / b for t, b in zip(times[label], base))
    return [rows[label] for label, _, _ in cands if label in rows]


def candidates(device: str) -> list[tuple[str, torch.dtype, Callable]]:
    cuda = device == "cuda"
    torch_kw = {"fused": True} if cuda else {"foreach": True}
    c: list[tuple[str, torch.dtype, Callable]] = [
        ("torch AdamW fp32" + (" fused" if cuda else " foreach"), torch.float32,
         lambda ps: torch.optim.AdamW(ps, lr=1e-3, **torch_kw)),
        ("torch AdamW bf16 (RTN)", torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=1e-3, **torch_kw)),
    ]
    sr_configs = [
        ("bf16 w + bf16 SR states", torch.bfloat16, {"state_dtype": torch.bfloat16}),
        ("fp16 w + scaled fp16 SR states", torch.float16, {"state_dtype": torch.float16}),
        ("bf16 w + fp32 master/states", torch.bfloat16,
         {"master_weights": True, "master_format": "fp32", "state_dtype": torch.float32}),
        ("bf16 w + split master (int16 low half)/fp32 states", torch.bfloat16,
         {"master_weights": True, "state_dtype": torch.float32}),
    ]
    for label, dtype, kw in sr_configs:
        c.append((f"SRAdamW {label} (PyTorch path)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=False, **kw)))
    if cuda:  # the fused kernel runs compiled on CUDA tensors only
        for label, dtype, kw in sr_configs:
            c.append((f"SRAdamW {label} (fused)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=True, **kw)))
        for label, dtype, kw in sr_configs[:2]:
            c.append(
                (f"SRAdamW {label} (fused, check_finite=False)", dtype,
                 lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, fused=True, check_finite=False, **kw))
            )
    else:
        print("# SRAdamW fused rows need CUDA: skipped", file=sys.stderr)
        for label, dtype, kw in sr_configs:  # the default on CPU tensors: the C++ kernel
            c.append((f"SRAdamW {label} (CPU kernel)", dtype, lambda ps, kw=kw: SRAdamW(ps, lr=1e-3, **kw)))
    try:
        from torchao.optim import _AdamW

        c.append(("torchao _AdamW bf16 SR", torch.bfloat16, lambda ps: _AdamW(ps, lr=1e-3, bf16_stochastic_round=True)))
    except ImportError:
        print("# torchao not installed: skipped", file=sys.stderr)
    try:
        from optimi import AdamW as OptimiAdamW

        c.append(("optimi AdamW bf16 Kahan", torch.bfloat16, lambda ps: OptimiAdamW(ps, lr=1e-3, kahan_sum=True)))
    except ImportError:
        print("# torch-optimi not installed: skipped", file=sys.stderr)
    return c


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--layout", default=None, help="uniform | gpu-1b | vit-b-32 | tiny, X-flat (the same elements "
                    "as one tensor), or several separated by commas "
                    "(default: gpu-1b on CUDA, uniform on CPU)")
    ap.add_argument("--tensors", type=int, default=8)
    ap.add_argument("--size", type=int, default=1 << 20)
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--iters", type=int, default=None)
    ap.add_argument("--only", default=None, help="substring filter on optimizer names")
    ap.add_argument("--exclude", action="append", default=[],
                    help="skip optimizers whose name contains this substring (repeatable)")
    ap.add_argument("--json", default=None, help="also write the rows to this JSON file")
    ap.add_argument("--interleave", action=argparse.BooleanOptionalAction, default=None,
                    help="prepare every optimizer, then step them in turn and report medians (default on CPU, "
                    "where the machine may be shared; needs memory for all optimizers at once)")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch.set_num_threads (CPU); 1 avoids OpenMP oversubscription on a shared machine")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda"
    warmup = args.warmup if args.warmup is not None else (5 if cuda else 2)
    iters = args.iters if args.iters is not None else (20 if cuda else 5)
    dev_name = torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine()
    triton_version = "n/a"
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        pass
    all_rows = []
    for name in (args.layout or ("gpu-1b" if cuda else "uniform")).split(","):
        shapes = layout(name, args.tensors, args.size)
        print(f"# device: {dev_name}; torch {torch.__version__}; triton {triton_version}; layout {name}: {len(shapes)} "
              f"tensors, {sum(torch.Size(s).numel() for s in shapes):,} params; {torch.get_num_threads()} threads; "
              f"load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d')}")
        cands = [(label, dtype, make) for label, dtype, make in candidates(args.device)
                 if not (args.only and args.only not in label) and not any(x in label for x in args.exclude)]
        interleave = args.interleave if args.interleave is not None else not cuda
        rows = []
        if interleave:
            rows = bench_interleaved(cands, shapes, args.device, warmup, iters)
            for r in rows:
                r["layout"] = name
        else:
            for label, dtype, make in cands:
                try:
                    rows.append(bench_one(label, make, shapes, dtype, args.device, warmup, iters))
                except Exception as e:  # a comparison optimizer that cannot run here is reported, not hidden
                    rows.append({"optimizer": label, "error": f"{type(e).__name__}: {e}"[:120]})
                rows[-1]["layout"] = name
                if cuda:
                    torch.cuda.empty_cache()
                if args.json:
                    Path(args.json).write_text(json.dumps(all_rows + rows, indent=2))
        base = next((r["ms"] for r in rows if r["optimizer"].startswith("torch AdamW bf16") and "ms" in r), None)
        print(f"# {'interleaved, median of' if interleave else 'mean of'} {iters} steps after {warmup} warm-up steps")
        print("| optimizer | ms/step | × torch bf16 | × torch bf16, paired | weight B/param | state B/param | GB/s |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in rows:
            if "error" in r:
                print(f"| {r['optimizer']} | error: {r['error']} | | | | | |")
            else:
                ratio = f"{r['ms'] / base:.2f}" if base else "-"
                paired = f"{r['paired']:.2f}" if "paired" in r else "-"
                print(f"| {r['optimizer']} | {r['ms']:.2f} | {ratio} | {paired} | {r['weight_bytes_per_param']:.0f} "
                      f"| {r['state_bytes_per_param']:.2f} | {r['GB/s']:.1f} |")
        all_rows += rows
    if args.json:
        Path(args.json).write_text(json.dumps(all_rows, indent=2))


if __name__ == "__main__":
    main()
