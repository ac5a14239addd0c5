"""Tests of recipe.training.param_groups: a partition of the trainable parameters, CLIP's weight-decay rule
(all weights but gains, biases and the logit scale), per-tower precision flags, and the groups'
effect inside real optimizers (torch AdamW and optim.SRAdamW).

The decay rule is checked against an independent reference that names parameters by the type of
the module owning them (torch normalisation layers, ConvNeXt/LayerScale ``gamma``, ``*bias``),
rather than by shape as the implementation does.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from recipe.model import create_model
from recipe.training.param_groups import param_groups

MODELS = {
    "tiny": dict(preset="tiny"),
    "tiny-resnet": dict(preset="tiny-resnet"),
    "tiny-convnext": dict(preset="tiny-convnext"),
    "tiny+distilbert": dict(preset="tiny", text_encoder="distilbert-tiny"),
}
NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm2d)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request):
    torch.manual_seed(0)
    kwargs = dict(MODELS[request.param])
    return create_model(kwargs.pop("preset"), **kwargs)


def _reference_no_decay(model: nn.Module) -> set[str]:
    names = set()
    for module_name, module in model.named_modules():
        for local, _ in module.named_parameters(recurse=False):
            full = f"{module_name}.{local}" if module_name else local
            if isinstance(module, NORMS) or local == "bias" or local == "gamma" or full == "logit_scale":
                names.add(full)
    return names


def _names(model: nn.Module, group: dict) -> set[str]:
    by_id = {id(p): n for n, p in model.named_parameters()}
    return {by_id[id(p)] for p in group["params"]}


def test_every_parameter_in_exactly_one_group(model):
    groups = param_groups(model, 0.2)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids))
    assert set(ids) == {id(p) for p in model.parameters()}
    expected = ["image.decay", "image.no_decay", "text.decay", "text.no_decay", "logit_scale"]
    assert [g["name"] for g in groups] == expected


def test_decay_rule_matches_reference(model):
    groups = {g["name"]: g for g in param_groups(model, 0.2)}
    no_decay = set().union(*(_names(model, g) for k, g in groups.items() if not k.endswith(".decay")))
    decay = set().union(*(_names(model, g) for k, g in groups.items() if k.endswith(".decay")))
    assert no_decay == _reference_no_decay(model)
    for key, group in groups.items():
        assert group["weight_decay"] == (0.2 if key.endswith(".decay") else 0.0)
    # Towers: projections travel with their tower; embeddings are decayed weights (CLIP).
    assert "image_proj.weight" in _names(model, groups["image.decay"])
    assert "text_proj.weight" in _names(model, groups["text.decay"])
    assert _names(model, groups["logit_scale"]) == {"logit_scale"}
    assert all(n.startswith(("visual.", "image_proj.")) for n in _names(model, groups["image.decay"]))
    assert all(n.startswith(("text.", "text_proj.")) for n in _names(model, groups["text.no_decay"]))
    embedding_tables = {n for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    assert embedding_tables and {f"{n}.weight" for n in embedding_tables} <= decay


def test_decay_embeddings_false_exempts_only_embeddings(model):
    default = param_groups(model, 0.1)
    exempt = param_groups(model, 0.1, decay_embeddings=False)
    decay_before = set().union(*(_names(model, g) for g in default if g["name"].endswith(".decay")))
    decay_after = set().union(*(_names(model, g) for g in exempt if g["name"].endswith(".decay")))
    moved = decay_before - decay_after
    assert decay_after <= decay_before
    expected = {f"{n}.weight" for n, m in model.named_modules() if isinstance(m, nn.Embedding)}
    expected |= {n for n, _ in model.named_parameters() if n.split(".")[-1] in ("pos_embed", "cls_token")}
    assert moved == expected


def test_precision_flags_and_options(model):
    groups = {g["name"]: g for g in param_groups(model, 0.1)}
    assert groups["text.decay"]["master_weights"] is False and groups["text.no_decay"]["master_weights"] is False
    assert groups["image.decay"]["master_weights"] is True and groups["image.no_decay"]["master_weights"] is True
    assert groups["logit_scale"]["master_weights"] is True
    assert all("lr" not in g and "state_dtype" not in g for g in groups.values())

    flipped = {g["name"]: g for g in param_groups(
        model, 0.1, text_master_weights=True, image_master_weights=False, logit_scale_master_weights=False,
        image_lr=1e-3, text_lr=2e-3, logit_scale_lr=3e-3, text_state_dtype=torch.bfloat16,
        image_state_dtype=torch.float32)}
    assert flipped["text.decay"]["master_weights"] is True and flipped["image.no_decay"]["master_weights"] is False
    assert flipped["logit_scale"]["master_weights"] is False
    assert flipped["image.decay"]["lr"] == 1e-3 and flipped["text.no_decay"]["lr"] == 2e-3
    assert flipped["logit_scale"]["lr"] == 3e-3
    assert flipped["text.decay"]["state_dtype"] is torch.bfloat16
    assert flipped["image.no_decay"]["state_dtype"] is torch.float32
    assert "state_dtype" not in flipped["logit_scale"]


def test_frozen_parameters_left_out_and_strangers_refused():
    model = create_model("tiny")
    for p in model.visual.parameters():
        p.requires_grad_(False)
    groups = param_groups(model, 0.1)
    assert [g["name"] for g in groups] == ["image.decay", "text.decay", "text.no_decay", "logit_scale"]
    assert _names(model, groups[0]) == {"image_proj.weight"}
    model.extra = nn.Linear(2, 2)
    with pytest.raises(ValueError, match="extra.weight"):
        param_groups(model, 0.1)


@pytest.mark.parametrize("which", ["torch.AdamW", "SRAdamW"])
def test_weight_decay_applied_by_group_in_optimizer(which):
    """With zero gradients AdamW's update is the decoupled decay alone: p <- p (1 - lr wd)."""
    if which == "SRAdamW":
        optim = pytest.importorskip("optim")
        make = lambda groups, lr: optim.SRAdamW(groups, lr=lr)  # noqa: E731
    else:
        make = lambda groups, lr: torch.optim.AdamW(groups, lr=lr)  # noqa: E731
    torch.manual_seed(0)
    model = create_model("tiny-convnext")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    groups = param_groups(model, 0.5)
    opt = make(groups, 0.1)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    decayed = set().union(*(_names(model, g) for g in groups if g["name"].endswith(".decay")))
    for name, p in model.named_parameters():
        expected = before[name] * (1 - 0.1 * 0.5) if name in decayed else before[name]
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_sradamw_keeps_master_copies_per_group():
    optim = pytest.importorskip("optim")
    torch.manual_seed(0)
    model = create_model("tiny").to(torch.bfloat16)
    groups = param_groups(model, 0.1)
    opt = optim.SRAdamW(groups, lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    for group in opt.param_groups:
        for p in group["params"]:
            assert (opt.master(p) is not None) == group["master_weights"], group["name"]
    names = {g["name"]: g["master_weights"] for g in opt.param_groups}
    assert names == {"image.decay": True, "image.no_decay": True, "text.decay": False,
                     "text.no_decay": False, "logit_scale": True}


# ---------------------------------------------------------------------------------------------
# Per-tower rates and layer-wise decay: lr_scale per group
# ---------------------------------------------------------------------------------------------

VIT_LAYERS = {  # the tiny ViT (2 blocks): embeddings 0, block i: i + 1, the final norm and projection with block 1
    0: ("visual.trunk.cls_token", "visual.trunk.pos_embed", "visual.trunk.patch_embed."),
    1: ("visual.trunk.blocks.0.",),
    2: ("visual.trunk.blocks.1.", "visual.trunk.norm.", "image_proj."),
}


def test_layer_decay_groups_and_scales():
    model = create_model("tiny")
    groups = param_groups(model, 0.1, layer_decay=0.5, image_lr_scale=2.0, text_lr_scale=0.25)
    names = [g["name"] for g in groups]
    assert names == [f"image.layer{i}.{k}" for i in range(3) for k in ("decay", "no_decay")] + [
        "text.decay", "text.no_decay", "logit_scale"]
    scales = {g["name"].rpartition(".")[0] if "." in g["name"] else g["name"]: g["lr_scale"] for g in groups}
    # the last layer at the tower's rate, each one before it x0.5: 2 x (0.25, 0.5, 1)
    assert scales == {"image.layer0": 0.5, "image.layer1": 1.0, "image.layer2": 2.0, "text": 0.25, "logit_scale": 1.0}
    for layer, prefixes in VIT_LAYERS.items():
        members = _names(model, groups[2 * layer]) | _names(model, groups[2 * layer + 1])
        assert members == {n for n, _ in model.named_parameters() if n.startswith(prefixes)}, layer
    ids = [id(p) for g in groups for p in g["params"]]
    assert sorted(ids) == sorted(id(p) for p in model.parameters())
    # the decay rule is unchanged by the split
    plain = param_groups(model, 0.1)
    decayed = set().union(*(_names(model, g) for g in groups if g["name"].endswith(".decay")))
    assert decayed == set().union(*(_names(model, g) for g in plain if g["name"].endswith(".decay")))
    assert all(g["lr_scale"] == 1.0 for g in plain)

    convnext = create_model("tiny-convnext")  # stem, four one-block stages, head norm (+ image_proj)
    scales = {g["name"]: g["lr_scale"] for g in param_groups(convnext, 0.1, layer_decay=0.8)}
    assert {k: v for k, v in scales.items() if k.endswith(".decay") and k.startswith("image")} == {
        f"image.layer{i}.decay": pytest.approx(0.8 ** (5 - i), rel=1e-12) for i in range(6)}
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="layer_decay"):
            param_groups(model, 0.1, layer_decay=bad)


