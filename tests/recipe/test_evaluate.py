"""recipe.evaluate on labelled images without captions: ImageNet zero-shot of a fake ImageNet folder
(``DIR/<wnid>/*.JPEG``) checked against an independent computation of the 1000-class classifier, a
class-name file for any folder of class subfolders, and the metrics training's ``run_eval`` returns.

The model is a randomly initialised ``tiny`` preset with a one-layer text tower (the 80,000 ImageNet
prompts take seconds), saved as a run directory the way training leaves one. The test images are put
into the folder of the class the reference ranks first, third or 500th for them, so that the expected
top-1 and top-5 are known and neither is zero.
"""

from __future__ import annotations

import csv
import json
import shutil
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform

from recipe.config import TrainConfig
from recipe.data import DataConfig, build_eval_loader
from recipe.evaluate import main as evaluate_main
from recipe.model import CLIPConfig, create_model
from recipe.model.tokenizer import load_tokenizer, train_tokenizer
from recipe.run import checkpoint
from recipe.synthetic import write_dataset
from recipe.zeroshot import (
    IMAGENET_CLASSNAMES,
    IMAGENET_WNIDS,
    OPENAI_IMAGENET_TEMPLATES,
    imagenet_class_index,
    imagenet_prompts,
)

ROOT = Path(__file__).resolve().parents[2]
DS = str(ROOT / "ds_configs" / "zero2_bf16_halfmaster.json")
STEP = 3
N_IMAGES = 12
#: Classes whose name the published list gives twice (identical classifier rows: ties).
TIED = {657, 744, 836, 837}
SMALL_TEXT = {"num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 2}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run directory as training leaves it: config, tokenizer, model config, a complete checkpoint."""
    run = tmp_path_factory.mktemp("run")
    texts = [t.replace("{}", c) for c in IMAGENET_CLASSNAMES[:60] for t in OPENAI_IMAGENET_TEMPLATES[:10]]
    tok = train_tokenizer(iter(texts), 300, context_length=16)
    tok.save(run / "tokenizer")
    torch.manual_seed(0)
    model = create_model("tiny", tokenizer=tok, text_overrides=SMALL_TEXT)
    (run / "model_config.json").write_text(json.dumps(model.config.to_dict()))
    cfg = TrainConfig(output_dir=str(run))
    (run / "config.json").write_text(json.dumps(cfg.to_dict()))
    tag = run / "checkpoints" / f"step{STEP:08d}"
    tag.mkdir(parents=True)
    torch.save(model.state_dict(), tag / checkpoint.MODEL_WEIGHTS)
    (tag / checkpoint.COMPLETE).write_text(json.dumps({"step": STEP}))
    (run / "checkpoints" / checkpoint.LATEST).write_text(tag.name)
    return run


def evaluate_to_file(run: Path, argv: list[str]) -> tuple[dict, Path]:
    """``python -m recipe.evaluate argv``: its metrics and the one result file it wrote (new or replaced)."""
    def files() -> dict[Path, tuple[int, int]]:
        return {p: (p.stat().st_ino, p.stat().st_mtime_ns) for p in run.glob("eval_*.json")}

    before = files()
    metrics = evaluate_main(["--checkpoint", str(run), "--no-progress", *argv])
    changed = [p for p, stamp in files().items() if before.get(p) != stamp]
    assert len(changed) == 1, changed
    return metrics, changed[0]


def load_run(run: Path) -> tuple[torch.nn.Module, object]:
    tok = load_tokenizer(run / "tokenizer")
    config = CLIPConfig.from_dict(json.loads((run / "model_config.json").read_text()))
    model = create_model(config=config, tokenizer=tok, text_load_weights=False).eval()
    tag = run / "checkpoints" / f"step{STEP:08d}"
    model.load_state_dict(torch.load(tag / checkpoint.MODEL_WEIGHTS, weights_only=True))
    return model, tok


def jpeg(path: Path, seed: int) -> None:
    """A 32x32 JPEG of smooth random colour blobs."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)
    Image.fromarray(small).resize((32, 32), Image.BILINEAR).save(path, "JPEG", quality=95)


@pytest.fixture(scope="module")
def imagenet(run_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A fake ImageNet folder and what the reference computation expects of it.

    The reference embeds all 1000 x 80 prompts and the images with the model, timm's transform and
    torch directly (not recipe.evaluate, not recipe.data).
    """
    model, tok = load_run(run_dir)
    prompts = [t.replace("{}", c) for c in IMAGENET_CLASSNAMES for t in OPENAI_IMAGENET_TEMPLATES]
    with torch.no_grad():
        parts = []
        for i in range(0, len(prompts), 8000):
            t = tok(prompts[i : i + 8000])
            parts.append(model.encode_text(t["input_ids"], t["attention_mask"]).float())
        classifier = F.normalize(torch.cat(parts).view(1000, 80, -1).mean(1), dim=-1)
    stage = tmp_path_factory.mktemp("stage")
    transform = create_transform(**model.image_data_config(), is_training=False)
    paths = []
    for i in range(N_IMAGES):
        jpeg(stage / f"img{i:02d}.JPEG", seed=i)
        paths.append(stage / f"img{i:02d}.JPEG")
    with torch.no_grad():
        pixels = torch.stack([transform(Image.open(p).convert("RGB")) for p in paths])
        logits = model.encode_image(pixels).float() @ classifier.T
    root = tmp_path_factory.mktemp("imagenet") / "val"
    ranks = []
    for i, (p, row) in enumerate(zip(paths, logits)):
        order = row.argsort(descending=True).tolist()
        want = (0, 2, 500)[i % 3]  # a top-1 hit, a top-5 hit, a miss
        margin = 1e-4  # far beyond fp32 noise: the evaluation must rank the same way
        ok = order[want] not in TIED and (
            want == 500
            or (want == 0 and row[order[0]] - row[order[1]] > margin)
            or (want == 2 and row[order[0]] - row[order[2]] > margin and row[order[2]] - row[order[5]] > margin)
        )
        rank = want if ok else 500
        wnid = IMAGENET_WNIDS[order[rank]]
        (root / wnid).mkdir(parents=True, exist_ok=True)
        shutil.copy(p, root / wnid / f"ILSVRC2012_val_{i:08d}.JPEG")
        ranks.append((wnid, rank))
    broken = root / ranks[0][0] / "ILSVRC2012_val_broken.JPEG"
    broken.write_bytes(b"\xff\xd8\xff\xe0 a cut-off JPEG")
    top1 = sum(r == 0 for _, r in ranks) / N_IMAGES
    top5 = sum(r < 5 for _, r in ranks) / N_IMAGES
    assert top1 >= 2 / N_IMAGES and top5 > top1  # the check below can tell a right answer from a wrong one
    return {"root": root, "ranks": ranks, "top1": top1, "top5": top5, "classifier": classifier}


def test_imagenet_zero_shot_of_an_imagenet_folder(run_dir: Path, imagenet: dict, tmp_path: Path) -> None:
    root = imagenet["root"]
    metrics, out = evaluate_to_file(run_dir, ["--zeroshot", "imagenet", "--val-data", str(root)])
    assert metrics["imagenet_top1"] == pytest.approx(imagenet["top1"], abs=1e-6)
    assert metrics["imagenet_top5"] == pytest.approx(imagenet["top5"], abs=1e-6)
    assert metrics["imagenet_chance"] == pytest.approx(1e-3)
    assert metrics["eval_samples"] == N_IMAGES and metrics["eval_skipped"] == 1  # the corrupt JPEG
    assert metrics["step"] == STEP and not any(k.startswith(("i2t", "t2i", "retrieval")) for k in metrics)
    assert out.name.startswith(f"eval_imagenet-{root.parent.name}-val-") and out.name.endswith(f"_step{STEP}.json")
    written = json.loads(out.read_text())
    assert written["imagenet_top1"] == metrics["imagenet_top1"] and written["zeroshot"] == "imagenet"
    assert written["val_data"] == str(root)
    [dataset] = written["datasets"]
    assert dataset["format"] == "imagefolder" and dataset["zeroshot"] == "imagenet" and dataset["role"] == "val_data"

    # each image is labelled with its folder's index among the 1000 classes
    loader = build_eval_loader(DataConfig(val_data=str(root)), None, {"input_size": (3, 32, 32), "crop_pct": 1.0},
                               5, classes=imagenet_prompts().class_index())
    labels = Counter(int(x) for b in loader for x in b["labels"])
    assert labels == Counter(imagenet_class_index(w) for w, _ in imagenet["ranks"])

    # a folder that is not an ImageNet class is an error naming it
    odd = tmp_path / "odd"
    shutil.copytree(root, odd)
    (odd / "n99999999").mkdir()
    shutil.copy(next(root.glob("*/*.JPEG")), odd / "n99999999" / "x.JPEG")
    with pytest.raises(ValueError, match="class folder 'n99999999' .* not one of the 1000 classes"):
        evaluate_main(["--checkpoint", str(run_dir), "--zeroshot", "imagenet", "--val-data", str(odd)])


def test_a_class_name_file_for_any_folder_of_class_subfolders(run_dir: Path, tmp_path: Path) -> None:
    model, tok = load_run(run_dir)
    root = tmp_path / "pets"
    folders = {"cat": 4, "dog": 3, "fish": 5}
    for j, (name, n) in enumerate(folders.items()):
        (root / name).mkdir(parents=True)
        for i in range(n):
            jpeg(root / name / f"{i}.jpg", seed=100 + 10 * j + i)
    templates = ["a photo of a {}.", "a drawing of the {}."]

    def expected(order: list[str]) -> float:
        """Top-1 computed directly, with class ``i`` the folder ``order[i]``."""
        with torch.no_grad():
            rows = []
            for name in order:
                t = tok([x.replace("{}", name) for x in templates])
                rows.append(F.normalize(model.encode_text(t["input_ids"], t["attention_mask"]).mean(0), dim=-1))
            transform = create_transform(**model.image_data_config(), is_training=False)
            hits = []
            for name in folders:
                for path in sorted((root / name).iterdir()):
                    img = model.encode_image(transform(Image.open(path).convert("RGB"))[None])
                    hits.append(int((img @ torch.stack(rows).T).argmax()) == order.index(name))
        return sum(hits) / len(hits)

    # a zeroshot.json next to the data: class i is the i-th subfolder in sorted order
    (tmp_path / "zeroshot.json").write_text(json.dumps({"classnames": ["cat", "dog", "fish"], "templates": templates}))
    metrics, found = evaluate_to_file(run_dir, ["--val-data", str(root)])
    assert metrics["zeroshot_top1"] == pytest.approx(expected(["cat", "dog", "fish"]), abs=1e-6)
    assert metrics["zeroshot_top5"] == 1.0 and metrics["zeroshot_chance"] == pytest.approx(1 / 3)
    assert metrics["eval_samples"] == 12 and "retrieval_r1" not in metrics  # no captions: no retrieval
    assert json.loads(found.read_text())["datasets"][0]["zeroshot_from"] == "found next to the data"

    # named by folder, in any order, through --zeroshot FILE
    named = tmp_path / "pets.json"
    named.write_text(json.dumps({"classnames": {"fish": "fish", "cat": "cat", "dog": "dog"}, "templates": templates}))
    metrics, out = evaluate_to_file(run_dir, ["--val-data", str(root), "--zeroshot", str(named)])
    assert metrics["zeroshot_top1"] == pytest.approx(expected(["fish", "cat", "dog"]), abs=1e-6)
    assert out.name.startswith("eval_pets-") and out != found  # other class names: another result

    # a class-name list that does not fit the folders, and a folder without any class names
    (tmp_path / "zeroshot.json").write_text(json.dumps({"classnames": ["cat", "dog"], "templates": templates}))
    with pytest.raises(ValueError, match="has 3 class folders .* class names are 2"):
        evaluate_main(["--checkpoint", str(run_dir), "--val-data", str(root)])
    (tmp_path / "zeroshot.json").unlink()
    with pytest.raises(ValueError, match="no zero-shot class names were found"):
        evaluate_main(["--checkpoint", str(run_dir), "--val-data", str(root)])


def test_two_datasets_at_one_step_keep_their_own_results(run_dir: Path, tmp_path: Path) -> None:
    """Two files both named val.csv, a JSON-lines val.jsonl next to one of them, and a val.csv with a
    class folder as --zeroshot-data (all ``eval_val_step<N>.json`` once): each evaluation at the same
    step writes its own file, recording its own metrics and data; evaluating the same data again
    (spelt differently) replaces its file."""
    for name, n_val, seed in (("a", 10, 1), ("b", 14, 2)):
        write_dataset(str(tmp_path / name), 8, n_val=n_val, image_size=32, seed=seed)
    a, b = tmp_path / "a" / "val.csv", tmp_path / "b" / "val.csv"
    jsonl = tmp_path / "a" / "val.jsonl"  # the first 6 rows of a/val.csv, as JSON lines
    with a.open() as f:
        rows = list(csv.DictReader(f, delimiter="\t"))[:6]
    jsonl.write_text("".join(json.dumps({**r, "label": int(r["label"])}) + "\n" for r in rows))
    pets = tmp_path / "pets" / "val"
    for j, name in enumerate(["cat", "dog"]):
        (pets / name).mkdir(parents=True)
        for i in range(3):
            jpeg(pets / name / f"{i}.jpg", seed=300 + 10 * j + i)
    (pets.parent / "zeroshot.json").write_text(json.dumps({"classnames": ["cat", "dog"], "templates": ["a {}."]}))
    results = {
        key: evaluate_to_file(run_dir, argv)
        for key, argv in (("a", ["--val-data", str(a)]), ("b", ["--val-data", str(b)]),
                          ("jsonl", ["--val-data", str(jsonl)]),
                          ("a+pets", ["--val-data", str(a), "--zeroshot-data", str(pets)]))
    }
    files = {out for _, out in results.values()}
    assert len(files) == len(results)  # no result overwrote another
    assert results["a"][1].name.startswith("eval_a-val-") and results["b"][1].name.startswith("eval_b-val-")
    assert all(out.name.endswith(f"_step{STEP}.json") for out in files)
    for key, (metrics, out) in results.items():
        written = json.loads(out.read_text())
        assert {k: written[k] for k in metrics} == metrics, key  # its own metrics, still there
    assert results["a"][0]["eval_samples"] == 10 and results["b"][0]["eval_samples"] == 14
    assert results["jsonl"][0]["eval_samples"] == 6 and results["jsonl"][1].name.startswith("eval_a-val-")
    [record] = json.loads(results["b"][1].read_text())["datasets"]
    assert record["paths"] == [str(b.resolve())] and record["format"] == "csv" and record["role"] == "val_data"
    assert record["zeroshot"] == str((tmp_path / "b" / "zeroshot.json").resolve())
    assert record["columns"] == {"image": None, "caption": None, "label": "label"}
    assert json.loads(results["jsonl"][1].read_text())["datasets"][0]["format"] == "json"
    retrieval, classes = json.loads(results["a+pets"][1].read_text())["datasets"]
    assert (retrieval["role"], retrieval["zeroshot"], classes["role"]) == ("val_data", None, "zeroshot_data")
    assert classes["paths"] == [str(pets.resolve())] and classes["format"] == "imagefolder"
    assert classes["zeroshot"] == str((pets.parent / "zeroshot.json").resolve())
    assert results["a+pets"][0]["zeroshot_samples"] == 6 and "zeroshot_samples" not in results["a"][0]

    # the same data at the same step, spelt another way: its own file is replaced, nothing else written
    metrics, out = evaluate_to_file(run_dir, ["--val-data", str(tmp_path / "a" / "." / "val.csv")])
    assert out == results["a"][1] and metrics == results["a"][0]


def test_run_eval_reports_imagenet_beside_retrieval(run_dir: Path, imagenet: dict, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Training's evaluation with ``--zeroshot imagenet``: with ``--zeroshot-data`` the caption data gives
    retrieval and the ImageNet folder ``imagenet_*``; without it the validation data is the folder."""
    import recipe.evaluate as E
    from recipe.train import run_eval

    model, tok = load_run(run_dir)
    calls = []

    def classifier(model, prompts, tokenize, **kw):  # the 1000-class classifier checked above, once
        calls.append(prompts.name)
        return imagenet["classifier"]

    monkeypatch.setattr(E, "zero_shot_classifier", classifier)
    syn = tmp_path / "syn"
    write_dataset(str(syn), 8, n_val=10, image_size=32, seed=0)
    engine = SimpleNamespace(module=model, zero_optimization_stage=lambda: 2)
    data = dict(val_data=str(syn / "val.csv"), zeroshot="imagenet", zeroshot_data=str(imagenet["root"]))
    cfg = TrainConfig(data=DataConfig(**data), eval_batch_size=4, deepspeed_config=DS)
    cfg.validate()
    metrics = run_eval(engine, cfg, tok)
    assert metrics["eval_samples"] == 10 and 0 <= metrics["retrieval_r1"] <= 1  # the caption data
    assert "zeroshot_top1" not in metrics and calls == ["imagenet"]  # its own labels are not classified
    assert metrics["imagenet_top1"] == pytest.approx(imagenet["top1"], abs=1e-6)
    assert metrics["imagenet_top5"] == pytest.approx(imagenet["top5"], abs=1e-6)
    assert metrics["imagenet_samples"] == N_IMAGES and metrics["imagenet_skipped"] == 1

    cfg = TrainConfig(data=DataConfig(val_data=str(imagenet["root"]), zeroshot="imagenet"), eval_batch_size=5)
    metrics = run_eval(engine, cfg, tok)
    assert metrics["imagenet_top1"] == pytest.approx(imagenet["top1"], abs=1e-6) and "retrieval_r1" not in metrics
    assert metrics["eval_samples"] == N_IMAGES

    for bad, error in ((dict(zeroshot="imagenet"), "needs images to classify"),
                       (dict(zeroshot=str(tmp_path / "absent.json"), val_data="x"), "'imagenet' or an existing"),
                       (dict(zeroshot_data=str(tmp_path / "absent")), "--zeroshot-data .* does not exist")):
        with pytest.raises(ValueError, match=error):
            TrainConfig(data=DataConfig(**bad), deepspeed_config=DS).validate()


def _two_rank_worker(rank: int, world: int, run: str, root: str) -> dict:
    from recipe.evaluate import evaluate, zero_shot_classifier
    from recipe.zeroshot import ZeroShotPrompts

    model, tok = load_run(Path(run))
    names = ["cat", "dog", "fish", "bird", "cow"]
    five = ZeroShotPrompts(names, ["a {}.", "the {}!"], folders=["cat", "dog", "fish", "b", "c"])
    one = ZeroShotPrompts(["cat"], ["a {}."])
    loader = build_eval_loader(DataConfig(val_data=root), tok, model.image_data_config(), 2, rank, world,
                               classes=five.class_index())
    return {
        "five": zero_shot_classifier(model, five, tok, max_prompts=4),  # blocks of 2 and 3 classes, chunks of 2
        "one": zero_shot_classifier(model, one, tok),  # rank 0 embeds no class
        "metrics": evaluate(model, loader, tok, five),
    }


def test_two_ranks_share_the_classifier_and_the_images(run_dir: Path, tmp_path: Path) -> None:
    """Under a process group each rank embeds a block of the classes and a share of the (caption-less)
    images; the gathered results equal one process's."""
    from ..dist_utils import run_distributed

    root = tmp_path / "five"
    for j, name in enumerate(["cat", "dog", "fish"]):
        (root / name).mkdir(parents=True)
        for i in range(j + 2):
            jpeg(root / name / f"{i}.jpg", seed=200 + 10 * j + i)
    results = run_distributed(_two_rank_worker, 2, str(run_dir), str(root), env={"TOKENIZERS_PARALLELISM": "false"},
                              threads_per_rank=1)
    single = _two_rank_worker(0, 1, str(run_dir), str(root))
    for r in results:
        assert r["five"].shape == (5, 64) and r["one"].shape == (1, 64)
        torch.testing.assert_close(r["five"], single["five"], atol=1e-6, rtol=0)
        torch.testing.assert_close(r["one"], single["one"], atol=1e-6, rtol=0)
        assert r["metrics"] == pytest.approx(single["metrics"], abs=1e-6)
    assert single["metrics"]["eval_samples"] == 9 and "retrieval_r1" not in single["metrics"]
