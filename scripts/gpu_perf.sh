#!/usr/bin/env bash
# Absolute GPU figures, after scripts/gpu_check.sh has built csrc/ in place: training step tokens/s and MFU of
# our models against Hugging Face's on the same card in one run (benchmarks/train_throughput.py, bf16), and
# pretrain_gpt.py's own logged throughput for a GPT-2 345M run. Prints tables; logs under $GPU_CHECK_LOGS.
#   PYTHON=python3 bash scripts/gpu_perf.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # benchmarks/ import megatron_like without an install
LOGS=${GPU_CHECK_LOGS:-build/gpu_check}
mkdir -p "$LOGS"
status=0
# GPT-2 345M shapes (24 layers, h1024, 16 heads, seq 1024), then a Llama-style model of similar size.
"$PY" benchmarks/train_throughput.py --device cuda --dtype bf16 --layers 24 --hidden 1024 --heads 16 --seq 1024 \
    --micro-batch 8 --trials 10 --warmup 3 ${PROFILE_ROWS:+--profile $PROFILE_ROWS} 2>&1 | tee "$LOGS/throughput_gpt.txt" || status=1
"$PY" benchmarks/train_throughput.py --device cuda --dtype bf16 --llama --layers 24 --hidden 1024 --heads 16 \
    --groups 4 --ffn 2816 --seq 1024 --micro-batch 8 --trials 10 --warmup 3 ${PROFILE_ROWS:+--profile $PROFILE_ROWS} 2>&1 \
    | tee "$LOGS/throughput_llama.txt" || status=1
# The trainer itself (mixed precision with fp32 master weights, Megatron's distributed optimizer path off).
OMP_NUM_THREADS=1 "$PY" pretrain_gpt.py --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
    --seq-length 1024 --max-position-embeddings 1024 --micro-batch-size 8 --global-batch-size 32 \
    --train-iters 30 --lr 1e-4 --mock-data --vocab-size 50257 --bf16 --log-interval 10 --eval-iters 0 \
    --seed 1234 2>&1 | tee "$LOGS/pretrain_345m.txt" | grep -E "iteration|error|Error" || status=1
exit $status
