"""Silencing library chatter that says nothing about a run, for the command-line entry points."""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_libraries"]


def quiet_libraries() -> None:
    """Call before DeepSpeed (and with it torchao) is imported: their deprecation notices and enum
    registrations are not about the user's run."""
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):  # DeepSpeed's ZeRO calls these
        warnings.filterwarnings("ignore", message=rf".*{op}.* is deprecated", category=FutureWarning)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)  # torchao's enum registration
    # torch.compile on a CPU-only machine (--compile): "No CUDA runtime is
    # found, using CUDA_HOME=..." when Inductor builds its C++ code; nothing the run can act on
    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
