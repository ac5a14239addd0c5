"""Preflight of a run on its cluster: ``python -m recipe.verify`` (or ``bash launch.sh verify``).

On every rank, in this order (``--skip`` takes the names), each in its own module:

* ``memory`` (:mod:`.check_memory`): free memory per rank against the planner's predicted peak
  (:func:`recipe.plan.predict_memory`) for the run's model, DeepSpeed JSON, micro-batch and world size;
* ``comm`` (:mod:`.check_comm`): all-gather and reduce-scatter of a few sizes, results checked exactly,
  algorithm and bus bandwidth of the slowest rank;
* ``loss`` (:mod:`.check_loss`): the sharded losses (every mode the device runs) at the real world
  size against a float64 full-batch reference, with tolerances by dtype;
* ``optimizer`` (:mod:`.check_optim`): SRAdamW's default implementation on the device (fused Triton
  kernel on CUDA, compiled loop on the CPU) against the eager reference definition, bit for bit, on
  each dtype route the run uses.

Rank 0 prints one screen (:mod:`.cli`); every rank exits 1 when any check failed on any rank.
"""

from .cli import VerifyConfig, main
from .common import CHECKS, Row, Run

__all__ = ["CHECKS", "Row", "Run", "VerifyConfig", "main"]
