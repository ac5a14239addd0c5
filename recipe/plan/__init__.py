"""Batch and memory planner: which micro-batch, accumulation, gradient checkpointing, ZeRO stage and
precision route fit a GPU, predicted from the same census ``benchmarks/bench_memory.py`` measures.

Python API (``recipe.verify`` compares free device memory against a :class:`Plan`)::

    from recipe.plan import plan, predict_memory, run_tokenizer, ModelSpec
    p = plan("ViT-B-32", gpus=8, gpu_memory="80GiB", global_batch=32768)
    p.micro_batch, p.accumulation, p.checkpointing, p.zero_stage, p.total_bytes_per_gpu, p.launch_command
    m = predict_memory(ModelSpec("tiny"), "zero2_bf16_halfmaster.json", world=2, micro_batch=8)
    # the vocabulary a run trains on these captions (a ModelSpec without a tokenizer keeps the tower's own)
    spec = ModelSpec("tiny", tokenizer=run_tokenizer("data/synthetic/train.csv"))

Modules: :mod:`.states` (model states per ZeRO stage and route), :mod:`.activations` (saved-tensor
accounting), :mod:`.vocab` (the run's tokenizer: the vocabulary the text tower gets), :mod:`.search`
(prediction and search), :mod:`.cli` (``python -m recipe.plan``).
"""

from .search import (
    MemoryPrediction,
    Plan,
    PlanError,
    ds_configs,
    parse_memory,
    plan,
    predict_memory,
)
from .states import ModelSpec
from .vocab import TokenizerShape, run_tokenizer

__all__ = ["MemoryPrediction", "ModelSpec", "Plan", "PlanError", "TokenizerShape", "ds_configs", "parse_memory", "plan",
           "predict_memory", "run_tokenizer"]
