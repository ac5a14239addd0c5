"""The recipe-managed routes' overlapped gradient all-reduce (recipe/training/overlap.py) on 2 gloo
ranks: the same gradients, bit for bit, as the all-reduce after backward
(``precision.allreduce_gradients``) for bf16 / fp32 gradients and each reduction dtype, with gradient
accumulation (only the last backward sends), a parameter outside the last backward's graph (sent by
``finish``), a frozen parameter; most buckets are sent while backward runs."""

from __future__ import annotations

import pytest
import torch

from recipe.training.overlap import OverlappedAllReduce

from ...dist_utils import run_distributed


def allreduce_gradients(params: list[torch.Tensor], reduce_dtype: torch.dtype | None) -> None:
    """The reference: every gradient all-reduced on its own after backward, summed in ``reduce_dtype``
    (None: fp32 for bf16 gradients, else their own dtype), divided by the world size there, rounded back."""
    import torch.distributed as dist

    for p in params:
        if p.grad is not None:
            dtype = reduce_dtype or (torch.float32 if p.grad.dtype == torch.bfloat16 else p.grad.dtype)
            total = p.grad.to(dtype)
            dist.all_reduce(total)
            p.grad.copy_(total.div_(dist.get_world_size()))

CASES = [(torch.bfloat16, None), (torch.bfloat16, torch.bfloat16), (torch.float32, None)]


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.extra = torch.nn.Parameter(torch.ones(3))  # first registered: the last bucket; used by micro-batch 0 only
        self.frozen = torch.nn.Parameter(torch.ones(5), requires_grad=False)
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 16)
        self.c = torch.nn.Linear(16, 4)

    def forward(self, x: torch.Tensor, use_extra: bool) -> torch.Tensor:
        y = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
        return y.sum() + (self.extra.sum() if use_extra else 0) + 0 * self.frozen.sum()


def _worker(rank: int, world: int) -> dict:
    out = {}
    for dtype, reduce_dtype in CASES:
        torch.manual_seed(0)
        ref = Net().to(dtype)
        net = Net().to(dtype)
        net.load_state_dict(ref.state_dict())
        gen = torch.Generator().manual_seed(1 + rank)
        xs = [torch.randn(4, 8, generator=gen).to(dtype) for _ in range(2)]
        for model in (ref, net):
            reducer = OverlappedAllReduce(list(model.parameters()), reduce_dtype, bucket_bytes=1) if model is net else None
            for step in range(2):
                model.zero_grad(set_to_none=True)
                model(xs[0], True).backward()  # micro-batch 0: accumulates locally
                if reducer is None:
                    model(xs[1], False).backward()
                    allreduce_gradients(list(model.parameters()), reduce_dtype=reduce_dtype)
                else:
                    with reducer.last_backward():
                        model(xs[1], False).backward()
                    in_flight = [p for b in reducer.buckets[:reducer._next] for p in b.params]
                    out[f"{dtype}-{reduce_dtype}-released"] = all(p.grad is None for p in in_flight) and bool(in_flight)
                    sent = reducer.finish()
                    out[f"{dtype}-{reduce_dtype}-sent-during-backward"] = (sent, len(reducer.buckets))
        out[f"{dtype}-{reduce_dtype}"] = [(n, None if p.grad is None else p.grad.clone(), None if q.grad is None else q.grad.clone())
                                          for (n, p), q in zip(ref.named_parameters(), net.parameters())]
        try:
            with reducer.last_backward():
                net(xs[1], False).backward()
            with reducer.last_backward():  # finish() forgotten
                pass
        except RuntimeError as e:
            out[f"{dtype}-{reduce_dtype}-error"] = str(e)
        reducer.close()
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_distributed(_worker, 2, timeout_s=180)


