"""Tests of the tower training settings: patch dropout (FLIP), locked towers (LiT) and the image tower's
layer ids (the groups of partial locking and layer-wise learning-rate decay).

Patch dropout is checked by counting the tokens the transformer blocks receive (and that the class
token and a subset of the real patch tokens are what they receive); locking by the parameters left
trainable, by BatchNorm statistics that a training-mode forward leaves alone, and in a short 2-rank
DeepSpeed run by bit-identical locked weights next to trained ones and an optimizer whose state covers
the trainable parameters only (with per-group rates of --image-lr/--text-lr/--layer-decay). The training
script's ``build_model`` applies the flags and records patch dropout in ``model_config.json``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from recipe.model import CLIPConfig, create_model
from recipe.training.param_groups import param_groups

from ...dist_utils import run_distributed
from ..test_train import ENV, ds_json, train_cfg

PATCHES = 16  # the tiny preset's ViT: 32-pixel images, 8-pixel patches


def _loss(model, pixels: torch.Tensor, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, model.text.config.vocab_size, (pixels.shape[0], 8), generator=gen)
    img, txt, scale, *_ = model(pixels, ids, torch.ones_like(ids))
    logits = scale * img @ txt.T
    target = torch.arange(pixels.shape[0])
    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2


# ---------------------------------------------------------------------------------------------
# Patch dropout
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [0.25, 0.5, 0.75])
def test_patch_dropout_drops_patches_in_training_only(p: float) -> None:
    torch.manual_seed(0)
    model = create_model("tiny", patch_dropout=p)
    trunk = model.visual.trunk
    counts, dropped = [], []
    trunk.blocks[0].register_forward_pre_hook(lambda m, a: counts.append(a[0].shape[1]))
    trunk.patch_drop.register_forward_hook(lambda m, a, out: dropped.append((a[0].detach(), out.detach())))
    pixels = torch.randn(4, 3, 32, 32)

    model.train()
    loss = _loss(model, pixels)
    loss.backward()
    keep = max(1, int(PATCHES * (1 - p)))  # timm's (and OpenCLIP's) count: the floor, at least one
    assert counts == [1 + keep]
    assert keep == round((1 - p) * PATCHES)  # these P: the same as rounding
    full, kept = dropped[0]
    assert full.shape[1] == 1 + PATCHES and kept.shape[1] == 1 + keep
    torch.testing.assert_close(kept[:, 0], full[:, 0], rtol=0, atol=0)  # the class token, always first
    for row in range(kept.shape[0]):  # the rest: distinct real patch tokens (embedding + position)
        match = (kept[row, 1:, None, :] == full[row, None, 1:, :]).all(-1)
        assert (match.sum(1) == 1).all() and match.any(0).sum() == keep
    assert torch.isfinite(loss) and all(q.grad is not None and torch.isfinite(q.grad).all()
                                        for q in model.parameters())
    assert trunk.pos_embed.grad.abs().sum() > 0

    model.eval()
    with torch.no_grad():
        features = model.encode_image(pixels)
    assert counts[-1] == 1 + PATCHES
    reference = create_model("tiny")  # the same weights without patch dropout: the same model in evaluation
    reference.load_state_dict(model.state_dict())
    torch.testing.assert_close(reference.eval().encode_image(pixels), features, rtol=0, atol=0)


def test_patch_dropout_recorded_in_config_not_in_timm_kwargs() -> None:
    model = create_model("tiny", patch_dropout=0.5)
    data = json.loads(json.dumps(model.config.to_dict()))
    assert data["image"]["patch_dropout"] == 0.5 and "patch_drop_rate" not in data["image"]["timm_kwargs"]
    again = create_model(config=CLIPConfig.from_dict(data))
    assert again.visual.trunk.patch_drop.prob == 0.5
    assert again.state_dict().keys() == create_model("tiny").state_dict().keys()
    old = {k: v for k, v in data["image"].items() if k != "patch_dropout"}  # a model_config.json from before
    assert create_model(config=CLIPConfig.from_dict({**data, "image": old})).config.image.patch_dropout == 0.0


@pytest.mark.parametrize("preset", ["tiny-resnet", "tiny-convnext"])
def test_patch_dropout_refused_without_patch_tokens(preset: str) -> None:
    with pytest.raises(ValueError, match="patch tokens"):
        create_model(preset, patch_dropout=0.5)
    create_model(preset, patch_dropout=0.0)
    with pytest.raises(ValueError, match="patch_dropout="):
        create_model("tiny", image_kwargs={"patch_drop_rate": 0.5})


# ---------------------------------------------------------------------------------------------
# Layer ids and locking
# ---------------------------------------------------------------------------------------------


def test_layer_ids_of_vit_and_convnext() -> None:
    ids, count = create_model("tiny").image_layer_ids()
    assert count == 3
    for name, i in ids.items():
        local = name.removeprefix("visual.trunk.")
        expected = 0 if local.split(".")[0] in ("cls_token", "pos_embed", "patch_embed") else None
        expected = 1 if local.startswith("blocks.0.") else expected
        expected = 2 if local.startswith(("blocks.1.", "norm.", "image_proj.")) else expected
        assert i == expected, name
    ids, count = create_model("tiny-convnext").image_layer_ids()  # stem, 4 one-block stages, head norm
    assert count == 6
    assert ids["visual.trunk.stem.0.weight"] == 0
    for name, i in ids.items():  # stage s (its downsampling and its one block): s + 1
        if name.startswith("visual.trunk.stages."):
            assert i == int(name.split(".")[3]) + 1, name
    assert {n for n, i in ids.items() if i == 5} == {"visual.trunk.head.norm.weight", "visual.trunk.head.norm.bias",
                                                     "image_proj.weight"}


@pytest.mark.parametrize("unlocked", [0, 1, 2])
def test_lock_image_tower_leaves_last_groups_and_keeps_batchnorm_stats(unlocked: int) -> None:
    torch.manual_seed(0)
    model = create_model("tiny-resnet")  # stem, layer1.0 ... layer4.0: five groups
    model.lock_image_tower(unlocked)
    trainable = {n for n, q in model.named_parameters() if q.requires_grad}
    unlocked_layers = [f"visual.trunk.layer{k}." for k in range(5 - unlocked, 5)]
    image = {n for n, _ in model.named_parameters() if n.startswith(("visual.", "image_proj."))}
    expected = {n for n in image if n.startswith(tuple(unlocked_layers))}
    expected |= {"image_proj.weight"} if unlocked else set()
    assert trainable & image == expected
    assert {n for n, _ in model.named_parameters() if n.startswith(("text", "logit"))} <= trainable

    model.train()  # locked BatchNorm stays in evaluation mode, the rest trains
    norms = {n: m for n, m in model.visual.trunk.named_modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert {n for n, m in norms.items() if m.training} == {n for n in norms if f"visual.trunk.{n}.".startswith(
        tuple(unlocked_layers))}
    before = {k: v.clone() for k, v in model.state_dict().items()}
    _loss(model, torch.randn(4, 3, 32, 32)).backward()
    after = model.state_dict()
    for name, m in norms.items():
        same = torch.equal(before[f"visual.trunk.{name}.running_mean"], after[f"visual.trunk.{name}.running_mean"])
        assert same != m.training, name
    assert all(q.grad is None for n, q in model.named_parameters() if n not in trainable)
    groups = param_groups(model, 0.1)
    grouped = {id(q) for g in groups for q in g["params"]}
    assert grouped == {id(q) for n, q in model.named_parameters() if n in trainable}
    assert not any(g["name"].startswith("image") for g in groups) or unlocked


def test_lock_text_tower_and_bad_unlocked_groups() -> None:
    model = create_model("tiny")
    model.lock_text_tower()
    assert {n for n, q in model.named_parameters() if q.requires_grad and n.startswith("text")} == set()
    assert [g["name"] for g in param_groups(model, 0.1)] == ["image.decay", "image.no_decay", "logit_scale"]
    with pytest.raises(ValueError, match="3 layer groups"):
        model.lock_image_tower(4)


def test_build_model_applies_patch_dropout_and_locks(tmp_path: Path) -> None:
    from recipe.config import TrainConfig
    from recipe.model.tokenizer import train_tokenizer
    from recipe.train import build_model

    cfg = TrainConfig()
    cfg.model.patch_dropout, cfg.model.lock_image, cfg.model.lock_image_unlocked_groups = 0.5, True, 1
    cfg.model.lock_text = True
    tokenizer = train_tokenizer([f"a {c} square" for c in ("red", "green", "blue")] * 4, 300, context_length=16)
    model = build_model(cfg, tokenizer, tmp_path)
    assert model.visual.trunk.patch_drop.prob == 0.5
    assert json.loads((tmp_path / "model_config.json").read_text())["image"]["patch_dropout"] == 0.5
    trainable = {n.split(".")[0] for n, q in model.named_parameters() if q.requires_grad}
    assert trainable == {"visual", "image_proj", "logit_scale"}  # the image tower's last group only
    assert not model.visual.trunk.blocks[0].norm1.weight.requires_grad


# ---------------------------------------------------------------------------------------------
# Under DeepSpeed: a locked tower stays bit-identical; per-group rates reach the optimizer
# ---------------------------------------------------------------------------------------------


def _locked_worker(rank: int, world: int, cfg: dict) -> dict:
    import recipe.train as T
    from recipe.config import config_from_dict
    from recipe.training.optimizer import lr_at

    seen: dict = {}
    build_engine = T.build_engine

    def spy(model, *args, **kwargs):
        engine, opt, counts = build_engine(model, *args, **kwargs)
        seen.update(engine=engine, opt=opt, before={k: v.clone() for k, v in engine.module.state_dict().items()})
        seen["trainable"] = {n: q.numel() for n, q in engine.module.named_parameters() if q.requires_grad}
        return engine, opt, counts

    T.build_engine = spy
    c = config_from_dict(cfg)
    final = T.train(c)
    after = seen["engine"].module.state_dict()
    opt = seen["opt"]
    return dict(
        changed={k for k, v in seen["before"].items() if not torch.equal(v, after[k])},
        names=set(seen["before"]),
        trainable=seen["trainable"],
        params={n: q.numel() for n, q in seen["engine"].module.named_parameters()},
        state=sum(s["exp_avg"].numel() for s in opt.state.values() if "exp_avg" in s),
        groups=[(g["name"], g["lr_scale"], g["lr"]) for g in opt.param_groups],
        lr=lr_at(c.steps - 1, c, c.steps),
        group_params=final["memory"]["group_params"],
    )


def test_locked_image_tower_under_deepspeed(data: Path, tmp_path: Path) -> None:
    """ZeRO-2, 2 ranks, 4 steps: the ResNet's stem to layer2 (weights and BatchNorm statistics) bit-identical,
    layer3, layer4, image_proj and the text tower trained; optimizer state for the trainable parameters only;
    group rates lr x 2 (--image-lr) x 0.5^k (--layer-decay) and lr x 0.5 (--text-lr)."""
    cfg = train_cfg(data, tmp_path / "run", ds_json(tmp_path, "zero2_bf16_halfmaster.json", micro=8), steps=4,
                    model={"preset": "tiny-resnet", "lock_image": True, "lock_image_unlocked_groups": 2},
                    optim={"warmup_steps": 0, "image_lr": 4e-3, "text_lr": 1e-3, "layer_decay": 0.5})
    cfg["data"]["val_data"] = None  # no evaluation: training alone
    ranks = run_distributed(_locked_worker, 2, cfg, init_process_group=False, env=ENV, timeout_s=600)
    r = ranks[0]
    locked = {n for n in r["names"] if n.startswith("visual.") and not n.startswith(
        ("visual.trunk.layer3.", "visual.trunk.layer4."))}
    assert any(n.endswith("running_var") for n in locked) and any(n.endswith("conv1.weight") for n in locked)
    assert not (r["changed"] & locked)
    trained = set(r["trainable"]) - {"logit_scale"}
    assert trained - r["changed"] == set(), trained - r["changed"]
    assert {n for n in r["changed"] if n.startswith("visual.trunk.layer4.") and "running_mean" in n}
    assert any(n.startswith("text.") for n in r["changed"])

    assert set(r["trainable"]) == set(r["params"]) - locked  # the locked tower's parameters: no gradients
    n_trainable = sum(r["trainable"].values())
    assert sum(r["group_params"].values()) == n_trainable  # ... and in no optimizer group
    state = sum(x["state"] for x in ranks)  # ZeRO-2: each rank's flat partitions, padded per group
    assert n_trainable <= state <= n_trainable + 2 * 64 * len(r["groups"])

    expected = {"image.layer3.decay": 1.0, "image.layer3.no_decay": 1.0, "image.layer4.decay": 2.0,
                "image.layer4.no_decay": 2.0, "text.decay": 0.5, "text.no_decay": 0.5, "logit_scale": 1.0}
    assert {name: scale for name, scale, _ in r["groups"]} == expected
    assert all(math.isclose(lr, r["lr"] * scale, rel_tol=1e-12) for _, scale, lr in r["groups"])
