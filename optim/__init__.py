"""Stochastic-rounding AdamW for half-precision weights and statistics.

Imports torch only (Triton lazily, for the fused GPU kernel), never ``recipe`` or ``deepspeed``::

    from optim import SRAdamW, stochastic_round
"""

from .functional import sradamw_update_
from .rounding import derive_key, random_bits, stochastic_round
from .sradamw import SRAdamW

__all__ = ["SRAdamW", "stochastic_round", "sradamw_update_", "random_bits", "derive_key"]
