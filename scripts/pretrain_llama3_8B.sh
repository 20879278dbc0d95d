#!/usr/bin/env bash
# Llama 3 8B (Llama Team 2024): 32 layers, hidden 4096, 32 query heads in 8 key/value groups, SwiGLU ffn 14336,
# RMSNorm, rotary positions (base 500000), no biases, untied output layer, 8192 tokens, 128256-token
# vocabulary, 4M tokens per batch. Eight nodes of 8 GPUs: tp 2 with sequence parallelism (Megatron-LM's
# example splits the sequence with context parallelism 2 instead; tp 2 + sp halves the activations the
# same way), selective recompute, ZeRO-1 over 32 data-parallel ranks. See docs/models.md.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_llama3_8B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=8
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-llama_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/llama3_8B}
VOCAB_SIZE=128256  # the tokenizer's vocabulary; given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_8B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
            --ffn-hidden-size 14336 --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope
            --rotary-base 500000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
            --recompute-granularity selective)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
               --use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 512 --train-iters 500000 --lr 3e-4 --min-lr 3e-5
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
