"""Contrastive loss forward+backward: time and peak extra memory of each implementation, one run.

Compares, on the same inputs (world size 1, L2-normalised random features, logit scale 100):
  * ``recipe.loss.ClipLoss(mode="plain")``: fp32 ``B x B`` logit blocks and ``F.cross_entropy``;
  * ``recipe.loss.ClipLoss(mode="chunked")`` for each ``--chunk-size``: tiled online log-sum-exp;
  * open_clip's ``ClipLoss`` (``open_clip_torch``, bench extra), if installed.

Time: median wall time of ``--repeats`` forward+backward passes after ``--warmup`` passes (CUDA:
synchronised before and after each pass); on CPU also the median process CPU time of a pass, which
tells a busy machine (wall >> CPU / threads) from a slow implementation. On a shared machine use
``--threads 1``: oversubscribed OpenMP threads slow the many small ops of the chunked mode most.

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
    python benchmarks/bench_loss.py --device cuda                    # B 8192..131072, D 512,1024, bf16
    python benchmarks/bench_loss.py --batch 2048 --dim 512 --dtype bfloat16 --chunk-size 256 1024
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from recipe.loss import ClipLoss  # noqa: E402

LossFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
MIB = 2**20


def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name) if name else None
    except OSError:
        return None


class CpuPeakRss:
    """Peak resident-set growth of this process over a region (Linux ``VmHWM`` reset trick)."""

    def __init__(self) -> None:
        self.libc = _libc()
        self.available = sys.platform.startswith("linux") and self._reset_hwm()

    @staticmethod
    def _status_kib(field: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
        raise KeyError(field)

    @staticmethod
    def _reset_hwm() -> bool:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
            return True
        except OSError:
            return False

    def start(self) -> None:
        gc.collect()
        if self.libc is not None and hasattr(self.libc, "malloc_trim"):
            self.libc.malloc_trim(0)
        self._reset_hwm()
        self.base_kib = self._status_kib("VmRSS")

    def stop_mib(self) -> float:
        return (self._status_kib("VmHWM") - self.base_kib) / 1024


def implementations(chunk_sizes: list[int]) -> dict[str, LossFn | None]:
    """Name -> loss callable ``fn(image, text, scale)``; ``None`` marks a missing optional package."""
    impls: dict[str, LossFn | None] = {"plain": ClipLoss(mode="plain", validate=False)}
    for chunk in chunk_sizes:
        impls[f"chunked c={chunk}"] = ClipLoss(mode="chunked", chunk_size=chunk, validate=False)
    try:
        from open_clip.loss import ClipLoss as OpenClipLoss
    except ImportError:
        impls["open_clip"] = None
    else:
        impls["open_clip"] = OpenClipLoss()
    return impls


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


def measure(fn: LossFn, inputs, device: torch.device, warmup: int, repeats: int, cpu_rss: CpuPeakRss):
    """Returns ``(median wall ms, median process CPU ms, peak extra MiB or None, loss)``."""
    for _ in range(warmup):
        run_once(fn, *inputs)
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
    times, cpu_times = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0, c0 = time.perf_counter(), time.process_time()
        run_once(fn, *inputs)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        cpu_times.append((time.process_time() - c0) * 1e3)
    return statistics.median(times), statistics.median(cpu_times), peak, loss


def _is_oom(err: BaseException) -> bool:
    oom_types = (MemoryError, torch.cuda.OutOfMemoryError)
    return isinstance(err, oom_types) or "out of memory" in str(err).lower()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, nargs="+", help="global batch sizes B (world size 1)")
    parser.add_argument("--dim", type=int, nargs="+", help="embedding dims D")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--chunk-size", type=int, nargs="+", help="chunk sizes of the chunked mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, help="timed passes (median reported)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads on CPU")
    args = parser.parse_args(argv)

    device = torch.device(args.device)
    gpu = device.type == "cuda"
    batches = args.batch or ([8192, 16384, 32768, 65536, 131072] if gpu else [1024, 2048, 4096])
    dims = args.dim or ([512, 1024] if gpu else [256])
    dtype = getattr(torch, args.dtype or ("bfloat16" if gpu else "float32"))
    chunks = args.chunk_size or ([4096] if gpu else [512])
    repeats = args.repeats or (10 if gpu else 3)
    if args.threads:
        torch.set_num_threads(args.threads)

    cpu_rss = CpuPeakRss()
    impls = implementations(chunks)
    if gpu:
        name, mem_method = torch.cuda.get_device_name(device), "torch.cuda.max_memory_allocated"
    else:
        name = f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"
        mem_method = "peak RSS (VmHWM) growth" if cpu_rss.available else "n/a"
    print(f"# bench_loss: {name}; torch {torch.__version__}; dtype {str(dtype).removeprefix('torch.')}; "
          f"world size 1; fwd+bwd median of {repeats}; memory = {mem_method} beyond the inputs\n")
    cpu_col = "" if gpu else " CPU ms |"
    print(f"| B | D | implementation | fwd+bwd ms |{cpu_col} peak extra MiB | loss |")
    print("|---:|---:|---|---:|" + ("" if gpu else "---:|") + "---:|---:|")
    for batch in batches:
        for dim in dims:
            inputs = make_inputs(batch, dim, dtype, device)
            for impl, fn in impls.items():
                if fn is None:
                    print(f"| {batch} | {dim} | {impl} | not installed |{cpu_col and ' |'} | |")
                    continue
                try:
                    ms, cpu_ms, peak, loss = measure(fn, inputs, device, args.warmup, repeats, cpu_rss)
                except (RuntimeError, MemoryError) as err:
                    if not _is_oom(err):
                        raise
                    print(f"| {batch} | {dim} | {impl} | OOM |{cpu_col and ' |'} | |")
                    continue
                finally:
                    gc.collect()
                    if gpu:
                        torch.cuda.empty_cache()
                peak_s = "n/a" if peak is None else f"{peak:.1f}"
                cpu_s = "" if gpu else f" {cpu_ms:.1f} |"
                print(f"| {batch} | {dim} | {impl} | {ms:.1f} |{cpu_s} {peak_s} | {loss:.6f} |", flush=True)
            del inputs


if __name__ == "__main__":
    main()
