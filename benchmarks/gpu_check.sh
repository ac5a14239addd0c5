#!/usr/bin/env bash
# Every measurement that needs a GPU, in one command, within 8 minutes on one CUDA GPU (H100/H200),
# with a GOALS summary at the end.
#
#   bash benchmarks/gpu_check.sh                  # all default steps: optim loss train memory tests
#   bash benchmarks/gpu_check.sh tests optim loss # some steps only (env and goals always run)
#   bash benchmarks/gpu_check.sh compile accum    # opt-in steps (not in the default run, nor in its budget)
#   bash benchmarks/gpu_check.sh --dry-run [STEPS] # print the steps, their limits and commands; run nothing
#
# Steps (key, time limit; each runs under `timeout`: SIGINT at the limit, so pytest still prints its
# summary and a benchmark its partial output, SIGKILL 4 s later; limits sum to 450 s, 478 s with the
# grace periods):
#   env      20 s  env.json: device, memory, driver, library versions, date, git commit (GIT_COMMIT= overrides)
#   optim    75 s  bench_optim: 1.07 B-parameter layout (64 x 2^24) and ViT-B-32 shapes; torch fused AdamW
#                  fp32/bf16, SRAdamW fused (with and without check_finite), torchao, optimi
#                  (the PyTorch-path SRAdamW rows, the CPU reference, are excluded)
#   loss     85 s  bench_loss: B = 32k/64k/131k, D = 1024, bf16; open_clip ClipLoss, chunked, fused
#   train   100 s  bench_train: ViT-B-32, batch 512, recipe (fused loss) vs OpenCLIP, no checkpointing
#   memory   40 s  bench_memory: ViT-B-32 bytes per parameter, recipe ZeRO-2 vs DeepSpeed standard bf16
#   tests   120 s  pytest -m gpu
#   goals    10 s  gpu_goals.py: PASS / FAIL / MISSING per goal, printed and written to goals.md
# Opt-in (named only):
#   compile 150 s  bench_train with --compile (issue 16)
#   accum   120 s  bench_train, recipe at accumulation 4 (the embedding cache's cost, issue 14)
#   zero0   140 s  bf16 at ZeRO-0 (ds_configs/zero0_bf16_sr.json: no ZeRO partition copy at one GPU):
#                  bench_train as `train` vs OpenCLIP, then bench_memory's census of that mode
#   verify   90 s  bash launch.sh verify on this GPU: fused loss and Triton optimizer kernel vs their
#                  references, NCCL all-gather/reduce-scatter, free memory vs recipe.plan (issue 18)
#
# A missing competitor package (open_clip, torchao, optimi) is reported by its benchmark, not fatal.
# Results: ONE folder, $OUT/gpu_<UTC date>_<host>/ when $OUT is set (the device tool), else
# benchmarks/results/gpu_<UTC date>_<host>/ (GPU_CHECK_RESULTS= overrides): env.json, the benchmarks'
# JSON and their output (*.md / *.log), tests.xml, gpu_check.log, goals.md. A failing step does not
# stop the others; the exit status is the number of failed steps (1 without a CUDA device).
#
# On the project's lent GPU machine (no deepspeed/datasets/open_clip there): run
# `bash ../shared/device/wheels.sh` here once, then the device call with carry [".whl"] and the
# command `bash benchmarks/gpu_check.sh`; the script installs .whl/*.whl into /tmp/site first.
# Record the figures in benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

ALL_STEPS=(optim loss train memory tests compile accum zero0 verify)
DEFAULT_STEPS=(optim loss train memory tests)
if [ "${1:-}" = "-h" ] || [ "${1:-}" = "--help" ]; then
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'
  exit 0
fi
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
for k in "$@"; do
  case " ${ALL_STEPS[*]} " in
    *" $k "*) ;;
    *) echo "gpu_check: unknown step '$k' (steps: ${ALL_STEPS[*]})" >&2; exit 2 ;;
  esac
