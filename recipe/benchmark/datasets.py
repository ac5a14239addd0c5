"""CLIP_benchmark's datasets from local files: which names it knows, where a name's files are under a
root, what is missing, and the dataset its own builder makes of them, cut into this rank's share.

A benchmark name is CLIP_benchmark's dataset name (``--dataset`` of ``clip_benchmark eval``):

* ``wds/<name>``, or a plain ``<name>`` whose converted copy is under the root: CLIP_benchmark's
  webdataset layout, which its converter (``clip_benchmark_export_wds``,
  ``clip_benchmark.webdataset_builder.convert_dataset``) writes and LAION publishes as
  ``clip-benchmark/wds_<name>`` on the Hugging Face Hub::

      ROOT/wds_<name>/                       (or ROOT/<name>/; '/' in a name is '-' in wds_<name>)
          test/nshards.txt, test/0.tar ...   the shards of the split
          classnames.txt                     classification: one class name a line, by label
          zeroshot_classification_templates.txt   its prompt templates ({c} for the class name)
          dataset_type.txt                   "retrieval" for image-captions sets (else classification)

  The task is read from ``dataset_type.txt`` (CLIP_benchmark's command line guesses it from the name).
* another name CLIP_benchmark's builder knows (``cifar10``, ``imagenet1k``, ``mscoco_captions``...): its
  torchvision / folder dataset, read from ``ROOT/<name>`` (or ``ROOT``) where its files are present;
  the builder's downloads are switched off (``download=False``, and its ``wget``/``kaggle`` calls refused).

``ROOT`` may hold ``{dataset}`` or ``{dataset_cleaned}`` as CLIP_benchmark's ``--dataset_root`` does
(``/data/clip_benchmark/wds_{dataset_cleaned}``). Nothing is ever downloaded.
"""

from __future__ import annotations

import collections
import contextlib
import inspect
import itertools
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

__all__ = [
    "CLASSIFICATION",
    "RETRIEVAL",
    "TASKS",
    "BenchmarkError",
    "UnknownBenchmark",
    "MissingBenchmarkData",
    "BenchmarkSpec",
    "require_clip_benchmark",
    "parse_names",
    "known_names",
    "local_wds_names",
    "resolve",
    "resolve_all",
    "build",
    "share",
    "make_loader",
]

CLASSIFICATION = "zeroshot_classification"
RETRIEVAL = "zeroshot_retrieval"
#: The CLIP_benchmark tasks the recipe evaluates.
TASKS = (CLASSIFICATION, RETRIEVAL)
WDS = "wds/"
#: What CLIP_benchmark's converter writes next to the shards, by task.
_WDS_METADATA = {CLASSIFICATION: ("classnames.txt", "zeroshot_classification_templates.txt"),
                 RETRIEVAL: ("dataset_type.txt",)}


class BenchmarkError(ValueError):
    """A benchmark that cannot be evaluated; the message says why and what to do."""


class UnknownBenchmark(BenchmarkError):
    """A name neither CLIP_benchmark nor the root knows; the message lists the names that are known."""


class MissingBenchmarkData(BenchmarkError):
    """A dataset whose files are not under the root; the message names them and how to make them."""


def require_clip_benchmark() -> None:
    """Raises :class:`BenchmarkError` with the install line when ``clip_benchmark`` is not importable."""
    try:
        import clip_benchmark  # noqa: F401
    except ImportError as e:
        raise BenchmarkError(
            f"CLIP_benchmark is not installed ({e}): pip install -e \".[eval]\" (the clip-benchmark package)"
        ) from None


def parse_names(spec: str | Sequence[str] | None) -> list[str]:
    """The benchmark names of ``NAME[,NAME...]`` (or a list of such), in order, each once."""
    parts = [spec] if isinstance(spec, str) else list(spec or [])
    names = [n.strip() for p in parts for n in p.split(",") if n.strip()]
    if not names:
        raise BenchmarkError("no benchmark named: give NAME[,NAME...] (e.g. wds/cifar10,mscoco_captions)")
    return list(dict.fromkeys(names))


