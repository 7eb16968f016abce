#!/usr/bin/env bash
# Every GPU test and benchmark (in one go, or in parts: PART below); prints a short table last.
# Full logs go to $OUT (the device tool's output folder) or ./gpu_check_out.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu_check_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # the A/B runs below work in another folder
export PYTHONPATH=.${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
# PART splits the run for the device's 10-minute calls: "tests" every GPU test (close to 10 minutes
# on an H100, so a and b in two calls are safer), "a" the transformer tests (graphs, MoE), "b" the
# other tests, "bench" the benchmark alone, "gaps" what is live at the steady peak, eager against
# graphed, for the memory gaps still open and unfused attn mlp (tools/pool_peak.py --steady; one
# tarball, since the device returns only so many files); "mem" the GPU tests with a memory bound
# (hybrid, MoE, interleaved chunks, eager turns) and the dropped-trainer leak test, each in a
# process of its own, about 7 minutes, their numbers in the table (and, if a dropped trainer
# survived, tools/holders.py on a dropped interleaved-chunks run); "hybrid" the Mamba GPU tests (scan
# kernels too; MEGATRON_SSD_KERNELS=torch puts every hybrid run on the PyTorch scan), the
# hybrid memory test (each run in its own process), pool_peak.py --steady for hybrid eager, mlp and
# whole layers and the capture-time view of whole layers (every pool, with each growth its free bytes
# would have held), about 3 minutes on an H200; "growth" every growth of the hybrid eager cache
# and each phase's peak reserved, with what lives outside the pools at the capture's start and at the
# end (pool_peak.py --growth: eager, every scope, and a what-if: the cache's unused pages released
# after capture), about 1.5 minutes on an H100, every run's output in growth.tgz;
# unset: every GPU test and the benchmark.
# With PART=mem, MEM_SELECT replaces the tests' selection (a pytest -k expression) and AB_TREE names
# a folder holding another tree (e.g. `git archive BRANCH | tar x -C ab_tree`, untracked so that it
# travels to the device): each test then runs in this tree and in that one, one after the other, so
# both are measured on the same machine at about the same time; that tree's log is pytest_gpu_ab.log.
PART=${PART:-all}
case "$PART" in
    mem)
        TESTS="tests/unit_tests/models/hybrid/test_hybrid_graphs_gpu.py tests/unit_tests/transformer/moe/test_moe_graphs_gpu.py
               tests/unit_tests/transformer/cuda_graphs/test_graphs_gpu.py"
        SELECT=${MEM_SELECT:-"dropped_graphed or issue_config or interleaved_chunks_peak or (eager_turns and all)"}
        ;;
    hybrid) TESTS="tests/unit_tests/ssm/test_mamba_gpu.py tests/unit_tests/ssm/test_ssd_kernels.py
            tests/unit_tests/models/hybrid/test_hybrid_graphs_gpu.py" ;;
    a) TESTS="tests/unit_tests/transformer" ;;
    b) TESTS="tests --ignore=tests/unit_tests/transformer" ;;
    all | tests) TESTS="tests" ;;
    bench | gaps | growth) TESTS="" ;;
    *) echo "PART=$PART: use tests, a, b, mem, hybrid, growth, bench, gaps or leave it unset" >&2; exit 2 ;;
