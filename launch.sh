#!/usr/bin/env bash
# Thin wrapper over the `deepspeed` launcher. Examples:
#   bash launch.sh                                   # the demo: synthetic data, small CLIP, CPU (2 ranks) or all GPUs
#   bash launch.sh --steps 100 --loss-mode chunked   # the demo with some of its settings changed
#   NUM_GPUS=8 DS_CONFIG=ds_configs/zero2_bf16_halfmaster.json bash launch.sh \
#       --preset ViT-B-32 --train-data /data/cc3m/train.csv --val-data /data/cc3m/val.csv --epochs 32
#   bash launch.sh --output-dir runs/demo --resume latest      # continue a run with its own settings
#   bash launch.sh --init-from exported/ --steps 100           # fine-tune an open_clip/HF/recipe model on the demo data
#   HOSTFILE=hostfile bash launch.sh --train-data 's3-mounted/shards-{0000..0999}.tar' --data-format webdataset
#   bash launch.sh verify                            # preflight (python -m recipe.verify) on the same ranks
#   NUM_GPUS=8 DS_CONFIG=runs/plans/zero2_bf16_halfmaster_m2048_k2.json bash launch.sh verify --preset ViT-B-32
# `verify` as the first argument launches `python -m recipe.verify` instead of training, on the ranks
# the run would get (NUM_GPUS, HOSTFILE, DS_CONFIG as below; `bash launch.sh verify --help` lists its
# flags); it exits non-zero when a check fails on any rank.
# Every other argument goes to `python -m recipe.train` (`bash launch.sh --help` lists them). Relative paths
# are taken from the directory you run this from. Without --train-data (or --config / --resume) the
# demo's settings are the defaults and your arguments override them.
# Environment: NUM_GPUS, DS_CONFIG (default ds_configs/zero0_bf16_sr.json), OUTPUT_DIR, DATA_DIR (demo data),
# HOSTFILE, MASTER_ADDR, MASTER_PORT.
# Signals, to this script or to its whole process group / job (timeout, SLURM, Kubernetes): SIGTERM and
# SIGUSR1 (SLURM's --signal=USR1@SECONDS) make every rank save a checkpoint at the next step boundary
# and exit; this script returns once every rank has ended, with 143 when the checkpoint was saved (3
# and one line naming the lost step when it was not). SIGINT (Ctrl-C) stops every rank at once without
# saving (130). Whatever fails on whichever rank, the output ends with one `error:` line naming the
# cause and the log holding the tracebacks (python -m recipe.run.outcome).
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export TOKENIZERS_PARALLELISM=false

has() {  # has FLAG ARGS...: whether FLAG (or FLAG=value) is among ARGS
  local flag=$1 a
  shift
  for a in "$@"; do [[ $a == "$flag" || $a == "$flag="* ]] && return 0; done
  return 1
}

module=recipe.train
if [[ ${1:-} == verify ]]; then  # the preflight: `bash launch.sh verify [recipe.verify flags]`
  module=recipe.verify
  shift
fi

if has --help "$@" || has -h "$@"; then
  python -m "$module" --help
  exit 0
fi

