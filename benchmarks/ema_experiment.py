"""Why the bf16 EMA of ``--ema-decay`` is written with stochastic rounding: a round-to-nearest bf16
EMA freezes at its initial value on slowly moving weights, the SR one tracks the fp32 EMA.

Setting (seconds on a CPU): ``--n`` bf16 weights of a typical trained magnitude, ``|w|`` uniform in
[1/32, 1/16) (one binade: bf16 spacing 2**-12 there) with random signs, are trained for ``--steps``
steps the way the recipe trains bf16 weights without a master: each step ``w <- SR_bf16(w - lr * g)``
with ``g = mu + xi``, a per-weight drift ``mu ~ N(0, 0.05^2)`` and fresh noise ``xi ~ N(0, 1)``,
``lr = 2**-14`` (a quarter ulp): slowly moving weights, a random walk of about 16 ulps and a drift of
about 50 ulps RMS over 4000 steps. Four EMAs of the same live bf16 weights run side by side for each
decay ``D``:

* ``fp64``: the exact recurrence, the reference;
* ``fp32``: an fp32 EMA;
* ``bf16 RTN``: a bf16 EMA computed in fp32 and rounded to nearest;
* ``bf16 SR``: the recipe's (:func:`recipe.training.ema.ema_update_`): computed in fp32, stochastically rounded
  with counter-based noise.

Reported at the end, against the fp64 reference, in bf16 ulps at each weight's initial value: the
mean error (bias), the mean lag (the error against the direction the reference moved: ``-err *
sign(ref_T - ref_0)``, which does not average out over weights drifting both ways), its RMS and
maximum; the fraction of weights whose EMA ended at its initial value
(frozen); and the share of the reference's movement the EMA followed (the slope of its change
``ema_T - ema_0`` regressed on the reference's change, 1 = follows, 0 = frozen).

Bound: an SR EMA element's error obeys ``e_t = D e_(t-1) + r_t`` with independent zero-mean rounding
errors of variance <= 1/4 ulp^2, so its standard deviation is <= ``1/(2 sqrt(1 - D^2))`` ulp and the
mean over ``n`` independent elements (and the mean lag: the signs depend on the live weights only,
not on the EMA's noise) lies within ``5/(2 sqrt((1 - D^2) n))`` ulp of 0 (5 sigma). A
round-to-nearest EMA moves only when ``(1 - D) |w - ema|`` reaches half an ulp, i.e. when the
weights are ``1/(2(1 - D))`` ulps (500 at D = 0.999) away from the average.

Usage::

    python benchmarks/ema_experiment.py                    # n = 16384, 4000 steps, D = 0.99, 0.999
    python benchmarks/ema_experiment.py --json benchmarks/results/ema_experiment.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from optim.rounding import derive_key, random_bits, round_with_bits  # noqa: E402
from recipe.training.ema import ema_update_, noise_key  # noqa: E402

__all__ = ["ARMS", "bf16_ulp", "run", "table", "main"]

ARMS = ("fp32", "bf16 RTN", "bf16 SR")


def bf16_ulp(x: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 numbers at ``|x|`` (float64; subnormal spacing below 2**-126)."""
    e = torch.floor(torch.log2(x.abs().clamp(min=2.0**-126)))
    return torch.pow(2.0, e - 7).to(torch.float64)


def _stats(ema: torch.Tensor, ema0: torch.Tensor, ref: torch.Tensor, ref0: torch.Tensor) -> dict[str, float]:
    ulp = bf16_ulp(ref0)
    err = (ema.double() - ref) / ulp
    moved_ref = (ref - ref0) / ulp
    moved = (ema.double() - ema0.double()) / ulp
    return {
        "mean_err_ulp": err.mean().item(),
        "lag_ulp": -(err * torch.sign(moved_ref)).mean().item(),
        "rms_err_ulp": err.square().mean().sqrt().item(),
        "max_err_ulp": err.abs().max().item(),
        "frozen": (ema == ema0).double().mean().item(),
        "followed": ((moved * moved_ref).sum() / moved_ref.square().sum()).item(),
        "ref_moved_rms_ulp": moved_ref.square().mean().sqrt().item(),
    }


