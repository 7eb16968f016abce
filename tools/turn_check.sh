#!/usr/bin/env bash
# The eager turn and the Mamba mixer's memory on one GPU, in one device call (about 8 minutes):
# the turn's GPU tests (bitwise against eager, peak within 2%), the hybrid GPU tests, the steady
# peaks with and without the turn (dense8 attn, hybrid mamba; deterministic mode, as the tests run),
# and the Mamba mixer's benchmark. Prints a short table last; full logs go to $OUT (or ./turn_check_out).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-turn_check_out}
mkdir -p "$OUT"
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
SWITCH=MEGATRON_CG_EAGER_TURN  # megatron/core/transformer/cuda_graphs/turn.py

python3 -m pytest -m gpu -q -rfEP --tb=short tests/unit_tests/transformer/cuda_graphs/test_graphs_gpu.py -k eager_turn \
    > "$OUT/turn_tests.log" 2>&1
turn_rc=$?
python3 -m pytest -m gpu -q -rfE --tb=short tests/unit_tests/models/hybrid tests/unit_tests/ssm > "$OUT/hybrid_tests.log" 2>&1
hybrid_rc=$?

peak() {  # config mode turn(0/1/all) [more pool_peak args] -> its steady-peak line (whole logs: peaks.log)
    env "$SWITCH=$3" python3 tools/pool_peak.py --config "$1" --mode "$2" --steady "${@:4}" \
        --extra="--deterministic-mode $VPP_EXTRA" > "$OUT/peak.log" 2>&1
    { echo "=== $*"; cat "$OUT/peak.log"; } >> "$OUT/peaks.log"
    grep -h "steady peak" "$OUT/peak.log"
    rm -f "$OUT/peak.log"
}
{
    for run in "dense8 eager 0" "dense8 local:attn 0" "dense8 local:attn 1" "dense8 local:attn all" \
               "dense8 local:mlp 1" "dense8 local:mlp all" "hybrid eager 0" "hybrid local:layer 0" \
               "hybrid local:mamba 0" "hybrid local:mamba 1" "hybrid local:mamba all"; do
        set -- $run
        VPP_EXTRA= ; echo "$1 $2 turn=$3: $(peak "$1" "$2" "$3")"
    done
    # The interleaved (VPP 2) order of pipeline rank 0 in one process, as the VPP memory test (issue 17).
    for mode in eager local:layer; do
        VPP_EXTRA="--global-batch-size 8 --untie-embeddings-and-output-weights"
        echo "dense8 $mode vpp rank 0: $(peak dense8 "$mode" 0 --vpp-rank 0)"
    done
} > "$OUT/peaks.txt"
python3 tools/bench_mamba.py --skip-sequential > "$OUT/bench_mamba.log" 2>&1
bench_rc=$?

echo
echo "== eager turn GPU tests: $(tail -n 1 "$OUT/turn_tests.log")"
grep -hE "^E  +AssertionError" "$OUT/turn_tests.log" | cut -c1-400
grep -hE "^(0|1|all) .*peak reserved" "$OUT/turn_tests.log"  # each case's peaks (the tests print them)
echo "== hybrid and SSM GPU tests: $(tail -n 1 "$OUT/hybrid_tests.log")"
grep -hE "^E  +AssertionError" "$OUT/hybrid_tests.log" | cut -c1-600
echo "== steady peaks (deterministic mode):"
cat "$OUT/peaks.txt"
echo "== Mamba mixer and scan (tools/bench_mamba.py):"
tail -n 8 "$OUT/bench_mamba.log"
exit $(( turn_rc || hybrid_rc || bench_rc ))