def known_names() -> list[str]:
    """The dataset names CLIP_benchmark's builder (``clip_benchmark.datasets.builder.build_dataset``)
    takes by name, read from it (its ``dataset_name == ...`` branches and its named collections)."""
    from clip_benchmark.datasets import builder

    names = set(re.findall(r"dataset_name\s*==\s*['\"]([^'\"]+)['\"]", inspect.getsource(builder.build_dataset)))
    for members in builder.dataset_collection.values():
        names.update(members)
    names.discard("dummy")
    return sorted(names)


def _cleaned(base: str) -> str:
    return base.replace("/", "-")


def _templated(root: str) -> bool:
    return "{dataset" in root


def _candidates(base: str, root: str) -> list[Path]:
    """Where a converted (webdataset) copy of ``base`` may lie under ``root``."""
    if _templated(root):
        return [Path(root.format(dataset=base, dataset_cleaned=_cleaned(base)))]
    r = Path(root)
    return list(dict.fromkeys([r / f"wds_{_cleaned(base)}", r / base, r / _cleaned(base), r / "wds" / base]))


def _wds_task(directory: Path) -> str:
    kind = directory / "dataset_type.txt"
    return RETRIEVAL if kind.is_file() and kind.read_text().strip().lower() == "retrieval" else CLASSIFICATION


def _wds_missing(directory: Path, split: str, task: str = CLASSIFICATION) -> list[str]:
    """The files of CLIP_benchmark's webdataset layout missing in ``directory`` (relative paths; ``task``:
    what a missing ``dataset_type.txt`` stands for when there are no shards either)."""
    nshards = directory / split / "nshards.txt"
    if not nshards.is_file():
        return [f"{split}/nshards.txt", f"{split}/0.tar", *_WDS_METADATA[task]]
    missing = []
    try:
        count = int(nshards.read_text().strip())
    except ValueError:
        return [f"{split}/nshards.txt (holds {nshards.read_text().strip()[:20]!r}, not a number of shards)"]
    missing += [f"{split}/{i}.tar" for i in range(count) if not (directory / split / f"{i}.tar").is_file()]
    missing += [f for f in _WDS_METADATA[_wds_task(directory)] if not (directory / f).is_file()]
    return missing


def local_wds_names(root: str, split: str = "test") -> list[str]:
    """The converted datasets directly under ``root`` (``wds_<name>`` or ``<name>`` folders with
    ``<split>/nshards.txt``), by the name ``--benchmark`` takes."""
    if _templated(root) or not Path(root).is_dir():
        return []
    found = []
    for d in sorted(Path(root).iterdir()):
        if (d / split / "nshards.txt").is_file():
            found.append(d.name[4:] if d.name.startswith("wds_") else d.name)
    return found


def _converter_hint(base: str, target: Path, retrieval: bool | None) -> str:
    flag = " --retrieval" if retrieval else ""
    alt = "" if retrieval is not None else " (add --retrieval for an image-captions set)"
    return (f"CLIP_benchmark's converter writes this layout from the raw dataset its builder reads: "
            f"clip_benchmark_export_wds --dataset {base} --dataset-root RAW_DIR --split test{flag} --output {target}"
            f"{alt}; LAION's converted copy is https://huggingface.co/datasets/clip-benchmark/wds_{_cleaned(base)} "
            f"(git clone it to {target})")


@dataclass(frozen=True)
class BenchmarkSpec:
    """One benchmark, resolved against a root.

    Attributes:
        name: The name as given.
        dataset: CLIP_benchmark's dataset name: ``wds/<name>`` or a builder name (``cifar10``).
        root: What CLIP_benchmark's builder takes as ``root`` for it.
        task: ``zeroshot_classification`` or ``zeroshot_retrieval``.
        split: The split (``test``).
        search_root: The root it was looked up under (``--benchmark-root``).
    """

    name: str
    dataset: str
    root: str
    task: str
    split: str = "test"
    search_root: str = ""

    @property
    def base(self) -> str:
        """The name without ``wds/`` (what CLIP_benchmark's command line names its results by)."""
        return self.dataset[len(WDS):] if self.dataset.startswith(WDS) else self.dataset

    @property
    def slug(self) -> str:
        """The name in metric keys and file names (``/`` as ``-``)."""
        return re.sub(r"[^A-Za-z0-9_.@-]+", "-", self.base)

    @property
    def webdataset(self) -> bool:
        return self.dataset.startswith(WDS)