@torch.no_grad()
def run(n: int = 1 << 14, steps: int = 4000, decays: tuple[float, ...] = (0.99, 0.999), lr: float = 2.0**-14,
        seed: int = 0) -> dict[str, Any]:
    """Runs the experiment; returns the settings and, per decay, each arm's statistics and the bound."""
    g = torch.Generator().manual_seed(seed)
    sign = torch.randint(0, 2, (n,), generator=g) * 2 - 1
    w = (sign * (1 + torch.rand(n, generator=g)) / 32).to(torch.bfloat16)
    mu = 0.05 * torch.randn(n, generator=g)
    w0 = w.clone()
    emas = {d: {"fp64": w0.double(), "fp32": w0.float(), "bf16 RTN": w0.clone(), "bf16 SR": w0.clone()}
            for d in decays}
    t0 = time.perf_counter()
    for t in range(1, steps + 1):
        upd = w.float() - lr * (mu + torch.randn(n, generator=g))
        w = round_with_bits(upd, torch.bfloat16, random_bits(derive_key(seed, 0x5752, t), 0, n))  # SR training
        for d, e in emas.items():
            e["fp64"].mul_(d).add_(w.double(), alpha=1 - d)
            e["fp32"].lerp_(w.float(), 1 - d)
            e["bf16 RTN"] = torch.lerp(e["bf16 RTN"].float(), w.float(), 1 - d).to(torch.bfloat16)
            ema_update_(e["bf16 SR"], w, d, noise_key(seed, 0, t))
    seconds = time.perf_counter() - t0
    out: dict[str, Any] = {"settings": {"n": n, "steps": steps, "lr": lr, "seed": seed, "decays": list(decays)},
                           "seconds": seconds, "weights_moved_rms_ulp": _stats(w, w0, w.double(), w0.double())[
                               "ref_moved_rms_ulp"], "results": {}}
    for d, e in emas.items():
        ref = e["fp64"]
        sigma = 0.5 / math.sqrt(1 - d * d)
        out["results"][str(d)] = {
            "arms": {arm: _stats(e[arm], w0, ref, w0.double()) for arm in ARMS},
            "sr_sigma_bound_ulp": sigma,
            "sr_mean_bound_ulp": 5 * sigma / math.sqrt(n),
            "rtn_moves_beyond_ulp": 1 / (2 * (1 - d)),
        }
    return out


def table(result: dict[str, Any]) -> str:
    """The results as a Markdown table."""
    lines = [
        ("| D | EMA stored as | mean error (ulp) | mean lag (ulp) | RMS error (ulp) | max error (ulp) | frozen "
         "| followed |"),
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for d, r in result["results"].items():
        for arm, s in r["arms"].items():
            lines.append(f"| {d} | {arm} | {s['mean_err_ulp']:+.3f} | {s['lag_ulp']:+.3f} | {s['rms_err_ulp']:.3f} "
                         f"| {s['max_err_ulp']:.3g} "
                         f"| {100 * s['frozen']:.1f}% | {s['followed']:.3f} |")
    st = result["settings"]
    bounds = ", ".join(f"D = {d}: |mean| <= {r['sr_mean_bound_ulp']:.3f}, RMS <= {r['sr_sigma_bound_ulp']:.1f}"
                       for d, r in result["results"].items())
    lines.append("")
    lines.append(f"{st['n']} bf16 weights, {st['steps']} SR-trained steps (the weights moved "
                 f"{result['weights_moved_rms_ulp']:.0f} ulp RMS), {result['seconds']:.1f} s; errors against the "
                 f"fp64 EMA in bf16 ulps of the initial weights; SR bound (5 sigma): {bounds}.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python benchmarks/ema_experiment.py", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=1 << 14, help="number of weights")
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--decays", type=float, nargs="+", default=[0.99, 0.999])
    ap.add_argument("--lr", type=float, default=2.0**-14)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = ap.parse_args(argv)
    result = run(args.n, args.steps, tuple(args.decays), args.lr, args.seed)
    print(table(result), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
