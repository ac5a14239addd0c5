"""The fp32 masters out of a checkpoint's optimizer state (:mod:`recipe.export.masters`) and what the
export makes of them (``--weights master``, the default).

Checkpoints DeepSpeed wrote on 2 ranks (:func:`conftest.deepspeed_runs`): ZeRO-2 and ZeRO-3 bf16
halfmaster (split masters: bf16 weight + int16 low half, sharded) and the ZeRO-0 fp16 route (fp32
``master`` in the model-states file). For each, the masters read from the files equal, bit for bit, the
live optimizer's ``SRAdamW.master`` at the save; they differ from the module weights (so the test can
fail); SR parameters export as their module weights. Wrong input: a truncated or missing optimizer file,
a layout that does not fit, the EMA with masters.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from optim.master16 import split_master
from recipe.export import export_run, load_run, read_masters, read_pretrained
from recipe.export.__main__ import main as export_main
from recipe.run import checkpoint
from recipe.training.param_groups import tower_of


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # bit patterns: -0.0 vs 0.0 and NaN payloads count


def _tag(run: Path) -> Path:
    return checkpoint.complete_checkpoints(run / "checkpoints")[-1]


@pytest.mark.parametrize("name, half", [("zero2", torch.bfloat16), ("zero3", torch.bfloat16),
                                        ("zero0", torch.float16)])
def test_masters_are_the_live_optimizers_bit_for_bit(deepspeed_runs: dict[str, Any], name: str,
                                                     half: torch.dtype) -> None:
    run, live = deepspeed_runs[name]["run"], deepspeed_runs[name]["masters"]
    tag = _tag(run)
    module = torch.load(tag / checkpoint.MODEL_WEIGHTS, weights_only=True)
    # the mastered groups: the image tower and the logit scale (recipe.training.param_groups defaults)
    params = [n for n, _ in load_run(run).model.named_parameters()]
    assert sorted(live) == sorted(n for n in params if tower_of(n) != "text")
    masters = read_masters(tag)
    assert sorted(masters) == sorted(live)
    for n, m in masters.items():
        assert m.dtype == torch.float32 and m.shape == module[n].shape, n
        assert torch.equal(_bits(m), _bits(live[n])), n
    differ = sum(int((m != module[n].float()).sum()) for n, m in masters.items())
    total = sum(m.numel() for m in masters.values())
    assert differ > total // 2  # the masters carry bits the half-precision weights do not
    # the module weight is the master's rounding (bf16 split form: its high half, nearest with ties away from
    # zero; fp16: nearest even)
    for n, m in masters.items():
        assert torch.equal(split_master(m)[0] if half == torch.bfloat16 else m.to(half), module[n]), n

    # the exported model: masters where kept, the module weights elsewhere (exact upcasts)
    loaded = load_run(run, weights="master")
    assert sorted(loaded.master_names) == sorted(masters) and loaded.optimizer_state
    for n, t in loaded.model.state_dict().items():
        expected = masters[n] if n in masters else module[n].to(t.dtype)
        assert t.dtype == expected.dtype and torch.equal(t, expected), n
        assert torch.equal(t.signbit(), expected.signbit()), n  # -0.0 too
    assert load_run(run).master_names == ()  # load_run's default: the module weights, as before
    assert all(torch.equal(t, module[n].to(t.dtype)) for n, t in load_run(run).model.state_dict().items())
    # --dtype bf16 from the masters: rounded to nearest even
    in_bf16 = load_run(run, torch.bfloat16, weights="master").model.state_dict()
    assert all(torch.equal(in_bf16[n], m.to(torch.bfloat16)) for n, m in masters.items())
    # --init-from a recipe run starts from the masters too
    imported = read_pretrained(run)
    assert all(torch.equal(_bits(imported.state_dict[n]), _bits(m)) for n, m in masters.items())
    assert f"fp32 masters of {len(masters)} parameters" in imported.source


def test_export_writes_the_masters(deepspeed_runs: dict[str, Any], tmp_path: Path,
                                   capsys: pytest.CaptureFixture) -> None:
    """open_clip files hold the masters (default) or the bf16 weights (``--weights module``): the tensors that
    the open_clip layout renames without changing them are compared directly."""
    from safetensors.torch import load_file

    run, live = deepspeed_runs["zero3"]["run"], deepspeed_runs["zero3"]["masters"]
    module = torch.load(_tag(run) / checkpoint.MODEL_WEIGHTS, weights_only=True)
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "m")]) == 0
    assert f"fp32 masters of {len(live)} of " in capsys.readouterr().out
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "w"), "--weights", "module"]) == 0
    assert "module weights (bfloat16)" in capsys.readouterr().out
    m, w = (load_file(tmp_path / d / "open_clip_model.safetensors") for d in ("m", "w"))
    renamed = {"logit_scale": "logit_scale", "visual.trunk.norm.weight": "visual.ln_post.weight"}
    for i in range(2):
        for ours, theirs in (("attn.qkv.weight", "attn.in_proj_weight"), ("attn.proj.bias", "attn.out_proj.bias"),
                             ("mlp.fc1.weight", "mlp.c_fc.weight"), ("norm2.weight", "ln_2.weight")):
            renamed[f"visual.trunk.blocks.{i}.{ours}"] = f"visual.transformer.resblocks.{i}.{theirs}"
    for ours, theirs in renamed.items():
        assert torch.equal(_bits(m[theirs]), _bits(live[ours].reshape(m[theirs].shape))), ours
        assert torch.equal(w[theirs], module[ours].float().reshape(w[theirs].shape)), ours
        assert not torch.equal(m[theirs], w[theirs]), ours
    text = [n for n in m if n.startswith("transformer.") and m[n].is_floating_point()]
    assert len(text) > 10 and all(torch.equal(m[n], w[n]) for n in text)  # SR tower: its module weights either way
    doc = json.loads((tmp_path / "m" / "open_clip_config.json").read_text())
    assert doc["recipe"]["weights"] == {"source": "master", "master_params": len(live)}


def test_ema_takes_no_masters(make_run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--ema`` exports the EMA weights (``--weights module`` implied); asking for masters with it is refused.
    A checkpoint reduced to ``model_weights.pt`` exports its module weights, with a note."""
    run, model = make_run("run", preset="tiny")
    torch.save(model.state_dict(), _tag(run) / checkpoint.EMA_WEIGHTS)
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "e"), "--ema",
                        "--weights", "master"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the EMA weights have no fp32 master") and err.count("\n") == 1
    assert not (tmp_path / "e").exists()
    with pytest.raises(ValueError, match="no fp32 master"):
        export_run(run, "open_clip", tmp_path / "e", ema=True, weights="master")
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "e"), "--ema"]) == 0
    assert "EMA weights" in capsys.readouterr().out
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "m")]) == 0
    captured = capsys.readouterr()
    assert "fp32 masters of 0 of" in captured.out and "holds no optimizer state" in captured.err


