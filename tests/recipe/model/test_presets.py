"""Every model preset, and a BatchNorm timm model named by flag, trains and evaluates under DeepSpeed
on 2 CPU ranks (gloo), on the default bf16 config and on the fp16 route.

One 2-rank spawn trains every (model, route) pair in turn (process start-up is paid once): two
optimizer steps of micro-batch 2 per rank at 32 pixels (ViT-B-32 and resnet18 through ``image_size``;
ViT-B-32 keeps its architecture, one patch, so that its 151 M parameters cost seconds, not minutes),
then the final evaluation on 4 held-out pairs. BatchNorm towers are checked in the trained module
itself: fp32 running statistics next to half-precision weights, updated once per training forward
and never by the evaluation. Before that, single-process tests hold half-precision BatchNorm to fp64
references.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from recipe.model import PRESETS, CLIPConfig, create_model, keep_batchnorm_fp32
from recipe.model.encoders import create_image_tower
from recipe.synthetic import write_dataset

from ...dist_utils import run_distributed
from .test_model import _check_forward_backward, _tokens

ROOT = Path(__file__).resolve().parents[3]
ENV = {"DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
ROUTES = {
    "bf16": ("zero2_bf16_halfmaster.json", torch.bfloat16),  # the default DeepSpeed config
    "fp16": ("zero0_fp16_sr_lossscale.json", torch.float16),
}
STEPS, MICRO, N_VAL = 2, 2, 4
# model config and image side of each trained model; every preset is there (checked below)
MODELS: dict[str, tuple[dict[str, Any], int]] = {
    "ViT-B-32": ({"preset": "ViT-B-32", "image_size": 32}, 32),
    "tiny": ({"preset": "tiny"}, 32),
    "tiny-clip": ({"preset": "tiny-clip"}, 32),
    "tiny-resnet": ({"preset": "tiny-resnet"}, 32),
    "tiny-convnext": ({"preset": "tiny-convnext"}, 32),
    "resnet18": ({"preset": None, "image_encoder": "resnet18", "text_encoder": "bert-tiny", "image_size": 32}, 32),
}
RUNS = [(m, r) for m in MODELS for r in ROUTES] + [("tiny-resnet@48", "bf16")]
SIZED = {**MODELS, "tiny-resnet@48": ({"preset": "tiny-resnet", "image_size": 48}, 48)}


# --------------------------------------------------------------------------------------------------
# BatchNorm in a half-precision model, on one process, against fp64 references
# --------------------------------------------------------------------------------------------------


def _cast(module: torch.nn.Module, dtype: torch.dtype, how: str) -> None:
    if how == "deepspeed":  # DeepSpeed's bf16/fp16 cast: parameters only, buffers keep their dtype
        for p in module.parameters():
            p.data = p.data.to(dtype)
    else:
        module.to(dtype)


def _batchnorms(**kw: Any) -> list[torch.nn.Module]:
    from timm.layers import BatchNormAct2d

    return [torch.nn.BatchNorm2d(6, **kw), BatchNormAct2d(6, **kw)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("how", ["deepspeed", "module"])
def test_half_batchnorm_matches_fp64_and_keeps_fp32_statistics(dtype: torch.dtype, how: str) -> None:
    """A half model's BatchNorm computes like an fp64 one with the same (rounded) weights, updates
    fp32 running statistics like it, and hands half gradients to its half parameters."""
    eps = torch.finfo(dtype).eps
    for bn in _batchnorms():
        torch.manual_seed(0)
        with torch.no_grad():
            bn.weight.uniform_(0.5, 1.5), bn.bias.uniform_(-0.5, 0.5)
            bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
        ref = copy.deepcopy(bn).double()
        keep_batchnorm_fp32(bn)
        _cast(bn, dtype, how)
        assert bn.weight.dtype == dtype and bn.running_var.dtype == torch.float32
        with torch.no_grad():
            ref.weight.copy_(bn.weight), ref.bias.copy_(bn.bias)
        x = torch.randn(4, 6, 5, 5).to(dtype)
        g = torch.randn(4, 6, 5, 5)
        for training in (True, False):
            bn.train(training), ref.train(training)
            y, y_ref = bn(x), ref(x.double())
            assert y.dtype == dtype
            torch.testing.assert_close(y.double(), y_ref, rtol=2 * eps, atol=4 * eps)
            torch.testing.assert_close(bn.running_mean.double(), ref.running_mean, rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(bn.running_var.double(), ref.running_var, rtol=1e-6, atol=1e-7)
            assert bn.running_var.dtype == torch.float32 and int(bn.num_batches_tracked) == 1
        bn.train(), ref.train()
        (bn(x).double() * g).sum().backward()
        (ref(x.double()) * g).sum().backward()
        assert type(bn.weight) is torch.nn.Parameter and bn.weight.grad.dtype == dtype
        for name in ("weight", "bias"):
            grad, grad_ref = getattr(bn, name).grad.double(), getattr(ref, name).grad
            torch.testing.assert_close(grad, grad_ref, rtol=4 * eps, atol=4 * eps * grad_ref.abs().max().item())


def test_full_precision_batchnorm_is_unchanged() -> None:
    """In fp32 the model's BatchNorm layers are timm's own: same state-dict names, same numbers."""
    import timm

    torch.manual_seed(0)
    model = create_model("tiny-resnet").train()
    trunk = model.visual.trunk
    kwargs = PRESETS["tiny-resnet"]().image.timm_kwargs
    plain = timm.create_model("resnet18", pretrained=False, num_classes=0, **kwargs).train()
    assert not any(type(m).__module__.startswith("recipe.") for m in plain.modules())
    plain.load_state_dict(trunk.state_dict())  # same names (strict)
    x = torch.randn(4, 3, 32, 32)
    for training in (True, False):
        trunk.train(training), plain.train(training)
        torch.testing.assert_close(trunk(x), plain(x), rtol=0, atol=0)
    for (name, a), (_, b) in zip(trunk.named_buffers(), plain.named_buffers(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)


def test_half_casts_keep_batchnorm_statistics_exact() -> None:
    model = create_model("tiny-resnet")
    bn = model.visual.trunk.bn1
    names = list(model.state_dict())
    with torch.no_grad():
        bn.running_var.fill_(1 + 2**-20)  # not representable in fp16 or bf16
    for dtype in (torch.float16, torch.bfloat16):
        model.to(dtype)
        assert bn.weight.dtype == dtype and bn.running_var.dtype == torch.float32
        assert (bn.running_var == 1 + 2**-20).all()  # never rounded to half
    model.float()
    assert bn.weight.dtype == torch.float32 and list(model.state_dict()) == names
    model.half()
    bn.running_mean.data = bn.running_mean.data.half()  # cast by other means (DeepSpeed's buffer_dtype)
    model(torch.randn(2, 3, 32, 32, dtype=torch.float16), *_tokens(model, 2))
    assert bn.running_mean.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("preset", [p for p in PRESETS if p != "ViT-B-32"])
def test_presets_forward_backward_in_half_precision(preset: str, dtype: torch.dtype) -> None:
    """Each CPU preset cast as DeepSpeed casts it trains and evaluates, close to fp32 with the same weights."""
    torch.manual_seed(0)
    model = create_model(preset)
    _cast(model, dtype, "deepspeed")
    ref = create_model(preset)
    ref.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    pixels = torch.randn(4, *model.image_data_config()["input_size"])
    ids, mask = _tokens(model, 4)
    for training in (True, False):
        model.train(training), ref.train(training)
        img, txt, scale = model(pixels.to(dtype), ids, mask)
        img_ref, txt_ref, _ = ref(pixels, ids, mask)
        assert img.dtype == txt.dtype == dtype
        cos = torch.cat([(img.float() * img_ref).sum(-1), (txt.float() * txt_ref).sum(-1)])
        assert cos.min() > 0.99, cos
        if training:
            (scale * img @ txt.T).float().logsumexp(-1).sum().backward()
            grads = {n: p.grad for n, p in model.named_parameters()}
            assert all(g is not None and g.dtype == dtype and torch.isfinite(g).all() for g in grads.values())


# --------------------------------------------------------------------------------------------------
# image size
# --------------------------------------------------------------------------------------------------


def test_image_size_builds_the_timm_model_and_the_data_config() -> None:
    tiny = create_model("tiny", image_size=48)  # a ViT: fixed input size, given to the timm constructor
    assert tiny.visual.trunk.patch_embed.img_size == (48, 48)
    assert tiny.image_data_config()["input_size"] == (3, 48, 48)
    assert tiny.config.image.timm_kwargs["img_size"] == 48
    assert tiny.encode_image(torch.randn(2, 3, 48, 48)).shape == (2, 64)
    with pytest.raises(AssertionError):
        tiny.encode_image(torch.randn(2, 3, 32, 32))  # the model itself changed, not just the data config
    vit = create_image_tower("vit_tiny_patch16_224", image_size=64, patch_size=16, embed_dim=64, depth=1, num_heads=2)
    assert vit.trunk.patch_embed.img_size == (64, 64) and vit.data_config()["input_size"] == (3, 64, 64)
    with pytest.raises(ValueError, match="contradicts"):
        create_image_tower("vit_tiny_patch16_224", image_size=64, img_size=32)

    torch.manual_seed(0)
    resnet = create_model("tiny-resnet", image_size=48)  # a CNN: any size; the data config follows
    assert resnet.image_data_config()["input_size"] == (3, 48, 48)
    _check_forward_backward(resnet)  # at 48 pixels
    again = create_model(config=CLIPConfig.from_dict(json.loads(json.dumps(resnet.config.to_dict()))))
    assert again.image_data_config() == resnet.image_data_config()


# --------------------------------------------------------------------------------------------------
# DeepSpeed, 2 CPU ranks: every preset and resnet18, on the bf16 and the fp16 route
# --------------------------------------------------------------------------------------------------


def test_every_preset_is_trained_here() -> None:
    assert set(PRESETS) <= set(MODELS)


def _training_model(tmp: Path, *flags: str) -> torch.nn.Module:
    """The model ``recipe.train`` builds for these flags."""
    import recipe.train as T
    from recipe.config import parse_args

    ds = str(ROOT / "ds_configs" / ROUTES["bf16"][0])
    return T.build_model(parse_args(["--deepspeed_config", ds, "--output-dir", str(tmp), *flags]), None, tmp)


def test_image_size_reaches_the_training_model(tmp_path: Path) -> None:
    """``--image-size`` goes through the config to the model the training loop builds."""
    model = _training_model(tmp_path, "--preset", "tiny-resnet", "--image-size", "48")
    assert model.config.image.image_size == 48 and model.image_data_config()["input_size"] == (3, 48, 48)
    assert json.loads((tmp_path / "model_config.json").read_text())["image"]["image_size"] == 48


def _ds_json(tmp: Path, name: str) -> str:
    cfg = json.loads((ROOT / "ds_configs" / name).read_text())
    cfg["train_micro_batch_size_per_gpu"] = MICRO
    if "fp16" in cfg:  # start near the scale these models need instead of halving from 2**16
        cfg["fp16"]["initial_scale_power"] = 8
    path = tmp / name
    path.write_text(json.dumps(cfg))
    return str(path)


def _bn_state(module: torch.nn.Module) -> list[dict[str, Any]]:
    return [
        {
            "weight": m.weight.dtype,
            "stats": (m.running_mean.dtype, m.running_var.dtype),
            "tracked": int(m.num_batches_tracked),
            "var_moved": bool((m.running_var != 1).any()),
        }
        for m in module.modules()
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
    ]


def _worker(rank: int, world: int, cfgs: list[dict]) -> list[dict]:
    import traceback

    import recipe.train as T
    from recipe.config import config_from_dict

    seen: dict[str, Any] = {}
    build_engine = T.build_engine

    def observed_build_engine(model: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        """The recipe's engine, plus a record of the image batches the tower sees (and the engine)."""
        model.visual.register_forward_pre_hook(lambda _, args: seen["shapes"].add(tuple(args[0].shape[1:])))
        out = build_engine(model, *args, **kwargs)
        seen["engine"] = out[0]
        return out

    T.build_engine = observed_build_engine
    results = []
    for cfg in cfgs:
        seen.update(shapes=set(), engine=None)
        try:
            final = T.train(config_from_dict(cfg))
        except Exception:  # every rank fails alike (e.g. in the forward): record it, train the next
            results.append({"error": traceback.format_exc()})
            continue
        module = seen["engine"].module
        results.append({
            "final": final,
            "shapes": seen["shapes"],
            "batchnorm": _bn_state(module),
            "input_size": module.image_data_config()["input_size"],
        })
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], dict]:
    tmp = tmp_path_factory.mktemp("presets")
    if _training_model(tmp, "--image-size", "48").image_data_config()["input_size"] != (3, 48, 48):
        pytest.fail("recipe.train.build_model ignores model.image_size: ViT-B-32 would train at 224 pixels (minutes)")
    # 4 classes, one prompt each, 12 tokens: ViT-B-32's text tower costs little in bf16 on a CPU
    write_dataset(str(tmp / "data"), STEPS * MICRO * 2, n_val=N_VAL, image_size=32, seed=0,
                  colours=("red", "blue"), shapes=("circle", "square"))
    prompts = json.loads((tmp / "data" / "zeroshot.json").read_text())
    (tmp / "data" / "zeroshot.json").write_text(json.dumps({**prompts, "templates": prompts["templates"][:1]}))
    cfgs = []
    for model, route in RUNS:
        cfgs.append({
            "deepspeed_config": _ds_json(tmp, ROUTES[route][0]),
            "output_dir": str(tmp / f"{model}-{route}"),
            "steps": STEPS,
            "log_every": 1,
            "eval_batch_size": N_VAL,
            "model": SIZED[model][0],
            "data": {"train_data": str(tmp / "data" / "train.csv"), "val_data": str(tmp / "data" / "val.csv"),
                     "workers": 0, "vocab_size": 300, "context_length": 12},
            "optim": {"lr": 1e-3, "warmup_steps": 0},
        })
    results = run_distributed(_worker, 2, cfgs, init_process_group=False, env=ENV, timeout_s=600)
    for cfg in cfgs:  # ViT-B-32's final checkpoints hold GBs; nothing here reads them
        shutil.rmtree(Path(cfg["output_dir"]) / "checkpoints", ignore_errors=True)
    return {run: {"rank0": a, "rank1": b, "dir": Path(c["output_dir"])}
            for run, a, b, c in zip(RUNS, results[0], results[1], cfgs, strict=True)}


