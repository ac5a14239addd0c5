"""DeepSpeed engine setup shared by the training loop and the benchmarks: process group, engine
with the recipe's optimizer and precision route, and a module to evaluate under any ZeRO stage."""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

import torch

from .config import TrainConfig
from .optimizer import build_optimizer
from .precision import Precision

__all__ = ["init_distributed", "build_engine", "eval_module"]


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

    ``ds_config`` is the config :func:`recipe.precision.resolve_precision` returned with ``prec``.
    On the fp16 route the model is cast to fp16 here and the recipe all-reduces gradients itself
    (see :mod:`recipe.precision`). ``optimizer`` replaces SRAdamW (the benchmarks' comparison arms);
    its groups need a ``name``.

    Returns:
        ``(engine, optimizer, group_params)``: ``group_params`` counts the model parameters of each
        optimizer group by name (counted before ZeRO replaces the groups' tensors by partitions).
    """
    import deepspeed

    if prec.mode == "fp16":
        model.half()
    opt = optimizer if optimizer is not None else build_optimizer(model, cfg, prec)
    group_params = {g["name"]: sum(p.numel() for p in g["params"]) for g in opt.param_groups}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if prec.mode == "fp16":
        engine.enable_backward_allreduce = False  # done by allreduce_gradients (see recipe.precision)
    return engine, opt, group_params


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

    from .model import create_model

    with deepspeed.zero.GatheredParameters(list(model.parameters())):
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    dtype, device = weights["logit_scale"].dtype, weights["logit_scale"].device
    copy = create_model(config=model.config, tokenizer=tokenizer, text_load_weights=False).to(
        device=device, dtype=dtype
    )
    copy.load_state_dict(weights)
    return copy