def resolve(name: str, root: str | os.PathLike, split: str = "test") -> BenchmarkSpec:
    """Where ``name`` is under ``root`` (module docstring): a converted copy first, else a builder dataset.

    Raises:
        UnknownBenchmark: A plain name CLIP_benchmark's builder does not know, with no converted copy
            under ``root`` (the message lists both kinds of names).
        MissingBenchmarkData: ``wds/<name>`` or a known name whose files are not there (the message
            names the missing files and the converter's command line).
        BenchmarkError: A task the recipe does not evaluate (image-caption selection, linear probes).
    """
    require_clip_benchmark()
    from clip_benchmark.datasets.builder import get_dataset_default_task

    root = os.fspath(root)
    is_wds = name.startswith(WDS)
    base = name[len(WDS):] if is_wds else name
    if not base:
        raise UnknownBenchmark(f"benchmark {name!r} names no dataset: give wds/<name>")
    candidates = _candidates(base, root)
    present = [d for d in candidates if (d / split / "nshards.txt").is_file()]
    if present:
        directory = present[0]
        missing = _wds_missing(directory, split)
        if missing:
            raise MissingBenchmarkData(
                f"benchmark {name!r}: {directory} is incomplete, missing {', '.join(missing)}. "
                + _converter_hint(base, directory, _wds_task(directory) == RETRIEVAL))
        return BenchmarkSpec(name, WDS + base, str(directory), _wds_task(directory), split, root)
    known = known_names()
    if not is_wds and base not in known:
        local = local_wds_names(root, split)
        raise UnknownBenchmark(
            f"unknown benchmark {name!r}: not a dataset CLIP_benchmark knows, and no converted copy of it under "
            f"{root} ({' or '.join(str(c) for c in candidates)}). Converted datasets under {root}: "
            f"{', '.join(local) if local else 'none'}. CLIP_benchmark's datasets: {', '.join(known)}; and "
            "wds/<name> for any dataset in its webdataset layout")
    if not is_wds:
        task = get_dataset_default_task(base)
        if task not in TASKS:
            raise BenchmarkError(f"benchmark {name!r} is a {task} dataset: --benchmark evaluates "
                                 f"{' and '.join(TASKS)} only")
        source = Path(root.format(dataset=base, dataset_cleaned=_cleaned(base))) if _templated(root) else (
            Path(root) / base if (Path(root) / base).is_dir() else Path(root))
        found = ""
        if source.is_dir() and any(source.iterdir()):
            spec = BenchmarkSpec(name, base, str(source), task, split, root)
            try:
                build(spec)  # the builder's own check that its files are there (nothing is downloaded)
                return spec
            except MissingBenchmarkData as e:
                found = f" ({e.__cause__ or e})"
    task = get_dataset_default_task(base)  # CLIP_benchmark's guess from the name (classification if unknown)
    target = candidates[0]
    missing = _wds_missing(target, split, RETRIEVAL if task == RETRIEVAL else CLASSIFICATION)
    where = f"{target}" + (f" (or {', '.join(str(c) for c in candidates[1:])})" if len(candidates) > 1 else "")
    raw = "" if is_wds else (f"; nor the files of CLIP_benchmark's {base} dataset in {Path(root) / base} or {root}"
                             f"{found}, which its builder reads (nothing is downloaded)")
    raise MissingBenchmarkData(
        f"benchmark {name!r} is not under {root}: looked for CLIP_benchmark's webdataset layout in {where}, missing "
        f"{', '.join(missing)}{raw}. "
        + _converter_hint(base, target, task == RETRIEVAL if base in known else None))