@pytest.mark.parametrize("dtype, reduce_dtype", CASES, ids=["bf16-fp32sum", "bf16-bf16sum", "fp32"])
def test_overlapped_gradients_equal_the_allreduce_after_backward(results: list[dict], dtype, reduce_dtype) -> None:
    key = f"{dtype}-{reduce_dtype}"
    for rank, r in enumerate(results):
        for name, want, got in r[key]:
            if name == "frozen":
                assert want is None and got is None
                continue
            assert got.dtype == want.dtype and torch.equal(got.view(-1), want.view(-1)), (rank, name)
        for name, g, _ in r[key]:  # the replicas agree
            if g is not None:
                assert torch.equal(g, dict((n, x) for n, x, _ in results[0][key])[name])
        sent, buckets = r[f"{key}-sent-during-backward"]
        assert buckets == 7 and sent == 6, (sent, buckets)  # all but the bucket of `extra` (outside the graph)
        assert "finish() was not called" in r[f"{key}-error"]
        assert r[f"{key}-released"]  # a sent bucket's gradients are released until finish() gives the means


# --------------------------------------------------------------------------------------------------
# end to end: the recipe's bf16 ZeRO-0 route at world size 2, with and without the overlap
# --------------------------------------------------------------------------------------------------
class _AfterBackward:
    """In place of the overlapped all-reduce: the reference all-reduce, after backward."""

    def __init__(self, engine, reduce_dtype) -> None:
        self.params, self.reduce_dtype = list(engine.module.parameters()), reduce_dtype

    def last_backward(self):
        import contextlib

        return contextlib.nullcontext()

    def finish(self) -> int:
        allreduce_gradients(self.params, self.reduce_dtype)
        return 0


def _two_runs_worker(rank: int, world: int, overlapped: dict, plain: dict) -> dict:
    """The same training twice: through train_step's overlapped all-reduce (counting the buckets sent
    during backward), then with the reference all-reduce after backward in its place."""
    import recipe.training.step as step_module
    from recipe.training import overlap

    from ..test_train import _train_worker

    overlap.BUCKET_BYTES = 64 * 2**10  # the tiny model in several buckets
    sent = []
    real_finish = overlap.OverlappedAllReduce.finish
    overlap.OverlappedAllReduce.finish = lambda self: sent.append(real_finish(self)) or sent[-1]
    _train_worker(rank, world, [overlapped], None)
    overlap.OverlappedAllReduce.finish = real_finish
    step_module.reducer_for = _AfterBackward
    _train_worker(rank, world, [plain], None)
    return {"sent": sent}


def test_the_bf16_zero0_route_trains_bit_identically_with_the_overlap(data, tmp_path) -> None:
    """Two ranks, bf16 ZeRO-0 (the multi-GPU default), 4 steps of 2 accumulated micro-batches: the
    overlapped run sends buckets while backward runs at every step and its losses, gradient norms and
    weights equal the run that all-reduces after backward bit for bit (each element's sum over two
    ranks is the same whatever the buckets)."""
    import json

    from recipe.run import checkpoint

    from ...dist_utils import run_distributed
    from ..test_train import ENV, ds_json, train_cfg

    ds = ds_json(tmp_path, "zero0_bf16_sr.json", micro=4, accumulation=2)
    cfgs = [train_cfg(data, tmp_path / name, ds, steps=4, optim={"warmup_steps": 0}) for name in ("overlapped", "plain")]
    for cfg in cfgs:
        cfg["data"]["val_data"] = None
    results = run_distributed(_two_runs_worker, 2, *cfgs, init_process_group=False, env=ENV, timeout_s=600)
    for r in results:
        assert len(r["sent"]) == 4 and all(n >= 1 for n in r["sent"]), r["sent"]

    def rows(name):
        lines = (tmp_path / name / "metrics.jsonl").read_text().splitlines()
        return [(x["step"], x["loss"], x["grad_norm"]) for x in map(json.loads, lines) if x["kind"] == "train"]

    def weights(name):
        tag = checkpoint.complete_checkpoints(tmp_path / name / "checkpoints")[-1]
        return torch.load(tag / checkpoint.MODEL_WEIGHTS, map_location="cpu", weights_only=True)

    assert rows("overlapped") == rows("plain") and len(rows("plain")) == 4
    a, b = weights("overlapped"), weights("plain")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
