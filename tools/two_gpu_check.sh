#!/usr/bin/env bash
# The two-GPU validation table in one call of at most 10 minutes (tools/two_gpu_run.py):
# TP=2+SP, PP=2, PP=2 x VPP=2 eager and graphed, the one-GPU reference, MoE EP=2, and a
# TP=2 torch_dist checkpoint loaded at TP=1 and PP=2. Logs, metrics and two_gpu.json go
# to $OUT (the device tool's output folder) or ./two_gpu_out; the table is printed last.
# Arguments go to two_gpu_run.py (--only NAMES, --iters N, --budget-s S, --dry-run; --gpus 4:
# the four-GPU table, as tools/four_gpu_check.sh runs it).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-two_gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'devices', torch.cuda.device_count())"
} 2>&1 | tee "$OUT/gpu.txt"
# The runs stop themselves within --budget-s (default 560 s); this is the backstop.
timeout -k 10 585 python3 tools/two_gpu_run.py --out "$OUT" "$@" 2>&1 | tee "$OUT/two_gpu_run.log"
exit "${PIPESTATUS[0]}"
