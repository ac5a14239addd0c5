"""A resume whose flags differ from its checkpoint's: each change applied and said, or refused.

Every checkpoint records the settings below (``settings`` in its rank files, :func:`record`); a resume
compares them with its own flags (a checkpoint saved before they were recorded: its run's
``config.json`` as it was before this start, and its EMA's own record) and says each change in one
line, ``--image-lr changed 0.002 -> 0.001 on resume: applied``:

* **Learning rates and the optimizer's hyperparameters** (``--lr``, ``--image-lr``, ``--text-lr``,
  ``--layer-decay``, ``--weight-decay``, ``--beta1``, ``--beta2``, ``--eps``): applied. The optimizer
  groups' ``lr_scale``, weight decay, betas and eps are this run's (:mod:`recipe.training.param_groups`), not
  the ones the checkpoint's optimizer state carries; the Adam statistics are kept.
* **Group structure** (``--layer-decay`` turned on or off, ``--lock-image``,
  ``--lock-image-unlocked-groups``, ``--lock-text``): applied under ZeRO 0-2. The groups are this
  run's and the optimizer state is mapped by parameter name (:mod:`recipe.run.regroup`): a parameter still
  trained keeps its state, a locked one stays bit-identical (no gradient, no state), an unlocked one
  starts with fresh state at its first step. Refused, in one line naming the flag, under ZeRO-3 and
  where ZeRO-1/2's flat groups cannot hold the result (trained and newly trainable parameters in one
  group: lock the image tower by layer groups with ``--layer-decay``, or use ZeRO-0).
* **EMA** (``--ema-decay``, ``--ema-warmup``): applied from the resumed step on; the average so far is
  kept. Set now and not in the checkpoint: the average starts at the resumed weights; unset now: the
  run keeps no EMA from here on.
* **Master weights** (``--text-master-weights``, ``--image-master-weights``): refused (the optimizer
  state of a tower holds its fp32 masters or not); start a new run from the checkpoint's weights
  with ``--init-from``.

The run's ``config.json`` is rewritten at every start (:func:`recipe.run.rundir.prepare_run_dir`), so it
records the new values from the resume on (a refused start puts the old file back).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path
from typing import Any, Callable

import torch

from ..training.distributed import broadcast_from_rank0, rank_world
from . import checkpoint
from .files import CheckpointError, read_file

__all__ = ["SETTINGS", "Setting", "Change", "record", "previous_config", "saved_settings", "changes", "load"]


@dataclasses.dataclass(frozen=True)
class Setting:
    """A recorded setting: its flag, its place in :class:`recipe.config.TrainConfig` (``section.field``),
    and what a change of it on resume does."""

    flag: str
    path: str
    kind: str = "hyper"  # "hyper" (group hyperparameters), "groups" (may change the groups), "ema", "refused"


SETTINGS: tuple[Setting, ...] = (
    Setting("--lr", "optim.lr"),
    Setting("--image-lr", "optim.image_lr"),
    Setting("--text-lr", "optim.text_lr"),
    Setting("--layer-decay", "optim.layer_decay", "groups"),
    Setting("--weight-decay", "optim.weight_decay"),
    Setting("--beta1", "optim.beta1"),
    Setting("--beta2", "optim.beta2"),
    Setting("--eps", "optim.eps"),
    Setting("--lock-image", "model.lock_image", "groups"),
    Setting("--lock-image-unlocked-groups", "model.lock_image_unlocked_groups", "groups"),
    Setting("--lock-text", "model.lock_text", "groups"),
    Setting("--ema-decay", "optim.ema_decay", "ema"),
    Setting("--ema-warmup", "optim.ema_warmup", "ema"),
    Setting("--text-master-weights", "model.text_master_weights", "refused"),
    Setting("--image-master-weights", "model.image_master_weights", "refused"),
)

#: The group keys a resume takes from this run's groups rather than from the checkpoint's.
HYPERPARAMETERS = ("lr_scale", "weight_decay", "betas", "eps", "clamp")


def _get(tree: Any, path: str) -> Any:
    section, _, name = path.partition(".")
    return getattr(getattr(tree, section), name)


def record(cfg: Any) -> dict[str, Any]:
    """The settings of :data:`SETTINGS` in ``cfg`` (a :class:`recipe.config.TrainConfig`), as checkpoints keep them."""
    return {s.path: _get(cfg, s.path) for s in SETTINGS}


def previous_config(run_dir: Path, resume: str | None) -> dict[str, Any] | None:
    """The run's ``config.json`` before this start rewrites it (every rank calls it; rank 0 reads), for
    checkpoints saved before settings were recorded; ``None`` without ``resume`` or file."""
    data = None
    if resume and rank_world()[0] == 0:
        try:
            data = json.loads((Path(run_dir) / "config.json").read_text())
        except (OSError, ValueError):
            data = None
    return broadcast_from_rank0(data)


def saved_settings(tag_dir: Path, client: dict[str, Any], run_dir: Path,
                   previous: dict[str, Any] | None) -> dict[str, Any] | None:
    """The settings checkpoint ``tag_dir`` was saved with: its record (``client["settings"]``, rank 0's
    client state), else its run's config (``previous`` when the checkpoint is in ``run_dir``, else the
    ``config.json`` next to its ``checkpoints/``) with its EMA's own record; ``None`` when neither is there."""
    if isinstance(client.get("settings"), dict):
        return dict(client["settings"])
    tag_dir = Path(tag_dir)
    own_run = tag_dir.resolve().parent.parent
    data = previous if own_run == Path(run_dir).resolve() else None
    if data is None:
        try:
            data = json.loads((own_run / "config.json").read_text())
        except (OSError, ValueError):
            return None
    from ..config import TrainConfig

    defaults = record(TrainConfig())
    out = {}
    for s in SETTINGS:
        section, _, name = s.path.partition(".")
        out[s.path] = (data.get(section) or {}).get(name, defaults[s.path])
    ema = client.get("ema")
    out["optim.ema_decay"] = ema.get("decay") if isinstance(ema, dict) else None
    if isinstance(ema, dict) and "warmup" in ema:
        out["optim.ema_warmup"] = ema["warmup"]
    return out


