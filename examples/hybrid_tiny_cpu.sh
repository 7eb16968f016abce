#!/usr/bin/env bash
# A tiny hybrid Mamba/attention model (M*M-M*M-) on Megatron-style mock data: trains on the CPU.
# Extra flags are passed through, e.g. `bash examples/hybrid_tiny_cpu.sh --train-iters 100`.
set -euo pipefail
cd "$(dirname "$0")/.."
exec python3 pretrain_hybrid.py \
    --hybrid-layer-pattern "M*M-M*M-" --hidden-size 64 --num-attention-heads 4 \
    --mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2 \
    --seq-length 64 --micro-batch-size 4 --global-batch-size 8 \
    --position-embedding-type none --normalization RMSNorm --disable-bias-linear \
    --train-iters 60 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 5 \
    --weight-decay 0.01 --clip-grad 1.0 --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 512 \
    --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 \
    --log-interval 10 "$@"
