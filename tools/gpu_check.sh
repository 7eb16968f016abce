#!/usr/bin/env bash
# Every GPU test and benchmark (in one go, or in parts: PART below); prints a short table last.
# Full logs go to $OUT (the device tool's output folder) or ./gpu_check_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# PART splits the run for the device's 10-minute calls: "tests" every GPU test (close to 10 minutes
# on an H100, so a and b in two calls are safer), "a" the transformer tests (graphs, MoE), "b" the
# other tests, "bench" the benchmark alone; unset: everything.
PART=${PART:-all}
case "$PART" in
    a) TESTS="tests/unit_tests/transformer" ;;
    b) TESTS="tests --ignore=tests/unit_tests/transformer" ;;
    all | tests) TESTS="tests" ;;
    bench) TESTS="" ;;
    *) echo "PART=$PART: use tests, a, b, bench or leave it unset" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
tests_rc=0 bench_rc=0
if [ -n "$TESTS" ]; then
    python3 -m pytest -m gpu -q -rfE $TESTS ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log"
    tests_rc=${PIPESTATUS[0]}
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    python3 tools/graph_bench.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
fi
echo
[ -n "$TESTS" ] && echo "== GPU tests ($TESTS): $(tail -n 1 "$OUT/pytest_gpu.log")"
if [ -f "$OUT/bench.log" ]; then
    echo "== benchmark (ms/it median of it 10..50; peak = NVML used, polled; pool = our graph pool reserved):"
    sed -n '/^config /,$p' "$OUT/bench.log"
fi
exit $(( tests_rc || bench_rc ))
