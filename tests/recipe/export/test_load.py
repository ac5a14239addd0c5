"""``recipe.load`` (:mod:`recipe.loading`): a run's model, tokenizer and preprocessing give the run's own
embeddings, and those of its open_clip and Hugging Face exports; it reads the optimizer's fp32 masters by
default; and the demo's preset (``launch.sh``) exports to both formats exactly."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import recipe  # noqa: E402
from recipe.data.decode import build_transform  # noqa: E402
from recipe.export import export_run  # noqa: E402
from recipe.export.run import load_run  # noqa: E402

from .conftest import CAPTIONS  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:open_clip export")

ROOT = Path(__file__).resolve().parents[3]
TEXTS = [*CAPTIONS[:5], "", "A LONG caption, " * 30]
ATOL = 1e-5


def demo_preset() -> str:
    """The preset ``launch.sh`` trains the demo with."""
    found = re.findall(r"args\+=\(--preset ([\w.-]+)\)", (ROOT / "launch.sh").read_text())
    assert len(found) == 1, found
    return found[0]


def _images() -> list[Any]:
    """PIL images: one at the model's size, larger and non-square ones, a grayscale one."""
    from PIL import Image

    g = torch.Generator().manual_seed(3)
    shapes = [(32, 32, 3), (45, 61, 3), (80, 50, 3), (40, 40, 1)]
    arrays = [torch.randint(0, 256, s, dtype=torch.uint8, generator=g).numpy() for s in shapes]
    return [Image.fromarray(a[..., 0] if a.shape[-1] == 1 else a) for a in arrays]


def _embed(model: Any, tokenizer: Any, preprocess: Any) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        image = model.encode_image(torch.stack([preprocess(im) for im in _images()]))
        text = model.encode_text(**tokenizer(TEXTS))
    return image, text


def test_load_gives_the_runs_model_tokenizer_and_evaluation_transform(make_run: Any, tokenizer: Any) -> None:
    run_dir, trained = make_run("run", preset="tiny-clip")
    loaded = recipe.load(run_dir)
    model, tok, preprocess = loaded  # unpacks like open_clip's create_model_and_transforms
    assert isinstance(loaded, recipe.Loaded) and loaded.model is model
    assert not model.training and all(p.dtype == torch.float32 for p in model.parameters())
    saved = trained.state_dict()
    assert all(torch.equal(v, saved[k]) for k, v in model.state_dict().items())
    # the evaluation's transform (grayscale converted to RGB as the evaluation decodes)
    evaluate = build_transform(trained.image_data_config(), train=False)
    for im in _images():
        assert torch.equal(preprocess(im), evaluate(im.convert("RGB")))
    assert torch.equal(tok(TEXTS)["input_ids"], tokenizer(TEXTS)["input_ids"])
    image, text = _embed(model, tok, preprocess)
    ref_image, ref_text = _embed(trained, tokenizer, preprocess)
    assert torch.equal(image, ref_image) and torch.equal(text, ref_text)
    assert image.shape == (len(_images()), 64) and torch.allclose(image.norm(dim=-1), torch.ones(len(image)))

    half = recipe.load(run_dir, weights="module", dtype="bf16").model
    assert all(p.dtype == torch.bfloat16 for p in half.parameters()) and not half.training


def test_load_refuses_what_load_run_refuses(make_run: Any, tmp_path: Path) -> None:
    run_dir, _ = make_run("run", preset="tiny-clip")
    with pytest.raises(ValueError, match="weights must be one of"):
        recipe.load(run_dir, weights="fp32")
    with pytest.raises(ValueError, match="no fp32 master"):
        recipe.load(run_dir, ema=True)
    with pytest.raises(ValueError, match="dtype must be one of"):
        recipe.load(run_dir, dtype="int8")
    with pytest.raises(FileNotFoundError):
        recipe.load(tmp_path / "missing")


