"""The interface every arm implements: built once per process, then one training step per call."""

from __future__ import annotations

import torch

from _common import TextSpec  # noqa: E402  (the benchmarks' shared module; puts the repository on sys.path)

__all__ = ["Runner"]


class Runner:
    """One arm in one process: ``step(inputs) -> loss``; inputs are on the device."""

    name = "runner"
    description = ""
    text: TextSpec
    image_size: int
    params: int

    def step(self, inputs: dict[str, torch.Tensor]) -> float:
        raise NotImplementedError

