"""The parts of ``benchmarks/bench_train.py`` (the command line and its documentation live there).

* :mod:`.settings`: what to measure (:class:`BenchSettings`), the arms that can run, a worker's spec;
* :mod:`.runner`: the interface of an arm (:class:`Runner`);
* :mod:`.recipe_arm`: the recipe's arm, stepped by the recipe's own :func:`recipe.training.step.train_step`;
* :mod:`.openclip_arm`: the OpenCLIP baseline (or ``torch-amp`` without ``open_clip``);
* :mod:`.worker`: one arm measured in its own process, and the parent's side that starts it;
* :mod:`.sweep`: every arm and setting, with the largest-batch search;
* :mod:`.breakdown`: ``--breakdown``, per-phase times of one step;
* :mod:`.report`: the markdown tables and log lines.

The modules import ``_common`` (``benchmarks/`` is on ``sys.path`` when ``bench_train.py`` runs, and
the tests put it there), which puts the repository on ``sys.path`` for ``recipe``.
"""
