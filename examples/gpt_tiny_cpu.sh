#!/usr/bin/env bash
# A tiny GPT on Megatron-style mock data: trains on the CPU (or one GPU) in about a minute.
# Extra flags are passed through, e.g. `bash examples/gpt_tiny_cpu.sh --train-iters 100`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 pretrain_gpt.py \
    --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
    --max-position-embeddings 64 --micro-batch-size 4 --global-batch-size 8 \
    --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 512 \
    --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 \
    --log-interval 10 --metrics-file runs/tiny/metrics.jsonl "$@"
