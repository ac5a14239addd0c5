"""``--compile`` (:func:`recipe.training.engine.compile_towers`): the towers run compiled in training under
DeepSpeed on 2 CPU ranks, with the losses of the eager run (bf16 rounding apart), no recompilation
after the first step, and checkpoints that evaluation, export and resuming read as before."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from torch import nn

from ...dist_utils import run_distributed
from ..test_train import ENV, ds_json, losses_of, train_cfg

#: Compiled vs eager losses on the bf16 route, where the rounding differs (fused kernels, another order
#: of accumulation): at step 1 (the same weights) measured 2-3e-4 relative, allowed 2e-3 (half a bf16
#: epsilon); later steps add the rounding of the updates, measured up to 3e-3, allowed 1e-2.
FIRST_STEP_REL, BF16_REL = 2e-3, 1e-2
#: A learning rate at which 4 steps on 32-pair batches stay stable (rounding differences are not amplified).
OPTIM = {"lr": 5e-4}


def _assert_close(eager: dict[int, float], compiled: dict[int, float], steps: int) -> None:
    assert sorted(eager) == sorted(compiled) == list(range(1, steps + 1)), (eager, compiled)
    for s in eager:
        rel = FIRST_STEP_REL if s == 1 else BF16_REL
        assert compiled[s] == pytest.approx(eager[s], rel=rel), (s, eager, compiled)


def _compile_worker(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    """Trains each config in turn; records the graphs Dynamo compiled and its graph breaks per run, and
    makes any recompilation after a run's first optimizer step an error. Every graph counted is the
    towers' (SRAdamW's CPU update is a C++ kernel, not a Dynamo graph)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import recipe.train as T

    from recipe.config import config_from_dict

    step = T.train_step

    def step_then_forbid_recompiles(*args, **kwargs):
        result = step(*args, **kwargs)
        torch._dynamo.config.error_on_recompile = True  # from now on, a guard failure raises
        return result

    T.train_step = step_then_forbid_recompiles
    out = []
    for cfg in cfgs:
        torch._dynamo.config.error_on_recompile = False  # the first step compiles (grad and no-grad graphs)
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        final = T.train(config_from_dict(cfg))
        out.append({"final": final, "graphs": counters["stats"]["unique_graphs"] - graphs,
                    "graph_breaks": sum(counters["graph_break"].values()) - breaks})
    torch._dynamo.config.error_on_recompile = False
    return out


def _run(cfgs: list[dict]) -> list[dict]:
    return run_distributed(_compile_worker, 2, cfgs, init_process_group=False, env=ENV, timeout_s=1200)[0]


def _weights(run_dir: Path, step: int) -> dict[str, torch.Tensor]:
    path = run_dir / "checkpoints" / f"step{step:08d}" / "model_weights.pt"
    return torch.load(path, map_location="cpu", weights_only=True)


@pytest.mark.slow  # 50-85 s: two ranks compile the towers on 2 cores
def test_compiled_training_matches_eager_and_checkpoints_stay_plain(data: Path, tmp_path: Path) -> None:
    # ZeRO-2, bf16, 2 micro-batches per step with the global contrastive batch: every step runs the
    # no-grad forward and the RNG-restoring second forward of recipe.training.passes through the compiled towers
    ds = ds_json(tmp_path, "zero2_bf16_halfmaster.json", micro=8, accumulation=2)
    common = dict(steps=4, save_every=2, contrastive_batch="global", optim=OPTIM)
    eager = train_cfg(data, tmp_path / "eager", ds, **common)
    compiled = train_cfg(data, tmp_path / "compiled", ds, **common, model={"compile": True})
    resumed = train_cfg(data, tmp_path / "resumed", ds, **common, model={"compile": True},
                        resume=str(tmp_path / "compiled" / "checkpoints" / "step00000002"))
    r_eager, r_compiled, r_resumed = _run([eager, compiled, resumed])  # rank 0's results

    assert r_eager["graphs"] == 0
    assert r_compiled["graphs"] > 0  # the towers ran compiled; no recompilation after step 1 (else it raised)
    a, b, c = losses_of(tmp_path / "eager"), losses_of(tmp_path / "compiled"), losses_of(tmp_path / "resumed")
    _assert_close(a, b, 4)
    # resuming a compiled run continues it exactly
    assert r_resumed["final"]["steps"] == 4
    assert sorted(c) == [3, 4] and all(c[s] == b[s] for s in c), (b, c)

    # the checkpoint holds the plain model's names: no torch.compile wrapper (`_orig_mod.`) anywhere
    plain, saved = _weights(tmp_path / "eager", 4), _weights(tmp_path / "compiled", 4)
    assert list(saved) == list(plain)
    assert not any("_orig_mod" in k for k in saved)
    # evaluation (eager in both runs) of the same checkpoint agrees with the run's own final evaluation
    from recipe.evaluate import main as evaluate_main

    final = r_compiled["final"]
    # --weights module: the weights the run evaluated (the default reads the fp32 masters, as export does)
    standalone = evaluate_main(["--checkpoint", str(tmp_path / "compiled"), "--weights", "module"])
    assert standalone["step"] == 4 and standalone["eval_samples"] == final["eval_samples"] == 24
    for k in ("zeroshot_top1", "i2t_r1", "t2i_r5"):  # at most one sample apart (float32 metrics)
        assert abs(standalone[k] - final[k]) <= 1 / 24 + 1e-6, k
    # export reads it strictly (missing or unexpected keys raise) and writes it
    from recipe.export import export_run, load_run

    run = load_run(tmp_path / "compiled")
    assert run.step == 4
    assert (export_run(tmp_path / "compiled", "open_clip", tmp_path / "exported") / "open_clip_config.json").is_file()


