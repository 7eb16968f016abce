#!/usr/bin/env bash
# The four-GPU validation table in one call of at most 10 minutes: tools/two_gpu_check.sh
# with --gpus 4 (the same tool, its four-GPU table): TP=2 x PP=2 x VPP=2 with the
# distributed optimizer eager, whole layer and `attn mlp`; MoE EP=4 eager and `attn
# moe_router moe_preprocess`; the TP=2 x PP=2 x VPP=2 job as two torchrun c10d "nodes" of
# two GPUs each. Output as the two-GPU check's, with four_gpu.json for the results.
# Arguments go to two_gpu_run.py (--only NAMES, --iters N, --budget-s S, --dry-run).
exec "$(dirname "$0")/two_gpu_check.sh" --gpus 4 "$@"
