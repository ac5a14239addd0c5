"""The typed config and its command line; the learning-rate schedule; the precision modes read from
the DeepSpeed JSON; dynamic loss scaling."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch

import typing

from recipe.config import TrainConfig, _flag, _leaves, _sections, _unwrap, build_parser, config_from_dict, parse_args, UsageError
from recipe.model import PRESETS
from recipe.model.encoders import TEXT_CONFIGS
from recipe.training.optimizer import lr_at, warmup_note
from recipe.training.precision import ConfigError, DynamicLossScaler, read_ds_config, resolve_precision

ROOT = Path(__file__).resolve().parents[2]
DS = str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json")


def test_flags_fill_the_typed_config() -> None:
    cfg = parse_args([
        "--deepspeed_config", DS, "--image-encoder", "resnet50", "--text-encoder", "bert-tiny", "--preset", "tiny",
        "--train-data", "a.csv", "--data-format", "csv", "--steps", "7", "--lr", "3e-4", "--schedule", "constant",
        "--grad-checkpointing", "--loss-mode", "chunked", "--output-dir", "out", "--resume", "latest",
        "--eval-every", "5", "--seed", "3", "--no-image-master-weights", "--contrastive-batch", "micro",
    ])
    assert cfg.contrastive_batch == "micro" and parse_args(["--deepspeed_config", DS]).contrastive_batch == "global"
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
    # eval_batch_size is evaluation's; contrastive_batch picks which pairs a loss sees, not a size
    words = {w for n in names if n not in ("eval_batch_size", "contrastive_batch") for w in n.split("_")}
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
    with pytest.raises(UsageError, match="unrecognized arguments: --loss-m chunked \\(did you mean --loss-mode\\?\\)"):
        parse_args(["--deepspeed_config", DS, "--loss-m", "chunked"])  # not --loss-mode
    # --loss is a flag of its own (clip or siglip), never a prefix of --loss-mode
    assert parse_args(["--deepspeed_config", DS, "--loss", "siglip"]).loss_mode == "plain"
    with pytest.raises(ValueError, match="--loss must be one of clip, siglip, got 'chunked'"):
        parse_args(["--deepspeed_config", DS, "--loss", "chunked"])
    with pytest.raises(UsageError, match="--warmup 3 \\(did you mean --warmup-steps\\?\\); --help lists every flag"):
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
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--steps", "5", "--epochs", "1"], "give --steps or --epochs, not both"),
        (["--loss-mode", "dense"], "--loss-mode must be one of"),
        (["--contrastive-batch", "full"], "--contrastive-batch must be one of global, micro, got 'full'"),
        (["--schedule", "step"], "--schedule must be"),
        (["--lr", "-1"], "--lr must be"),
        (["--workers", "-1"], "--workers must be >= 0"),
        (["--chunk-size", "0"], "--chunk-size must be"),
        (["--embed-dim", "0"], "--embed-dim must be >= 1, got 0"),
        (["--image-size", "0"], "--image-size must be >= 1, got 0"),
        (["--context-length", "-3"], "--context-length must be >= 1, got -3"),
        (["--vocab-size", "0"], "--vocab-size must be"),
        (["--eval-batch-size", "0"], "--eval-batch-size must be"),
        (["--epochs", "0"], "--epochs must be > 0"),
        (["--num-samples", "0"], "--num-samples must be"),
        (["--hflip", "1.5"], "--hflip must be <= 1"),
        (["--beta2", "1"], "--beta2 must be < 1"),
        (["--train-scale", "0", "1"], "--train-scale must be > 0"),
        (["--train-scale", "1", "0.5"], "--train-scale must be a range"),
        (["--text-encoder", "no-such-tower"], "text encoder 'no-such-tower' is neither a built-in text tower"),
        (["--image-encoder", "resnet_99"], "image encoder 'resnet_99' is not a timm model name"),
        (["--deepspeed_config", "missing.json"], "DeepSpeed config"),
        (["--preset", "", "--image-encoder", "vit_tiny_patch16_224"], "give a preset, or both an image encoder and a text encoder"),
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


def _numeric(hint: object) -> bool:
    tp, _ = _unwrap(hint)
    elem = typing.get_args(tp)[0] if typing.get_origin(tp) is tuple else tp
    return elem in (int, float)


def test_every_number_in_the_config_is_range_checked() -> None:
    """Every numeric field declares its range; a value outside it is a ValueError naming the field
    (sizes and counts: >= 1), its bound itself is accepted."""
    fields = {f.name: (f, hint) for cls in _sections().values() for f, hint in _leaves(cls)}
    numeric = {name for name, (_, hint) in fields.items() if _numeric(hint)}
    bounds = {name: fields[name][0].metadata.get("bounds") for name in numeric}
    assert all(bounds.values()), [n for n, b in bounds.items() if not b]
    sizes = {n for n, b in bounds.items() if b.get("ge") == 1 or b.get("gt") == 0}
    assert {"embed_dim", "context_length", "vocab_size", "image_size", "eval_batch_size", "chunk_size", "steps",
            "epochs", "prefetch_factor", "shuffle_buffer", "num_samples", "log_every"} <= sizes
    for name in sorted(numeric):
        hint = fields[name][1]
        is_int = _unwrap(hint)[0] is int
        width = len(typing.get_args(_unwrap(hint)[0])) or 1
        for kind, bound in bounds[name].items():
            bad = {"ge": bound - 1, "gt": bound, "le": bound + 1, "lt": bound}[kind]
            argv = ["--deepspeed_config", DS, _flag(name), *[str(int(bad) if is_int else float(bad))] * width]
            with pytest.raises(ValueError, match=f"^{_flag(name)} must be"):
                parse_args(argv)
            if kind == "ge" and width == 1:  # the bound itself is in range
                parse_args(["--deepspeed_config", DS, _flag(name), str(int(bound) if is_int else float(bound))])
    with pytest.raises(ValueError, match="--steps must be an integer"):
        config_from_dict({"steps": 2.5, "deepspeed_config": DS}).validate()


def test_help_lists_presets_and_text_towers_from_their_registries(monkeypatch: pytest.MonkeyPatch) -> None:
    def helps() -> dict[str, str]:
        return {a.dest.rpartition(".")[2]: a.help for a in build_parser()._actions}

    text = build_parser().format_help()
    for name in [*PRESETS, *TEXT_CONFIGS]:
        assert name in text, name
    assert all(name in helps()["preset"] for name in PRESETS)
    assert all(name in helps()["text_encoder"] for name in TEXT_CONFIGS)
    monkeypatch.setitem(PRESETS, "tiny-2", PRESETS["tiny"])  # one registry entry: the help and the check follow
    monkeypatch.setitem(TEXT_CONFIGS, "bert-tiny-2", TEXT_CONFIGS["bert-tiny"])
    assert "tiny-2" in helps()["preset"] and "bert-tiny-2" in helps()["text_encoder"]
    cfg = parse_args(["--deepspeed_config", DS, "--preset", "tiny-2", "--text-encoder", "bert-tiny-2"])
    assert (cfg.model.preset, cfg.model.text_encoder) == ("tiny-2", "bert-tiny-2")
    with pytest.raises(ValueError, match="unknown preset 'ViT-Z-99'; choose from ViT-B-32, tiny, tiny-clip, tiny-resnet, tiny-convnext, tiny-2"):
        parse_args(["--deepspeed_config", DS, "--preset", "ViT-Z-99"])


def test_image_size_flag() -> None:
    assert parse_args(["--deepspeed_config", DS, "--image-size", "48"]).model.image_size == 48
    assert parse_args(["--deepspeed_config", DS, "--image-size", ""]).model.image_size is None
    assert "--image-size IMAGE_SIZE" in build_parser().format_help()


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


@pytest.mark.parametrize("steps, said", [(30, True), (20, True), (31, False), (400, False)])
def test_a_run_that_is_all_warmup_is_said(steps: int, said: bool) -> None:
    """The demo's --warmup-steps 30 with --steps 30 never reaches --lr: one line says so, with the peak
    the schedule reaches (lr_at of the last step) and a warm-up that fits."""
    cfg = config_from_dict({"optim": {"lr": 2e-3, "warmup_steps": 30}})
    note = warmup_note(cfg, steps)
    assert (note is not None) == said
    if said:
        assert f"covers all {steps} steps" in note and "--lr 0.002" in note
        assert f"{lr_at(steps - 1, cfg, steps):.3g}" in note and f"--warmup-steps {max(1, steps // 10)}" in note


def load(name: str) -> dict:
    return json.loads((ROOT / "ds_configs" / name).read_text())


def test_precision_modes_from_the_shipped_configs() -> None:
    p, cfg = resolve_precision(load("zero2_bf16_halfmaster.json"))
    assert (p.mode, p.zero_stage, p.param_dtype, p.sr_state_dtype, p.half_master_partitions) == ("bf16", 2, torch.bfloat16, torch.bfloat16, True)
    assert cfg == load("zero2_bf16_halfmaster.json")  # handed to DeepSpeed unchanged
    p, cfg = resolve_precision(load("zero0_fp16_sr_lossscale.json"))
    assert (p.mode, p.param_dtype, p.sr_state_dtype, p.recipe_clip) == ("fp16", torch.float16, torch.float16, 1.0)
    assert "fp16" not in cfg and cfg["gradient_clipping"] == 0.0  # taken over by the recipe
    from deepspeed.runtime.config import get_gradient_clipping
    assert get_gradient_clipping(cfg) == 0.0  # DeepSpeed does not clip again (its default is 1.0)
    assert get_gradient_clipping({}) == 1.0  # why the key is set to 0, not removed
    assert p.loss_scaler.scale == 2.0**16
    assert p.recipe_managed
    p, cfg = resolve_precision(load("zero0_bf16_sr.json"))
    assert (p.mode, p.zero_stage, p.param_dtype, p.sr_state_dtype, p.recipe_clip) == ("bf16", 0, torch.bfloat16, torch.bfloat16, 1.0)
    assert p.recipe_managed and p.loss_scaler is None
    assert "bf16" not in cfg  # DeepSpeed would wrap an fp32-master BF16_Optimizer
    assert get_gradient_clipping(cfg) == 0.0
    p, cfg = resolve_precision({"bf16": {"enabled": True}})  # plain bf16 at stage 0: DeepSpeed's own (fp32 master)
    assert not p.recipe_managed and cfg == {"bf16": {"enabled": True}}
    assert not resolve_precision(load("zero2_bf16_halfmaster.json"))[0].recipe_managed
    p, _ = resolve_precision(load("zero2_fp32.json"))
    assert (p.mode, p.param_dtype) == ("fp32", torch.float32)


@pytest.mark.parametrize(
    "cfg, error",
    [
        ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "both bf16 and fp16"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 2}}, "requires"),
        ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": True}, "gradient_clipping": -1}, "gradient_clipping"),
        ({"fp16": {"enabled": True}, "zero_optimization": {"stage": 2}}, "ZeRO stage 0"),
        ({"fp16": {"enabled": True, "loss_scale": 128}}, "static"),
    ],
)
def test_contradictory_precision_configs_are_rejected(cfg: dict, error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        resolve_precision(cfg)


def _write(tmp: Path, text: str) -> str:
    path = tmp / "ds.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "edit, error",
    [
        ({"train_micro_batch_size_per_gpu": 0}, "train_micro_batch_size_per_gpu must be a positive integer, got 0"),
        ({"train_micro_batch_size_per_gpu": "auto"}, "train_micro_batch_size_per_gpu must be a positive integer"),
        ({"train_micro_batch_size_per_gpu": 2.5}, "train_micro_batch_size_per_gpu must be a positive integer"),
        ({"gradient_accumulation_steps": -1}, "gradient_accumulation_steps must be a positive integer, got -1"),
        ({"gradient_accumulation_steps": True}, "gradient_accumulation_steps must be a positive integer"),
        ({"train_batch_size": 0}, "train_batch_size must be a positive integer"),
        ({"train_batch_size": 100}, "train_batch_size 100 is not a multiple of train_micro_batch_size_per_gpu 64"),
        ({"train_micro_batch_size_per_gpu": None}, "give train_micro_batch_size_per_gpu"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
        ({"gradient_clipping": -1.0}, "gradient_clipping must be a finite number >= 0"),
        ({"fp16": {"enabled": True}}, "both bf16 and fp16"),
        ({"bf16": {"enabled": True, "bf16_optimizer_states": True}, "zero_optimization": {"stage": 0}},
         "bf16.bf16_optimizer_states requires bf16.bf16_master_weights_and_grads"),
    ],
)
def test_bad_deepspeed_json_fails_at_parse_time_naming_the_file(edit: dict, error: str, tmp_path: Path) -> None:
    cfg = {k: v for k, v in {**load("zero2_bf16_halfmaster.json"), **edit}.items() if v is not None}
    path = _write(tmp_path, json.dumps(cfg))
    with pytest.raises(ConfigError, match=f"^{re.escape(path)}: .*{error}"):
        parse_args(["--deepspeed_config", path])  # before any model, engine or data is built


def test_malformed_deepspeed_json_names_file_line_and_column(tmp_path: Path) -> None:
    path = _write(tmp_path, '{\n  "train_micro_batch_size_per_gpu": 4,\n  "bf16": {"enabled": true,}\n}\n')
    with pytest.raises(ConfigError, match=f"^{re.escape(path)}: not valid JSON: .* at line 3, column 28$"):
        parse_args(["--deepspeed_config", path])
    path = _write(tmp_path, "[4]")
    with pytest.raises(ConfigError, match="a DeepSpeed config is a JSON object, got list"):
        read_ds_config(path)
    with pytest.raises(FileNotFoundError, match="DeepSpeed config not found: .*missing.json"):
        read_ds_config(tmp_path / "missing.json")


def test_deepspeed_batch_sizes_against_the_world_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = {"train_micro_batch_size_per_gpu": 16, "gradient_accumulation_steps": 2}
    ok = _write(tmp_path, json.dumps({**base, "train_batch_size": 64}))
    assert read_ds_config(ok, world_size=2)["train_batch_size"] == 64
    with pytest.raises(ConfigError, match="train_batch_size 64 != .* x world size 4 = 128"):
        read_ds_config(ok, world_size=4)
    monkeypatch.setenv("WORLD_SIZE", "4")  # a launched rank: parse_args knows the world size
    with pytest.raises(ConfigError, match="world size 4"):
        parse_args(["--deepspeed_config", ok])
    # DeepSpeed derives a missing entry: only the divisibility is checked
    assert read_ds_config(_write(tmp_path, '{"train_batch_size": 64}'), world_size=4)
    assert read_ds_config(_write(tmp_path, '{"train_batch_size": 64, "gradient_accumulation_steps": 8}'), world_size=4)
    with pytest.raises(ConfigError, match="train_batch_size 64 is not a multiple of world size 3$"):
        read_ds_config(_write(tmp_path, '{"train_batch_size": 64}'), world_size=3)
    for name in ("zero0_fp16_sr_lossscale.json", "zero0_bf16_sr.json", "zero1_bf16_halfmaster.json", "zero2_bf16_halfmaster.json",
                 "zero3_bf16_halfmaster.json", "zero2_fp32.json"):
        assert read_ds_config(ROOT / "ds_configs" / name, world_size=8) == load(name)


def test_dynamic_loss_scaler_follows_deepspeed_semantics() -> None:
    s = DynamicLossScaler.from_section({"initial_scale_power": 4, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 2})
    history = []
    for overflow in [True, True, False, False, False, True, True, True, True, True, True]:
        s.update(overflow)
        history.append(s.scale)
    # two overflows halve (hysteresis 2); three good steps double; never below min_loss_scale
    assert history == [16, 8, 8, 8, 16, 16, 8, 8, 4, 4, 2]


def test_skipped_steps_are_classified_and_the_guard_stops() -> None:
    from recipe.training.step import TrainState, record_skip

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
