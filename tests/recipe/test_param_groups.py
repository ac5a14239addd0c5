"""Tests of recipe.param_groups: a partition of the trainable parameters, CLIP's weight-decay rule
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
from recipe.param_groups import param_groups

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
            assert ("master" in opt.state[p]) == group["master_weights"], group["name"]
    names = {g["name"]: g["master_weights"] for g in opt.param_groups}
    assert names == {"image.decay": True, "image.no_decay": True, "text.decay": False,
                     "text.no_decay": False, "logit_scale": True}
