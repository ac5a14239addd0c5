"""The train step and what it needs: ``step`` (one optimizer step: forward, backward, step, skip-or-stop),
``passes`` (its forward/backward passes), ``engine`` (process group, DeepSpeed engine, the module to evaluate),
``precision`` (precision routes, fp16 loss scaling), ``optimizer`` + ``param_groups`` (SRAdamW over the CLIP
paper's groups, the learning-rate schedule), ``ema`` (the EMA of the weights), ``numerics`` (sampled SR
telemetry), ``memory`` (bytes per parameter), ``batchnorm`` (BatchNorm statistics averaged over the ranks) and
``distributed`` (rank, world and the small collectives).

Kept free of imports: each module is imported by its own name (``from recipe.training.step import train_step``).
"""
