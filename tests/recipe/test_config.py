"""The typed config and its command line; the learning-rate schedule; the precision modes read from
the DeepSpeed JSON; dynamic loss scaling."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from recipe.config import TrainConfig, build_parser, config_from_dict, parse_args
from recipe.precision import ConfigError, DynamicLossScaler, resolve_precision
from recipe.optimizer import lr_at

ROOT = Path(__file__).resolve().parents[2]
DS = str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json")


def test_flags_fill_the_typed_config() -> None:
    cfg = parse_args([
        "--deepspeed_config", DS, "--image-encoder", "resnet50", "--text-encoder", "bert-tiny", "--preset", "tiny",
        "--train-data", "a.csv", "--data-format", "csv", "--steps", "7", "--lr", "3e-4", "--schedule", "constant",
        "--grad-checkpointing", "--loss-mode", "chunked", "--output-dir", "out", "--resume", "latest",
        "--eval-every", "5", "--seed", "3", "--no-image-master-weights",
    ])
    assert cfg.model.image_encoder == "resnet50" and cfg.model.text_encoder == "bert-tiny"
    assert cfg.model.grad_checkpointing is True and cfg.model.image_master_weights is False
    assert cfg.data.train_data == "a.csv" and cfg.data.data_format == "csv"
    assert (cfg.steps, cfg.optim.lr, cfg.optim.schedule, cfg.loss_mode, cfg.resume, cfg.eval_every, cfg.seed) == (
        7, 3e-4, "constant", "chunked", "latest", 5, 3)
    assert cfg.output_dir == "out" and cfg.deepspeed_config == DS


def test_deepspeed_json_owns_batch_precision_and_zero() -> None:
    flags = {a for action in build_parser()._actions for a in action.option_strings}
    for owned in ("--batch-size", "--micro-batch-size", "--gradient-accumulation-steps", "--bf16", "--fp16", "--precision", "--zero-stage", "--grad-clip"):
        assert owned not in flags
    def keys(d: dict) -> list[str]:
        return [k for k, v in d.items() for k in ([k] + (keys(v) if isinstance(v, dict) else []))]

    names = keys(TrainConfig().to_dict())
    words = {w for n in names if n != "eval_batch_size" for w in n.split("_")}
    for owned in ("batch", "accumulation", "zero", "stage", "clipping", "bf16", "fp16", "precision", "dtype"):
        assert owned not in words, owned


def test_every_option_is_documented_with_its_default() -> None:
    parser = build_parser()
    leaves = {k for section in TrainConfig().to_dict().values() if isinstance(section, dict) for k in section}
    leaves |= {k for k, v in TrainConfig().to_dict().items() if not isinstance(v, dict)}
    documented = {}
    for action in parser._actions:
        if action.help and action.help != "==SUPPRESS==" and action.option_strings[0] not in ("-h", "--config"):
            documented[action.option_strings[0][2:].replace("-", "_")] = action.help
    assert set(documented) == leaves  # every config field is a flag, and nothing else is
    for name, text in documented.items():
        assert "(default: " in text and len(text) > len("(default: x)") + 10, (name, text)
    assert "(default: 0.0005)" in documented["lr"] and "(default: 0.9 1.0)" in documented["train_scale"]
    assert "(default: unset)" in documented["val_data"]
    help_text = parser.format_help()
    assert "--eval-workers" in help_text and "--shuffle-buffer" in help_text


def test_data_options_reach_the_one_data_config() -> None:
    cfg = parse_args(["--deepspeed_config", DS, "--train-scale", "0.5", "1.0", "--hflip", "0.5", "--workers", "0",
                      "--eval-workers", "3", "--val-split", "test", "--label-column", "", "--csv-separator", ";"])
    d = cfg.data
    assert (d.train_scale, d.hflip, d.workers, d.eval_workers, d.val_split) == ((0.5, 1.0), 0.5, 0, 3, "test")
    assert d.label_column is None and d.csv_separator == ";"  # '' unsets an optional field


def test_prefixes_of_flags_are_not_taken_for_the_flag() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed_config", DS, "--loss", "chunked"])  # not --loss-mode
    with pytest.raises(SystemExit):
        parse_args(["--deepspeed_config", DS, "--warmup", "3"])  # not --warmup-steps


def test_config_names_the_loss_modes_that_exist() -> None:
    from recipe.config import LOSS_MODE_NAMES
    from recipe.loss import LOSS_MODES

    assert tuple(LOSS_MODES) == LOSS_MODE_NAMES


def test_config_file_round_trip_and_flag_override(tmp_path: Path) -> None:
    cfg = parse_args(["--deepspeed_config", DS, "--lr", "1e-4"])
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg.to_dict()))
    again = parse_args(["--config", str(path), "--steps", "9"])
    assert again.optim.lr == 1e-4 and again.steps == 9 and again.model == cfg.model and again.data == cfg.data
    path.write_text(json.dumps({**cfg.to_dict(), "resume": "latest"}))
    assert parse_args(["--config", str(path)]).resume == "latest"
    unset = parse_args(["--config", str(path), "--resume", ""])  # an explicit '' overrides the file too
    assert unset.resume is None


@pytest.mark.parametrize(
    "argv, error",
    [
        (["--steps", "0"], "steps"),
        (["--steps", "5", "--epochs", "1"], "steps or epochs"),
        (["--loss-mode", "dense"], "loss_mode"),
        (["--schedule", "step"], "schedule"),
        (["--lr", "-1"], "lr"),
        (["--workers", "-1"], "workers"),
        (["--chunk-size", "0"], "chunk_size"),
        (["--deepspeed_config", "missing.json"], "DeepSpeed config"),
        (["--preset", "", "--image-encoder", "vit_tiny_patch16_224"], "text_encoder"),
    ],
)
def test_bad_configs_are_clear_errors(argv: list[str], error: str) -> None:
    full = (["--deepspeed_config", DS] if "--deepspeed_config" not in argv else []) + argv
    if "--preset" in argv:
        cfg = config_from_dict({"model": {"preset": None, "image_encoder": "vit_tiny_patch16_224"}, "deepspeed_config": DS})
        with pytest.raises(ValueError, match=error):
            cfg.validate()
        return
    with pytest.raises((ValueError, FileNotFoundError), match=error):
        parse_args(full)


def test_unknown_config_keys_are_rejected() -> None:
    with pytest.raises(ValueError, match="unknown config key"):
        config_from_dict({"batch_size": 4})
    with pytest.raises(ValueError, match="unknown config keys in optim"):
        config_from_dict({"optim": {"learning_rate": 1.0}})


def test_warmup_cosine_schedule_against_closed_form() -> None:
    cfg = config_from_dict({"optim": {"lr": 1e-3, "min_lr": 1e-5, "warmup_steps": 10, "schedule": "cosine"}})
    total = 110
    for step in range(total):
        if step < 10:
            ref = 1e-3 * (step + 1) / 10
        else:
            ref = 1e-5 + 0.5 * (1e-3 - 1e-5) * (1 + math.cos(math.pi * (step - 10) / 100))
        assert lr_at(step, cfg, total) == pytest.approx(ref, rel=1e-12)
    const = config_from_dict({"optim": {"lr": 1e-3, "warmup_steps": 0, "schedule": "constant"}})
    assert {lr_at(s, const, 50) for s in range(50)} == {1e-3}


def load(name: str) -> dict:
    return json.loads((ROOT / "ds_configs" / name).read_text())


def test_precision_modes_from_the_shipped_configs() -> None:
    p, cfg = resolve_precision(load("zero2_bf16_halfmaster.json"))
    assert (p.mode, p.zero_stage, p.param_dtype, p.sr_state_dtype, p.half_master_partitions) == ("bf16", 2, torch.bfloat16, torch.bfloat16, True)
    assert cfg == load("zero2_bf16_halfmaster.json")  # handed to DeepSpeed unchanged
    p, cfg = resolve_precision(load("zero0_fp16_sr_lossscale.json"))
    assert (p.mode, p.param_dtype, p.sr_state_dtype, p.recipe_clip) == ("fp16", torch.float16, torch.float16, 1.0)
    assert "fp16" not in cfg and "gradient_clipping" not in cfg  # taken over by the recipe
    assert p.loss_scaler.scale == 2.0**16
    p, _ = resolve_precision(load("zero2_fp32.json"))
    assert (p.mode, p.param_dtype) == ("fp32", torch.float32)


@pytest.mark.parametrize(
    "cfg, error",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16 and fp16"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}, "requires"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}}, "ZeRO stage 1, 2 or 3"),
        ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "ZeRO stage 0"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "static"),
    ],
)
def test_contradictory_precision_configs_are_rejected(cfg: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        resolve_precision(cfg)


def test_dynamic_loss_scaler_follows_deepspeed_semantics() -> None:
    s = DynamicLossScaler.from_section({"initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 2})
    history = []
    for overflow in [True, True, False, False, False, True, True, True, True, True, True]:
        s.update(overflow)
        history.append(s.scale)
    # two overflows halve (hysteresis 2); three good steps double; never below min_loss_scale
    assert history == [16, 8, 8, 8, 16, 16, 8, 8, 4, 4, 2]


def test_skipped_steps_are_classified_and_the_guard_stops() -> None:
    from recipe.step import TrainState, record_skip

    p16, _ = resolve_precision(load("zero0_fp16_sr_lossscale.json"))
    state = TrainState()
    record_skip(state, p16, skipped=True, loss_nonfinite=False, limit=2)  # gradient overflow: scaler's business
    record_skip(state, p16, skipped=True, loss_nonfinite=False, limit=2)
    assert (state.overflow_steps, state.nonfinite_steps, state.nonfinite_in_row) == (2, 0, 0)
    assert p16.loss_scaler.scale == 2.0**15  # hysteresis 2: halved once
    record_skip(state, p16, skipped=True, loss_nonfinite=True, limit=2)
    record_skip(state, p16, skipped=False, loss_nonfinite=False, limit=2)  # a good step resets the streak
    assert (state.nonfinite_steps, state.nonfinite_in_row) == (1, 0)
    pbf, _ = resolve_precision(load("zero2_bf16_halfmaster.json"))
    record_skip(state, pbf, skipped=True, loss_nonfinite=False, limit=2)  # bf16: any skip is non-finite
    with pytest.raises(FloatingPointError, match="2 non-finite steps in a row"):
        record_skip(state, pbf, skipped=True, loss_nonfinite=True, limit=2)
