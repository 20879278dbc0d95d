#!/usr/bin/env bash
# The main job on built-in defaults, on CPU: build a small real-English corpus (the Python standard
# library's docstrings), train a byte-level BPE on it, binarize it, train a small GPT with tensor x
# pipeline parallelism (2 x 2 = 4 processes through torchrun), save a checkpoint, and generate text
# from that checkpoint. Everything lands in runs/demo/ (override with DEMO_DIR=...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

DEMO_DIR=${DEMO_DIR:-runs/demo}
TRAIN_ITERS=${TRAIN_ITERS:-300}
PY=.venv/bin/python
mkdir -p "$DEMO_DIR"
export OMP_NUM_THREADS=1  # 4 processes share 2 cores

if [ ! -f "$DEMO_DIR/data/docs_text_document.idx" ]; then
    echo "== corpus, tokenizer, binarized dataset"
    $PY data_tools/make_demo_corpus.py --output "$DEMO_DIR/corpus.jsonl"
    $PY data_tools/train_tokenizer.py --input "$DEMO_DIR/corpus.jsonl" --output-dir "$DEMO_DIR/tokenizer" \
        --vocab-size 4096
    $PY data_tools/preprocess.py --input "$DEMO_DIR/corpus.jsonl" --output-prefix "$DEMO_DIR/data/docs" \
        --tokenizer-type GPT2BPETokenizer --vocab-file "$DEMO_DIR/tokenizer/vocab.json" \
        --merge-file "$DEMO_DIR/tokenizer/merges.txt" --append-eod --workers 1
fi

TOKENIZER=(--tokenizer-type GPT2BPETokenizer --vocab-file "$DEMO_DIR/tokenizer/vocab.json"
           --merge-file "$DEMO_DIR/tokenizer/merges.txt")
MODEL=(--num-layers 4 --hidden-size 128 --num-attention-heads 4 --seq-length 128
       --max-position-embeddings 128 --hidden-dropout 0.0 --attention-dropout 0.0)
PARALLEL=(--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2)
TRAINING=(--micro-batch-size 4 --global-batch-size 16 --train-iters "$TRAIN_ITERS" --lr 2e-3 --min-lr 2e-4
          --lr-decay-style cosine --lr-warmup-iters 20 --weight-decay 0.1 --clip-grad 1.0 --seed 1234)
DATA=(--data-path "$DEMO_DIR/data/docs_text_document" --split 98,2,0 --num-workers 0)
LOGGING=(--log-interval 20 --eval-interval 100 --eval-iters 5)

echo "== training (tensor parallel 2 x pipeline parallel 2 on 4 CPU processes)"
rm -rf "$DEMO_DIR/checkpoints"
.venv/bin/torchrun --standalone --nproc_per_node=4 pretrain_gpt.py \
    "${MODEL[@]}" "${PARALLEL[@]}" "${TRAINING[@]}" "${DATA[@]}" "${TOKENIZER[@]}" "${LOGGING[@]}" \
    --save "$DEMO_DIR/checkpoints" | tee "$DEMO_DIR/train.log"
$PY tools/plot_logs.py "$DEMO_DIR/train.log" --output "$DEMO_DIR/loss.png"

echo "== generating text from the checkpoint (tensor parallel 2; the loader merges the 2 pipeline stages)"
.venv/bin/torchrun --standalone --nproc_per_node=2 tools/generate.py --load "$DEMO_DIR/checkpoints" \
    --tensor-model-parallel-size 2 --prompt "Return a new" --prompt "This module provides" \
    --prompt "If the file" --max-new-tokens 40 --top-k 40 --temperature 0.8 --seed 1234