@pytest.mark.slow  # about 55 s
def test_compiled_zero3_trains_like_eager(data: Path, tmp_path: Path) -> None:
    """ZeRO-3: the towers' blocks are compiled (ZeRO-3 leaf modules), gathered and released by its hooks."""
    ds = ds_json(tmp_path, "zero3_bf16_halfmaster.json", micro=8, accumulation=2)
    eager = train_cfg(data, tmp_path / "eager", ds, steps=3, optim=OPTIM)
    compiled = train_cfg(data, tmp_path / "compiled", ds, steps=3, optim=OPTIM, model={"compile": True})
    r_eager, r_compiled = _run([eager, compiled])
    assert r_eager["graphs"] == 0 and r_compiled["graphs"] > 0
    _assert_close(losses_of(tmp_path / "eager"), losses_of(tmp_path / "compiled"), 3)
    assert list(_weights(tmp_path / "compiled", 3)) == list(_weights(tmp_path / "eager", 3))


# --------------------------------------------------------------------------------------------------
# compile_towers on one process, without DeepSpeed
# --------------------------------------------------------------------------------------------------


def test_compile_towers_keeps_the_module_tree() -> None:
    from recipe.model import create_model
    from recipe.training.engine import compile_towers, compiled_units

    torch.manual_seed(0)
    model = create_model("tiny")
    keys = list(model.state_dict())
    assert compile_towers(model) == [model.visual, model.text]
    assert list(model.state_dict()) == keys and list(dict(model.named_modules())) == list(
        dict(create_model("tiny").named_modules()))
    # a copy's forward runs the copy (not the original, as torch.compile of a bound method would)
    twin = copy.deepcopy(model)
    assert twin.visual.forward.module is twin.visual and twin.text.forward.module is twin.text
    # evaluation mode runs eager: nothing is compiled, the numbers are the uncompiled model's
    from torch._dynamo.utils import counters

    graphs = counters["stats"]["unique_graphs"]
    model.eval()
    pixels = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        got = model.encode_image(pixels)
        want = model.image_proj(type(model.visual).forward(model.visual, pixels))
    assert torch.equal(got, nn.functional.normalize(want, dim=-1))
    assert counters["stats"]["unique_graphs"] == graphs
    # ZeRO-3 compiles the repeated blocks (transformer layers), one class per tower
    blocks = compiled_units(create_model("tiny"), zero_stage=3)
    assert [type(b).__name__ for b in blocks] == ["Block", "Block", "CLIPEncoderLayer", "CLIPEncoderLayer"]


class _Noisy(nn.Module):
    """Dropout and a patch-dropout-like random permutation: random numbers drawn inside the compiled code."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.drop = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.randn(x.shape[0], 16).argsort(dim=-1)[:, :8]
        return self.drop(self.fc(x)).gather(1, keep)


def test_compiled_no_grad_and_grad_forwards_draw_the_same_random_numbers() -> None:
    """The global contrastive batch forwards each micro-batch twice, first without a graph, then with
    one, from the same RNG state (recipe.training.passes): the compiled inference graph and the compiled training
    graph must draw the same masks."""
    from recipe.training.engine import compile_towers

    model = nn.Module()
    model.visual, model.text = _Noisy(), _Noisy()
    compile_towers(model)
    x = torch.randn(4, 16)
    state = torch.get_rng_state()
    with torch.no_grad():
        first = model.visual(x)
    torch.set_rng_state(state)
    second = model.visual(x)
    second.sum().backward()
    assert second.requires_grad and torch.equal(first, second)
    assert (first == 0).any()  # dropout did drop
