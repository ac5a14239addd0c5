"""DeepSpeed engine setup shared by the training loop and the benchmarks: process group, engine
with the recipe's optimizer and precision route (and ``--compile``), and a module to evaluate under
any ZeRO stage."""

from __future__ import annotations

import copy
import importlib
import logging
import os
import socket
from typing import Any, Callable

import torch

from ..config import TrainConfig
from .optimizer import build_optimizer
from .precision import Precision

__all__ = ["init_distributed", "build_engine", "engine_config", "compile_towers", "compiled_units", "eval_module"]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def init_distributed(backend: str | None = None) -> None:
    """Initialises torch.distributed through DeepSpeed (``backend``; default NCCL on GPUs, gloo on CPUs).

    Under a launcher (``deepspeed``, ``torchrun``) the environment names rank and world size; a
    plain ``python`` process (a benchmark, a one-rank run) becomes rank 0 of 1 on a free local port.
    """
    import deepspeed

    quiet_deepspeed()
    if torch.distributed.is_initialized():
        return
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "gloo":
        # DeepSpeed's CPU backend builds a shared-memory op at start: minutes of compilation on a
        # first run and two 66 MiB /dev/shm files per run that nothing removes. It serves only the
        # inference all-reduce; training collectives go through torch.distributed (gloo) anyway.
        # (by its module name: the package attribute `deepspeed.comm.torch` is the torch module itself)
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    if "RANK" not in os.environ and "WORLD_SIZE" not in os.environ:
        defaults = {
            "MASTER_ADDR": "127.0.0.1",
            "RANK": "0",
            "WORLD_SIZE": "1",
            "LOCAL_RANK": "0",
            "LOCAL_WORLD_SIZE": "1",
        }
        for key, value in defaults.items():
            os.environ.setdefault(key, value)
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    deepspeed.init_distributed(dist_backend=backend)


class _DropNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "untested optimizer" not in record.getMessage()


def quiet_deepspeed() -> None:
    """DeepSpeed logs warnings and errors only, and not its notice that ZeRO runs an "untested"
    client optimizer (SRAdamW is this recipe's own, tested here under ZeRO 0-3)."""
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
    if not any(isinstance(f, _DropNotice) for f in logger.filters):
        logger.addFilter(_DropNotice())


