#!/usr/bin/env bash
# Every measurement that needs a GPU, in one command, within 8 minutes on one CUDA GPU (H100/H200),
# with a GOALS summary at the end, and its results as at most 8 files.
#
#   bash benchmarks/gpu_check.sh                   # the default run: optim loss train memory tests
#   bash benchmarks/gpu_check.sh tests optim loss  # some steps only (setup, env, goals and pack always run)
#   bash benchmarks/gpu_check.sh numerics zero0    # opt-in steps (not in the default run, nor in its budget)
#   bash benchmarks/gpu_check.sh --dry-run [STEPS] # print the plan (steps, limits, commands), its total time
#                                                  # budget and the files it returns; run nothing
#
# The plan (key, time limit). Each step runs under `timeout`: SIGINT at its limit (pytest still prints
# its summary, a benchmark its partial output), SIGKILL 2 s later (KILL_AFTER). The budget of a run is
# the sum of its steps' limits plus KILL_AFTER per step; the default run's is 473 s <= 480 s (8 min),
# checked by tests/benchmarks/test_gpu_check.py on the dry run.
#   setup      40 s  install .whl/*.whl into /tmp/site (30 s; the GPU machine lacks deepspeed, datasets,
#                    open_clip, torchao, optimi; see below), then check that torch sees CUDA (8 s);
#                    counted in every run's budget
#   env        12 s  env.json: device, memory, driver, library versions, date, git commit (GIT_COMMIT= overrides)
#   optim      65 s  bench_optim: 1.07 B-parameter layout (64 x 2^24) and ViT-B-32 shapes; torch fused AdamW
#                    fp32/bf16, SRAdamW fused (with and without check_finite), torchao, optimi
#                    (the PyTorch-path SRAdamW rows, the CPU reference, are excluded)
#   loss       62 s  bench_loss: B = 32k/64k/131k, D = 1024, bf16; open_clip ClipLoss, chunked, fused
#   train      80 s  bench_train: ViT-B-32, batch 512, recipe (fused loss, default route) vs OpenCLIP, no checkpointing
#   memory     33 s  bench_memory: ViT-B-32 bytes per parameter, recipe default (ZeRO-0) vs DeepSpeed standard bf16
#   tests     150 s  pytest -m gpu (kernel tests first: tests/conftest.py orders them)
#   goals       8 s  gpu_goals.py: PASS / FAIL / MISSING per goal, printed and written to goals.md
#   pack        5 s  everything into one archive; see "Results"
# Opt-in (named only; each adds its limit to the run's budget):
#   compile   150 s  bench_train with --compile (issue 16)
#   accum     120 s  bench_train, recipe at accumulation 4 (the embedding cache's cost, issue 14)
#   zero0     140 s  bf16 at ZeRO-0 (ds_configs/zero0_bf16_sr.json: no ZeRO partition copy at one GPU):
#                    bench_train as `train` vs OpenCLIP, then bench_memory's census of that mode
#   verify     90 s  bash launch.sh verify on this GPU: fused loss and Triton optimizer kernel vs their
#                    references, NCCL all-gather/reduce-scatter, free memory vs recipe.plan (issue 18)
#   hosttime   45 s  bench_optim --host: SRAdamW's host time per step, launches recorded (issue 27.1)
#   routes     90 s  bench_train --routes: ViT-B-32 train step per DeepSpeed route / ZeRO-0 (issue 27.3)
#   data      170 s  bench_data --train-step: ViT-B-32 batch 512 on loader batches (14 workers; decoded on the
#                    CPU, and with --decode-device cuda) vs synthetic inputs, goal >= 0.9x (issue 27.5)
#   numerics  240 s  numerics_routes.py: ViT-B-32 on synthetic batches, same seed and batches, three arms
#                    (default SR route, all-SR, DeepSpeed standard bf16 with fp32 masters): loss curves
#                    in one figure (numerics_routes.png) and their JSON
#
# Results: ONE folder, $OUT/gpu_<UTC date>_<host>/ when $OUT is set (the device tool), else
# benchmarks/results/gpu_<UTC date>_<host>/ (GPU_CHECK_RESULTS= overrides). The steps write their files
# there (env.json, the benchmarks' JSON and output *.md / *.log, tests.xml, gpu_check.log, goals.md);
# the `pack` step puts all of them into gpu_check_results.tar.gz and, when $OUT is set, deletes every
# file but the archive and RETURN_FILES (gpu_check.log, goals.md, env.json, tests.log,
# numerics_routes.png: those of the steps run), so that at most 6 files come back (the device tool
# returns 8). An interrupted run (SIGINT/SIGTERM to this script) still packs what it has. A failing
# step does not stop the others; the exit status is the number of failed steps (1 without a CUDA device).
#
# Adding a step (e.g. the optimizer's host time, a ZeRO-2 / ZeRO-0 train-step ratio: see the marked
# places below):
#   1. its key in ALL_STEPS; in DEFAULT_STEPS only if the default budget stays <= 480 s (the test fails
#      otherwise: then lower other limits, or keep it opt-in);
#   2. one line `step KEY LIMIT OUTPUT DESCRIPTION COMMAND...` in the plan below, in run order, the
#      command writing any further files into "$RES" (they go into the archive);
#   3. a file that must come back on its own (not only in the archive): add it to RETURN_FILES
#      (at most 8 files in all, archive included: the test checks the dry run);
#   4. a line for it in the plan table above; then `bash benchmarks/gpu_check.sh --dry-run` and
#      `python -m pytest -q tests/benchmarks/test_gpu_check.py`.
#
# On the project's lent GPU machine (no deepspeed/datasets/open_clip there): run
# `bash ../shared/device/wheels.sh` here once, then the device call with carry [".whl"] and the
# command `bash benchmarks/gpu_check.sh`; the `setup` step installs .whl/*.whl into /tmp/site.
# Record the figures in benchmarks/RESULTS.md.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
PY=${PYTHON:-python3}

