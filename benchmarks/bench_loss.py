"""Contrastive loss forward+backward: time and peak extra memory of each implementation, one run.

Compares, on the same inputs (world size 1, L2-normalised random features, logit scale 100):
  * ``recipe.loss.ClipLoss(mode="plain")``: fp32 ``B x B`` logit blocks and ``F.cross_entropy``;
  * ``recipe.loss.ClipLoss(mode="chunked")`` for each ``--chunk-size``: tiled online log-sum-exp;
  * ``recipe.loss.ClipLoss(mode="fused")``: the Triton kernels of ``recipe/loss/fused.py`` (GPU;
    on the CPU only with ``--impls fused``, where they run in Triton's interpreter and the timing
    means nothing), plus one row per ``--fused-tiles`` configuration;
  * open_clip's ``ClipLoss`` (``open_clip_torch``, bench extra), if installed.

FLOP floor: a loss that keeps ``O(B D)`` memory must recompute the similarities in the backward, so
it needs at least ``8 B^2 D`` matrix-multiply flops (``2 B^2 D`` forward, ``2 B^2 D`` recompute,
``4 B^2 D`` for the two feature gradients). The "x floor" column is each time over ``8 B^2 D`` at the
matmul rate measured at the start of the run (``torch.mm`` of two square matrices in the feature
dtype; ``--matmul-tflops`` overrides it).

Large batches: an implementation is skipped at a batch where the previous batch's pass time, scaled
by ``B^2 D``, predicts more than ``--max-pass-s`` per pass, and after it ran out of memory at a
smaller batch of the same ``D``; the number of timed passes is cut so that they fit in
``--time-budget-s``.

Time: median wall time of ``--repeats`` forward+backward passes after ``--warmup`` passes (CUDA:
synchronised before and after each pass); on CPU also the median process CPU time of a pass, which
tells a busy machine (wall >> CPU / threads) from a slow implementation. On a shared machine use
``--threads 1``: oversubscribed OpenMP threads slow the many small ops of the chunked mode most.
On the CPU the timed passes are interleaved by default (``--interleave``: one pass of each
implementation per round, rounds repeated), so that load changes on a shared machine hit every
implementation alike; ``--no-interleave`` times each implementation's passes back to back as on CUDA.
The "x open_clip" columns are each row's time (CPU time on the CPU, where it is robust to other
processes; wall time on CUDA) and peak extra memory over open_clip's at the same ``B`` and ``D``.

Peak memory "beyond the inputs" (the inputs being the two ``B x D`` feature tensors and the scale)
is measured over one forward+backward pass after the warm-up (so that one-time costs such as
loading code pages or thread pools are not counted), with the gradients freed before it, so the
pass also allocates the feature gradients:
  * CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` before the pass,
    after ``reset_peak_memory_stats``;
  * CPU: the rise of the process's peak resident set size (``VmHWM`` in ``/proc/self/status``) over
    the resident size before the pass, after returning freed heap memory to the OS with
    ``malloc_trim(0)`` and resetting ``VmHWM`` through ``/proc/self/clear_refs``. This counts every
    page the pass touches (allocator overhead included), so it is an upper bound of the live tensor
    bytes; Linux only, "n/a" elsewhere.

The loss column shows that all implementations compute the same value.

Usage:
    python benchmarks/bench_loss.py                                  # CPU: B 1024..4096, D 256, fp32
    python benchmarks/bench_loss.py --threads 1 --dtype float32 bfloat16 --dim 256 512   # CPU, issue 17
    python benchmarks/bench_loss.py --device cuda                    # B 8192..1048576, D 512,1024, bf16
    python benchmarks/bench_loss.py --batch 2048 --dim 512 --dtype bfloat16 --chunk-size 256 1024
    python benchmarks/bench_loss.py --device cuda --impls fused --batch 32768 --dim 1024 \
        --fused-tiles 128x128x64w8s3 128x64x64w4s3                   # tile sweep of the kernels
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import importlib.util
import platform
import re
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from _common import CpuPeakRss  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)
from recipe.loss import ClipLoss  # noqa: E402

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MIB = 2**20


IMPLS = ("plain", "chunked", "fused", "open_clip")
#: Default chunk size of the chunked rows on the CPU (issue 17): as fast as 512 with fp32 features
#: (5-10 % slower with bf16) at a smaller footprint, the only edge that keeps bf16 near 0.3x
#: open_clip's peak extra memory at B = 1024 (512: 0.6-1.2x there).
CPU_CHUNK = 256


def _fused_with_tiles(spec: str, dtype: torch.dtype, dim: int) -> LossFn:
    """World-size-1 fused loss with an explicit tile configuration ``<BM>x<BN>x<BK>w<warps>s<stages>``,
    optionally ``b<cols>``: the backward's smallest band width (``min_band_cols``)."""
    from recipe.loss import fused

    match = re.fullmatch(r"(\d+)x(\d+)x(\d+)w(\d+)s(\d+)(?:b(\d+))?", spec)
    if match is None:
        raise SystemExit(f"--fused-tiles: expected e.g. 128x128x64w8s3 or 128x64x64w8s3b1024, got {spec!r}")
    bm, bn, bk, warps, stages = map(int, match.groups()[:5])
    cfg = dataclasses.replace(
        fused.default_config(dtype, dim), block_m=bm, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages
    )
    if match.group(6):
        cfg = dataclasses.replace(cfg, min_band_cols=int(match.group(6)))

    def loss(image: torch.Tensor, text: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        ce_i2t, ce_t2i, _, _ = fused.fused_symmetric_cross_entropy(image, text, scale.float(), cfg)
        return (ce_i2t.sum() + ce_t2i.sum()) / (2 * image.shape[0])

    return loss


def implementations(
    chunk_sizes: list[int],
    names: tuple[str, ...] = IMPLS,
    fused_tiles: tuple[str, ...] = (),
    dtype: torch.dtype = torch.bfloat16,
    dim: int = 1024,
) -> dict[str, LossFn | None]:
    """Name -> loss callable ``fn(image, text, scale)``; ``None`` marks a missing optional package."""
    impls: dict[str, LossFn | None] = {}

    def recipe_loss(mode: str, chunk_size: int = 4096) -> LossFn:
        fn = ClipLoss(mode=mode, chunk_size=chunk_size, validate=False)
        return lambda image, text, scale: fn(image, text, scale).loss

    if "plain" in names:
        impls["plain"] = recipe_loss("plain")
    if "chunked" in names:
        for chunk in chunk_sizes:
            impls[f"chunked c={chunk}"] = recipe_loss("chunked", chunk)
    if "fused" in names:
        have_triton = importlib.util.find_spec("triton") is not None
        impls["fused"] = recipe_loss("fused") if have_triton else None
        for spec in fused_tiles:
            impls[f"fused {spec}"] = _fused_with_tiles(spec, dtype, dim) if have_triton else None
    if "open_clip" in names:
        try:
            from open_clip.loss import ClipLoss as OpenClipLoss
        except ImportError:
            impls["open_clip"] = None
        else:
            impls["open_clip"] = OpenClipLoss()
    return impls


def matmul_tflops(dtype: torch.dtype, device: torch.device) -> tuple[float, str]:
    """Measured ``torch.mm`` rate of two square matrices in ``dtype`` (TFLOP/s) and a description."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    reps, t0 = 0, time.perf_counter()
    while reps < 5 or time.perf_counter() - t0 < 1.0:
        a @ b
        reps += 1
        if device.type == "cuda" and reps % 5 == 0:
            sync()
    sync()
    seconds = (time.perf_counter() - t0) / reps
    return 2 * n**3 / seconds / 1e12, f"{n}^3 torch.mm, {str(dtype).removeprefix('torch.')}"


def make_inputs(batch: int, dim: int, dtype: torch.dtype, device: torch.device, seed: int = 0):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    image = F.normalize(torch.randn(batch, dim, generator=gen), dim=1)
    text = F.normalize(image + 0.5 * torch.randn(batch, dim, generator=gen), dim=1)
    image = image.to(device=device, dtype=dtype).requires_grad_()
    text = text.to(device=device, dtype=dtype).requires_grad_()
    scale = torch.tensor(100.0, device=device, requires_grad=True)
    return image, text, scale


def run_once(fn: LossFn, image, text, scale) -> float:
    for t in (image, text, scale):
        t.grad = None
    loss = fn(image, text, scale)
    loss.backward()
    return float(loss.detach())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def warm_and_peak(fn: LossFn, inputs, device: torch.device, warmup: int, cpu_rss: CpuPeakRss):
    """Warm-up passes, then one pass measuring the peak extra memory.

    Returns ``(peak extra MiB or None, loss, seconds of the last warm-up pass or None)``.
    """
    pass_s = None
    for _ in range(warmup):
        _sync(device)
        t0 = time.perf_counter()
        run_once(fn, *inputs)
        _sync(device)
        pass_s = time.perf_counter() - t0
    for t in inputs:
        t.grad = None
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        loss = run_once(fn, *inputs)
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / MIB
    else:
        if cpu_rss.available:
            cpu_rss.start()
        loss = run_once(fn, *inputs)
        peak = cpu_rss.stop_mib() if cpu_rss.available else None
    return peak, loss, pass_s


def timed_pass(fn: LossFn, inputs, device: torch.device) -> tuple[float, float]:
    """``(wall ms, process CPU ms)`` of one forward+backward pass."""
    _sync(device)
    t0, c0 = time.perf_counter(), time.process_time()
    run_once(fn, *inputs)
    _sync(device)
    return (time.perf_counter() - t0) * 1e3, (time.process_time() - c0) * 1e3


def measure_interleaved(
    fns: dict[str, LossFn],
    inputs,
    device: torch.device,
    warmup: int,
    repeats: int,
    cpu_rss: CpuPeakRss,
    time_budget_s: float = float("inf"),
) -> dict[str, tuple]:
    """Times the implementations ``fns`` with their timed passes alternating (one pass of each per
    round), so that a load change on a shared machine hits all of them alike; one implementation
    alone is timed the same way. The timed passes are at most ``repeats`` and at most what fits in
    ``time_budget_s`` times the number of implementations at the speed of their last warm-up passes
    (at least one).

    Returns name -> ``(median wall ms, median CPU ms, peak MiB or None, loss, passes)`` or the
    exception an implementation raised in its warm-up.
    """
    warm: dict[str, tuple] = {}
    out: dict[str, tuple | BaseException] = {}
    for name, fn in fns.items():
        try:
            warm[name] = warm_and_peak(fn, inputs, device, warmup, cpu_rss)
        except (RuntimeError, MemoryError) as err:
            out[name] = err
        finally:
            for t in inputs:
                t.grad = None
            gc.collect()
    total_s = sum(w[2] or 0.0 for w in warm.values())
    if total_s > 0:
        repeats = max(1, min(repeats, int(time_budget_s * max(1, len(warm)) / total_s)))
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in warm}
    for _ in range(repeats):
        for name in warm:
            times[name].append(timed_pass(fns[name], inputs, device))
    for name, (peak, loss, _) in warm.items():
        wall, cpu = zip(*times[name])
        out[name] = (statistics.median(wall), statistics.median(cpu), peak, loss, repeats)
    return out


def _is_oom(err: BaseException) -> bool:
    oom_types = (MemoryError, torch.cuda.OutOfMemoryError)
    return isinstance(err, oom_types) or "out of memory" in str(err).lower()


def _triton_version() -> str:
    """Installed Triton version, read without importing Triton (the fused mode decides how)."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return "n/a"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", help="global batch sizes B (world size 1)")
    parser.add_argument("--dim", type=int, nargs="+", help="embedding dims D")
    parser.add_argument(
        "--dtype", nargs="+", choices=["float32", "bfloat16", "float16"], help="feature dtypes (one table each)"
    )
    parser.add_argument(
        "--impls", nargs="+", choices=IMPLS, help="implementations (default: all; on the CPU all but fused)"
    )
    parser.add_argument("--chunk-size", type=int, nargs="+", help="chunk sizes of the chunked mode")
    parser.add_argument(
        "--fused-tiles",
        nargs="+",
        default=[],
        help="extra fused rows with tiles <BM>x<BN>x<BK>w<warps>s<stages>[b<min band columns>], e.g. "
        "128x128x64w8s3, or 128x64x64w8s3b1024 (the default tiles with the earlier 1,024-column bands)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, help="timed passes (median reported)")
    parser.add_argument("--time-budget-s", type=float, default=20.0, help="cap on the timed passes of one row")
    parser.add_argument("--max-pass-s", type=float, help="skip rows predicted slower than this per pass")
    parser.add_argument("--matmul-tflops", type=float, help="matmul rate for the FLOP floor (default: measured)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads on CPU")
    parser.add_argument(
        "--interleave",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="alternate the implementations' timed passes (default: on the CPU)",
    )
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batches = args.batch or (
        [8192, 16384, 32768, 65536, 131072, 262144, 524288, 1048576] if gpu else [1024, 2048, 4096]
    )
    dims = args.dim or ([512, 1024] if gpu else [256])
    dtypes = [getattr(torch, d) for d in (args.dtype or ["bfloat16" if gpu else "float32"])]
    chunks = args.chunk_size or ([4096] if gpu else [CPU_CHUNK])
    repeats = args.repeats or (10 if gpu else 3)
    max_pass_s = args.max_pass_s or (60.0 if gpu else 120.0)
    names = tuple(args.impls or (IMPLS if gpu else tuple(n for n in IMPLS if n != "fused")))
    interleave = (not gpu) if args.interleave is None else args.interleave
    if args.threads:
        torch.set_num_threads(args.threads)

    cpu_rss = CpuPeakRss()
    for dtype in dtypes:
        _table(args, device, dtype, batches, dims, chunks, repeats, max_pass_s, names, interleave, cpu_rss)
        print()


def _table(args, device, dtype, batches, dims, chunks, repeats, max_pass_s, names, interleave, cpu_rss) -> None:
    """Measures and prints one dtype's table."""
    gpu = device.type == "cuda"
    if args.matmul_tflops:
        tflops, how = args.matmul_tflops, "given"
    else:
        tflops, how = matmul_tflops(dtype, device)
    if gpu:
        name, mem_method = torch.cuda.get_device_name(device), "torch.cuda.max_memory_allocated"
    else:
        name = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        mem_method = "peak RSS (VmHWM) growth" if cpu_rss.available else "n/a"
    order = "interleaved rounds" if interleave else "consecutive passes"
    print(
        f"# bench_loss: {name}; torch {torch.__version__}; triton {_triton_version()}; "
        f"{datetime.date.today().isoformat()}; dtype {str(dtype).removeprefix('torch.')}; world size 1; "
        f"fwd+bwd median of up to {repeats} ({order}; time budget {args.time_budget_s:g} s per row); "
        f"memory = {mem_method} beyond the inputs; FLOP floor 8 B^2 D at {tflops:.3g} TFLOP/s ({how})\n"
    )
    cpu_col = "" if gpu else " CPU ms |"
    print(
        f"| B | D | implementation | fwd+bwd ms |{cpu_col} floor ms | x floor | peak extra MiB | loss "
        "| x open_clip time | x open_clip mem |"
    )
    print("|---:|---:|---|---:|" + ("" if gpu else "---:|") + "---:|---:|---:|---:|---:|---:|")
    blank = f"{cpu_col and ' |'} | | | | |"
    for dim in dims:
        impls = implementations(chunks, names, tuple(args.fused_tiles), dtype, dim)
        last: dict[str, tuple[int, float]] = {}  # impl -> (B, pass seconds) of its last measured row
        oom_at: dict[str, int] = {}
        for batch in batches:
            floor_ms = 8 * batch**2 * dim / (tflops * 1e12) * 1e3
            rows: list[tuple[str, str | tuple]] = []  # (impl, message or measurement), printed at the end
            runnable: dict[str, LossFn] = {}
            for impl, fn in impls.items():
                if fn is None:
                    rows.append((impl, "not installed"))
                elif impl in oom_at:
                    rows.append((impl, f"skipped (OOM at B={oom_at[impl]})"))
                elif impl in last and last[impl][1] * (batch / last[impl][0]) ** 2 > max_pass_s:
                    predicted = last[impl][1] * (batch / last[impl][0]) ** 2
                    rows.append((impl, f"skipped (~{predicted:.0f} s/pass predicted)"))
                else:
                    rows.append((impl, "pending"))
                    runnable[impl] = fn
            inputs = make_inputs(batch, dim, dtype, device) if runnable else None
            results: dict[str, tuple | BaseException] = {}
            if interleave and runnable:
                results = measure_interleaved(
                    runnable, inputs, device, args.warmup, repeats, cpu_rss, args.time_budget_s
                )
            for impl, fn in runnable.items():
                if not interleave:
                    try:
                        results[impl] = measure_interleaved({impl: fn}, inputs, device, args.warmup, repeats, cpu_rss,
                                                           args.time_budget_s)[impl]
                    except (RuntimeError, MemoryError) as err:
                        results[impl] = err
                    finally:
                        for t in inputs:
                            t.grad = None
                        gc.collect()
                        if gpu:
                            torch.cuda.empty_cache()
                if isinstance(results[impl], BaseException):
                    if not _is_oom(results[impl]):
                        raise results[impl]
                    oom_at[impl] = batch
                    results[impl] = "OOM"
                else:
                    last[impl] = (batch, results[impl][0] / 1e3)
            ref = results.get("open_clip")
            ref = ref if isinstance(ref, tuple) else None
            for impl, status in rows:
                got = results.get(impl, status)
                if isinstance(got, str):
                    print(f"| {batch} | {dim} | {impl} | {got} |{blank} |")
                    continue
                ms, cpu_ms, peak, loss, passes = got
                peak_s = "n/a" if peak is None else f"{peak:.1f}"
                cpu_s = "" if gpu else f" {cpu_ms:.1f} |"
                reps = "" if passes == repeats else f" ({passes} passes)"
                t_ratio = m_ratio = ""
                if ref is not None:
                    # CPU time on the CPU (robust to other processes), wall time on CUDA
                    t_ratio = f"{(ms / ref[0]) if gpu else (cpu_ms / ref[1]):.2f}"
                    if peak is not None and ref[2]:
                        m_ratio = f"{peak / ref[2]:.2f}"
                print(
                    f"| {batch} | {dim} | {impl} | {ms:.1f}{reps} |{cpu_s} {floor_ms:.3g} | {ms / floor_ms:.2f} "
                    f"| {peak_s} | {loss:.6f} | {t_ratio} | {m_ratio} |",
                    flush=True,
                )
            del inputs


if __name__ == "__main__":
    main()