def _copy(run: Path, tmp_path: Path, name: str) -> tuple[Path, Path]:
    copy = Path(shutil.copytree(run, tmp_path / name))
    return copy, _tag(copy)


def _fails(argv: list[str], capsys: pytest.CaptureFixture, *messages: str) -> None:
    assert export_main(argv) == 2, argv
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    for message in messages:
        assert message in err, err


@pytest.mark.parametrize("name", ["zero2", "zero0"])
def test_broken_optimizer_files_are_named(deepspeed_runs: dict[str, Any], tmp_path: Path, name: str,
                                          capsys: pytest.CaptureFixture) -> None:
    run, tag = _copy(deepspeed_runs[name]["run"], tmp_path, "run")
    out = tmp_path / "out"
    victim = tag / ("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" if name == "zero2"
                    else "mp_rank_00_model_states.pt")
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])  # a copy that stopped halfway
    _fails([str(run), "--format", "open_clip", "--out", str(out)], capsys, f"cannot read checkpoint file {victim}")
    assert not out.exists()
    # the module weights alone do not need the optimizer files
    assert export_main([str(run), "--format", "open_clip", "--out", str(out), "--weights", "module"]) == 0
    victim.unlink()
    expected = "missing: ranks [1]" if name == "zero2" else f"checkpoint file {victim} is missing"
    _fails([str(run), "--format", "open_clip", "--out", str(tmp_path / "out2")], capsys, expected)
    with pytest.raises(checkpoint.CheckpointError, match="bf16_zero_pp_rank_<R>_mp_rank_00_optim_states.pt"
                       if name == "zero2" else "mp_rank_00_model_states.pt is missing"):
        read_masters(tag)


def test_zero0_layout_that_does_not_fit_is_refused(deepspeed_runs: dict[str, Any], tmp_path: Path,
                                                   capsys: pytest.CaptureFixture) -> None:
    """ZeRO-0 maps the optimizer's indices through the groups rebuilt from the run's settings: settings that
    give other groups (here a locked text tower: the text groups vanish) fail, naming the file."""
    run, tag = _copy(deepspeed_runs["zero0"]["run"], tmp_path, "run")
    config = json.loads((run / "config.json").read_text())
    config["model"]["lock_text"] = True
    (run / "config.json").write_text(json.dumps(config))
    _fails([str(run), "--format", "open_clip", "--out", str(tmp_path / "out")], capsys,
           f"{tag / 'mp_rank_00_model_states.pt'}: optimizer group 'text.decay'", "cannot map the optimizer state")
    (run / "config.json").unlink()
    with pytest.raises(checkpoint.CheckpointError, match="cannot read .*config.json"):
        read_masters(tag)
