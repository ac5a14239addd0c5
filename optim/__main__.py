"""``python -m optim``: a one-minute demonstration of why stochastic rounding matters.

Fits a small linear regression with AdamW at a low learning rate, where each update is smaller than
half a unit in the last place of bfloat16 weights: float32 weights learn, bfloat16 weights with
round-to-nearest stall, SRAdamW's bfloat16 and float16 weights (no master copy, half-precision
states) follow float32.
"""

from __future__ import annotations

import argparse
import json

import torch

from . import SRAdamW


def fit(dtype: torch.dtype, make_opt, steps: int, seed: int) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(512, 64, generator=gen)
    w_true = torch.randn(64, generator=gen)
    b = a @ w_true + 0.01 * torch.randn(512, generator=gen)
    w = torch.nn.Parameter((4 + torch.randn(64, generator=gen)).to(dtype))  # weights far from 0
    opt = make_opt([w])
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = ((a @ w.float() - b) ** 2).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    lr = args.lr
    runs = {
        "fp32 weights, torch AdamW": (torch.float32, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)),
        "bf16 weights, torch AdamW (round-to-nearest)": (
            torch.bfloat16, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.0)
        ),
        "bf16 weights + bf16 states, SRAdamW": (
            torch.bfloat16, lambda ps: SRAdamW(ps, lr=lr, weight_decay=0.0, seed=args.seed)
        ),
        "fp16 weights + fp16 states, SRAdamW": (
            torch.float16, lambda ps: SRAdamW(ps, lr=lr, weight_decay=0.0, seed=args.seed)
        ),
    }
    results = {}
    print(f"linear regression, {args.steps} AdamW steps at lr={lr}: mean squared error")
    print(f"{'run':48s} {'start':>10s} {'final':>10s}")
    for name, (dtype, make) in runs.items():
        losses = fit(dtype, make, args.steps, args.seed)
        results[name] = {"start": losses[0], "final": losses[-1]}
        print(f"{name:48s} {losses[0]:10.4f} {losses[-1]:10.4f}")
    print(json.dumps({k: round(v["final"], 5) for k, v in results.items()}))


if __name__ == "__main__":
    main()
