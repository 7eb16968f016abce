"""tools/bench_moe_gemm.py: its row counts, a CPU smoke run of every path, and the GPU run's time."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tools"))
import bench_moe_gemm  # noqa: E402


def test_fresh_counts_are_never_repeated_and_sum_to_the_rows():
    source = bench_moe_gemm.CountSource(8, 8192, seed=1, fresh=True)
    source.seen.update(range(1000, 1010))
    draws = [source.draw() for _ in range(30)]
    flat = [c for counts in draws for c in counts]
    assert all(sum(counts) == 8192 and len(counts) == 8 for counts in draws)
    assert len(set(flat)) == len(flat) and not set(flat) & set(range(1000, 1010))
    assert max(flat) - min(flat) > 200  # spread around the mean of 1024


def test_repeating_counts_may_repeat():
    source = bench_moe_gemm.CountSource(2, 4, seed=0)
    draws = {tuple(source.draw()) for _ in range(50)}
    assert all(sum(d) == 4 for d in draws) and len(draws) < 50


def test_cpu_smoke_run_reports_every_path(tmp_path):
    out = tmp_path / "r.json"
    argv = ["--device", "cpu", "--experts", "4", "--tokens", "32", "--hidden", "16", "--ffn", "32"]
    argv += ["--iters", "2", "--warmup", "1", "--gemm-calls", "3", "--multiples", "8", "16", "--json", str(out)]
    bench_moe_gemm.main(argv)
    r = json.loads(out.read_text())
    assert [row["name"] for row in r["layer"]] == ["loop, new counts", "bucketed:8", "bucketed:16"]
    assert all(row["host_ms"] > 0 and row["gemm_calls"] == 24 for row in r["layer"])
    assert {(g["gemm"], g["rows"]) for g in r["gemm"]} == {
        (k, label) for k in ("fc1 forward", "fc2 forward", "fc1 wgrad") for label in ("seen", "new")
    }
    assert "grouped" in r["note"]


@pytest.mark.gpu
def test_default_gpu_run_finishes_within_a_minute(tmp_path):
    """The default run (the ``moe`` config's sizes, every path, grouped included) in < 60 s."""
    out = tmp_path / "r.json"
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_moe_gemm.py"), "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    elapsed = time.perf_counter() - start
    assert done.returncode == 0, done.stderr[-3000:]
    assert elapsed < 60, elapsed
    r = json.loads(out.read_text())
    names = [row["name"] for row in r["layer"]]
    assert names == ["loop, new counts", "bucketed:64", "bucketed:128", "bucketed:256", "grouped"]
    assert all(row["device_ms"] > 0 for row in r["layer"])
