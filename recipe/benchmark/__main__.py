"""``python -m recipe.benchmark eval ...``: CLIP_benchmark's command line with ``--model_type recipe``
(:mod:`recipe.benchmark.loader`)."""

import sys

from .loader import main

if __name__ == "__main__":
    sys.exit(main())
