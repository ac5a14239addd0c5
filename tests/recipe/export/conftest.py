"""Runs to export: a recipe run directory as training leaves it (model config, tokenizer, a complete
checkpoint with the consolidated ``model_weights.pt``), made from a freshly built model without
training, so each tower pair costs a second; and (:func:`deepspeed_runs`, once per session) checkpoints
that DeepSpeed wrote on 2 ranks (ZeRO-2 and ZeRO-3 bf16 halfmaster, ZeRO-0 fp16 route) with the
optimizer's fp32 masters as they were when the checkpoint was saved."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from recipe.model import CLIP, create_model
from recipe.model.tokenizer import Tokenizer, train_tokenizer
from recipe.run import checkpoint

CAPTIONS = [f"a {c} {s} on a {b} background" for c in ("red", "green", "blue", "black") for s in
            ("circle", "square", "triangle") for b in ("white", "grey", "dark")]


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    """A byte-level BPE the way training makes one (pad 0, bos 1, eos 2), context 32."""
    return train_tokenizer(CAPTIONS * 4, vocab_size=300, context_length=32)


def save_run(model: CLIP, tokenizer: Tokenizer, run_dir: Path, step: int = 7) -> Path:
    """Writes ``run_dir`` as :mod:`recipe.train` would after saving a checkpoint at ``step``."""
    tag = run_dir / "checkpoints" / f"step{step:08d}"
    tag.mkdir(parents=True)
    tokenizer.save(run_dir / "tokenizer")
    (run_dir / "model_config.json").write_text(json.dumps(model.config.to_dict(), indent=2))
    torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, tag / checkpoint.MODEL_WEIGHTS)
    (tag / checkpoint.COMPLETE).write_text(json.dumps({"step": step, "world_size": 1}))
    (run_dir / "checkpoints" / checkpoint.LATEST).write_text(tag.name)
    return run_dir


@pytest.fixture
def make_run(tmp_path: Path, tokenizer: Tokenizer) -> Callable[..., tuple[Path, CLIP]]:
    """``make_run(name, **create_model_kwargs) -> (run_dir, model)``: a random-initialised model of the
    given towers (weights perturbed away from their initial values, so that biases and norms are not
    trivially zero or one) saved as a run."""

    def make(name: str = "run", seed: int = 0, **kwargs: Any) -> tuple[Path, CLIP]:
        torch.manual_seed(seed)
        model = create_model(tokenizer=tokenizer, **kwargs)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        return save_run(model, tokenizer, tmp_path / name), model.eval()

    return make


# --------------------------------------------------------------------------------------------------
# checkpoints DeepSpeed wrote, with the live optimizer's masters at save time
# --------------------------------------------------------------------------------------------------

#: The DeepSpeed runs of :func:`deepspeed_runs`, by short name.
DEEPSPEED_RUNS = {"zero2": "zero2_bf16_halfmaster.json", "zero3": "zero3_bf16_halfmaster.json",
                  "zero0": "zero0_fp16_sr_lossscale.json"}


def live_masters(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master as the live SRAdamW holds it (what ``SRAdamW.master`` gives), by name,
    from the engine's own structures (not the checkpoint files). ZeRO-1/2/3: each flat group's weights and
    ``master_low`` over all ranks (:func:`recipe.run.elastic.full_flat_state`, a collective) joined as
    ``SRAdamW.master`` joins them (or DeepSpeed's fp32 partitions, where it keeps them), cut along the
    group's live parameters; ZeRO-0: ``SRAdamW.master`` of each module tensor."""
    from optim.master16 import join_master
    from recipe.run import elastic

    stage = int(engine.zero_optimization_stage())
    if stage == 0:
        opt = engine.optimizer
        names = {id(p): n for n, p in engine.module.named_parameters()}
        return {names[id(p)]: opt.master(p).detach().clone() for g in opt.param_groups for p in g["params"]
                if opt.master(p) is not None}
    full = elastic.full_flat_state(engine)
    zo = engine.optimizer
    # the flat order: ZeRO-3 sub-groups' parameters; ZeRO-1/2 groups' (round-robin) order with DeepSpeed's
    # alignment padding after each parameter (zero_optimization.parameter_alignment)
    groups = zo.fp16_groups if stage >= 3 else zo.round_robin_bit16_groups
    paddings = [[0] * len(g) for g in groups] if stage >= 3 else zo.round_robin_bit16_padding
    flat_states = [v for k, v in full.items() if k != "sr"]
    assert len(flat_states) == len(groups)
    out = {}
    for params, pads, st in zip(groups, paddings, flat_states):
        if st["weight"].dtype == torch.float32:  # DeepSpeed's own fp32 partitions (bf16 without halfmaster)
            flat = st["weight"]
        elif "master_low" in st:
            flat = join_master(st["weight"], st["master_low"])
        else:
            continue
        offset = 0
        for p, pad in zip(params, pads):
            shape = tuple(p.ds_shape) if stage >= 3 else tuple(p.shape)
            n = math.prod(shape)
            out[engine.param_names[p]] = flat[offset : offset + n].reshape(shape).clone()
            offset += n + pad
        assert offset == flat.numel()
    return out


def _capture_worker(rank: int, world: int, cfgs: list[dict]) -> dict[str, dict[str, torch.Tensor]]:
    """Trains every config on this rank; returns per run directory the live masters at its last save."""
    import recipe.train as T
    from recipe.config import config_from_dict

    captured: dict[str, dict[str, torch.Tensor]] = {}
    save = T.save

    def saving(engine, run_dir, *args, **kwargs):  # type: ignore[no-untyped-def]
        captured[str(run_dir)] = live_masters(engine)  # every rank: a collective under ZeRO-1/2/3
        return save(engine, run_dir, *args, **kwargs)

    T.save = saving
    try:
        for cfg in cfgs:
            T.train(config_from_dict(cfg))
    finally:
        T.save = save
    return captured


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Three steps of the tiny preset on 2 ranks for each of :data:`DEEPSPEED_RUNS` (about 1 min in all):
    ``{name: {"run": run directory, "masters": the live optimizer's masters by name at the save}}``."""
    from recipe.synthetic import write_dataset

    from ...dist_utils import run_distributed
    from ..test_train import ENV, ds_json, train_cfg

    tmp = tmp_path_factory.mktemp("deepspeed_runs")
    data = tmp / "data"
    write_dataset(str(data), 64, n_val=24, image_size=32, seed=0)
    cfgs = {}
    for name, ds in DEEPSPEED_RUNS.items():
        cfg = train_cfg(data, tmp / name, ds_json(tmp, ds), steps=3, optim={"warmup_steps": 0})
        cfg["data"]["val_data"] = None
        cfgs[name] = cfg
    captured = run_distributed(_capture_worker, 2, list(cfgs.values()), init_process_group=False, env=ENV,
                               timeout_s=900)[0]
    return {name: {"run": Path(cfg["output_dir"]), "masters": captured[cfg["output_dir"]]}
            for name, cfg in cfgs.items()}
