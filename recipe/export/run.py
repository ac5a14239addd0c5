"""A trained run as one model: the checkpoint's consolidated weights, the run's model config and tokenizer.

Every checkpoint holds ``model_weights.pt``, the module's full state dict (gathered across ranks under
ZeRO-3; the same file on every ZeRO stage and on the fp16 route), so reading a run's module weights
needs no DeepSpeed and no knowledge of how it was sharded. Those are the weights the model trained
and evaluated with, in the run's dtype (bf16 or fp16).

For the parameters of mastered groups (the image tower and the logit scale by default) SRAdamW also
keeps an fp32 master, of which the module weight is only the rounding; ``weights="master"`` reads
those masters out of the sharded optimizer state (:mod:`recipe.export.masters`, any ZeRO stage, any
saved world size) and puts them in place of the module weights, bit for bit: the exact fp32 weights
the optimizer was updating. The other parameters (SR groups, buffers) keep the module weights, whose
fp32 upcast is exact: SR groups have no other copy. Reading the masters unpickles DeepSpeed's files
(``deepspeed`` must be importable; no process group is started). In another dtype than fp32 the
masters are rounded to nearest (even): in bf16 that is the module weight again, except at exact ties,
where the split master's weight was rounded away from zero (1 element in 10^5 in a short run).
``weights="module"`` (the default of :func:`load_run`) reads ``model_weights.pt`` alone. The EMA
weights (``ema=True``) are an average of their own, kept in the weights' dtype, with no master: they
combine with ``weights="module"`` only.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..model.clip import CLIP, CLIPConfig
from ..model.tokenizer import Tokenizer
from ..run import checkpoint
from .architecture import build_architecture
from .masters import has_optimizer_state, read_masters

__all__ = ["LoadedRun", "load_run", "find_checkpoint", "build_architecture", "DTYPES", "WEIGHTS", "parse_dtype"]

#: ``--dtype`` names.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

#: ``--weights`` names: the optimizer's fp32 masters where it keeps them, or the module's weights only.
WEIGHTS = ("master", "module")


def parse_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--dtype`` name (``fp32``, ``bf16``, ``fp16``).

    Raises:
        ValueError: Another name.
    """
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


@dataclass
class LoadedRun:
    """A run's model at one checkpoint.

    Attributes:
        model: The :class:`recipe.model.CLIP` with the checkpoint's weights, in evaluation mode.
        tokenizer: The run's tokenizer.
        config: The model's :class:`recipe.model.CLIPConfig`.
        run_dir: The run directory.
        tag_dir: The checkpoint directory the weights came from.
        step: The checkpoint's optimizer step.
        saved_dtype: The dtype the weights were saved in (the run's training dtype).
        weights_file: The file the weights came from (``model_weights.pt`` or ``ema_weights.pt``).
        weights: ``"master"`` or ``"module"``: what was asked for (:func:`load_run`).
        master_names: The parameters whose values are the optimizer's fp32 masters (empty with
            ``weights="module"``, or when the checkpoint keeps no master).
        optimizer_state: Whether the checkpoint is one training saved whole, with its optimizer state
            (False for a checkpoint reduced to ``model_weights.pt``: ``weights="master"`` then gives the
            module weights; :func:`recipe.export.masters.has_optimizer_state`).
    """

    model: CLIP
    tokenizer: Tokenizer
    config: CLIPConfig
    run_dir: Path
    tag_dir: Path
    step: int
    saved_dtype: torch.dtype
    weights_file: str = checkpoint.MODEL_WEIGHTS
    weights: str = "module"
    master_names: tuple[str, ...] = ()
    optimizer_state: bool = True

    def provenance(self) -> dict[str, Any]:
        """What an export records about its weights: ``source`` (``master``: the optimizer's fp32 masters
        where kept, the module weights elsewhere; ``module``; ``ema``) and ``master_params`` (how many
        parameters hold a master)."""
        source = "ema" if self.weights_file == checkpoint.EMA_WEIGHTS else self.weights
        return {"source": source, "master_params": len(self.master_names)}


