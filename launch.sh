#!/usr/bin/env bash
# Entry point of the recipe. Example:
#   bash launch.sh                 # no arguments: the stochastic-rounding optimizer demo
#   bash launch.sh --steps 3000    # arguments pass through
set -euo pipefail
cd "$(dirname "$0")"
exec python -m optim "$@"
