#!/usr/bin/env bash
# DeepSeek-V3 (DeepSeek-AI 2024, "DeepSeek-V3 Technical Report"; the Hugging Face config of deepseek-ai/DeepSeek-V3):
# 61 layers, hidden 7168, 128 heads of multi-latent attention (query latent 1536, key/value latent 512, 128 + 64
# rotary query/key features and 128 value features per head, YaRN factor 40 over a 4096-token pretraining context),
# RMSNorm (eps 1e-6), SwiGLU, no biases, untied output layer, 129280-token vocabulary; the first 3 layers dense
# (hidden 18432), the other 58 MoE: 256 routed experts of hidden 2048 plus 1 shared, sigmoid routing to the top 8
# inside the best 4 of 8 groups, scaled by 2.5, auxiliary-loss-free balancing (the expert bias, step 1e-3) and a
# sequence-level balance loss of weight 1e-4; one multi-token prediction depth (an MoE layer too) at weight 0.1:
# 671B parameters, 37B active per token, and 11.7B more in the MTP depth. See docs/models.md and docs/moe.md.
# Model flags: Megatron-LM's names (its DeepSeek-V3 recipe; batch, learning rate and schedule from the report).
# Layout (ours, from DRY_RUN=1's plan): 128 nodes of 8 GPUs, tp 8 with sequence parallelism inside a node, no
# pipeline, ep 256 with expert tp 1 (each rank holds 1 expert of every MoE layer, whole; expert-dp 4), the
# distributed optimizer, full recompute. DeepSeek trained with pp 16 x ep 64 on uneven stages; our pipeline splits
# the layers evenly, which 61 (a prime) does not allow, so pipeline parallelism is left out here.
#
# Cluster environment, multi-node and preemption: scripts/cluster_launch.sh.
#   DRY_RUN=1 bash scripts/pretrain_deepseek_v3.sh   # print the per-rank memory plan (tools/plan.py) and exit; no GPU needed
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT_NNODES=128
source scripts/cluster_launch.sh

DATA_PATH=${DATA_PATH:-data/my-deepseek_text_document}
# The model's tokenizer.json (a Hugging Face tokenizer directory or file); no network access is needed.
TOKENIZER_MODEL=${TOKENIZER_MODEL:-tokenizers/deepseek_v3}
VOCAB_SIZE=129280  # the model's embedding rows (config.json's vocab_size); given to the planner, which opens no files
CHECKPOINT_PATH=${CHECKPOINT_PATH:-checkpoints/deepseek_v3}
TENSORBOARD_DIR=${TENSORBOARD_DIR:-$CHECKPOINT_PATH/tensorboard}

# --make-vocab-size-divisible-by 2020: 2020 x tp 8 divides 129280, so the vocabulary needs no padding.
MODEL_ARGS=(--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --seq-length 4096
            --max-position-embeddings 163840 --position-embedding-type rope --rotary-base 10000
            --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
            --untie-embeddings-and-output-weights --make-vocab-size-divisible-by 2020 --hidden-dropout 0
            --attention-dropout 0 --init-method-std 0.006)
MLA_ARGS=(--multi-latent-attention --q-lora-rank 1536 --kv-lora-rank 512 --qk-head-dim 128 --qk-pos-emb-head-dim 64
          --v-head-dim 128 --rope-type yarn --rotary-scaling-factor 40 --original-max-position-embeddings 4096
          --beta-fast 32 --beta-slow 1 --mscale 1.0 --mscale-all-dim 1.0)
MOE_ARGS=(--num-experts 256 --moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048
          --moe-layer-freq "[0]*3+[1]*58" --moe-router-topk 8 --moe-router-score-function sigmoid
          --moe-router-num-groups 8 --moe-router-group-topk 4 --moe-router-topk-scaling-factor 2.5
          --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
          --moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 1e-4
          --moe-token-dispatcher-type alltoall --moe-grouped-gemm)
MTP_ARGS=(--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1)
PARALLEL_ARGS=(--tensor-model-parallel-size 8 --sequence-parallel --pipeline-model-parallel-size 1
               --expert-model-parallel-size 256 --expert-tensor-parallel-size 1 --use-distributed-optimizer
               --overlap-grad-reduce --recompute-granularity full --recompute-method uniform
               --recompute-num-layers 1)
TRAINING_ARGS=(--micro-batch-size 1 --global-batch-size 15360 --train-iters 240000 --lr 2.2e-4 --min-lr 2.2e-5
               --lr-decay-style cosine --lr-decay-iters 240000 --lr-warmup-iters 2000 --weight-decay 0.1
               --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --bf16 --seed 1234)
DATA_ARGS=(--data-path "$DATA_PATH" --split 949,50,1 --tokenizer-type HuggingFaceTokenizer
           --tokenizer-model "$TOKENIZER_MODEL" --num-workers 2)
# torch_dist (the default format) stores each layer's 256 experts as one global tensor: the checkpoint resumes at
# any tp/pp/ep layout, and tools/convert_hf.py writes it as a DeepseekV3ForCausalLM (its MTP depth as layer 61).
CHECKPOINT_ARGS=(--save "$CHECKPOINT_PATH" --load "$CHECKPOINT_PATH" --save-interval 1000)
LOGGING_ARGS=(--log-interval 100 --eval-interval 1000 --eval-iters 10 --tensorboard-dir "$TENSORBOARD_DIR"
              --distributed-timeout-minutes 10)

ARGS=("${MODEL_ARGS[@]}" "${MLA_ARGS[@]}" "${MOE_ARGS[@]}" "${MTP_ARGS[@]}" "${PARALLEL_ARGS[@]}"
      "${TRAINING_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}")

PLAN_ARGS=(--vocab-size "$VOCAB_SIZE")
launch "${ARGS[@]}"
