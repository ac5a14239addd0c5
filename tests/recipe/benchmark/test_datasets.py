"""Benchmark names and files: unknown names list the known ones, missing files are named with the
converter's command line, nothing is downloaded, a root may be a template, and the ranks' shares of a
dataset are disjoint and whole."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from recipe.benchmark.datasets import (
    CLASSIFICATION,
    RETRIEVAL,
    BenchmarkError,
    MissingBenchmarkData,
    UnknownBenchmark,
    build,
    known_names,
    parse_names,
    resolve,
    resolve_all,
    share,
)

from .conftest import N_IMAGES


def test_names_resolve_to_the_converted_sets(bench_root: Path) -> None:
    shapes, captions = resolve_all("synthetic_shapes, wds/synthetic_captions,synthetic_shapes", bench_root)
    assert (shapes.dataset, shapes.task, shapes.root) == (
        "wds/synthetic_shapes", CLASSIFICATION, str(bench_root / "wds_synthetic_shapes"))
    assert (captions.dataset, captions.task) == ("wds/synthetic_captions", RETRIEVAL)  # from dataset_type.txt
    templated = resolve("synthetic_shapes", f"{bench_root}/wds_{{dataset}}")  # CLIP_benchmark's --dataset_root form
    assert templated.root == shapes.root
    assert parse_names(["a,b", "c"]) == ["a", "b", "c"]


def test_an_unknown_name_lists_the_names_known(bench_root: Path) -> None:
    known = known_names()
    assert {"cifar10", "imagenet1k", "mscoco_captions", "flickr30k", "vtab/pets"} <= set(known)
    with pytest.raises(UnknownBenchmark) as e:
        resolve_all("synthetic_shape", bench_root)
    message = str(e.value)
    assert "unknown benchmark 'synthetic_shape'" in message
    assert "Converted datasets under" in message and "synthetic_captions, synthetic_shapes" in message
    assert "cifar10, cifar100" in message and "wds/<name>" in message


def test_missing_files_are_named_with_the_converters_command(bench_root: Path, tmp_path: Path) -> None:
    with pytest.raises(MissingBenchmarkData) as e:
        resolve("wds/cifar10", tmp_path)
    message = str(e.value)
    assert f"looked for CLIP_benchmark's webdataset layout in {tmp_path / 'wds_cifar10'}" in message
    assert "missing test/nshards.txt, test/0.tar, classnames.txt, zeroshot_classification_templates.txt" in message
    assert (f"clip_benchmark_export_wds --dataset cifar10 --dataset-root RAW_DIR --split test --output "
            f"{tmp_path / 'wds_cifar10'}") in message
    # a retrieval set by CLIP_benchmark's name: its own files, the converter's --retrieval
    with pytest.raises(MissingBenchmarkData, match=r"missing test/nshards.txt, test/0.tar, dataset_type.txt.*"
                                                   r"--split test --retrieval --output"):
        resolve("mscoco_captions", tmp_path)
    # an incomplete copy: exactly what is missing
    broken = tmp_path / "wds_synthetic_shapes"
    shutil.copytree(bench_root / "wds_synthetic_shapes", broken)
    (broken / "classnames.txt").unlink()
    (broken / "test" / "0.tar").unlink()
    with pytest.raises(MissingBenchmarkData, match=r"is incomplete, missing test/0.tar, classnames.txt\. "):
        resolve("synthetic_shapes", tmp_path)
    with pytest.raises(BenchmarkError, match="need --benchmark-root DIR"):
        resolve_all("cifar10", None)


def test_nothing_is_downloaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A builder dataset whose files are absent: torchvision's and the builder's own downloads refused."""
    import subprocess

    calls = []
    monkeypatch.setattr(subprocess, "call", lambda *a, **k: calls.append(a))  # in case anything slipped through
    (tmp_path / "cifar10").mkdir()
    (tmp_path / "cifar10" / "readme.txt").write_text("not the data")
    with pytest.raises(MissingBenchmarkData, match=r"nor the files of CLIP_benchmark's cifar10 dataset.*"
                                                   r"Dataset not found"):
        resolve("cifar10", tmp_path)
    (tmp_path / "flickr30k").mkdir()
    (tmp_path / "flickr30k" / "x.jpg").write_bytes(b"")
    with pytest.raises(MissingBenchmarkData, match=r"CLIP_benchmark would run: wget https://github.com/mehdidc"):
        resolve("flickr30k", tmp_path)
    assert calls == [] and not list((tmp_path / "flickr30k").glob("*.txt"))


def test_the_ranks_shares_are_disjoint_and_whole(bench_root: Path) -> None:
    """Samples ``rank::world`` of the webdataset pipeline (cut after its tar reader), each with its position
    in the set (shard, place in the shard): each image once, the keys giving one reader's order back."""
    spec = resolve("synthetic_captions", bench_root)
    whole = list(share(build(spec), 0, 1))
    assert len(whole) == N_IMAGES and all(len(c) == 2 for _, c, _ in whole)
    assert [key for _, _, key in whole] == [(0, i) for i in range(N_IMAGES)]
    shares = [list(share(build(spec), rank, 3)) for rank in range(3)]
    assert [len(s) for s in shares] == [12, 12, 12]
    assert [key for _, _, key in shares[1]] == [(0, i) for i in range(1, N_IMAGES, 3)]
    back = sorted((item for s in shares for item in s), key=lambda item: item[2])
    assert [c for _, c, _ in back] == [c for _, c, _ in whole]
    mapped = share([("a", 0), ("b", 1), ("c", 2), ("d", 3)], 1, 2)
    assert len(mapped) == 2 and list(mapped) == [("b", 1, 1), ("d", 3, 3)]
    image, label, key = next(iter(share(build(resolve("synthetic_shapes", bench_root), transform=lambda im: 7), 0, 1)))
    assert (image, label, key) == (7, 0, (0, 0))
