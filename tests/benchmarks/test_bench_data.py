"""CPU smoke tests of benchmarks/bench_data.py at tiny sizes: the shards it writes, every arm it runs,
the table, the profile, the quality figures and the train-step mode. No test asserts a speed."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_data  # noqa: E402


def test_shards_are_written_once_with_natural_jpegs_and_captions(tmp_path):
    m = bench_data.write_shards(str(tmp_path), 10, 4, 64, seed=1, unique=6, jobs=1)
    assert m["shards"] == 3 and m["samples"] == 10 and m["unique_images"] == 6
    names, images = [], []
    for s in range(3):
        with tarfile.open(Path(m["folder"]) / f"{s:05d}.tar") as tf:
            for member in tf:
                names.append(member.name)
                if member.name.endswith(".jpg"):
                    images.append(tf.extractfile(member).read())
    assert names[:2] == ["00000000.jpg", "00000000.txt"] and len(names) == 20
    assert images[6] == images[0] and images[1] != images[0]  # image i % unique, repeated in turn
    sizes = [Image.open(io.BytesIO(b)).size for b in images]
    assert all(min(s) == 64 and 3 / 4 - 0.02 <= s[0] / s[1] <= 4 / 3 + 0.02 for s in sizes)
    mtime = (Path(m["folder"]) / "00000.tar").stat().st_mtime_ns
    assert bench_data.write_shards(str(tmp_path), 10, 4, 64, seed=1, unique=6) == m  # reused, not rewritten
    assert (Path(m["folder"]) / "00000.tar").stat().st_mtime_ns == mtime
    assert json.loads((Path(m["folder"]) / "sizes.json").read_text()) == {"00000.tar": 4, "00001.tar": 4, "00002.tar": 2}


def test_the_tokenizer_fits_a_smaller_text_tower():
    tok = bench_data.ClipTokens(context_length=8, vocab_size=4096)
    out = tok(["a photo of a red car parked on a long street near the river", "a dog"])
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.shape == (2, 8) and int(ids.max()) <= 4095
    assert mask[0].all() and mask[1].sum() == 4
    assert int(ids[0, -1]) == min(tok.tok.eot_token_id, 4095)  # the truncated row keeps its end token


def test_the_benchmark_runs_every_arm_side_by_side(tmp_path):
    out = tmp_path / "bench_data.json"
    arms = ["recipe", "recipe-exact", "recipe-pil"] + (["openclip"] if bench_data._openclip_available() is None else [])
    result = bench_data.main([
        "--data", str(tmp_path / "data"), "--samples", "24", "--shard-size", "6", "--batch", "4", "--repeats", "2",
        "--workers", "1", "2", "--arms", *arms, "--profile", "--profile-batches", "2",
        "--quality", "4", "--quality-sizes", "--json", str(out),
    ])
    saved = json.loads(out.read_text())
    assert saved["summary"] == result["summary"]
    assert {(r["arm"], r["workers"]) for r in result["summary"]} == {(a, w) for a in arms for w in (1, 2)}
    assert len(result["rows"]) == len(arms) * 2 * 2
    for row in result["rows"]:
        assert row["samples"] >= 20 and row["samples_per_s"] > 0
    for r in result["summary"]:
        assert r["cores_for_gpu_rate"] >= 1 and r["repeats"] == 2
        if "openclip" in arms:
            assert r["ratio_to_openclip"] > 0
    table = saved["markdown"]
    assert "| recipe | 1 |" in table and "cores for 4800/s" in table
    assert result["profile"]["top"] and result["profile"]["us_per_sample"] > 0
    assert result["quality"]["resize"]["images"] == 4 and result["quality"]["resize"]["within_one"] > 0.99


@pytest.mark.slow
def test_the_train_step_mode_on_cpu(tmp_path):
    """In its own process, as from the command line: the recipe's engine starts a process group."""
    out = tmp_path / "ts.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "bench_data.py"), "--train-step", "--device", "cpu",
         "--data", str(tmp_path / "data"), "--samples", "64", "--unique-images", "8", "--shard-size", "16",
         "--batch", "4", "--workers", "1", "--steps", "2", "--warmup", "1", "--decode-device", "cpu", "cuda",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    saved = json.loads(out.read_text())
    arms = saved["train_step"]["arms"]
    assert arms["synthetic"]["samples_per_s"] > 0 and arms["loader-cpu"]["ratio_to_synthetic"] > 0
    assert arms["loader-cpu"]["loader_only_samples_per_s"] > 0
    assert "unavailable" in arms["loader-cuda"] or arms["loader-cuda"]["samples_per_s"] > 0
    assert "Goal: >= 0.9x" in saved["markdown"]