# --------------------------------------------------------------------------------------------------
# changes
# --------------------------------------------------------------------------------------------------


def _show(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g}" if isinstance(value, float) else str(value)


def _as_flag(setting: Setting, value: Any) -> str:
    """The command-line words that give ``setting`` the value ``value``."""
    if isinstance(value, bool):
        return setting.flag if value else "--no-" + setting.flag[2:]
    return f"{setting.flag} ''" if value is None else f"{setting.flag} {_show(value)}"


@dataclasses.dataclass
class Change:
    """A setting whose value on resume differs from the checkpoint's."""

    setting: Setting
    old: Any
    new: Any

    @property
    def regroups(self) -> bool:
        """Whether the change changes the optimizer groups (their number or their parameters)."""
        if self.setting.path == "optim.layer_decay":
            return (self.old is None) != (self.new is None)
        return self.setting.kind == "groups"

    def said(self) -> str:
        return f"{self.setting.flag} changed {_show(self.old)} -> {_show(self.new)} on resume"

    def applied(self, detail: str = "") -> str:
        return f"{self.said()}: applied" + (f" ({detail})" if detail else "")

    def refused(self, why: str, run: str) -> str:
        return (f"{self.said()} is not supported: {why}; resume with {_as_flag(self.setting, self.old)}, or start a "
                f"new run from this checkpoint's weights with --init-from {run}")


def changes(saved: dict[str, Any], now: dict[str, Any]) -> list[Change]:
    """The settings that differ, in :data:`SETTINGS` order (``--ema-warmup`` only where both keep an EMA)."""
    out = []
    for s in SETTINGS:
        if s.path not in saved or saved[s.path] == now[s.path]:
            continue
        if s.path == "optim.ema_warmup" and (saved.get("optim.ema_decay") is None or now["optim.ema_decay"] is None):
            continue
        out.append(Change(s, saved[s.path], now[s.path]))
    return out


def _ema_detail(change: Change) -> str:
    if change.setting.path != "optim.ema_decay":
        return "the average so far is kept"
    if change.old is None:
        return ""  # the resume says that the checkpoint has no EMA and where the average starts
    if change.new is None:
        return "the run keeps no EMA from here on"
    return "the average so far is kept"


# --------------------------------------------------------------------------------------------------
# the resume
# --------------------------------------------------------------------------------------------------


def _hyperparameters(opt: torch.optim.Optimizer) -> dict[str, dict[str, Any]]:
    return {str(g.get("name", i)): {k: copy.deepcopy(g[k]) for k in HYPERPARAMETERS if k in g}
            for i, g in enumerate(opt.param_groups)}


def _apply(opt: torch.optim.Optimizer, wanted: dict[str, dict[str, Any]]) -> None:
    for i, g in enumerate(opt.param_groups):
        g.update(wanted.get(str(g.get("name", i)), {}))


def load(engine: Any, opt: torch.optim.Optimizer, tag_dir: Path, cfg: Any, run_dir: Path,
         previous: dict[str, Any] | None, say: Callable[[str], None]) -> dict[str, Any]:
    """Loads checkpoint ``tag_dir`` into ``engine`` and its optimizer ``opt`` (SRAdamW, built from this
    run's flags) as :func:`recipe.run.checkpoint.load` does, with this run's settings applied or refused
    (module docstring), each change said through ``say``; returns this rank's client state.

    Raises:
        ValueError: A change that is refused (one line naming the flag).
        CheckpointError: As :func:`recipe.run.checkpoint.load`.
    """
    tag_dir = Path(tag_dir)
    run = str(tag_dir.resolve().parent.parent)
    if not (tag_dir / checkpoint.COMPLETE).exists():
        raise CheckpointError(f"checkpoint {tag_dir} is incomplete (no {checkpoint.COMPLETE} marker)")
    saved = saved_settings(tag_dir, read_file(tag_dir / "rank00000.pt"), run_dir, previous)
    found = changes(saved, record(cfg)) if saved is not None else []
    stage = int(engine.zero_optimization_stage())
    for c in found:
        if c.setting.kind == "refused":
            raise ValueError(c.refused("a tower's optimizer state holds its fp32 masters or not, from the run's "
                                       "start", run))
    regroup = [c for c in found if c.regroups]
    if regroup and stage not in (0, 1, 2):
        raise ValueError(regroup[0].refused(f"it changes the optimizer groups, and under ZeRO-{stage} the optimizer "
                                            "state is not mapped by parameter name", run))
    wanted = _hyperparameters(opt)
    detail = ""
    if regroup:
        from .regroup import RegroupError, load_by_name

        client = checkpoint.load(engine, tag_dir, optimizer_states=False)
        try:
            detail = load_by_name(engine, opt, tag_dir, saved or {}).describe()
        except RegroupError as e:
            raise ValueError(regroup[0].refused(str(e), run)) from e
    else:
        client = checkpoint.load(engine, tag_dir)
    _apply(opt, wanted)
    if saved is None:
        say(f"checkpoint {tag_dir} records no settings and its run's config.json is missing: this run's learning-rate "
            "scales, weight decay and EMA settings apply")
    for c in found:
        if c.regroups:
            say(c.applied(detail))
            detail = ""  # said once
        else:
            say(c.applied(_ema_detail(c) if c.setting.kind == "ema" else ""))
    return client
