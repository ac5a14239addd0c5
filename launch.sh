#!/usr/bin/env bash
# Thin wrapper over the `deepspeed` launcher. Examples:
#   bash launch.sh                                   # CPU (2 ranks) or all local GPUs: synthetic data, small CLIP
#   NUM_GPUS=8 DS_CONFIG=ds_configs/zero2_bf16_halfmaster.json bash launch.sh \
#       --preset ViT-B-32 --train-data /data/cc3m/train.csv --val-data /data/cc3m/val.csv --epochs 32
#   HOSTFILE=hostfile bash launch.sh --train-data 's3-mounted/shards-{0000..0999}.tar' --data-format webdataset
# Every argument is passed through to `python -m recipe.train` (see `python -m recipe.train --help`).
set -euo pipefail
cd "$(dirname "$0")"

DS_CONFIG=${DS_CONFIG:-ds_configs/zero2_bf16_halfmaster.json}
DATA_DIR=${DATA_DIR:-data/synthetic}
OUTPUT_DIR=${OUTPUT_DIR:-runs/synthetic-$(date +%Y%m%d-%H%M%S)}
if python -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  NUM_GPUS=${NUM_GPUS:-$(python -c 'import torch; print(torch.cuda.device_count())')}
else
  export DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}   # gloo ranks on the CPU
  NUM_GPUS=${NUM_GPUS:-2}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
export TOKENIZERS_PARALLELISM=false

launcher=(deepspeed --no_local_rank)
if [ -n "${HOSTFILE:-}" ]; then
  launcher+=(--hostfile "$HOSTFILE" ${MASTER_ADDR:+--master_addr "$MASTER_ADDR"})
else
  launcher+=(--num_gpus "$NUM_GPUS")
fi
launcher+=(${MASTER_PORT:+--master_port "$MASTER_PORT"})

if [ "$#" -eq 0 ]; then
  # the default job: write the synthetic dataset once, then train a small CLIP on it
  [ -f "$DATA_DIR/train.csv" ] || python -m recipe.synthetic --out "$DATA_DIR" --n 6000 --image-size 32
  set -- --preset tiny --train-data "$DATA_DIR/train.csv" --val-data "$DATA_DIR/val.csv" \
         --steps 1000 --lr 2e-3 --warmup-steps 50 --eval-every 250 --log-every 50
fi
exec "${launcher[@]}" --module recipe.train --deepspeed_config "$DS_CONFIG" --output-dir "$OUTPUT_DIR" "$@"
