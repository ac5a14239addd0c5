"""A run's files and how it ends: ``checkpoint`` (saves, loads; ``files``: the marker, the error, one file's
read), ``elastic`` (resume on another number of ranks), ``resume`` + ``regroup`` (resume with changed settings),
``rundir`` (the run directory, its guard and lock), ``metrics`` (metrics.jsonl, TensorBoard, progress),
``preempt`` (stopping cleanly on a signal) and ``outcome`` (how each rank ended; ``python -m recipe.run.outcome``).

Kept free of imports so that ``recipe.run.outcome`` and ``recipe.run.preempt`` stay light.
"""
