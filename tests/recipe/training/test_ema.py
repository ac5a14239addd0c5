"""The EMA of the weights (``--ema-decay``, :mod:`recipe.training.ema`).

In process: the EMA follows the recurrence computed independently in fp64 from the recorded live
weights (fp32: to 1e-6; bf16/fp16 with stochastic rounding: an error whose mean over the elements
is zero within a 5-sigma bound, where a round-to-nearest EMA freezes and fails the same check),
skipped steps leave it untouched, sharded updates give the unsharded bits, state round trips.

Under DeepSpeed (2 CPU ranks): every checkpoint holds a complete EMA state dict with the model's
names under ZeRO-2 and ZeRO-3, each saved EMA is the previous one updated with the saved live weights
(bit for bit), a skipped step leaves it as it was, resume continues it bit-identically, and the
evaluation reports ``ema_`` metrics (also standalone: ``python -m recipe.evaluate --ema``).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from optim.rounding import random_bits, round_with_bits
from recipe.training.ema import ModelEMA, ema_decay_at, ema_update_, noise_key

from ...dist_utils import run_distributed
from ..test_train import ENV, _train_worker, ds_json, losses_of, train_cfg

# --------------------------------------------------------------------------------------------------
# in process
# --------------------------------------------------------------------------------------------------


def _toy() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU(), torch.nn.Linear(32, 4)
    )


@pytest.mark.parametrize("warmup", [False, True])
def test_fp32_ema_follows_the_fp64_recurrence(warmup: bool) -> None:
    model, decay = _toy(), 0.9
    ema = ModelEMA(model, decay, warmup=warmup)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    for t in range(30):
        loss = model(torch.randn(8, 16)).square().mean()  # train mode: BatchNorm statistics move
        opt.zero_grad()
        loss.backward()
        opt.step()
        assert ema.update()
        d = min(decay, (1 + t) / (10 + t)) if warmup else decay
        for n, p in model.named_parameters():
            ref[n] = d * ref[n] + (1 - d) * p.detach().double()
    state = ema.full_state_dict()
    assert list(state) == list(model.state_dict())  # the model's names, in its order
    for n, r in ref.items():
        assert state[n].dtype == torch.float32
        assert (state[n].double() - r).abs().max() <= 1e-6 * r.abs().max(), n
        assert not torch.equal(state[n], model.state_dict()[n])  # an average, not the live weights
    for n, b in model.named_buffers():  # copied, not averaged
        assert torch.equal(state[n], b), n
    assert ema.updates == 30


def _drifting(dtype: torch.dtype, steps: int, n: int = 1 << 14) -> tuple[torch.Tensor, list[torch.Tensor], float]:
    """Slowly moving half weights in [1, 2) (one ulp there): each element drifts at 0..0.1 ulp per
    step, stored round-to-nearest; returns the initial weights, the live weights after every step
    and the ulp."""
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-10
    g = torch.Generator().manual_seed(1)
    w0 = 1.2 + 0.4 * torch.rand(n, generator=g, dtype=torch.float64)
    rate = 0.1 * ulp * torch.rand(n, generator=g, dtype=torch.float64)
    return w0.to(dtype), [(w0 + rate * (t + 1)).to(dtype) for t in range(steps)], ulp


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_ema_is_unbiased_where_round_to_nearest_freezes(dtype: torch.dtype) -> None:
    decay, steps = 0.99, 250
    w0, live, ulp = _drifting(dtype, steps)
    n = w0.numel()
    p = torch.nn.Parameter(w0.clone())
    module = torch.nn.Module()
    module.w = p
    ema = ModelEMA(module, decay, seed=7)
    ref, rtn = w0.double(), w0.clone()
    for w in live:
        p.data.copy_(w)
        ema.update()
        ref = decay * ref + (1 - decay) * w.double()
        rtn = torch.lerp(rtn.float(), w.float(), 1 - decay).to(dtype)  # round-to-nearest EMA
    got = ema.full_state_dict()["w"]
    assert got.dtype == dtype
    err = (got.double() - ref) / ulp
    rtn_err = (rtn.double() - ref) / ulp
    # Each element's error e_t = d e_(t-1) + r_t with independent zero-mean rounding errors |r_t| < 1
    # ulp of variance <= 1/4 ulp^2 (SR is unbiased; the fp32 update adds < 2**-16 ulp): its standard
    # deviation is <= 1/(2 sqrt(1 - d^2)) ulp, and the mean over n elements is within 5 sigma of 0:
    sigma = 0.5 / math.sqrt(1 - decay**2)
    bound = 5 * sigma / math.sqrt(n)  # 0.14 ulp
    assert abs(err.mean().item()) <= bound, (err.mean().item(), bound)
    assert err.square().mean().sqrt().item() <= sigma  # and the error is small element by element
    moved = (ref - w0.double()).mean().item() / ulp
    assert moved > 5  # the exact average moved by several ulps...
    assert torch.equal(rtn, w0)  # ...while round-to-nearest froze at the initial weights
    assert abs(rtn_err.mean().item()) > 50 * bound  # and fails the same check


def test_skipped_steps_leave_the_ema_untouched() -> None:
    model = _toy().to(torch.bfloat16)
    ema = ModelEMA(model, 0.5, warmup=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    assert ema.update()
    before = {k: v.clone() for k, v in ema.full_state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
        model[1].running_mean.add_(1.0)
    assert not ema.update(skipped=True)
    after = ema.full_state_dict()
    assert ema.updates == 1 and all(torch.equal(before[k], after[k]) for k in before)
    assert ema.update()  # the next one is update 2, with the decay of t = 1
    assert ema.updates == 2 and ema_decay_at(0.5, True, 1) == pytest.approx(2 / 11)
    assert not torch.equal(before["0.weight"], ema.full_state_dict()["0.weight"])


def test_frozen_parameters_keep_no_copy() -> None:
    model = _toy().to(torch.bfloat16)
    model[0].requires_grad_(False)  # a locked layer
    ema = ModelEMA(model, 0.5)
    frozen = sum(p.numel() for p in model[0].parameters())
    total = sum(p.numel() for p in model.parameters())
    assert ema.bytes_per_param() == pytest.approx(2 * (total - frozen) / total)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update()
    state = ema.full_state_dict()
    assert list(state) == list(model.state_dict())
    assert torch.equal(state["0.weight"], model[0].weight) and not torch.equal(state["3.weight"], model[3].weight)


def test_sharded_update_matches_the_whole_tensor() -> None:
    """Noise indexed by the element's place in the whole parameter: ZeRO-3 partitions (the last one
    padded) give the bits of the unsharded update."""
    g = torch.Generator().manual_seed(0)
    full, live = (torch.randn(1001, generator=g).to(torch.bfloat16) for _ in range(2))
    key = noise_key(0, 5, 3)
    whole = full.clone()
    ema_update_(whole, live, 0.999, key)
    part = 501
    shards = [torch.zeros(part, dtype=torch.bfloat16) for _ in range(2)]
    for r, s in enumerate(shards):
        valid = min(part, 1001 - r * part)
        s[:valid] = full[r * part : r * part + valid]
        ema_update_(s[:valid], live[r * part : r * part + valid], 0.999, key, offset=r * part)
    assert torch.equal(torch.cat(shards)[:1001], whole)
    other = full.clone()
    ema_update_(other, live, 0.999, noise_key(0, 5, 4))
    assert not torch.equal(other, whole)  # a new draw at every update
    assert not torch.equal(whole, full)  # far below half an ulp, yet some elements move


def test_state_round_trip_continues_bit_identically_and_swap_restores(tmp_path: Path) -> None:
    from recipe.run.checkpoint import EMA_WEIGHTS

    model = _toy().to(torch.bfloat16)
    a = ModelEMA(model, 0.999, seed=3)
    steps = [{n: torch.randn_like(p) * 0.05 for n, p in model.named_parameters()} for _ in range(6)]

    def step(ema: ModelEMA, delta: dict) -> None:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(delta[n])
        ema.update()

    for d in steps[:3]:
        step(a, d)
    torch.save(a.full_state_dict(), tmp_path / EMA_WEIGHTS)
    saved = torch.load(tmp_path / EMA_WEIGHTS, weights_only=True)
    b = ModelEMA(model, 0.999, seed=3)
    assert not b.restore(tmp_path / "elsewhere", None)  # a checkpoint without an EMA: restart from the weights
    live = {k: v.clone() for k, v in model.state_dict().items()}
    assert b.updates == 0 and all(torch.equal(v, live[k]) for k, v in b.full_state_dict().items())
    assert b.restore(tmp_path, a.client_state()) and b.updates == 3
    with b.swapped_in() as m:
        assert all(torch.equal(m.state_dict()[k], saved[k]) for k in saved)
    assert all(torch.equal(model.state_dict()[k], live[k]) for k in live)  # the live weights are back
    for d in steps[3:]:  # both see the same live weights: a continues, b resumed
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(d[n])
        a.update()
        b.update()
    sa, sb = a.full_state_dict(), b.full_state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)


# --------------------------------------------------------------------------------------------------
# under DeepSpeed, 2 CPU ranks
# --------------------------------------------------------------------------------------------------


def _run(cfgs: list[dict], nan_call: int | None = None) -> list:
    return run_distributed(_train_worker, 2, cfgs, nan_call, init_process_group=False, env=ENV, timeout_s=900)


def _weights(run: Path, step: int, name: str) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / f"step{step:08d}" / name, map_location="cpu", weights_only=True)


def _expected(prev: dict, live: dict, names: list[str], decay: float, seed: int, update: int) -> dict:
    """One EMA update of the whole tensors, from the optim.rounding primitives."""
    out = dict(live)  # buffers: copied
    for i, n in enumerate(names):
        x = torch.lerp(prev[n].float(), live[n].float(), 1 - decay)
        bits = random_bits(noise_key(seed, i, update), 0, x.numel())
        out[n] = round_with_bits(x.contiguous(), prev[n].dtype, bits)
    return out


def _check_complete(run: Path, step: int) -> tuple[dict, dict]:
    model, ema = _weights(run, step, "model_weights.pt"), _weights(run, step, "ema_weights.pt")
    assert list(ema) == list(model)  # every parameter and buffer, with the model's names
    for k, v in model.items():
        assert ema[k].shape == v.shape and ema[k].dtype == v.dtype, k
    assert all(v.dtype == torch.bfloat16 for k, v in ema.items() if v.is_floating_point())
    return model, ema


def _param_names(run: Path) -> list[str]:
    from recipe.export import load_run

    return [n for n, _ in load_run(run).model.named_parameters()]


def test_zero2_checkpoints_skips_and_evaluates_the_ema(data: Path, tmp_path: Path) -> None:
    ds = ds_json(tmp_path, "zero2_bf16_halfmaster.json")
    run = tmp_path / "run"
    cfg = train_cfg(data, run, ds, steps=4, save_every=1, optim={"ema_decay": 0.9})
    final = _run([cfg], nan_call=3)[0][0]  # step 3 is skipped
    assert final["nonfinite_steps"] == 1 and final["ema"]["updates"] == 3
    assert final["ema"]["bytes_per_param"] == 2.0  # a full bf16 copy on every rank
    names = _param_names(run)
    ckpt = {s: _check_complete(run, s) for s in range(1, 5)}
    # step 2: the EMA of step 1 updated with the live weights of step 2 (update 2), bit for bit
    exp = _expected(ckpt[1][1], ckpt[2][0], names, 0.9, 0, 2)
    assert all(torch.equal(ckpt[2][1][k], exp[k]) for k in exp)
    # step 3 was skipped: weights and EMA as they were
    for k in ckpt[3][1]:
        assert torch.equal(ckpt[3][0][k], ckpt[2][0][k]) and torch.equal(ckpt[3][1][k], ckpt[2][1][k]), k
    exp = _expected(ckpt[3][1], ckpt[4][0], names, 0.9, 0, 3)
    assert all(torch.equal(ckpt[4][1][k], exp[k]) for k in exp)
    differ = sum(int((ckpt[4][1][n] != ckpt[4][0][n]).sum()) for n in names)
    assert differ > 0.5 * sum(ckpt[4][0][n].numel() for n in names)  # an average, not the live weights
    client = torch.load(run / "checkpoints" / "step00000004" / "rank00001.pt", weights_only=False)
    assert client["ema"]["updates"] == 3
    # evaluation: live and EMA metrics in the run, and the EMA on its own
    for k in ("retrieval_r1", "zeroshot_top1", "eval_samples"):
        assert k in final and f"ema_{k}" in final, k
    from recipe.evaluate import main as evaluate_main
    from recipe.export import load_run

    standalone = evaluate_main(["--checkpoint", str(run), "--ema", "--no-progress"])
    for k in ("zeroshot_top1", "i2t_r1", "t2i_r5"):
        assert abs(standalone[k] - final[f"ema_{k}"]) <= 1 / 24 + 1e-6, k  # one sample (float32 metrics)
    [written] = run.glob("eval_*_ema_step4.json")  # named by the run's validation data
    assert json.loads(written.read_text())["weights"] == "ema_weights.pt"
    loaded = load_run(run, ema=True)
    assert loaded.weights_file == "ema_weights.pt"
    assert all(torch.equal(v, ckpt[4][1][k].float()) for k, v in loaded.model.state_dict().items())


def test_zero3_ema_is_gathered_and_resumes_bit_identically(data: Path, tmp_path: Path) -> None:
    ds = ds_json(tmp_path, "zero3_bf16_halfmaster.json")
    optim = {"ema_decay": 0.9, "ema_warmup": True}
    full = train_cfg(data, tmp_path / "full", ds, steps=4, save_every=1, optim=optim)
    resumed = train_cfg(data, tmp_path / "resumed", ds, steps=4, save_every=2, optim=optim,
                        resume=str(tmp_path / "full" / "checkpoints" / "step00000002"))
    finals = _run([full, resumed])[0]
    run = tmp_path / "full"
    names = _param_names(run)
    ckpt = {s: _check_complete(run, s) for s in range(1, 5)}
    for s in (2, 3, 4):  # the gathered partitions are the unsharded update, bit for bit
        exp = _expected(ckpt[s - 1][1], ckpt[s][0], names, ema_decay_at(0.9, True, s - 1), 0, s)
        assert all(torch.equal(ckpt[s][1][k], exp[k]) for k in exp), s
    a, b = losses_of(tmp_path / "full"), losses_of(tmp_path / "resumed")
    assert sorted(b) == [3, 4] and all(b[s] == a[s] for s in b)
    ema_b = _weights(tmp_path / "resumed", 4, "ema_weights.pt")
    assert all(torch.equal(ema_b[k], ckpt[4][1][k]) for k in ema_b)  # bit-identical continuation
    for f in finals:
        assert f["ema"]["updates"] == 4 and f["ema"]["bytes_per_param"] < 1.1  # this rank's half
    assert {k: v for k, v in finals[0].items() if k.startswith("ema_")} == {
        k: v for k, v in finals[1].items() if k.startswith("ema_")
    }
    assert "ema_retrieval_r1" in finals[0] and "ema_zeroshot_top1" in finals[0]
    assert json.loads((run / "final_metrics.json").read_text())["ema"]["decay"] == 0.9
