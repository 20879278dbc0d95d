#!/usr/bin/env bash
# Qwen3-30B-A3B (Qwen Team 2025, "Qwen3 Technical Report"; the Hugging Face config of Qwen/Qwen3-30B-A3B):
# 48 layers, hidden 2048, 32 query heads of 128 features (--kv-channels 128: the attention is 4096 wide) in 4
# key/value groups, RMS QK-norm on every query and key head (--qk-layernorm), RMSNorm (eps 1e-6), rotary positions
# (base 1e6, 40960 positions), no biases, untied output layer, 151936-token vocabulary; every layer's MLP is 128
# SwiGLU experts of hidden 768, top-8 routing renormalized over the 8 (norm_topk_prob: our default top-k order,
# docs/models.md), no shared expert: 30.5B parameters, 3.3B active per token. See docs/models.md and docs/moe.md.
# Model flags: Megatron-LM's examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh (sequence 4096, aux loss
# 1e-3, alltoall dispatcher, --make-vocab-size-divisible-by 1187 so that the 151936 rows need no padding).
# Layout (ours, from DRY_RUN=1's plan): two nodes of 8 GPUs, tp 2 with sequence parallelism, pp 2, ep 4 (dp 4, so
# each rank holds 32 experts of every layer of its stage, whole), the distributed optimizer.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_qwen3_30b_a3b.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=2
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-qwen3_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/qwen3}
VOCAB_SIZE=151936  # the model's embedding rows (config.json's vocab_size); given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/qwen3_30b_a3b}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

MODEL_ARGS=(--num-layers 48 --hidden-size 2048 --num-attention-heads 32 --kv-channels 128 --group-query-attention
            --num-query-groups 4 --qk-layernorm --ffn-hidden-size 6144 --seq-length 4096
            --max-position-embeddings 40960 --position-embedding-type rope --rotary-base 1000000
            --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --make-vocab-size-divisible-by 1187 --hidden-dropout 0
            --attention-dropout 0 --init-method-std 0.02)
MOE_ARGS=(--num-experts 128 --moe-ffn-hidden-size 768 --moe-router-topk 8 --moe-router-load-balancing-type aux_loss
          --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
PARALLEL_ARGS=(--tensor-model-parallel-size 2 --sequence-parallel --pipeline-model-parallel-size 2
               --expert-model-parallel-size 4 --use-distributed-optimizer --overlap-grad-reduce)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 512 --train-iters 500000 --lr 3e-4 --min-lr 3e-5
               --lr-decay-style cosine --lr-decay-iters 320000 --lr-warmup-iters 2000 --weight-decay 0.1
               --clip-grad 1.0 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --num-workers 2)
# torch_dist (the default format) stores each layer's 128 experts as one global tensor: the checkpoint resumes at
# any tp/pp/ep layout, and tools/convert_hf.py writes it as a Qwen3MoeForCausalLM (docs/inference.md).
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${PARALLEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}"
      "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}")

PLAN_ARGS=(--vocab-size "$VOCAB_SIZE")
launch "${ARGS[@]}"