@pytest.mark.parametrize("model, route", RUNS, ids=[f"{m}-{r}" for m, r in RUNS])
def test_model_trains_and_evaluates_on_the_route(model: str, route: str, runs: dict) -> None:
    result = runs[(model, route)]
    for rank in ("rank0", "rank1"):
        assert "error" not in result[rank], result[rank].get("error")
    final = result["rank0"]["final"]
    # two optimizer steps taken (none skipped for a non-finite loss or an fp16 overflow)
    assert (final["steps"], final["nonfinite_steps"], final["overflow_steps"]) == (STEPS, 0, 0)
    assert final["precision"] == f"{route}/zero{2 if route == 'bf16' else 0}"
    rows = [json.loads(line) for line in (result["dir"] / "metrics.jsonl").read_text().splitlines()]
    losses = {r["step"]: r["loss"] for r in rows if r["kind"] == "train"}
    assert sorted(losses) == list(range(1, STEPS + 1)) and all(math.isfinite(v) for v in losses.values()), losses
    # evaluated: zero-shot and retrieval on every held-out pair
    assert final["eval_samples"] == N_VAL
    assert 0 <= final["zeroshot_top1"] <= 1 and 0 <= final["retrieval_r1"] <= 1
    size = SIZED[model][1]
    for out in (result["rank0"], result["rank1"]):
        # the towers saw the configured image size, in training and in evaluation
        assert out["input_size"] == (3, size, size)
        assert out["shapes"] == {(3, size, size)}
        # BatchNorm: fp32 statistics next to half weights; one update per training forward, none in evaluation
        batchnorm = out["batchnorm"]
        assert bool(batchnorm) == model.startswith(("tiny-resnet", "resnet18")), batchnorm
        for bn in batchnorm:
            assert bn["weight"] == ROUTES[route][1] and bn["stats"] == (torch.float32, torch.float32), bn
            assert bn["tracked"] == STEPS and bn["var_moved"], bn