def test_build_optimizer_rates_move_parameters_by_their_scale():
    """Adam's first step moves every element by lr (the update is g / |g|): the rates are read off the step."""
    from recipe.config import TrainConfig
    from recipe.training.optimizer import build_optimizer, describe_groups, tower_lr_scales
    from recipe.training.precision import Precision

    torch.manual_seed(0)
    model = create_model("tiny")
    cfg = TrainConfig()
    cfg.optim.lr, cfg.optim.image_lr, cfg.optim.text_lr, cfg.optim.layer_decay = 1e-3, 2e-3, 5e-4, 0.5
    cfg.optim.weight_decay = 0.0
    opt = build_optimizer(model, cfg, Precision("fp32", 0, torch.float32, torch.float32, False))
    expected = {"image.layer0": 0.5, "image.layer1": 1.0, "image.layer2": 2.0, "text": 0.5, "logit_scale": 1.0}
    by_param = {}
    for g in opt.param_groups:
        part = g["name"].rpartition(".")[0] if g["name"] != "logit_scale" else "logit_scale"
        assert g["lr_scale"] == expected[part], g["name"]
        g["lr"] = cfg.optim.lr * g["lr_scale"]  # as the training loop sets it
        by_param.update({id(p): g["lr"] for p in g["params"]})
    assert "image.layer0.decay 13,440 x0.5 wd 0, " in describe_groups(opt)  # cls token, positions, patch kernel
    assert "logit_scale 7 x1" in describe_groups(opt, {g["name"]: 7 for g in opt.param_groups})
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p in model.parameters():
        p.grad = torch.randn_like(p).sign() * (1 + torch.rand_like(p))
    model.logit_scale.grad.fill_(-1.0)
    opt.step()
    for name, p in model.named_parameters():
        step = (p.detach() - before[name]).abs().double().mean().item()
        assert step == pytest.approx(by_param[id(p)], rel=2e-3), name

    cfg.optim.lr = 0.0
    with pytest.raises(ValueError, match="--image-lr"):
        tower_lr_scales(cfg)
    cfg.optim.image_lr = cfg.optim.text_lr = None
    assert tower_lr_scales(cfg) == (1.0, 1.0)
