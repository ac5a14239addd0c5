"""Tests of the standalone ``optim`` package (stochastic rounding, SRAdamW, the fused kernel)."""