def resolve_all(names: str | Sequence[str], root: str | os.PathLike | None, split: str = "test") -> list[BenchmarkSpec]:
    """:func:`resolve` of every name of ``NAME[,NAME...]``; every error at once, one per line. A list of
    :class:`BenchmarkSpec` s (resolved already) comes back as it is."""
    if isinstance(names, (list, tuple)) and names and all(isinstance(n, BenchmarkSpec) for n in names):
        return list(names)
    listed = parse_names(names)
    if not root:
        raise BenchmarkError(f"the benchmark datasets {', '.join(listed)} need --benchmark-root DIR: the folder "
                             "holding them (wds_<name>/ as CLIP_benchmark's converter writes them)")
    require_clip_benchmark()
    specs, errors = [], []
    for name in listed:
        try:
            specs.append(resolve(name, root, split))
        except BenchmarkError as e:
            errors.append(e)
    if errors:
        kind = type(errors[0]) if all(type(e) is type(errors[0]) for e in errors) else BenchmarkError
        raise kind("\n".join(str(e) for e in errors))
    return specs


class _DownloadRefused(RuntimeError):
    pass


@contextlib.contextmanager
def _no_download() -> Iterator[None]:
    """CLIP_benchmark's builder with its shell downloads (``wget``, ``kaggle``, ``unzip`` through
    ``subprocess.call``) and ImageNetV2's ``requests`` download refused."""
    from clip_benchmark.datasets import builder, imagenetv2

    def refuse(command: Any, *args: Any, **kwargs: Any) -> int:
        raise _DownloadRefused(f"its files are missing (CLIP_benchmark would run: {command})")

    class _Requests:
        def get(self, url: str, *args: Any, **kwargs: Any) -> Any:
            raise _DownloadRefused(f"its files are missing (CLIP_benchmark would download {url})")

    saved = builder.call, imagenetv2.requests
    builder.call, imagenetv2.requests = refuse, _Requests()
    try:
        yield
    finally:
        builder.call, imagenetv2.requests = saved


def build(spec: BenchmarkSpec, transform: Any = None, language: str = "en") -> Any:
    """The dataset CLIP_benchmark's builder makes of ``spec`` (its class names and templates attached
    for classification), images through ``transform``, downloads refused.

    Raises:
        MissingBenchmarkData: The builder did not find its files (its own message, and the converter's).
        BenchmarkError: A classification set without class names or templates.
    """
    from clip_benchmark.datasets.builder import build_dataset

    target = Path(spec.root) if spec.webdataset else _candidates(spec.base, spec.search_root or spec.root)[0]
    try:
        with _no_download():
            ds = build_dataset(dataset_name=spec.dataset, root=spec.root, transform=transform, split=spec.split,
                               download=False, language=language, task=spec.task)
    except (_DownloadRefused, RuntimeError, FileNotFoundError, OSError, AssertionError, KeyError) as e:
        raise MissingBenchmarkData(
            f"benchmark {spec.name!r}: CLIP_benchmark's builder cannot read {spec.dataset} from {spec.root}: "
            f"{e or type(e).__name__}. " + _converter_hint(spec.base, target, spec.task == RETRIEVAL)) from e
    if spec.task == CLASSIFICATION and not (getattr(ds, "classes", None) and getattr(ds, "templates", None)):
        raise MissingBenchmarkData(f"benchmark {spec.name!r}: no class names or templates in {spec.root} "
                                   "(classnames.txt, zeroshot_classification_templates.txt)")
    return ds


class _Keyed(Dataset):
    """Items ``indices`` of a map-style dataset, each with its index appended (its position key)."""

    def __init__(self, ds: Any, indices: Sequence[int]) -> None:
        self.ds, self.indices = ds, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[Any, ...]:
        return (*self.ds[self.indices[i]], self.indices[i])


