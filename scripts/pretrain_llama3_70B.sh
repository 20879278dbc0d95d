#!/usr/bin/env bash
# Llama 3 70B (Llama Team 2024): 80 layers, hidden 8192, 64 query heads in 8 key/value groups, SwiGLU ffn
# 28672, RMSNorm, rotary positions (base 500000), no biases, untied output layer, 8192 tokens, 128256-token
# vocabulary, 4M tokens per batch. Sixteen nodes of 8 GPUs: tp 8 with sequence parallelism inside a node,
# pp 4 with the interleaved schedule (4 chunks of 5 layers per stage), selective recompute, ZeRO-1 over 4
# data-parallel ranks. See docs/models.md.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_llama3_70B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=16
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-llama_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/llama3_70B}
VOCAB_SIZE=128256  # the tokenizer's vocabulary; given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_70B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 80 --hidden-size 8192 --num-attention-heads 64 --group-query-attention --num-query-groups 8
            --ffn-hidden-size 28672 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
            --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
            --recompute-granularity selective)
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --pipeline-model-parallel-size 4
               --num-layers-per-virtual-pipeline-stage 5 --sequence-parallel --use-distributed-optimizer
               --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 512 --train-iters 500000 --lr 1.5e-4 --min-lr 1.5e-5
               --lr-decay-style cosine --lr-warmup-iters 2000 --weight-decay 0.1 --clip-grad 1.0
               --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --num-workers 2)
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

PLAN_ARGS=(--vocab-size "$VOCAB_SIZE")
launch "${ARGS[@]}"