done
if [ $# -gt 0 ]; then SELECTED=("$@"); else SELECTED=("${DEFAULT_STEPS[@]}"); fi

if [ "$DRY" = 1 ]; then :
elif ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || { echo "installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
if [ "$DRY" = 0 ] && ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False, or torch does not import): nothing to measure" >&2
  exit 1
fi

host=$(hostname -s 2>/dev/null || hostname)
stamp=$(date -u +%Y%m%d-%H%M%S)
if [ -n "${GPU_CHECK_RESULTS:-}" ]; then RES=$GPU_CHECK_RESULTS
elif [ -n "${OUT:-}" ]; then RES=$OUT/gpu_${stamp}_${host//[^A-Za-z0-9_.-]/_}
else RES=benchmarks/results/gpu_${stamp}_${host//[^A-Za-z0-9_.-]/_}
fi
if [ "$DRY" = 1 ]; then log=/dev/null; else mkdir -p "$RES" || exit 1; log=$RES/gpu_check.log; fi
echo "gpu_check: steps ${SELECTED[*]}; results in $RES" | tee "$log"
total=0

failed=0
wanted() { local k; for k in "${SELECTED[@]}"; do [ "$k" = "$1" ] && return 0; done; return 1; }
step() {  # step KEY SECONDS OUTPUT_FILE DESCRIPTION COMMAND...
  local key=$1 limit=$2 out=$3 what=$4
  shift 4
  if [ "$key" != env ] && [ "$key" != goals ] && ! wanted "$key"; then return 0; fi
  total=$((total + limit))
  if [ "$DRY" = 1 ]; then printf '%-8s %4d s  %s\n        ' "$key" "$limit" "$what"; printf ' %q' "$@"; echo; return 0; fi
  echo "=== $what ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after=4 "$limit" "$@" 2>&1 | tee "$RES/$out" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $what: exit $rc after $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo ' (time limit)')" | tee -a "$log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
}

loss_json=()
if grep -q -- '"--json"' benchmarks/bench_loss.py; then loss_json=(--json "$RES/bench_loss.json"); fi

step env 20 env.log "environment" "$PY" benchmarks/gpu_goals.py env "$RES"
step optim 75 bench_optim.md "optimizer step, 1.07 B params and ViT-B-32 (issue 6)" \
  "$PY" benchmarks/bench_optim.py --device cuda --layout gpu-1b,vit-b-32 --exclude "PyTorch path" \
  --json "$RES/bench_optim.json"
step loss 85 bench_loss.md "contrastive loss, D=1024 bf16, B=32k..131k (issues 3, 7)" \
  "$PY" benchmarks/bench_loss.py --device cuda --batch 32768 65536 131072 --dim 1024 --dtype bfloat16 \
  --impls chunked fused open_clip --repeats 5 --time-budget-s 3 ${loss_json[@]+"${loss_json[@]}"}
step train 100 bench_train.md "ViT-B-32 train step at batch 512 vs OpenCLIP (issue 8)" \
  "$PY" benchmarks/bench_train.py --device cuda --batch 512 --fit none --ckpt off --loss-modes fused \
  --steps 10 --warmup 3 --json "$RES/bench_train.json"
step memory 40 bench_memory.md "memory census, ViT-B-32" \
  "$PY" benchmarks/bench_memory.py --device cuda --world 1 --preset ViT-B-32 --batch 64 \
  --modes zero2_bf16_halfmaster zero2_bf16_standard --json "$RES/bench_memory.json"
step tests 120 tests.log "GPU tests" \
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=10 --junitxml "$RES/tests.xml" tests
step compile 150 bench_train_compile.md "train step with --compile (issue 16, opt-in)" \
  "$PY" benchmarks/bench_train.py --device cuda --fit none --ckpt off --steps 5 --warmup 3 --no-baseline --compile \
  --json "$RES/bench_train_compile.json"
step accum 120 bench_train_accum.md "train step at accumulation 4 (issue 14, opt-in)" \
  "$PY" benchmarks/bench_train.py --device cuda --batch 512 --fit none --ckpt off --loss-modes fused --no-baseline \
  --accumulation 4 --steps 5 --warmup 2 --json "$RES/bench_train_accum.json"
step zero0 140 bench_train_zero0.md "bf16 at ZeRO-0: train step vs OpenCLIP, memory census (opt-in)" \
  bash -c '"$1" benchmarks/bench_train.py --device cuda --batch 512 --fit none --ckpt off --loss-modes fused \
    --ds-config ds_configs/zero0_bf16_sr.json --steps 10 --warmup 3 --json "$2/bench_train_zero0.json" &&
  "$1" benchmarks/bench_memory.py --device cuda --world 1 --preset ViT-B-32 --batch 64 --modes zero0_bf16_sr \
    --json "$2/bench_memory_zero0.json"' _ "$PY" "$RES"
step verify 90 verify.log "preflight on this GPU (issue 18, opt-in)" \
  env NUM_GPUS=1 bash launch.sh verify --preset ViT-B-32 --loss-mode fused --micro-batch 512 --world-size 1
step goals 10 goals.log "GOALS" "$PY" benchmarks/gpu_goals.py goals "$RES"
echo "gpu_check: $failed step(s) failed; time limits of the steps run: $total s; results in $RES" | tee -a "$log"
exit "$failed"