class _EveryNth(IterableDataset):
    """Samples ``rank, rank + world, ...`` of an iterable dataset, each with its position appended (every
    rank still reads them all)."""

    def __init__(self, ds: Any, rank: int, world: int) -> None:
        self.ds, self.rank, self.world = ds, rank, world

    def __iter__(self) -> Iterator[Any]:
        numbered = itertools.islice(enumerate(self.ds), self.rank, None, self.world)
        return ((*sample, i) for i, sample in numbered)


class _NumberSamples:
    """Webdataset stage right after the tar reader: ``__position__`` = (shard's place in the shard list,
    the sample's place in its shard), the order one reader of the whole set sees."""

    def __init__(self, urls: Sequence[str]) -> None:
        self.order = {u: i for i, u in enumerate(urls)}

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        seen: dict[Any, int] = {}
        for sample in samples:
            url = sample.get("__url__")
            seen[url] = seen.get(url, -1) + 1
            sample["__position__"] = (self.order.get(url, len(self.order)), seen[url])
            yield sample


class _KeepPositions:
    """Webdataset stage: passes samples on, keeping their ``__position__`` for :class:`_AppendPositions`
    (the stages between are one sample in, one out, so the two see the samples in the same order)."""

    def __init__(self, fifo: collections.deque) -> None:
        self.fifo = fifo

    def __call__(self, samples: Iterator[dict]) -> Iterator[dict]:
        for sample in samples:
            self.fifo.append(sample["__position__"])
            yield sample


class _AppendPositions:
    """The pipeline's last stage: its tuples with the position :class:`_KeepPositions` kept appended."""

    def __init__(self, fifo: collections.deque) -> None:
        self.fifo = fifo

    def __call__(self, items: Iterator[tuple]) -> Iterator[tuple]:
        for item in items:
            yield (*item, self.fifo.popleft())


def share(ds: Any, rank: int, world: int) -> Any:
    """This rank's share of ``ds``, each sample with a position key appended: the samples ``rank::world``
    in the order one reader of the whole set sees them (keys sort in that order). A webdataset pipeline is
    cut right after its tar reader, so that each rank decodes and transforms its own samples only (keys:
    shard, place in the shard, whatever the DataLoader workers); a map-style dataset gives its indices.
    The shares are disjoint and together the whole set."""
    if not isinstance(ds, IterableDataset):
        return _Keyed(ds, range(rank, len(ds), world))
    stages = getattr(ds, "pipeline", None)
    if isinstance(stages, list) and stages:
        import webdataset as wds

        for i, stage in enumerate(stages):
            if "tarfile" in getattr(getattr(stage, "f", None), "__name__", ""):
                fifo: collections.deque = collections.deque()
                added = [_NumberSamples(list(getattr(stages[0], "urls", []))),
                         *([wds.filters.slice(rank, None, world)] if world > 1 else []), _KeepPositions(fifo)]
                stages[i + 1:i + 1] = added
                stages.append(_AppendPositions(fifo))
                return ds
    return _EveryNth(ds, rank, world)


def _collate_classification(batch: list[tuple[Any, ...]]) -> tuple[torch.Tensor, torch.Tensor, list[Any]]:
    images, labels, keys = zip(*batch)
    return torch.stack(list(images)), default_collate(list(labels)), list(keys)


def _collate_retrieval(batch: list[tuple[Any, ...]]) -> tuple[torch.Tensor, list[list[str]], list[Any]]:
    images, captions, keys = zip(*batch)
    return torch.stack(list(images)), [[c] if isinstance(c, str) else list(c) for c in captions], list(keys)


def make_loader(ds: Any, task: str, batch_size: int, workers: int = 0) -> DataLoader:
    """Batches of :func:`share` 's samples: ``(images, labels, keys)`` (classification) or ``(images,
    [captions of each image], keys)`` (retrieval)."""
    collate = _collate_retrieval if task == RETRIEVAL else _collate_classification
    return DataLoader(ds, batch_size=batch_size, shuffle=False, num_workers=workers, collate_fn=collate)
