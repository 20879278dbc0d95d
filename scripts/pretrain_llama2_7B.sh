#!/usr/bin/env bash
# Llama 2 7B (Touvron et al. 2023): 32 layers, hidden 4096, 32 heads, SwiGLU ffn 11008, RMSNorm, rotary
# positions (base 10000), no biases, untied output layer, 4096 tokens, 32000-token vocabulary, 4M tokens per batch.
# Four nodes of 8 GPUs: tp 2 with sequence parallelism inside a node, ZeRO-1 (Megatron's distributed
# optimizer) over 16 data-parallel ranks. See docs/models.md for the flags of each model family.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_llama2_7B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=4
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-llama_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/llama2_7B}
VOCAB_SIZE=32000  # the tokenizer's vocabulary; given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama2_7B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 --seq-length 4096
            --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 10000
            --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --sequence-parallel
               --use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 1024 --train-iters 500000 --lr 3e-4 --min-lr 3e-5
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
