"""``python -m recipe.plan --preset ViT-B-32 --gpus 8 --gpu-memory 80GiB --global-batch 32768``."""

import sys

from .cli import main

sys.exit(main())
