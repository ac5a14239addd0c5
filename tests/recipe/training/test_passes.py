"""The passes of one optimizer step (recipe/training/passes.py), in one process against a plain-autograd
reference: the global contrastive batch's gradients equal those of one graph over all micro-batches
with dropout, stochastic depth and BatchNorm in play; BatchNorm statistics move once per sample; the
random-number state ends as after one forward per micro-batch; fp16 loss scaling reaches the
embedding gradients. Training under DeepSpeed with accumulation: tests/recipe/training/test_accumulation.py."""

from __future__ import annotations

import copy

import pytest
import torch

from recipe.loss import ClipLoss
from recipe.model import create_model
from recipe.training.passes import batchnorm_stats_frozen, global_passes, micro_passes, run_passes
from recipe.training.precision import DynamicLossScaler, Precision

FP32 = Precision("fp32", 0, torch.float32, torch.float32, False)


class OneProcessEngine:
    """The three calls of DeepSpeed's engine the passes make, for one process and no sharding:
    forward, ``backward(loss, scale_wrt_gas)`` (dividing by the accumulation count as DeepSpeed
    does) and ``step`` (counted; gradients stay in ``.grad`` for the test to read)."""

    def __init__(self, module: torch.nn.Module, accumulation: int) -> None:
        self.module, self.accumulation, self.steps, self.backwards = module, accumulation, 0, 0

    def __call__(self, *inputs: torch.Tensor):
        return self.module(*inputs)

    def backward(self, loss: torch.Tensor, scale_wrt_gas: bool = True) -> None:
        self.backwards += 1
        (loss / self.accumulation if scale_wrt_gas else loss).backward()

    def step(self) -> None:
        self.steps += 1


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    # BatchNorm (ResNet), dropout before the head and stochastic depth in the image tower, dropout in
    # the text tower: every kind of randomness and running statistic the second forward must repeat
    model = create_model("tiny-resnet", image_kwargs={"drop_rate": 0.3, "drop_path_rate": 0.3},
                         text_overrides={"hidden_dropout_prob": 0.2, "attention_probs_dropout_prob": 0.2})
    return model.train()


def _batches(k: int, m: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(k):
        ids = torch.randint(5, 200, (m, 12), generator=g)
        mask = torch.ones_like(ids)
        mask[:, 9:] = torch.randint(0, 2, (m, 3), generator=g)
        out.append({"pixel_values": torch.randn(m, 3, 32, 32, generator=g), "input_ids": ids, "attention_mask": mask})
    return out


def _reference(model: torch.nn.Module, batches: list[dict], rng_seed: int) -> tuple[torch.Tensor, dict]:
    """One autograd graph over every micro-batch's forward (in order, from one RNG state)."""
    torch.manual_seed(rng_seed)
    outs = [model(b["pixel_values"], b["input_ids"], b["attention_mask"]) for b in batches]
    image, text = torch.cat([o[0] for o in outs]), torch.cat([o[1] for o in outs])
    loss, _ = ClipLoss()(image, text, outs[0][2])
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bn_stats(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: b.clone() for n, b in model.named_buffers() if "running" in n or "num_batches" in n}


@pytest.mark.parametrize("k,m,mode", [(4, 3, "plain"), (2, 5, "plain"), (3, 4, "chunked")])
def test_global_passes_equal_one_graph_over_all_micro_batches(k: int, m: int, mode: str) -> None:
    model, batches = _model(), _batches(k, m)
    ref_model = copy.deepcopy(model)
    ref_loss, ref_grads = _reference(ref_model, batches, rng_seed=7)
    ref_rng = torch.get_rng_state()

    engine = OneProcessEngine(model, k)
    torch.manual_seed(7)
    # chunked with 5-row tiles: the cache's 12 rows span several tiles of the online log-sum-exp
    passes = global_passes(engine, ClipLoss(mode=mode, chunk_size=5), FP32, batches, world=1)
    assert torch.equal(torch.get_rng_state(), ref_rng)  # the RNG continues as after one forward each
    assert (engine.backwards, engine.steps) == (k, k - 1)  # the last step (the optimizer's) is the caller's
    assert passes.samples == passes.contrastive_batch == k * m and len(passes.losses) == 1
    torch.testing.assert_close(passes.losses[0], ref_loss, rtol=1e-6, atol=0)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads.keys() == ref_grads.keys() and "logit_scale" in grads
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], rtol=1e-4, atol=1e-6, msg=n)
    # BatchNorm running statistics moved once per sample: as in the reference's single forward
    stats, ref_stats = _bn_stats(model), _bn_stats(ref_model)
    assert stats and stats.keys() == ref_stats.keys()
    for n, v in stats.items():
        torch.testing.assert_close(v, ref_stats[n], rtol=1e-6, atol=1e-7, msg=n)


