#!/usr/bin/env bash
# Llama 3 8B's long-context phase (Llama Team 2024, §3.4.2): the 8K-token model continued at 131072 tokens with
# Llama 3.1's RoPE scaling (factor 8 over the original 8192 positions), each sequence split over 8
# context-parallel ranks (ring attention, docs/context_parallel.md) times tensor parallelism 2 with sequence
# parallelism: one replica spans 16 GPUs, two replicas on four nodes of 8. Full recomputation, ZeRO-1 over the
# dp x cp ranks. The model as scripts/pretrain_llama3_8B.sh; it loads that run's checkpoint (--finetune: a new
# schedule from iteration 0).
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_llama3_8B_128k.sh   # print the per-rank memory plan (tools/plan.py) and exit
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=4
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-llama-long_text_document}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/llama3_8B}
VOCAB_SIZE=128256  # the tokenizer's vocabulary; given to the planner, which opens no files
LOAD_PATH=${LOAD_PATH:-checkpoints/llama3_8B}
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/llama3_8B_128k}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
            --ffn-hidden-size 14336 --seq-length 131072 --max-position-embeddings 131072
            --position-embedding-type rope --rotary-base 500000 --use-rope-scaling --rope-scaling-factor 8
            --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.02
            --recompute-granularity full --recompute-method uniform --recompute-num-layers 1)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --context-parallel-size 8 --cp-comm-type p2p
               --pipeline-model-parallel-size 1 --use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 32 --train-iters 2000 --lr 3e-5 --min-lr 3e-6
               --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1 --clip-grad 1.0
               --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --num-workers 2)
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$LOAD_PATH" --finetune --save-interval 200)
LOGGING_ARGS=(--log-interval 10 --eval-interval 200 --eval-iters 4 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 20)

ARGS=("${MODEL_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}"
      "${LOGGING_ARGS[@]}")

PLAN_ARGS=(--vocab-size "$VOCAB_SIZE")
launch "${ARGS[@]}"
