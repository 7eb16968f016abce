#!/usr/bin/env bash
# The 8-layer hybrid of the benchmarks (M*M-M*M-: Mamba, attention, Mamba, MLP, ...) on one GPU,
# bf16, with partial CUDA graphs. Scopes: `mamba`, `mamba attn mlp`, or nothing for whole layers;
# drop the graph flags for eager. Megatron's hybrid flags: the pattern sets the layer count.
set -euo pipefail
cd "$(dirname "$0")/.."
exec torchrun --nproc-per-node 1 pretrain_hybrid.py \
    --hybrid-layer-pattern "M*M-M*M-" --hidden-size 1024 --num-attention-heads 16 \
    --mamba-state-dim 128 --mamba-head-dim 64 --mamba-num-groups 8 \
    --seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 \
    --position-embedding-type none --normalization RMSNorm --disable-bias-linear \
    --train-iters 50 --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 \
    --mock-data --tokenizer-type NullTokenizer --vocab-size 32000 --bf16 \
    --attention-dropout 0.0 --hidden-dropout 0.0 --log-interval 10 \
    --cuda-graph-impl local --cuda-graph-scope "$@"
