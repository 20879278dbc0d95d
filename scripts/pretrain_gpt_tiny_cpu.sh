#!/usr/bin/env bash
# A tiny GPT that trains on this CPU machine in about a minute: 4 processes (tensor parallel 2 x pipeline
# parallel 2) on mock data, with checkpoints, TensorBoard and a validation run. The same shape of script as
# the cluster ones (pretrain_gpt_{345M,1.3B,6.7B,175B}.sh), so it is the place to try flags first.
#   bash scripts/pretrain_gpt_tiny_cpu.sh            # train; run again to resume from the checkpoint
#   DRY_RUN=1 bash scripts/pretrain_gpt_tiny_cpu.sh  # print the per-rank memory plan and exit
#   python tools/plot_logs.py runs/tiny_cpu/tensorboard --output runs/tiny_cpu/curves.png
set -euo pipefail
cd "$(dirname "$0")/.."

NPROC=${NPROC:-4}
RUN_DIR=${RUN_DIR:-runs/tiny_cpu}
TRAIN_ITERS=${TRAIN_ITERS:-40}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL_ARGS=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
            --max-position-embeddings 128 --hidden-dropout 0.1 --attention-dropout 0.1)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --distributed-timeout-minutes 2)
TRAINING_ARGS=(--micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" --lr 2e-3 --min-lr 2e-4
               --lr-decay-style cosine --lr-warmup-iters 4 --weight-decay 0.1 --clip-grad 1.0 --seed 1234)
DATA_ARGS=(--mock-data --vocab-size 1024 --num-workers 0)
CHECKPOINT_ARGS=(--save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 20)
LOGGING_ARGS=(--log-interval 5 --eval-interval 20 --eval-iters 2 --tensorboard-dir "$RUN_DIR/tensorboard")

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
    exec "$PYTHON" tools/plan.py --world-size "$NPROC" --plan-device cpu --device-tflops 0.3 "${ARGS[@]}"
fi
exec "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}"
