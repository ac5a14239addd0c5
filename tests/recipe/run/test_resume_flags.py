"""Resume with changed settings (recipe/run/resume.py, recipe/run/regroup.py): every flag a checkpoint records is
either applied on resume (the optimizer groups' lr scales and hyperparameters, the groups themselves
with the optimizer state mapped by parameter name, lock state, EMA decay), said in one line, or
refused in one line naming the flag; an unchanged resume stays bit-identical.

Each test resumes from a module-wide base run (one rank, 4 steps, a checkpoint at step 2) on the
default route (ZeRO-0 bf16) and on ZeRO-2 (fp32), in one spawned rank per test."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ...dist_utils import run_distributed
from ..test_train import ENV, ds_json, losses_of, train_cfg

ROUTES = ["zero0_bf16_sr.json", "zero2_fp32.json"]
LR = 2e-3


def _cfg(data: Path, out: Path, ds: str, **kw: Any) -> dict:
    cfg = train_cfg(data, out, ds, **{"steps": 4, **kw})
    cfg["data"]["val_data"] = None  # no evaluation: these tests read the optimizer and the weights
    return cfg


def _resume_worker(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    """Runs each config in turn and returns, per run: the lines said, the refusal (if any), the optimizer
    groups after the run, the optimizer state and the weights by parameter name right after the resume
    and at the end, which parameters train, and the final metrics."""
    import recipe.train as T
    from recipe.config import config_from_dict
    from recipe.run.regroup import named_state

    said: list[str] = []
    sessions: list[Any] = []
    T.say = said.append
    set_up = T.set_up

    def spy(*a: Any, **k: Any) -> Any:
        session = set_up(*a, **k)
        sessions.append((session, named_state(session.engine, session.opt), _weights(session.model)))
        return session

    T.set_up = spy
    out = []
    for cfg in cfgs:
        said.clear()
        sessions.clear()
        row: dict[str, Any] = {"error": None}
        try:
            final = T.train(config_from_dict(cfg))
            row["final"] = {k: v for k, v in final.items() if k != "memory"}
        except (ValueError, RuntimeError) as e:
            row["error"] = str(e)
        row["said"] = list(said)
        if sessions and row["error"] is None:
            session, state0, w0 = sessions[-1]
            row.update(state0=state0, w0=w0, w1=_weights(session.model),
                       state1=named_state(session.engine, session.opt),
                       trainable={n: p.requires_grad for n, p in session.model.named_parameters()},
                       groups=[{k: g.get(k) for k in ("name", "lr_scale", "lr", "weight_decay", "betas", "eps")}
                               for g in session.opt.param_groups])
        out.append(row)
    return out


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def run(cfgs: list[dict]) -> list[dict]:
    return run_distributed(_resume_worker, 1, cfgs, init_process_group=False, env=ENV, timeout_s=600)[0]


@pytest.fixture(scope="module")
def bases(data: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """``bases(route)``: ``(root, DeepSpeed JSON, same)``: ``root / "base"`` holds the route's base run (4
    steps, a checkpoint at steps 2 and 4, an EMA with decay 0.99), ``same`` the row of its resume from
    step 2 with unchanged flags (into ``root / "same"``); made once per module, in one spawned rank."""
    made: dict[str, tuple[Path, str, dict]] = {}

    def get(route: str) -> tuple[Path, str, dict]:
        if route not in made:
            root = tmp_path_factory.mktemp(route.split(".")[0])
            ds = ds_json(root, route)
            base, same = run([_cfg(data, root / "base", ds, save_every=2, optim={"ema_decay": 0.99}),
                              _resume_cfg(data, root, ds, "same", _step2(root))])
            assert base["error"] is None and same["error"] is None, (base["error"], same["error"])
            made[route] = (root, ds, same)
        return made[route]

    return get


def _resume_cfg(data: Path, root: Path, ds: str, out: str, source: Path | str, **kw: Any) -> dict:
    kw.setdefault("optim", {})
    kw["optim"] = {"ema_decay": 0.99, **kw["optim"]}
    return _cfg(data, root / out, ds, resume=str(source), **kw)


def _step2(root: Path) -> Path:
    return root / "base" / "checkpoints" / "step00000002"


def _groups(row: dict) -> dict[str, dict]:
    return {g["name"]: g for g in row["groups"]}


def _same_state(a: dict[str, dict], b: dict[str, dict], names: Any = None) -> None:
    """Bit-identical optimizer state by parameter name (the noise stream index aside: renumbered)."""
    for name in names if names is not None else a:
        assert set(a[name]) == set(b[name]), name
        for key, t in a[name].items():
            if key != "index":
                assert t.dtype == b[name][key].dtype and torch.equal(t, b[name][key]), (name, key)


def _changed(row: dict, flag: str) -> list[str]:
    return [line for line in row["said"] if line.startswith(f"{flag} changed ")]


# --------------------------------------------------------------------------------------------------
# unchanged flags: bit-identical (regression)
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_unchanged_resume_stays_bit_identical(route: str, bases: Any, data: Path) -> None:
    root, ds, row = bases(route)
    assert not [line for line in row["said"] if " changed " in line], row["said"]
    a, b = losses_of(root / "base"), losses_of(root / "same")
    assert sorted(b) == [3, 4] and all(b[s] == a[s] for s in (3, 4)), (a, b)


# --------------------------------------------------------------------------------------------------
# learning rates and hyperparameters: applied to the same groups, the state kept
# --------------------------------------------------------------------------------------------------

HYPER_CASES = {
    "image_lr": ("--image-lr", {"optim": {"image_lr": 1e-3}}, {"image": 0.5, "text": 1.0}),
    "text_lr": ("--text-lr", {"optim": {"text_lr": 5e-4}}, {"image": 1.0, "text": 0.25}),
    "lr": ("--lr", {"optim": {"lr": 1e-3, "image_lr": 2e-3}}, {"image": 2.0, "text": 1.0}),  # --lr scales the towers
    "weight_decay": ("--weight-decay", {"optim": {"weight_decay": 0.1}}, {"image": 1.0, "text": 1.0}),
}


@pytest.fixture(scope="module")
def hyper_rows(bases: Any, data: Path) -> Any:
    """``hyper_rows(route)``: the rows of the resumes of :data:`HYPER_CASES` (one spawned rank per route)."""
    made: dict[str, dict[str, dict]] = {}

    def get(route: str) -> dict[str, dict]:
        if route not in made:
            root, ds, _ = bases(route)
            cases = sorted(HYPER_CASES)
            rows = run([_resume_cfg(data, root, ds, case, _step2(root), **HYPER_CASES[case][1]) for case in cases])
            made[route] = dict(zip(cases, rows))
        return made[route]

    return get


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", sorted(HYPER_CASES))
def test_lr_and_hyperparameter_flags_apply(case: str, route: str, bases: Any, hyper_rows: Any) -> None:
    root, ds, same = bases(route)
    flag, change, scales = HYPER_CASES[case]
    changed = hyper_rows(route)[case]
    assert changed["error"] is None, changed["error"]
    lr = change["optim"].get("lr", LR)
    for name, g in _groups(changed).items():  # this run's scales and hyperparameters, on the same groups
        scale = scales.get(name.split(".")[0], 1.0)
        assert g["lr_scale"] == pytest.approx(scale) and g["lr"] == pytest.approx(lr * scale), (name, g)
        wd = change["optim"].get("weight_decay", 0.0) if name.endswith(".decay") else 0.0
        assert g["weight_decay"] == wd, (name, g)
    assert [g["name"] for g in changed["groups"]] == [g["name"] for g in same["groups"]]
    lines = _changed(changed, flag)
    assert len(lines) == 1 and lines[0].endswith("on resume: applied"), changed["said"]
    _same_state(same["state0"], changed["state0"])  # the Adam state is the checkpoint's
    config = json.loads((root / case / "config.json").read_text())  # the run records the new values
    assert all(config["optim"][k] == v for k, v in change["optim"].items())


# --------------------------------------------------------------------------------------------------
# --layer-decay on, another value, off: the groups change, the state follows by parameter name
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ROUTES)
def test_layer_decay_on_and_off_maps_the_state_by_name(route: str, bases: Any, data: Path) -> None:
    root, ds, same = bases(route)
    on = root / "on" / "checkpoints" / "step00000004"
    other = root / "other" / "checkpoints" / "step00000005"
    layered, reset, flat = run([
        _resume_cfg(data, root, ds, "on", _step2(root), optim={"layer_decay": 0.5}),
        _resume_cfg(data, root, ds, "other", on, steps=5, optim={"layer_decay": 0.8}),
        _resume_cfg(data, root, ds, "off", other, steps=6),
    ])
    for row in (layered, reset, flat):
        assert row["error"] is None, row["error"]
    # on: the image tower split by layer (tiny ViT: embeddings, 2 blocks), scales 0.5 ** (2 - layer)
    line = _changed(layered, "--layer-decay")
    assert len(line) == 1 and "unset -> 0.5 on resume: applied (optimizer state mapped by parameter name" in line[0]
    groups = _groups(layered)
    assert not any(n.startswith("image.decay") or n.startswith("image.no_decay") for n in groups)
    for layer in range(3):
        assert groups[f"image.layer{layer}.decay"]["lr_scale"] == pytest.approx(0.5 ** (2 - layer))
    assert groups["text.decay"]["lr_scale"] == 1.0
    _same_state(same["state0"], layered["state0"])  # every parameter's state, bit for bit
    # another value: the same groups, other scales
    assert _changed(reset, "--layer-decay")[0] == "--layer-decay changed 0.5 -> 0.8 on resume: applied"
    assert _groups(reset)["image.layer0.decay"]["lr_scale"] == pytest.approx(0.64)
    _same_state(layered["state1"], reset["state0"])
    # off: one pair of image groups again, the state as the layered run left it
    assert "0.8 -> unset on resume: applied (optimizer state mapped" in _changed(flat, "--layer-decay")[0]
    assert [g["name"] for g in flat["groups"]] == [g["name"] for g in same["groups"]]
    _same_state(reset["state1"], flat["state0"])
    assert all(math.isfinite(v) for v in losses_of(root / "off").values())


# --------------------------------------------------------------------------------------------------
# --lock-text on, then off; --lock-image with unlocked layer groups
# --------------------------------------------------------------------------------------------------


def _text(name: str) -> bool:
    return name.startswith(("text.", "text_proj."))


@pytest.mark.parametrize("route", ROUTES)
def test_lock_text_on_then_off(route: str, bases: Any, data: Path) -> None:
    root, ds, same = bases(route)
    locked, unlocked = run([
        _resume_cfg(data, root, ds, "lock", _step2(root), model={"lock_text": True}),
        # into the same run directory: its config.json records the new value
        _resume_cfg(data, root, ds, "lock", "latest", steps=5, model={"lock_text": False}),
    ])
    assert locked["error"] is None and unlocked["error"] is None, (locked["error"], unlocked["error"])
    line = _changed(locked, "--lock-text")
    assert len(line) == 1 and line[0].startswith("--lock-text changed off -> on on resume: applied"), locked["said"]
    assert "parameters frozen, their state dropped" in line[0]
    assert not any(g["name"].startswith("text") for g in locked["groups"])
    text = [n for n in locked["trainable"] if _text(n)]
    assert text and not any(locked["trainable"][n] for n in text)
    for n in text:  # locked: bit-identical over the steps, no optimizer state
        assert torch.equal(locked["w0"][n], locked["w1"][n]) and n not in locked["state0"], n
    _same_state(same["state0"], locked["state0"], [n for n in same["state0"] if not _text(n)])
    # unlocked again: the text tower trains with fresh state
    line = _changed(unlocked, "--lock-text")
    assert len(line) == 1 and line[0].startswith("--lock-text changed on -> off on resume: applied"), unlocked["said"]
    assert "parameters trained with fresh state" in line[0]
    assert all(unlocked["trainable"][n] for n in text)
    assert any(not torch.equal(unlocked["w0"][n], unlocked["w1"][n]) for n in text)
    assert int(unlocked["state1"]["text_proj.weight"]["step"]) == 1  # its first step
    assert int(unlocked["state1"]["image_proj.weight"]["step"]) == 5
    assert json.loads((root / "lock" / "config.json").read_text())["model"]["lock_text"] is False


@pytest.mark.parametrize("route", ROUTES)
def test_lock_image_unlocked_groups(route: str, bases: Any, data: Path) -> None:
    root, ds, _ = bases(route)
    last = root / "last" / "checkpoints" / "step00000004"
    locked, more = run([
        _resume_cfg(data, root, ds, "last", _step2(root), model={"lock_image": True, "lock_image_unlocked_groups": 1}),
        _resume_cfg(data, root, ds, "more", last, steps=5, model={"lock_image": True, "lock_image_unlocked_groups": 2}),
    ])
    assert locked["error"] is None, locked["error"]
    assert _changed(locked, "--lock-image")[0].startswith("--lock-image changed off -> on on resume: applied")
    frozen = [n for n, t in locked["trainable"].items() if not t]
    assert "visual.trunk.blocks.0.attn.qkv.weight" in frozen and locked["trainable"]["visual.trunk.blocks.1.attn.qkv.weight"]
    assert all(torch.equal(locked["w0"][n], locked["w1"][n]) for n in frozen)
    if route.startswith("zero0"):
        # block 0 joins block 1's group: its fresh state next to block 1's carried one
        assert more["error"] is None, more["error"]
        line = _changed(more, "--lock-image-unlocked-groups")
        assert len(line) == 1 and line[0].startswith("--lock-image-unlocked-groups changed 1 -> 2 on resume: applied")
        assert more["trainable"]["visual.trunk.blocks.0.attn.qkv.weight"]
        assert int(more["state1"]["visual.trunk.blocks.0.attn.qkv.weight"]["step"]) == 1
        assert int(more["state1"]["visual.trunk.blocks.1.attn.qkv.weight"]["step"]) == 5
    else:
        # one flat group with one step count cannot hold trained and newly trainable parameters
        error = more["error"]
        assert error is not None and "\n" not in error
        assert error.startswith("--lock-image-unlocked-groups changed 1 -> 2 on resume is not supported"), error
        assert "--lock-image-unlocked-groups 1" in error and "--init-from" in error


# --------------------------------------------------------------------------------------------------
# --ema-decay, --ema-warmup; master weights refused
# --------------------------------------------------------------------------------------------------


def test_ema_decay_applies_and_keeps_the_average(bases: Any, data: Path) -> None:
    root, ds, _ = bases(ROUTES[0])
    changed = root / "ema" / "checkpoints" / "step00000004"
    decay, warmup, dropped = run([
        _resume_cfg(data, root, ds, "ema", _step2(root), optim={"ema_decay": 0.9}),
        _resume_cfg(data, root, ds, "warmup", changed, steps=5, optim={"ema_decay": 0.9, "ema_warmup": True}),
        _resume_cfg(data, root, ds, "none", changed, steps=5, optim={"ema_decay": None}),
    ])
    assert decay["error"] is None, decay["error"]
    assert _changed(decay, "--ema-decay") == ["--ema-decay changed 0.99 -> 0.9 on resume: applied "
                                              "(the average so far is kept)"]
    assert decay["final"]["ema"]["decay"] == 0.9 and decay["final"]["ema"]["updates"] == 4  # 2 saved + 2
    assert _changed(warmup, "--ema-warmup")[0].startswith("--ema-warmup changed off -> on on resume: applied")
    assert warmup["final"]["ema"]["warmup"] is True and warmup["final"]["ema"]["updates"] == 5
    assert _changed(dropped, "--ema-decay")[0].startswith("--ema-decay changed 0.9 -> unset on resume: applied")
    assert "ema" not in dropped["final"]
    assert not (root / "none" / "checkpoints" / "step00000005" / "ema_weights.pt").exists()


MASTER_CASES = {"--text-master-weights": {"text_master_weights": True},
                "--image-master-weights": {"image_master_weights": False}}


@pytest.fixture(scope="module")
def master_rows(bases: Any, data: Path) -> dict[str, dict]:
    root, ds, _ = bases(ROUTES[0])
    flags = sorted(MASTER_CASES)
    rows = run([_resume_cfg(data, root, ds, f"masters{i}", _step2(root), model=MASTER_CASES[flag])
                for i, flag in enumerate(flags)])
    return {flag: {**row, "dir": root / f"masters{i}"} for i, (flag, row) in enumerate(zip(flags, rows))}


@pytest.mark.parametrize("flag", sorted(MASTER_CASES))
def test_master_weights_change_is_refused(flag: str, master_rows: dict[str, dict]) -> None:
    row = master_rows[flag]
    error = row["error"]
    assert error is not None and "\n" not in error and error.startswith(f"{flag} changed "), error
    assert "is not supported" in error and "--init-from" in error
    assert not (row["dir"] / "config.json").exists()  # a refused start takes back what it wrote


# --------------------------------------------------------------------------------------------------
# without a training run
# --------------------------------------------------------------------------------------------------


def test_locked_parameters_are_what_the_model_locks() -> None:
    from recipe.model import create_model
    from recipe.training.param_groups import locked_parameters, param_groups

    for image, groups, text in [(True, 0, False), (True, 1, True), (True, 2, False), (False, 0, True)]:
        model = create_model("tiny")
        names = locked_parameters(model, image, groups, text)
        before = param_groups(model, 0.1, layer_decay=0.5, trainable={n for n, _ in model.named_parameters()} - names)
        if image:
            model.lock_image_tower(groups)
        if text:
            model.lock_text_tower()
        assert names == {n for n, p in model.named_parameters() if not p.requires_grad}
        after = param_groups(model, 0.1, layer_decay=0.5)
        assert [(g["name"], [id(p) for p in g["params"]]) for g in before] == \
            [(g["name"], [id(p) for p in g["params"]]) for g in after]


def test_refusals_before_loading(tmp_path: Path) -> None:
    """ZeRO-3 cannot map its optimizer state to other groups: a change of the groups is refused before
    anything is loaded, in one line naming the flag; so is a change of master weights on any stage."""
    from recipe.run import resume
    from recipe.config import TrainConfig, config_from_dict

    tag = tmp_path / "run" / "checkpoints" / "step00000002"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text(json.dumps({"step": 2, "world_size": 1}))
    torch.save({"settings": resume.record(TrainConfig())}, tag / "rank00000.pt")

    class Engine:
        def __init__(self, stage: int) -> None:
            self.stage = stage

        def zero_optimization_stage(self) -> int:
            return self.stage

    for stage, change, flag in [(3, {"optim": {"layer_decay": 0.7}}, "--layer-decay"),
                                (3, {"model": {"lock_text": True}}, "--lock-text"),
                                (0, {"model": {"text_master_weights": True}}, "--text-master-weights")]:
        cfg = config_from_dict({"model": {"preset": "tiny"}, **change})
        with pytest.raises(ValueError) as e:
            resume.load(Engine(stage), torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), tag, cfg,
                        tmp_path / "other", None, print)
        assert str(e.value).startswith(f"{flag} changed ") and "\n" not in str(e.value), str(e.value)
    # a value change of --layer-decay keeps the groups: not refused under ZeRO-3 (the load itself is reached)
    saved = {**resume.record(TrainConfig()), "optim.layer_decay": 0.8}
    found = resume.changes(saved, resume.record(config_from_dict({"optim": {"layer_decay": 0.7}})))
    assert [(c.setting.flag, c.regroups) for c in found] == [("--layer-decay", False)]


def test_settings_of_a_checkpoint_saved_before_they_were_recorded(tmp_path: Path) -> None:
    """A checkpoint without a settings record: its run's config.json (as it was before this start when the
    run is this one) and its EMA's own record."""
    from recipe.run import resume
    from recipe.config import config_from_dict

    run_dir = tmp_path / "run"
    tag = run_dir / "checkpoints" / "step00000002"
    tag.mkdir(parents=True)
    old = config_from_dict({"optim": {"image_lr": 1e-4}, "model": {"lock_text": True}}).to_dict()
    (run_dir / "config.json").write_text(json.dumps(old))
    client = {"ema": {"updates": 2, "decay": 0.95, "warmup": False, "seed": 0}}
    elsewhere = resume.saved_settings(tag, client, tmp_path / "other", None)
    assert elsewhere["optim.image_lr"] == 1e-4 and elsewhere["model.lock_text"] is True
    assert elsewhere["optim.ema_decay"] == 0.95
    # resumed into its own directory: the config.json this start has rewritten is not read, the previous one is
    (run_dir / "config.json").write_text(json.dumps(config_from_dict({}).to_dict()))
    here = resume.saved_settings(tag, {}, run_dir, old)
    assert here["optim.image_lr"] == 1e-4 and here["optim.ema_decay"] is None
    assert resume.saved_settings(tmp_path / "x" / "checkpoints" / "s", {}, tmp_path / "y", None) is None
    assert resume.saved_settings(tag, {"settings": {"optim.lr": 1.0}}, run_dir, old) == {"optim.lr": 1.0}
