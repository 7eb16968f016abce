#!/usr/bin/env bash
# The 8-layer GPT of the benchmarks on one GPU, bf16, with partial CUDA graphs.
# Scope: empty = whole layers; try `--cuda-graph-scope attn` or `mlp`, or drop the graph flags for eager.
set -euo pipefail
cd "$(dirname "$0")/.."
exec torchrun --nproc-per-node 1 pretrain_gpt.py \
    --num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 \
    --train-iters 50 --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 10 --log-throughput \
    --cuda-graph-impl local --cuda-graph-scope "$@"
