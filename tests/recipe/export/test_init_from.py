"""``--init-from DIR``: training starts from a recipe run's (or an export's) weights and tokenizer, with
the architecture read from DIR; flags that contradict it are errors; a restart needs DIR no more."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import recipe.train as T
from recipe.run import checkpoint
from recipe.config import config_from_dict, parse_args
from recipe.export import detect_format, export_run, read_pretrained

from ...dist_utils import run_distributed
from ..test_train import ENV, _train_worker, ds_json, train_cfg
from .conftest import save_run

ROOT = Path(__file__).resolve().parents[3]


def _cfg(tmp: Path, init: Path | None, **model: object) -> object:
    return config_from_dict({
        "deepspeed_config": str(ROOT / "ds_configs" / "zero2_fp32.json"),
        "output_dir": str(tmp / "out"),
        "model": {**({"init_from": str(init)} if init else {}), **model},
    })


def _init_from(tmp: Path, init: Path) -> tuple[Path, object, object]:
    """``--init-from init`` through the training's own code (read_init_from, get_tokenizer, build_model):
    the output directory, the tokenizer and the model built."""
    cfg = _cfg(tmp, init, preset=None)
    out = tmp / "out"
    out.mkdir()
    imported = T.read_init_from(cfg, out)
    tokenizer = T.get_tokenizer(cfg, out, imported)
    return out, tokenizer, T.build_model(cfg, tokenizer, out, imported)


def test_init_from_a_run_starts_from_its_weights_and_tokenizer(make_run, tmp_path: Path) -> None:
    src, model = make_run("src", preset="tiny", seed=3)
    assert detect_format(src) == "recipe"
    out, _, built = _init_from(tmp_path, src)
    assert (out / "tokenizer" / "tokenizer.json").read_text() == (src / "tokenizer" / "tokenizer.json").read_text()
    got, want = built.state_dict(), model.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    saved, source = (json.loads((d / "model_config.json").read_text()) for d in (out, src))
    # the architecture came from src; the text tower is no longer loaded from its own files (the weights are src's)
    assert saved["text"].pop("load_weights") is False
    source["text"].pop("load_weights")
    assert saved == source


@pytest.mark.parametrize(
    "flags, error",
    [
        ({"image_encoder": "resnet18"}, "--image-encoder resnet18 contradicts --init-from"),
        ({"embed_dim": 32}, "--embed-dim 32 contradicts --init-from"),
    ],
)
def test_contradicting_model_flags_are_errors(make_run, tmp_path: Path, flags: dict, error: str) -> None:
    src, _ = make_run("src", preset="tiny")
    with pytest.raises(ValueError, match=error):
        T.read_init_from(_cfg(tmp_path, src, **flags), tmp_path / "out")


def test_command_line_checks(make_run, tmp_path: Path) -> None:
    src, _ = make_run("src", preset="tiny")
    ds = str(ROOT / "ds_configs" / "zero2_fp32.json")
    base = ["--deepspeed_config", ds, "--init-from", str(src)]
    assert parse_args(base).model.init_from == str(src)
    with pytest.raises(ValueError, match="--preset ViT-B-32 contradicts --init-from"):
        parse_args([*base, "--preset", "ViT-B-32"])
    with pytest.raises(ValueError, match="--tokenizer contradicts --init-from"):
        parse_args([*base, "--tokenizer", str(src / "tokenizer")])
    with pytest.raises(FileNotFoundError, match="--init-from directory not found"):
        parse_args(["--deepspeed_config", ds, "--init-from", str(tmp_path / "nowhere")])
    with pytest.raises(ValueError, match="neither an open_clip directory"):
        T.read_init_from(_cfg(tmp_path, tmp_path), tmp_path / "out")


def test_training_from_a_run_and_resuming_without_it(data: Path, make_run, tmp_path: Path) -> None:
    """Under DeepSpeed (2 CPU ranks): the first step trains the source's weights (its loss is the loss of
    the source model on that batch: the same as a run resumed from the source would see), and a restart
    rebuilds the architecture from the run's own model_config.json after the source is gone."""
    src, model = make_run("src", preset="tiny", seed=5)
    ds = ds_json(tmp_path, "zero2_fp32.json", micro=16)
    first = train_cfg(data, tmp_path / "ft", ds, steps=2, save_every=1, model={"init_from": str(src), "preset": None})
    first["data"]["val_data"] = None
    run_distributed(_train_worker, 2, [first], None, init_process_group=False, env=ENV, timeout_s=600)
    start = torch.load(checkpoint.complete_checkpoints(tmp_path / "ft" / "checkpoints")[0] / checkpoint.MODEL_WEIGHTS,
                       weights_only=True)
    # one small step away from the source (lr 2e-3 after a 2-step warm-up: a fraction of that)
    moved = max(float((start[k].float() - v.float()).abs().max()) for k, v in model.state_dict().items())
    assert 0 < moved < 5e-3, moved
    shutil.rmtree(src)
    again = dict(first, steps=3, resume="latest")
    run_distributed(_train_worker, 2, [again], None, init_process_group=False, env=ENV, timeout_s=600)
    rows = [json.loads(x) for x in (tmp_path / "ft" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["kind"] == "train"] == [1, 2, 3]


TINY_CLIP_VIT = dict(image_encoder="vit_base_patch32_clip_224", text_encoder="clip-text-tiny", embed_dim=32,
                     image_kwargs=dict(img_size=32, patch_size=8, embed_dim=64, depth=2, num_heads=2))


@pytest.mark.parametrize(
    "fmt, weights, kwargs",
    [
        ("open_clip", "open_clip_model.safetensors", dict(preset="tiny")),
        ("open_clip", "open_clip_model.safetensors",  # timm ResNet + BERT: open_clip's TimmModel and HF towers
         dict(image_encoder="test_resnet", text_encoder="bert-tiny", embed_dim=32)),
        ("hf", "model.safetensors", TINY_CLIP_VIT),
    ],
)
def test_export_then_init_from_then_export_gives_identical_weights(
    make_run, tmp_path: Path, fmt: str, weights: str, kwargs: dict
) -> None:
    """The round trip through ``--init-from``'s own code (read_init_from, get_tokenizer, build_model)."""
    from safetensors.torch import load_file

    src, _ = make_run("src", **kwargs)
    first = export_run(src, fmt, tmp_path / "first")
    _, tokenizer, model = _init_from(tmp_path, first)
    second = export_run(save_run(model, tokenizer, tmp_path / "again"), fmt, tmp_path / "second")
    a, b = load_file(first / weights), load_file(second / weights)
    assert a.keys() == b.keys() and len(a) > 10
    assert all(torch.equal(a[k], b[k]) for k in a)


# --------------------------------------------------------------------------------------------------
# bf16 runs: export -> --init-from -> export keeps the fp32 masters bit for bit
# --------------------------------------------------------------------------------------------------

#: The one line a bf16 run started from fp32 weights writes about the tensors it had to round.
ROUNDED_NOTE = "tensors that keep no fp32 master here"


def _train_export_worker(rank: int, world: int, chain: list[tuple[dict, str]]) -> list[str]:
    """Trains each config in turn, rank 0 exporting its run (open_clip, the default fp32 masters) to the
    directory given before the next starts (which may start from that export); returns what each
    training wrote to stderr."""
    import contextlib
    import io

    from recipe.config import config_from_dict

    logs = []
    for cfg, export_to in chain:
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            T.train(config_from_dict(cfg))
        logs.append(err.getvalue())
        if rank == 0:
            export_run(cfg["output_dir"], "open_clip", export_to)
        torch.distributed.barrier()
    return logs


def _is_mastered(open_clip_key: str) -> bool:
    """The tiny preset's mastered groups in the open_clip export: the image tower and the logit scale."""
    return open_clip_key.startswith("visual.") or open_clip_key == "logit_scale"


@pytest.fixture(scope="module", params=["zero0_bf16_sr.json", "zero2_bf16_halfmaster.json",
                                        "zero3_bf16_halfmaster.json"])
def bf16_chain(request: pytest.FixtureRequest, data: Path, tokenizer, tmp_path_factory) -> dict:
    """On 2 ranks: the export of an fp32 model (no weight a bf16 value) -> ``--init-from`` 1 step at lr 0 ->
    export -> ``--init-from`` 1 step at lr 0 -> export."""
    from recipe.model import create_model

    tmp = tmp_path_factory.mktemp(request.param.split(".")[0])
    torch.manual_seed(4)
    model = create_model("tiny", tokenizer=tokenizer)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    first = export_run(save_run(model, tokenizer, tmp / "src"), "open_clip", tmp / "first")
    ds = ds_json(tmp, request.param)

    def start(name: str, init: Path) -> dict:
        cfg = train_cfg(data, tmp / name, ds, steps=1, model={"init_from": str(init), "preset": None},
                        optim={"lr": 0.0, "warmup_steps": 0})
        cfg["data"]["val_data"] = None
        return cfg

    chain = [(start("ft1", first), str(tmp / "second")), (start("ft2", tmp / "second"), str(tmp / "third"))]
    logs = run_distributed(_train_export_worker, 2, chain, init_process_group=False, env=ENV, timeout_s=900)[0]
    return {"model": model, "tmp": tmp, "logs": logs, "exports": [first, tmp / "second", tmp / "third"]}


def test_export_init_from_export_keeps_the_fp32_masters_bit_for_bit(bf16_chain: dict) -> None:
    """The mastered groups start from the export's exact fp32 values (not their bf16 rounding), so the
    next export holds them again bit for bit; the SR groups' rounding of the fp32 source is said once.
    From there (SR weights now bf16 values) the round trip is bit for bit in every tensor, and says nothing."""
    from safetensors.torch import load_file

    from recipe.training.param_groups import tower_of

    a, b, c = (load_file(d / "open_clip_model.safetensors") for d in bf16_chain["exports"])
    assert a.keys() == b.keys() == c.keys()
    mastered = [k for k in a if _is_mastered(k)]
    assert len(mastered) > 10 and len(a) - len(mastered) > 10
    assert not any(torch.equal(a[k].bfloat16().float(), a[k]) for k in a)  # a bf16 rounding would show
    for k in a:
        want = a[k] if _is_mastered(k) else a[k].bfloat16().float()
        assert torch.equal(b[k], want), k
    texts = sum(1 for n, _ in bf16_chain["model"].named_parameters() if tower_of(n) == "text")
    first, second = bf16_chain["logs"]
    assert first.count(ROUNDED_NOTE) == 1, first
    note = next(line for line in first.splitlines() if ROUNDED_NOTE in line)
    assert f": {texts} of the {texts} tensors" in note and "to bfloat16" in note, note
    assert all(torch.equal(b[k], c[k]) for k in b), [k for k in b if not torch.equal(b[k], c[k])]
    assert ROUNDED_NOTE not in second


def test_evaluate_weights_master_is_the_exports_module_the_bf16_weights(bf16_chain: dict, data: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m recipe.evaluate --weights master`` (the default) embeds exactly as the export's fp32
    weights do, ``--weights module`` as the checkpoint's bf16 module weights; the two differ."""
    import dataclasses

    import recipe.evaluate as E
    from recipe.model import create_model
    from recipe.model.tokenizer import load_tokenizer

    seen: list[torch.Tensor] = []
    embed_split = E.embed_split

    def embedding(*args, **kwargs):  # type: ignore[no-untyped-def]
        out = embed_split(*args, **kwargs)
        seen.append(torch.cat([out[0], out[1]]))
        return out

    monkeypatch.setattr(E, "embed_split", embedding)
    run = bf16_chain["tmp"] / "ft1"
    argv = ["--checkpoint", str(run), "--val-data", str(data / "val.csv"), "--no-progress"]
    metrics = {w: E.main([*argv, *(["--weights", w] if w else [])]) for w in ("", "master", "module")}
    default, master, module = seen
    assert torch.equal(default, master) and metrics[""] == metrics["master"]
    assert not torch.equal(master, module)
    written = {p.name: json.loads(p.read_text()) for p in run.glob("eval_*.json")}
    assert sorted(r["weights_source"] for r in written.values()) == ["master", "module"]
    assert any(name.endswith("_module_step1.json") for name in written)

    # the export's fp32 weights, and the checkpoint's bf16 module weights, evaluated directly
    imported = read_pretrained(bf16_chain["exports"][1])
    fp32 = create_model(config=imported.config, text_load_weights=False)
    fp32.load_state_dict(imported.state_dict)
    tag = checkpoint.complete_checkpoints(run / "checkpoints")[-1]
    bf16 = create_model(config=imported.config, text_load_weights=False).to(torch.bfloat16)
    bf16.load_state_dict(torch.load(tag / checkpoint.MODEL_WEIGHTS, weights_only=True))
    cfg = dataclasses.replace(config_from_dict(json.loads((run / "config.json").read_text())).data,
                              val_data=str(data / "val.csv"))
    for model, want in ((fp32, master), (bf16, module)):
        seen.clear()
        E.evaluate_data(model.eval(), cfg, load_tokenizer(run / "tokenizer"), 256)
        assert torch.equal(seen[0], want)
