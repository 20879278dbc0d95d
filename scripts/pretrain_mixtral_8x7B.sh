#!/usr/bin/env bash
# Mixtral 8x7B (Jiang et al. 2024, "Mixtral of Experts"; the Hugging Face config of mistralai/Mixtral-8x7B-v0.1):
# 32 layers, hidden 4096, 32 query heads in 8 key/value groups, RMSNorm, rotary positions (base 1e6), no
# biases, untied output layer, 32000-token vocabulary; every layer's MLP is 8 SwiGLU experts of hidden 14336,
# top-2 routing: 46.7B parameters, 12.9B active per token. See docs/models.md and docs/moe.md.
# Layout: Megatron-LM's recommended training layout for this model, TP1 EP8 PP4 (NVIDIA/Megatron-LM,
# examples/mixtral/README.md: "For training, the recommended model parallel config is TP1EP8PP4"), with the
# flags of its examples/mixtral/train_mixtral_8x7b_distributed.sh: sequence 4096, micro batch 1, global batch
# 256, alltoall dispatcher, aux loss 1e-2, grouped GEMM, distributed optimizer. Eight nodes of 8 GPUs: dp 16,
# so each expert lives on dp / ep = 2 ranks (its expert-data-parallel group, over which ZeRO shards it).
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_mixtral_8x7B.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=8
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-llama_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/mixtral_8x7B}
VOCAB_SIZE=32000  # the tokenizer's vocabulary; given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/mixtral_8x7B}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention --num-query-groups 8
            --ffn-hidden-size 14336 --seq-length 4096 --max-position-embeddings 32768 --position-embedding-type rope
            --rotary-base 1000000 --normalization RMSNorm --norm-epsilon 1e-5 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 --init-method-std 0.01)
MOE_ARGS=(--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
          --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
PARALLEL_ARGS=(--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --expert-model-parallel-size 8
               --use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 256 --train-iters 500000 --lr 1e-4 --min-lr 1e-5
               --lr-decay-style cosine --lr-decay-iters 320000 --lr-warmup-iters 500 --weight-decay 0.1
               --clip-grad 1.0 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --num-workers 2)
# torch_dist (the default format) stores each layer's 8 experts as one global tensor: the checkpoint resumes at
# any tp/pp/ep layout (docs/checkpoints.md, docs/moe.md).
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
      "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}")

PLAN_ARGS=(--vocab-size "$VOCAB_SIZE")
launch "${ARGS[@]}"