KILL_AFTER=2          # seconds between a step's SIGINT and its SIGKILL
BUDGET_LIMIT_S=480    # what the default run must fit (8 minutes)
ALL_STEPS=(optim loss train memory tests compile accum zero0 verify numerics hosttime routes data)
DEFAULT_STEPS=(optim loss train memory tests)
ALWAYS_STEPS=(setup env goals pack)
ARCHIVE=gpu_check_results.tar.gz
# files that come back on their own besides the archive, each with the step that writes it ("-": always)
RETURN_FILES=("gpu_check.log:-" "goals.md:-" "env.json:-" "tests.log:tests" "numerics_routes.png:numerics")

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

wanted() { local k; for k in "${ALWAYS_STEPS[@]}" "${SELECTED[@]}"; do [ "$k" = "$1" ] && return 0; done; return 1; }
returned() {  # the names of the files that come back on their own, archive included
  local entry
  for entry in "${RETURN_FILES[@]}"; do
    if [ "${entry#*:}" = "-" ] || wanted "${entry#*:}"; then echo "${entry%%:*}"; fi
  done
  echo "$ARCHIVE"
}

host=$(hostname -s 2>/dev/null || hostname)
stamp=$(date -u +%Y%m%d-%H%M%S)
if [ -n "${GPU_CHECK_RESULTS:-}" ]; then RES=$GPU_CHECK_RESULTS
elif [ -n "${OUT:-}" ]; then RES=$OUT/gpu_${stamp}_${host//[^A-Za-z0-9_.-]/_}
else RES=benchmarks/results/gpu_${stamp}_${host//[^A-Za-z0-9_.-]/_}
fi
if [ "$DRY" = 1 ]; then log=/dev/null; else mkdir -p "$RES" || exit 1; log=$RES/gpu_check.log; fi
echo "gpu_check: steps ${SELECTED[*]}; results in $RES" | tee "$log"

total=0
nsteps=0
failed=0
plan() {  # plan KEY SECONDS DESCRIPTION COMMAND...: counts the step in the budget; in a dry run prints it
  local key=$1 limit=$2 what=$3
  shift 3
  total=$((total + limit + KILL_AFTER))
  nsteps=$((nsteps + 1))
  if [ "$DRY" = 1 ]; then printf '%-9s %4d s  %s\n          ' "$key" "$limit" "$what"; printf ' %q' "$@"; echo; fi
}
step() {  # step KEY SECONDS OUTPUT_FILE DESCRIPTION COMMAND...
  local key=$1 limit=$2 out=$3 what=$4
  shift 4
  wanted "$key" || return 0
  plan "$key" "$limit" "$what" "$@"
  [ "$DRY" = 1 ] && return 0
  echo "=== $what ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$log"
  local t0=$SECONDS
  timeout --signal=INT --kill-after="$KILL_AFTER" "$limit" "$@" 2>&1 | tee "$RES/$out" | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  echo "=== $what: exit $rc after $((SECONDS - t0)) s$([ "$rc" -eq 124 ] && echo ' (time limit)')" | tee -a "$log"
  [ "$rc" -eq 0 ] || failed=$((failed + 1))
  return 0
}

packed=0
pack() {  # everything into the archive; under $OUT only RETURN_FILES and the archive stay
  [ "$DRY" = 1 ] && return 0
  [ "$packed" = 1 ] && return 0
  packed=1
  local keep name
  keep=$(returned)
  echo "=== pack: $RES/$ARCHIVE ($(date -u +%H:%M:%S))" | tee -a "$log"
  # the partial archive is written beside the folder, not in it: a file growing inside the folder tar
  # reads makes it report "file changed as we read it" (exit 1) when the folder's ctime moves under it
  timeout --kill-after="$KILL_AFTER" 5 tar -czf "$RES.$ARCHIVE.part" -C "$RES" --exclude "./$ARCHIVE" . \
    && mv "$RES.$ARCHIVE.part" "$RES/$ARCHIVE" || { rm -f -- "$RES.$ARCHIVE.part"
    echo "gpu_check: packing failed: the files stay as they are" | tee -a "$log"; failed=$((failed + 1)); return 0; }
  if [ -n "${OUT:-}" ] && [ -z "${GPU_CHECK_RESULTS:-}" ]; then
    while IFS= read -r -d '' name; do
      grep -qxF "${name#"$RES"/}" <<<"$keep" || rm -rf -- "$name"
    done < <(find "$RES" -mindepth 1 -maxdepth 1 -print0)
  fi
  echo "gpu_check: returned: $(echo $keep) in $RES (everything in $ARCHIVE)" | tee -a "$log"
}
interrupted() {
  echo "gpu_check: interrupted; packing what there is" | tee -a "$log"
  pack
  exit 130
}
[ "$DRY" = 1 ] || trap interrupted INT TERM

# ----------------------------------------------------------------------------------------------
# setup: wheels the GPU machine lacks
# ----------------------------------------------------------------------------------------------
plan setup 40 "install .whl/*.whl into /tmp/site when there are wheels (30 s), then: does torch see CUDA? (8 s)" \
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site '.whl/*.whl'
if [ "$DRY" = 0 ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "=== setup: installing .whl/*.whl into /tmp/site ($(date -u +%H:%M:%S), limit 30s)" | tee -a "$log"
  timeout --kill-after="$KILL_AFTER" 30 "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .whl/*.whl 2>&1 | tee -a "$log"
  [ "${PIPESTATUS[0]}" -eq 0 ] || { echo "installing .whl/*.whl failed" | tee -a "$log" >&2; pack; exit 1; }
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
fi
if [ "$DRY" = 0 ] && ! timeout --kill-after="$KILL_AFTER" 8 "$PY" -c \
    'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_check: no CUDA device (torch.cuda.is_available() is False, or torch does not import): nothing to measure" \
    | tee -a "$log" >&2
  pack
  exit 1
fi

# SRAdamW's plan walk (optim/csrc/plan_host.cpp) is built once per machine and torch on first use (10-20 s):
# build it now in a process of its own, beside the next steps, so that no timed step pays it (a step that
# needs it first waits for the same cached file; the build log comes back in the archive)
if [ "$DRY" = 0 ]; then
  ( timeout --kill-after="$KILL_AFTER" 120 "$PY" -c \
      'from optim import _host; ok = _host.wait(); print("plan walk:", "C++" if ok else _host.unavailable_reason())' \
      > "$RES/plan_host_build.log" 2>&1 & )
fi

loss_json=()
if grep -q -- '"--json"' benchmarks/bench_loss.py; then loss_json=(--json "$RES/bench_loss.json"); fi

# ----------------------------------------------------------------------------------------------
# the plan, in run order
# ----------------------------------------------------------------------------------------------
step env 12 env.log "environment" "$PY" benchmarks/gpu_goals.py env "$RES"
step optim 65 bench_optim.md "optimizer step, 1.07 B params and ViT-B-32 (issue 6)" \
  "$PY" benchmarks/bench_optim.py --device cuda --layout gpu-1b,vit-b-32 --exclude "PyTorch path" \
  --json "$RES/bench_optim.json"
step hosttime 45 bench_optim_host.md "SRAdamW host time per step, launches recorded (issue 27.1, opt-in)" \
  "$PY" benchmarks/bench_optim.py --host --json "$RES/bench_optim_host.json"
step loss 62 bench_loss.md "contrastive loss, D=1024 bf16, B=32k..131k (issues 3, 7)" \
  "$PY" benchmarks/bench_loss.py --device cuda --batch 32768 65536 131072 --dim 1024 --dtype bfloat16 \
  --impls chunked fused open_clip --fused-tiles 128x64x64w8s3b1024 --repeats 5 --time-budget-s 2 \
  ${loss_json[@]+"${loss_json[@]}"}
step train 80 bench_train.md "ViT-B-32 train step at batch 512 vs OpenCLIP (issue 8)" \
  "$PY" benchmarks/bench_train.py --device cuda --batch 512 --fit none --ckpt off --loss-modes fused \
  --steps 10 --warmup 3 --json "$RES/bench_train.json"
step routes 90 bench_train_routes.md "train step per DeepSpeed route / ZeRO-0, ViT-B-32 batch 512 (issue 27.3, opt-in)" \
  "$PY" benchmarks/bench_train.py --device cuda --ckpt off --loss-modes fused --steps 20 --warmup 3 \
  --routes zero0_bf16_sr zero2_bf16_halfmaster zero1_bf16_halfmaster --json "$RES/bench_train_routes.json"
step data 170 bench_data.md "train step on loader batches (CPU / GPU decode) vs synthetic inputs (issue 27.5, opt-in)" \
  "$PY" benchmarks/bench_data.py --train-step --device cuda --workers 14 --batch 512 --samples 16384 --steps 20 \
  --warmup 30 --decode-device cpu cuda --json "$RES/bench_data.json"
step memory 33 bench_memory.md "memory census, ViT-B-32" \
  "$PY" benchmarks/bench_memory.py --device cuda --world 1 --preset ViT-B-32 --batch 64 \
  --modes zero0_bf16_sr zero2_bf16_standard --json "$RES/bench_memory.json"
step tests 150 tests.log "GPU tests (kernel tests first)" \
  "$PY" -m pytest -q -m gpu -p no:cacheprovider --durations=15 --junitxml "$RES/tests.xml" tests
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
step numerics 240 numerics_routes.md "loss curves: default SR, all-SR, DeepSpeed standard bf16, ViT-B-32 (opt-in)" \
  "$PY" benchmarks/numerics_routes.py --device cuda --preset ViT-B-32 --batch 256 --steps 300 --pool 8 \
  --time-budget-s 180 --json "$RES/numerics_routes.json" --png "$RES/numerics_routes.png"
step goals 8 goals.log "GOALS" "$PY" benchmarks/gpu_goals.py goals "$RES"
plan pack 5 "pack: every file into $ARCHIVE; under \$OUT only the returned files stay" tar -czf "$RES/$ARCHIVE" .

if [ "$DRY" = 1 ]; then
  files=$(returned)
  echo "budget: $total s = the limits of $nsteps steps + ${KILL_AFTER} s each to stop" \
    "(the default run must fit $BUDGET_LIMIT_S s)"
  echo "returns: $(echo "$files" | wc -l) files ($(echo $files)) in $RES (the device tool returns at most 8)"
  echo "budget_s=$total"
  echo "returned_files=$(echo "$files" | wc -l)"
  exit 0
fi
echo "gpu_check: $failed step(s) failed; budget of the steps run: $total s; $SECONDS s in all" | tee -a "$log"
pack
trap - INT TERM
exit "$failed"