def test_randomness_is_in_play() -> None:
    """The comparison above can fail: the model's forwards differ with the RNG state (dropout,
    stochastic depth), so a second forward from another state gives other gradients."""
    model, batches = _model(), _batches(1, 4)
    b = batches[0]
    torch.manual_seed(1)
    a = model(b["pixel_values"], b["input_ids"], b["attention_mask"])
    torch.manual_seed(2)
    c = model(b["pixel_values"], b["input_ids"], b["attention_mask"])
    assert (a[0] - c[0]).abs().max() > 1e-3 and (a[1] - c[1]).abs().max() > 1e-3


def test_loss_scale_reaches_the_embedding_gradients() -> None:
    """fp16 route: the loss scale multiplies the cached embeddings' gradients, hence every gradient."""
    k, m = 3, 4
    model, batches = _model(), _batches(k, m)
    plain = copy.deepcopy(model)
    scaled_prec = Precision("fp16", 0, torch.float32, torch.float32, False, DynamicLossScaler(scale=1024.0))
    torch.manual_seed(3)
    global_passes(OneProcessEngine(plain, k), ClipLoss(), FP32, batches, world=1)
    torch.manual_seed(3)
    global_passes(OneProcessEngine(model, k), ClipLoss(), scaled_prec, batches, world=1)
    for (n, p), q in zip(model.named_parameters(), plain.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad * 1024.0, rtol=1e-5, atol=1e-6, msg=n)


def test_micro_passes_and_one_micro_batch() -> None:
    """``micro``: one loss per micro-batch, DeepSpeed's 1/k on each; with k = 1 ``global`` is the same
    single pass."""
    k, m = 3, 4
    model, batches = _model(), _batches(k, m)
    ref = copy.deepcopy(model)
    torch.manual_seed(5)
    passes = micro_passes(OneProcessEngine(model, k), ClipLoss(), FP32, batches, world=1)
    assert len(passes.losses) == k and passes.contrastive_batch == m and passes.samples == k * m
    torch.manual_seed(5)
    total = 0.0
    for b in batches:
        loss, _ = ClipLoss()(*ref(b["pixel_values"], b["input_ids"], b["attention_mask"]))
        (loss / k).backward()
        total += float(loss.detach()) / k
    assert float(torch.stack(passes.losses).mean()) == pytest.approx(total, rel=1e-6)
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        if p.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7, msg=n)
    one = run_passes("global", OneProcessEngine(copy.deepcopy(model), 1), ClipLoss(), FP32, batches[:1], world=1)
    assert one.contrastive_batch == m and len(one.losses) == 1
    with pytest.raises(ValueError, match="contrastive_batch must be one of global, micro, got 'full'"):
        run_passes("full", OneProcessEngine(model, 1), ClipLoss(), FP32, batches, world=1)


def test_batchnorm_stats_frozen_restores_even_nonfinite_statistics() -> None:
    bn = torch.nn.BatchNorm1d(3).train()
    before = _bn_stats(bn)
    with batchnorm_stats_frozen(bn):
        out = bn(torch.tensor([[1.0, float("nan"), 2.0], [3.0, 1.0, 4.0]]))
    assert torch.isnan(out[:, 1]).all()  # normalised with the batch's statistics, NaN included
    after = _bn_stats(bn)
    assert all(torch.equal(after[n], before[n]) for n in before)
    bn(torch.randn(4, 3))
    assert not torch.equal(_bn_stats(bn)["running_mean"], before["running_mean"])  # outside: updated