def test_load_matches_the_open_clip_export(make_run: Any, tmp_path: Path) -> None:
    """The open_clip snippet of docs/export.md and recipe.load give the same embeddings on the same PIL images and
    texts, each side with its own preprocessing and tokenizer."""
    import open_clip

    run_dir, _ = make_run("run", preset="tiny-clip")
    out = export_run(run_dir, "open_clip", tmp_path / "exported")
    oc, _, oc_preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    oc_tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    oc.eval()
    model, tokenizer, preprocess = recipe.load(run_dir)
    for im in _images():
        assert torch.allclose(oc_preprocess(im), preprocess(im), atol=1e-6)
    assert torch.equal(oc_tokenizer(TEXTS), tokenizer(TEXTS)["input_ids"])
    image, text = _embed(model, tokenizer, preprocess)
    with torch.no_grad():
        oc_image = oc.encode_image(torch.stack([oc_preprocess(im) for im in _images()]), normalize=True)
        oc_text = oc.encode_text(oc_tokenizer(TEXTS), normalize=True)
    assert (oc_image - image).abs().max() <= ATOL and (oc_text - text).abs().max() <= ATOL
    assert oc.logit_scale.item() == model.logit_scale.item()


def test_load_matches_the_hf_export(make_run: Any, tmp_path: Path) -> None:
    """``CLIPModel`` on ``preprocess``'s pixels gives recipe.load's embeddings; ``CLIPProcessor``'s own pixels
    are the same for an image at the model's size (crop_pct 1), not for others (docs/export.md: tensor resampling,
    crop offset)."""
    from transformers import CLIPModel, CLIPProcessor

    from .test_hf import hf_features

    run_dir, _ = make_run("run", preset="tiny-clip")
    out = export_run(run_dir, "hf", tmp_path / "exported-hf")
    hf_model = CLIPModel.from_pretrained(out, dtype=torch.float32).eval()
    processor = CLIPProcessor.from_pretrained(out)
    model, tokenizer, preprocess = recipe.load(run_dir)
    image, text = _embed(model, tokenizer, preprocess)
    batch = processor(text=TEXTS, padding="max_length", truncation=True, return_tensors="pt")
    pixels = torch.stack([preprocess(im) for im in _images()])
    hf_image, hf_text = hf_features(hf_model, pixels, batch)
    assert (hf_image - image).abs().max() <= ATOL
    assert (hf_text - text).abs().max() <= ATOL  # each side's own tokenizer (the export swaps eos id 2: test_hf)
    theirs = [processor(images=im, return_tensors="pt")["pixel_values"][0] for im in _images()]
    assert torch.allclose(theirs[0], pixels[0], atol=1e-5)  # 32 x 32
    assert all((a - b).abs().max() > 1e-3 for a, b in zip(theirs[1:3], pixels[1:3]))  # resized: not the same


def test_load_reads_the_optimizers_masters(deepspeed_runs: dict[str, dict[str, Any]]) -> None:
    """By default the image tower gets the fp32 masters SRAdamW kept (as the export does), not the bf16
    module weights; ``weights="module"`` gives those."""
    run = deepspeed_runs["zero2"]
    model = recipe.load(run["run"]).model
    params = dict(model.named_parameters())
    masters = {k: v for k, v in run["masters"].items() if k.startswith("visual.")}
    assert masters and all(torch.equal(params[k], v.float()) for k, v in masters.items())
    module = recipe.load(run["run"], weights="module").model
    assert torch.equal(dict(module.named_parameters())["visual.trunk.patch_embed.proj.weight"],
                       load_run(run["run"]).model.visual.trunk.patch_embed.proj.weight)
    assert any(not torch.equal(dict(module.named_parameters())[k], v.float()) for k, v in masters.items())


@pytest.mark.parametrize("fmt", ["open_clip", "hf"])
def test_demo_preset_exports_exactly(make_run: Any, tokenizer: Any, tmp_path: Path, fmt: str) -> None:
    """The model ``bash launch.sh`` trains exports to both formats with the run's embeddings (the first thing
    to try after the demo)."""
    preset = demo_preset()
    run_dir, model = make_run("demo", preset=preset)
    out = export_run(run_dir, fmt, tmp_path / fmt)  # UnsupportedExport for a preset the format cannot take
    if fmt == "hf":
        from .test_hf import TOL, compare

        diff = compare(model, tokenizer, out)
        assert max(diff.values()) <= TOL, diff
    else:
        from .test_open_clip import ATOL as OC_ATOL
        from .test_open_clip import _compare

        image, text, _ = _compare(model, tokenizer, out)
        assert image <= OC_ATOL and text <= OC_ATOL, (image, text)