def find_checkpoint(path: str | os.PathLike) -> tuple[Path, Path]:
    """The checkpoint tag directory :func:`load_run` reads for ``path`` (a run directory's ``latest``
    complete checkpoint, its ``checkpoints/`` directory's, or a tag directory itself) and the run
    directory owning it (the tag directory's grandparent). Reads the ``latest`` file and the
    ``COMPLETE`` markers only.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        recipe.run.checkpoint.CheckpointError: No complete checkpoint there.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"run directory not found: {path}")
    tag_dir = checkpoint.resolve(str(path), path / "checkpoints")
    return tag_dir, tag_dir.parent.parent


def load_run(
    path: str | os.PathLike, dtype: torch.dtype = torch.float32, ema: bool = False, weights: str = "module"
) -> LoadedRun:
    """Loads the model of a run directory (its ``latest`` complete checkpoint), of its
    ``checkpoints/`` directory, or of one checkpoint tag directory, cast to ``dtype``; with ``ema``
    the checkpoint's EMA weights (``ema_weights.pt``, runs with ``--ema-decay``) instead.

    ``weights="master"``: the parameters whose optimizer keeps an fp32 master get that master (rounded
    to ``dtype`` when it is not fp32), the others the module weights (module docstring); a checkpoint
    reduced to ``model_weights.pt`` (no DeepSpeed files, no ``rankNNNNN.pt``) gives the module weights
    (``optimizer_state`` False), while one training saved whole must have readable optimizer files.
    ``"module"``: ``model_weights.pt`` alone.

    Raises:
        FileNotFoundError: The directory, its ``model_config.json`` or tokenizer is missing.
        ValueError: ``weights`` is not ``master``/``module``, or ``master`` with ``ema``.
        recipe.run.checkpoint.CheckpointError: No complete checkpoint there, or an unreadable one
            (the optimizer files too with ``weights="master"``).
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    if ema and weights == "master":
        raise ValueError("the EMA weights have no fp32 master (the average is kept in the weights' dtype): "
                         "export them with --weights module, or the masters without --ema")
    tag_dir, run_dir = find_checkpoint(path)
    # the architecture as trained, randomly initialised, then the saved weights
    _, tokenizer, model = build_architecture(run_dir)
    weights_path = tag_dir / (checkpoint.EMA_WEIGHTS if ema else checkpoint.MODEL_WEIGHTS)
    if ema and not weights_path.is_file():
        raise checkpoint.CheckpointError(f"{weights_path} not found: the run has no EMA (train with --ema-decay)")
    try:
        state: dict[str, Any] = torch.load(weights_path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file
        raise checkpoint.CheckpointError(f"cannot read {weights_path}: {e}") from e
    model.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise checkpoint.CheckpointError(
            f"{weights_path} does not fit the run's model: missing {sorted(missing)[:5]}, "
            f"unexpected {sorted(unexpected)[:5]}"
        )
    has_state = has_optimizer_state(tag_dir)
    names: tuple[str, ...] = ()
    if weights == "master" and has_state:
        names = _put_masters(model, read_masters(tag_dir, model), tag_dir)
    step = int(json.loads((tag_dir / checkpoint.COMPLETE).read_text())["step"])
    saved = next(iter(state.values())).dtype if state else dtype
    return LoadedRun(model.eval(), tokenizer, model.config, run_dir, tag_dir, step, saved, weights_path.name,
                     weights, names, has_state)


def _put_masters(model: CLIP, masters: dict[str, torch.Tensor], tag_dir: Path) -> tuple[str, ...]:
    """Copies the masters into the model's parameters (rounded to the model's dtype); their names."""
    params = dict(model.named_parameters())
    for name, master in masters.items():
        p = params.get(name)
        if p is None or p.shape != master.shape:
            raise checkpoint.CheckpointError(
                f"the optimizer state of {tag_dir} holds a master for {name} {tuple(master.shape)}, which the run's "
                f"model {'does not have' if p is None else f'has with shape {tuple(p.shape)}'}")
        with torch.no_grad():
            p.copy_(master)
    return tuple(n for n in params if n in masters)