def build_engine(
    model: torch.nn.Module,
    cfg: TrainConfig,
    prec: Precision,
    ds_config: dict[str, Any],
    optimizer: torch.optim.Optimizer | None = None,
) -> tuple[Any, torch.optim.Optimizer, dict[str, int]]:
    """The DeepSpeed engine around ``model`` with SRAdamW as its client optimizer.

    ``ds_config`` is the config :func:`recipe.training.precision.resolve_precision` returned with ``prec``.
    On the recipe-managed routes (fp16, bf16 at ZeRO-0) the model is cast here and the recipe all-reduces gradients itself
    (see :mod:`recipe.training.precision`). ``optimizer`` replaces SRAdamW (the benchmarks' comparison arms);
    its groups need a ``name``. ``cfg.model.compile`` compiles the towers first (:func:`compile_towers`).

    Returns:
        ``(engine, optimizer, group_params)``: ``group_params`` counts the model parameters of each
        optimizer group by name (counted before ZeRO replaces the groups' tensors by partitions).
    """
    import deepspeed

    if prec.recipe_managed:  # the fp16 / bf16 ZeRO-0 routes (recipe.training.precision)
        model.to(prec.param_dtype)
    if cfg.model.compile:  # before deepspeed.initialize: ZeRO-3 registers its hooks there
        compile_towers(model, zero_stage=int(ds_config.get("zero_optimization", {}).get("stage", 0)))
    opt = optimizer if optimizer is not None else build_optimizer(model, cfg, prec)
    group_params = {g["name"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=engine_config(ds_config, world, opt))
    if prec.recipe_managed:
        engine.enable_backward_allreduce = False  # done by recipe.training.overlap (see recipe.training.precision)
    return engine, opt, group_params


def engine_config(ds_config: dict[str, Any], world_size: int, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The config handed to ``deepspeed.initialize``: ``ds_config`` with the settings the recipe chooses
    from the world size and the optimizer, in this one place (the JSON keeps precision, batch and stage):

    * ``bf16.check_grad_overflow`` off when the optimizer is SRAdamW with its gradient check: the train
      step (:mod:`recipe.training.step`) owns "finite or not, skip or stop", with SRAdamW's device-side check of
      the very gradients it applies; DeepSpeed's ZeRO-1/2 check was a second owner, with its own pass
      over every gradient, an all-reduce and a host read per step. A non-finite gradient still skips
      the step: DeepSpeed's clipping scales the gradients by 0 for a non-finite norm, which leaves
      inf/NaN entries NaN, and SRAdamW skips. (One case differs: all gradients finite in bf16 but
      beyond ~1e19, so that their fp32 norm overflows; DeepSpeed's check skipped that step, now it is
      a step with zero gradients.) Other optimizers (the benchmarks' comparison arms) keep DeepSpeed's
      check; ZeRO-3 and fp32 never used this setting.
    * One rank, ZeRO 1/2: ``zero_optimization.contiguous_gradients`` off unless the JSON sets it. With
      nothing to communicate, copying each gradient into a reduction bucket as backward produces it
      only adds a copy of every gradient (and the bucket's memory); the gradients are flattened once
      for the optimizer step either way. Results are bit for bit the same. Several ranks keep
      DeepSpeed's default (contiguous buckets overlap with the reduction).
    """
    cfg = copy.deepcopy(ds_config)
    from optim import SRAdamW

    bf16 = cfg.get("bf16", cfg.get("bfloat16"))
    if isinstance(bf16, dict) and bf16.get("enabled") and isinstance(optimizer, SRAdamW) and optimizer.check_finite:
        bf16["check_grad_overflow"] = False
    zero = cfg.get("zero_optimization")
    if world_size == 1 and isinstance(zero, dict) and int(zero.get("stage", 0)) in (1, 2):
        zero.setdefault("contiguous_gradients", False)
    return cfg


# --------------------------------------------------------------------------------------------------
# --compile
# --------------------------------------------------------------------------------------------------

#: ``torch.compile`` of each class's ``forward``, made once per class (Dynamo caches per code object).
_COMPILED_FORWARD: dict[type, Callable[..., Any]] = {}


class _CompiledForward:
    """A module's ``forward``: its class's ``forward`` through ``torch.compile`` in training mode, eager in
    evaluation mode. An object rather than a bound method, so that ``copy.deepcopy`` and pickle rebind
    it to the copy (a ``torch.compile`` wrapper of a bound method would keep calling the original)."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        cls = type(self.module)
        if not self.module.training:
            return cls.forward(self.module, *args, **kwargs)
        compiled = _COMPILED_FORWARD.get(cls)
        if compiled is None:
            compiled = _COMPILED_FORWARD[cls] = torch.compile(cls.forward, dynamic=False)
        return compiled(self.module, *args, **kwargs)


def _repeated_blocks(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost elements of ``ModuleList``/``Sequential`` containers whose elements all share one
    class from outside ``torch.nn`` and hold parameters: transformer layers, CNN stages."""
    found: list[torch.nn.Module] = []
    for child in module.children():
        kinds = {type(c) for c in child} if isinstance(child, (torch.nn.ModuleList, torch.nn.Sequential)) else set()
        if (len(kinds) == 1 and not next(iter(kinds)).__module__.startswith("torch.")
                and any(True for _ in child.parameters())):
            found.extend(child)
        else:
            found.extend(_repeated_blocks(child))
    return found


def compiled_units(model: torch.nn.Module, zero_stage: int) -> list[torch.nn.Module]:
    """The modules :func:`compile_towers` compiles: under ZeRO 0-2 the two towers (``model.visual``,
    ``model.text``), under ZeRO-3 the towers' repeated blocks (see there)."""
    towers = [model.visual, model.text]
    if zero_stage < 3:
        return towers
    units = []
    for tower in towers:
        blocks = _repeated_blocks(tower)
        if not blocks:
            raise ValueError(f"--compile under ZeRO-3 compiles the towers' repeated blocks, and the "
                             f"{type(tower).__name__} has none (a list of blocks of one class)")
        units += blocks
    return units


def compile_towers(model: torch.nn.Module, zero_stage: int = 0) -> list[torch.nn.Module]:
    """``--compile``: ``torch.compile`` of both towers, in place; call it before ``deepspeed.initialize``.

    Each compiled module gets, as its own ``forward``, the class's ``forward`` through ``torch.compile``
    in training mode (evaluation stays eager: no compilation for evaluation batch shapes, and the same
    numbers as an uncompiled model). The module tree, and so every parameter name, state dict,
    checkpoint and export, is unchanged: no ``torch.compile(model)`` wrapper with its ``_orig_mod.``
    prefix. Module hooks (DeepSpeed's among them) run outside the compiled code, around ``forward``.

    Under ZeRO 0-2 the compiled units are the two towers whole. ZeRO-3 gathers and releases the weights
    of every submodule through hooks inside the towers, which compiled code neither runs in order nor
    traces (a tower whose inputs need no gradient also releases its weights before its own backward);
    there the units are the towers' repeated blocks (transformer layers, CNN stages: regional
    compilation, one compiled graph per block class and shape), each made a ZeRO-3 leaf module
    (``deepspeed.utils.set_z3_leaf_module``): its hooks gather the block's weights before its compiled
    forward and release them after its backward. Weights live one block at a time, as before.

    Graphs are static (``dynamic=False``): training shapes do not change from step to step, and the
    stages of a CNN differ in shape (symbolic shapes failed in Inductor on ConvNeXt stages). The first
    step compiles a graph with and one without autograd (the global contrastive batch's first forward
    runs without); later steps reuse them.

    Returns:
        The compiled modules (:func:`compiled_units`).

    Raises:
        ValueError: ZeRO-3 after ``deepspeed.initialize`` (its hooks are in place), or a tower without
            repeated blocks under ZeRO-3.
    """
    units = compiled_units(model, zero_stage)
    if zero_stage >= 3:
        if any(hasattr(p, "ds_id") for p in model.parameters()):
            raise ValueError("compile_towers under ZeRO-3 must run before deepspeed.initialize")
        from deepspeed.utils import set_z3_leaf_module

        for unit in units:
            set_z3_leaf_module(unit, True)
    for unit in units:
        if "forward" not in vars(unit):  # idempotent; a module that has its own forward already is left as is
            unit.forward = _CompiledForward(unit)
    return units


def eval_module(engine: Any, tokenizer: Any) -> torch.nn.Module:
    """The module to evaluate: the engine's own, or under ZeRO-3 a gathered full copy.

    ZeRO-3 partitions the weights and its hooks re-partition them after every module call, while
    e.g. transformers reads a weight's shape outside the module that owns it: evaluation runs on a
    gathered copy instead (the full model on every rank, for the duration of the evaluation).
    """
    model = engine.module
    if engine.zero_optimization_stage() != 3:
        return model
    import deepspeed

    from ..model.clip import create_model

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtype, device = weights["logit_scale"].dtype, weights["logit_scale"].device
    copy = create_model(config=model.config, tokenizer=tokenizer, text_load_weights=False).to(
        device=device, dtype=dtype
    )
    copy.load_state_dict(weights)
    return copy
