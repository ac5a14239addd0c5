#!/usr/bin/env bash
# Every measurement that needs a GPU, in one command (one H200: about 10 minutes of the device's time).
#
#   bash benchmarks/gpu_check.sh                 # on a machine with CUDA and the project installed
#   bash benchmarks/gpu_check.sh tests optim loss   # some steps only (the device tool allows 10 minutes
#   bash benchmarks/gpu_check.sh train compile memory   # a call: two calls like these cover everything)
#
# On the project's lent GPU machine (no deepspeed/datasets/open_clip there): run
# `bash ../shared/device/wheels.sh` here once, then the device call with carry [".whl"] and the
# command `bash benchmarks/gpu_check.sh`; the script installs .whl/*.whl into /tmp/site first.
# Results: benchmarks/results/*_cuda*.json (+ the markdown tables) and, when $OUT is set (the device
# tool), a copy there with the full log. Each step has its own time limit and a failing step does
# not stop the others; the exit code is the number of failed steps. Record the figures in
# benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else "no CUDA device: nothing to measure")' \
  || exit 1
log=${OUT:-benchmarks/results}/gpu_check.log
mkdir -p "$(dirname "$log")" benchmarks/results
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$log"
failed=0
SELECTED=("$@")  # step keys to run (none: all)
wanted() { local k; for k in "${SELECTED[@]}"; do [ "$k" = "$1" ] && return 0; done; return 1; }
step() {  # step KEY SECONDS DESCRIPTION COMMAND...
  local key=$1 limit=$2 what=$3
  shift 3
  if [ ${#SELECTED[@]} -gt 0 ] && ! wanted "$key"; then return 0; fi
  echo "=== $what ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $what: exit $rc after $((SECONDS - t0)) s" | tee -a "$log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}
step tests 150 "GPU tests" python3 -m pytest -q -m gpu -p no:cacheprovider tests
step optim 120 "optimizer step (issue 6)" python3 benchmarks/bench_optim.py --layout gpu-1b,vit-b-32
step loss 120 "contrastive loss (issues 3, 7)" python3 benchmarks/bench_loss.py --device cuda
step train 150 "train step vs OpenCLIP, accumulation 1 vs 4 (issues 8, 14)" \
  python3 benchmarks/bench_train.py --device cuda --fit none --ckpt off --steps 5 --warmup 2 --accumulation 1 4
step compile 150 "train step with --compile (issue 16)" \
  python3 benchmarks/bench_train.py --device cuda --fit none --ckpt off --steps 5 --warmup 3 --no-baseline --compile \
  --json benchmarks/results/bench_train_cuda_compile.json
step memory 90 "memory census (ViT-B-32)" \
  python3 benchmarks/bench_memory.py --device cuda --world 1 --preset ViT-B-32 --batch 64
if [ -n "${OUT:-}" ]; then cp benchmarks/results/*cuda* "$OUT"/ 2>/dev/null; fi
echo "gpu_check: $failed step(s) failed" | tee -a "$log"
exit "$failed"