if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  NUM_GPUS=${NUM_GPUS:-$(python -c 'import torch; print(torch.cuda.device_count())')}
else
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}   # gloo ranks on the CPU
  NUM_GPUS=${NUM_GPUS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi

# the default DeepSpeed JSON, on any number of ranks: bf16 at ZeRO-0, replicated weights and one bf16 gradient
# all-reduce per step (ZeRO-1/2's per-step machinery cost ~1.3x its step time at one rank and move 1.5x the
# bytes over several; README, "Which route for several GPUs"; `python -m recipe.plan` prefers it too and
# falls back to ZeRO-1/2/3 when the replicated optimizer state does not fit)
DEFAULT_DS=$REPO/ds_configs/zero0_bf16_sr.json

args=()
if [[ $module == recipe.verify ]]; then
  # the run's DeepSpeed JSON (a --ds-config among the arguments comes later and wins); no run directory, no data
  args+=(--ds-config "${DS_CONFIG:-$DEFAULT_DS}")
else
  resuming=false
  if has --resume "$@" || has --config "$@"; then resuming=true; fi
  # the run's own DeepSpeed JSON when resuming (from its config.json), the default otherwise
  if [[ -n ${DS_CONFIG:-} ]] || ! $resuming; then
    args+=(--deepspeed_config "${DS_CONFIG:-$DEFAULT_DS}")
  fi
  if ! has --output-dir "$@"; then
    args+=(--output-dir "${OUTPUT_DIR:-runs/synthetic-$(date +%Y%m%d-%H%M%S)}")
  fi
  if ! has --train-data "$@" && ! $resuming; then
    # the demo: a synthetic dataset written once, a small CLIP trained on it, evaluated on its held-out split
    DATA_DIR=${DATA_DIR:-$REPO/data/synthetic}
    [ -f "$DATA_DIR/train.csv" ] || python -m recipe.synthetic --out "$DATA_DIR" --n 6000 --image-size 32
    args+=(--train-data "$DATA_DIR/train.csv" --val-data "$DATA_DIR/val.csv"
           --steps 400 --lr 2e-3 --warmup-steps 30 --eval-every 200 --log-every 50)
    # a CLIP-style ViT (pre-norm) that exports to open_clip and Hugging Face; --init-from brings its own architecture
    has --init-from "$@" || args+=(--preset tiny-clip)
  fi
fi

launcher=(deepspeed --no_local_rank --log_level critical)  # the ranks report their own errors
if [ -n "${HOSTFILE:-}" ]; then
  launcher+=(--hostfile "$HOSTFILE" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"})
else
  launcher+=(--num_gpus "$NUM_GPUS")
fi
if [ -z "${MASTER_PORT:-}" ] && [ -z "${HOSTFILE:-}" ]; then  # a free local port: runs side by side never collide
  MASTER_PORT=$(python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi
launcher+=(${MASTER_PORT:+--master_port "$MASTER_PORT"})

# The launcher runs in the background, in a process group of its own (job control), so that this
# script alone receives what is sent to its group (`timeout`, a terminal's Ctrl-C) and passes it to
# the ranks: the `deepspeed` runner does not forward signals on a single node, and its per-node
# launcher would end the ranks' whole process trees (DataLoader workers included) on a SIGTERM.
# The ranks announce themselves and leave how they ended in a private directory (recipe/run/outcome.py).
RECIPE_LAUNCH_DIR=$(mktemp -d "${TMPDIR:-/tmp}/recipe-launch.XXXXXX")
export RECIPE_LAUNCH_DIR
trap 'rm -rf "$RECIPE_LAUNCH_DIR"' EXIT
set -m
"${launcher[@]}" --module "$module" "${args[@]}" "$@" &
runner=$!
set +m
pending=""
forward() {  # the ranks are the children of the per-node launcher, itself a child of the runner
  local sig=$1 node found=false
  for node in $(pgrep -P "$runner" || true); do
    pkill "-$sig" -P "$node" && found=true
  done
  if $found || [[ $sig == INT ]]; then pending=""; else pending=$sig; fi  # no rank yet: again in a moment
}
trap 'forward TERM' TERM
trap 'forward USR1' USR1
trap 'forward INT' INT
status=0
while true; do
  wait "$runner" && status=0 || status=$?
  kill -0 "$runner" 2>/dev/null || break   # wait returns early when a trapped signal arrives
  if [[ -n $pending ]]; then sleep 1; forward "$pending"; fi
done
# the runner may have died of a job-wide signal while the ranks still save: wait for every rank, then
# print the one line that explains the launch and return its status
expect=0
[[ -z ${HOSTFILE:-} ]] && expect=$NUM_GPUS
python -m recipe.run.outcome "$RECIPE_LAUNCH_DIR" "$status" --expect "$expect" && status=0 || status=$?
exit "$status"