esac
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$OUT/gpu.txt"
tests_rc=0 bench_rc=0 gaps_rc=0
if [ "$PART" = mem ]; then
    # One process per test: a training process runs one trainer, and what an earlier test left in the
    # process (allocator segments, sessions) moved these peaks by up to 300 MiB (README, VPP).
    mapfile -t ids < <(python3 -m pytest -m gpu -q --collect-only $TESTS -k "$SELECT" 2>/dev/null | grep '::')
    : >"$OUT/pytest_gpu.log"
    trees=(.)
    if [ -n "${AB_TREE:-}" ]; then
        [ -d "$AB_TREE" ] || { echo "AB_TREE=$AB_TREE: no such folder" >&2; exit 2; }
        trees+=("$AB_TREE")
        : >"$OUT/pytest_gpu_ab.log"
    fi
    passed=0 failed=0 leaked=0
    for id in "${ids[@]}"; do
        for tree in "${trees[@]}"; do
            log="$OUT/pytest_gpu.log"
            [ "$tree" = . ] || log="$OUT/pytest_gpu_ab.log"
            if (cd "$tree" && python3 -m pytest -m gpu -q -rfE -rP "$id" ${PYTEST_ARGS:-}) >>"$log" 2>&1; then
                passed=$((passed + 1))
            else
                failed=$((failed + 1))
                [[ $id == *dropped_graphed* && $tree == . ]] && leaked=1
                echo "FAILED $id${AB_TREE:+ in $tree}"
            fi
        done
    done
    echo "one process per test: $passed passed, $failed failed" | tee -a "$OUT/pytest_gpu.log"
    tests_rc=$((failed > 0 || ${#ids[@]} == 0))
    if [ "$leaked" = 1 ]; then  # a dropped trainer survived: what holds a dropped run of interleaved chunks
        timeout 180 python3 tools/holders.py --config dense8 --mode local:layer --vpp-rank 1 \
            --extra="--global-batch-size 8 --untie-embeddings-and-output-weights --deterministic-mode" \
            >"$OUT/holders.txt" 2>&1 || echo "holders.py: exit $?" >>"$OUT/holders.txt"
    fi
elif [ -n "$TESTS" ]; then
    passes=""  # the hybrid part shows what passing tests print (their peaks)
    [ "$PART" = hybrid ] && passes="-rP"
    python3 -m pytest -m gpu -q -rfE $passes $TESTS ${PYTEST_ARGS:-} 2>&1 | tee "$OUT/pytest_gpu.log"
    tests_rc=${PIPESTATUS[0]}
fi
if [ "$PART" = hybrid ]; then  # where the pools' memory goes, against eager's steady peak
    for mode in eager local:mlp local:layer; do
        timeout 90 python3 tools/pool_peak.py --steady --top 16 --config hybrid --mode "$mode" \
            --extra=--deterministic-mode >"$OUT/pool_peak_${mode/:/_}.txt" 2>&1 || gaps_rc=1
    done
    timeout 90 python3 tools/pool_peak.py --all-pools --top 16 --config hybrid --mode local:layer \
        --extra=--deterministic-mode >"$OUT/pool_capture_local_layer.txt" 2>&1 || gaps_rc=1
fi
if [ "$PART" = growth ]; then
    mkdir -p "$OUT/growth"  # one tarball at the end: the device returns at most 8 files
    for run in "eager" "local:layer" "local:layer --empty-cache-after-capture" "local:mamba" "local:attn" \
        "local:mlp"; do  # and a what-if
        name=${run/:/_}
        timeout 120 python3 tools/pool_peak.py --growth --config hybrid --mode $run --extra=--deterministic-mode \
            >"$OUT/growth/${name// --/_}.txt" 2>&1 || gaps_rc=1  # e.g. growth/local_layer_empty-cache-after-capture.txt
    done
fi
if [ "$PART" = all ] || [ "$PART" = bench ]; then
    python3 tools/graph_bench.py --out "$OUT/bench" ${BENCH_ARGS:-} 2>&1 | tee "$OUT/bench.log"
    bench_rc=${PIPESTATUS[0]}
fi
if [ "$PART" = gaps ]; then
    mkdir -p "$OUT/gaps"
    vpp="--global-batch-size 8 --untie-embeddings-and-output-weights --deterministic-mode"
    gap() {  # name, then pool_peak's arguments
        local name=$1
        shift
        timeout 120 python3 tools/pool_peak.py --steady --top 14 --dump "$OUT/gaps/$name.json.gz" "$@" \
            >"$OUT/gaps/$name.txt" 2>&1 || { echo "$name: exit $?" >>"$OUT/gaps/failed.txt"; gaps_rc=1; }
    }
    for mode in eager local:layer; do
        gap "vpp0_${mode/:/_}" --config dense8 --vpp-rank 0 --mode "$mode" --extra="$vpp --no-cuda-graph-postprocess"
        gap "vpp1_${mode/:/_}" --config dense8 --vpp-rank 1 --mode "$mode" --extra="$vpp"
    done
    for mode in eager local:mamba local:attn local:mlp local:layer; do
        gap "hybrid_${mode/:/_}" --config hybrid --mode "$mode" --extra="--deterministic-mode"
    done
    for mode in eager local:attn+mlp; do
        gap "unfused_${mode/:/_}" --config dense8 --mode "$mode" \
            --extra="--deterministic-mode --no-gradient-accumulation-fusion"
    done
    tar czf "$OUT/gaps.tgz" -C "$OUT" gaps && rm -r "$OUT/gaps"
fi
echo
[ -n "$TESTS" ] && echo "== GPU tests ($TESTS): $(tail -n 1 "$OUT/pytest_gpu.log")"
if [ "$PART" = mem ] || [ "$PART" = hybrid ]; then
    for log in "$OUT/pytest_gpu.log" "$OUT/pytest_gpu_ab.log"; do
        [ -f "$log" ] || continue
        echo "== peaks (graphed vs eager, MiB)$([ "$log" = "$OUT/pytest_gpu.log" ] || echo " in AB_TREE=$AB_TREE"):"
        grep -E "^(scope '|rank [0-9]: graphed|(0|1|all) (attn|mlp))" "$log" | sort -u || true
    done
    if [ -f "$OUT/holders.txt" ]; then
        echo "== a dropped graphed run of interleaved chunks (tools/holders.py, whole output in holders.txt):"
        grep -E "^(after the drop|[0-9]+ holders|holders.py)" "$OUT/holders.txt" || true
    fi
fi
if [ "$PART" = hybrid ]; then
    echo "== steady peaks (tools/pool_peak.py --steady; whole output in pool_peak_*.txt):"
    cat "$OUT"/pool_peak_*.txt | grep -E "steady peak" || true
    echo "== whole layers at capture (pool_capture_local_layer.txt):"
    grep -E "pool reserved|^growth|^  \+" "$OUT/pool_capture_local_layer.txt" || true
fi
if [ "$PART" = growth ]; then
    echo "== each phase's peak per run (every growth of the eager cache in growth.tgz):"
    for f in "$OUT"/growth/*.txt; do
        echo "-- $(basename "$f" .txt)"
        grep -E "^eager cache at|^peak reserved per phase|^pools reserved|Error" "$f" || true
    done
    tar czf "$OUT/growth.tgz" -C "$OUT" growth && rm -r "$OUT/growth"
fi
if [ -f "$OUT/bench.log" ]; then
    echo "== benchmark (ms/it median of it 10..50; peak = NVML used, polled; pool = our graph pool reserved):"
    sed -n '/^config /,$p' "$OUT/bench.log"
fi
if [ -f "$OUT/gaps.tgz" ]; then
    echo "== steady peaks (tools/pool_peak.py --steady; logs and traces in gaps.tgz):"
    tar xzf "$OUT/gaps.tgz" -O --wildcards 'gaps/*.txt' | grep -E "steady peak|: exit" || true
fi
exit $(( tests_rc || bench_rc || gaps_rc ))
