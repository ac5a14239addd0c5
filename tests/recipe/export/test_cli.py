"""``python -m recipe.export``: checkpoints DeepSpeed wrote (ZeRO-3, the fp16 route) export; the output
directory appears whole or not at all; wrong input is a one-line error with a non-zero exit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import recipe.export as export
from recipe.export.__main__ import main as export_main


@pytest.mark.parametrize("run, half", [("zero3", torch.bfloat16), ("zero0", torch.float16)])
def test_deepspeed_checkpoints_export(deepspeed_runs: dict[str, Any], tmp_path: Path, run: str, half: torch.dtype,
                                      capsys: pytest.CaptureFixture) -> None:
    """The consolidated module weights of a sharded (ZeRO-3) or fp16-route run (``--weights module``) export in
    fp32 without loss: every value is the run's half-precision value; the exported logit scale is the one the
    run logged last. (The default, the optimizer's fp32 masters where kept: ``test_masters.py``.)"""
    import open_clip
    from safetensors.torch import load_file

    out = tmp_path / "oc"
    run_dir = deepspeed_runs[run]["run"]
    assert export_main([str(run_dir), "--format", "open_clip", "--out", str(out), "--weights", "module"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    tensors = load_file(out / "open_clip_model.safetensors")
    # the tiny ViT's patch-embedding bias is folded into the patch tokens' positional embedding (a sum)
    floats = {k: t for k, t in tensors.items() if t.is_floating_point() and k != "visual.positional_embedding"}
    assert len(floats) > 20 and all(t.dtype == torch.float32 for t in floats.values())
    assert all(torch.equal(t.to(half).float(), t) for t in floats.values())  # exact copies of the run's weights
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [r["logit_scale"] for r in rows if r["kind"] == "train"][-1]
    model, _, _ = open_clip.create_model_and_transforms(f"local-dir:{out}")
    scale = float(model.logit_scale.detach().exp())
    assert scale == pytest.approx(logged, rel=1e-6)
    assert scale != pytest.approx(1 / 0.07, rel=1e-4)  # trained: it moved
    assert (out / "open_clip_config.json").is_file() and not list(tmp_path.glob(".*partial*"))


def test_output_appears_whole_or_not_at_all(make_run, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run, _ = make_run("run", preset="tiny")
    out = tmp_path / "export"

    def dies_midway(run, tmp, dtype, final=None):
        (tmp / "open_clip_model.safetensors").write_bytes(b"half a file")
        raise OSError("No space left on device")

    monkeypatch.setattr(export, "_writers", lambda: {"open_clip": dies_midway, "hf": dies_midway})
    with pytest.raises(OSError, match="No space left"):
        export.export_run(run, "open_clip", out)
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["run"]  # no output, no leftovers
    out.mkdir()
    (out / "keep.txt").write_text("an earlier export")
    (out / export.MARKER).write_text("{}")  # what makes it one --overwrite may replace
    with pytest.raises(OSError, match="No space left"):
        export.export_run(run, "open_clip", out, overwrite=True)
    assert (out / "keep.txt").read_text() == "an earlier export"  # a failed overwrite keeps the old one


def test_wrong_input_is_one_line_and_a_nonzero_exit(make_run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run, _ = make_run("run", preset="tiny")
    cases = [
        ([str(tmp_path / "missing"), "--format", "hf", "--out", str(tmp_path / "x")], 2, "run directory not found"),
        ([str(run), "--format", "hf", "--out", str(tmp_path / "x")], 1, "cannot export"),  # the tiny ViT: no pre-norm
        ([str(run), "--format", "open_clip", "--out", str(run)], 2, "is the source run"),  # test_overwrite.py
    ]
    for argv, code, message in cases:
        assert export_main(argv) == code, argv
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1, err
        assert not (tmp_path / "x").exists()
    with pytest.raises(SystemExit):
        export_main([str(run), "--format", "onnx", "--out", str(tmp_path / "x")])
    assert "invalid choice: 'onnx'" in capsys.readouterr().err
    (run / "checkpoints" / "step00000007" / "COMPLETE").unlink()  # a save that never finished
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "y")]) == 2
    assert "step00000007 is incomplete (no COMPLETE marker)" in capsys.readouterr().err
    assert not (tmp_path / "y").exists()


def test_ema_weights_export_with_ema(make_run, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """``--ema`` exports the checkpoint's ``ema_weights.pt`` instead of the live weights."""
    from safetensors.torch import load_file

    from recipe.run import checkpoint

    run, model = make_run("run", preset="tiny")
    tag = checkpoint.complete_checkpoints(run / "checkpoints")[-1]
    ema = {k: v.clone() for k, v in model.state_dict().items()}
    ema["logit_scale"] = torch.tensor([1.25])
    torch.save(ema, tag / checkpoint.EMA_WEIGHTS)
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "live")]) == 0
    assert export_main([str(run), "--format", "open_clip", "--out", str(tmp_path / "ema"), "--ema"]) == 0
    assert "EMA weights" in capsys.readouterr().out
    live, averaged = (load_file(tmp_path / d / "open_clip_model.safetensors") for d in ("live", "ema"))
    assert float(averaged["logit_scale"]) == 1.25 != float(live["logit_scale"])
    (tag / checkpoint.EMA_WEIGHTS).unlink()
    assert export_main([str(run), "--format", "hf", "--out", str(tmp_path / "none"), "--ema"]) == 2
    assert "the run has no EMA" in capsys.readouterr().err
