"""What the benchmark scripts share: inputs, the recipe's engine, peak-memory meters, the environment
record and the result writer. The train step itself is the recipe's own (:func:`recipe.training.step.train_step`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import gc
import hashlib
import json
import os
import platform
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2**20
GIB = 2**30
RESULTS = ROOT / "benchmarks" / "results"

__all__ = [
    "ROOT",
    "MIB",
    "GIB",
    "RESULTS",
    "TextSpec",
    "make_inputs",
    "input_checksum",
    "CpuPeakRss",
    "environment",
    "write_result",
    "RecipeArm",
    "build_recipe_arm",
]


# --------------------------------------------------------------------------------------------------
# inputs
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TextSpec:
    """Token conventions of a text tower."""

    vocab_size: int
    context_length: int
    bos: int
    eos: int
    pad: int = 0

    @classmethod
    def of(cls, model: torch.nn.Module) -> "TextSpec":
        """The conventions of a :class:`recipe.model.CLIP` model's text tower."""
        tcfg = model.text.config
        return cls(
            int(tcfg.vocab_size),
            int(model.context_length),
            int(tcfg.bos_token_id),
            int(tcfg.eos_token_id),
            int(tcfg.pad_token_id or 0),
        )


def make_inputs(batch: int, image_size: int, text: TextSpec, seed: int) -> dict[str, torch.Tensor]:
    """Random pixels ``[B, 3, S, S]`` (standard normal) and token rows: ``bos``, random ids that
    are none of the special ids, ``eos`` at a random length in ``[3, context]``, ``pad`` after.

    Rows are a prefix-stable function of ``seed``: row ``i`` does not depend on ``batch``.
    """
    pixels, ids, mask = [], [], []
    for i in range(batch):
        gen = torch.Generator().manual_seed(seed * 1_000_003 + i)
        pixels.append(torch.randn(3, image_size, image_size, generator=gen))
        length = int(torch.randint(3, text.context_length + 1, (1,), generator=gen))
        row = torch.full((text.context_length,), text.pad, dtype=torch.long)
        low = 1 + max(text.pad, 2)
        body = torch.randint(low, text.vocab_size - 2, (length - 2,), generator=gen)
        body = torch.where((body == text.bos) | (body == text.eos), torch.full_like(body, low), body)
        row[0], row[1 : length - 1], row[length - 1] = text.bos, body, text.eos
        ids.append(row)
        m = torch.zeros(text.context_length, dtype=torch.long)
        m[:length] = 1
        mask.append(m)
    return {"pixel_values": torch.stack(pixels), "input_ids": torch.stack(ids), "attention_mask": torch.stack(mask)}


def input_checksum(inputs: dict[str, torch.Tensor], text: TextSpec) -> str:
    """SHA-1 of the pixels, the attention mask and the tokens with the begin/end-of-text ids
    written as -2/-1, so that models that differ only in those two ids get the same checksum."""
    h = hashlib.sha1()
    h.update(inputs["pixel_values"].float().numpy().tobytes())
    ids = inputs["input_ids"].clone()
    ids[ids == text.eos] = -1
    ids[ids == text.bos] = -2
    h.update(ids.numpy().tobytes())
    h.update(inputs["attention_mask"].numpy().tobytes())
    return h.hexdigest()


# --------------------------------------------------------------------------------------------------
# the recipe's engine, as the training loop builds it
# --------------------------------------------------------------------------------------------------


@dataclass
class RecipeArm:
    """An engine built the way :mod:`recipe.train` builds it, ready for :func:`recipe.training.step.train_step`."""

    engine: Any
    optimizer: torch.optim.Optimizer
    precision: Any
    model: torch.nn.Module
    group_sizes: dict[str, int]


def build_recipe_arm(
    preset: str,
    ds_config: dict[str, Any],
    seed: int = 0,
    grad_checkpointing: bool = False,
    image_master_weights: bool = True,
    optimizer: Any = None,
) -> RecipeArm:
    """Initialises torch.distributed (a one-rank group without a launcher), builds the preset's
    model and the DeepSpeed engine with the recipe's optimizer (or ``optimizer(model)`` instead)."""
    from recipe.config import ModelConfig, TrainConfig
    from recipe.model import create_model
    from recipe.training.engine import build_engine, init_distributed
    from recipe.training.precision import resolve_precision

    init_distributed()
    prec, ds = resolve_precision(ds_config)
    torch.manual_seed(seed)
    model = create_model(preset)
    model.set_grad_checkpointing(grad_checkpointing)
    cfg = TrainConfig(
        model=ModelConfig(
            preset=preset, grad_checkpointing=grad_checkpointing, image_master_weights=image_master_weights
        )
    )
    engine, opt, group_params = build_engine(model, cfg, prec, ds, optimizer=optimizer(model) if optimizer else None)
    return RecipeArm(engine, opt, prec, model, group_params)


# --------------------------------------------------------------------------------------------------
# memory and environment
# --------------------------------------------------------------------------------------------------


class CpuPeakRss:
    """Peak resident-set size of this process since :meth:`reset` (Linux ``VmHWM`` reset trick)."""

    def __init__(self) -> None:
        name = ctypes.util.find_library("c")
        try:
            self.libc = ctypes.CDLL(name) if name else None
        except OSError:
            self.libc = None
        self.available = sys.platform.startswith("linux") and os.path.exists("/proc/self/clear_refs")
        self.base = 0

    @staticmethod
    def _kib(field_name: str) -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
        raise KeyError(field_name)

    def rss_bytes(self) -> int:
        """The resident set now, after a garbage collection and returning free heap to the system."""
        gc.collect()
        if self.libc is not None and hasattr(self.libc, "malloc_trim"):
            self.libc.malloc_trim(0)
        return self._kib("VmRSS") * 1024

    def reset(self) -> None:
        """Starts a region: the peak is measured from here."""
        self.rss_bytes()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")

    def peak_bytes(self) -> int:
        return self._kib("VmHWM") * 1024

    def start(self) -> None:
        """Starts a region whose growth :meth:`stop_mib` returns."""
        self.reset()
        self.base = self.rss_bytes()

    def stop_mib(self) -> float:
        return (self.peak_bytes() - self.base) / MIB


def environment(device: str) -> dict[str, Any]:
    """Device, library versions and date of a measurement."""
    import importlib

    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for name in ("deepspeed", "timm", "transformers", "open_clip", "triton"):
        try:
            versions[name] = importlib.import_module(name).__version__
        except ImportError:
            versions[name] = None
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(0)
        dev = f"{props.name} ({props.total_memory / GIB:.0f} GiB), CUDA {torch.version.cuda}"
    else:
        dev = f"CPU: {platform.processor() or platform.machine()}, {os.cpu_count()} cores visible"
    return {
        "device": dev,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "versions": versions,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


def write_result(path: str | os.PathLike, result: dict[str, Any], table: str) -> Path:
    """Writes ``result`` (with ``table`` under ``"markdown"``) as JSON, prints the table and the path."""
    result["markdown"] = table
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(table)
    print(f"wrote {path}", file=sys.stderr)
    return path
