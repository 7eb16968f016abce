#!/usr/bin/env bash
# Every GPU test and benchmark in one go; prints a short table last.
# Full logs go to $OUT (the device tool's output folder) or ./gpu_check_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -m gpu -q -rfE tests ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log"
tests_rc=${PIPESTATUS[0]}
python3 tools/graph_bench.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
bench_rc=${PIPESTATUS[0]}
echo
echo "== GPU tests: $(tail -n 1 "$OUT/pytest_gpu.log")"
echo "== benchmark (ms/it median of it 10..50; peak = NVML used, polled; pool = our graph pool reserved):"
sed -n '/^config /,$p' "$OUT/bench.log"
exit $(( tests_rc || bench_rc ))
