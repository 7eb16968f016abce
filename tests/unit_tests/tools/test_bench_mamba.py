"""tools/bench_mamba.py runs end to end on the CPU at tiny sizes and writes its rows."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import bench_mamba  # noqa: E402


def test_bench_rows_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    argv = "--device cpu --dtype fp32 --batch 1 --seq 24 --hidden 32 --head-dim 8 --state 8 --groups 2"
    rows = bench_mamba.main(argv.split() + ["--chunks", "8", "16", "--iters", "1", "--warmup", "0", "--json", str(out)])
    assert [r["row"] for r in rows] == ["scan sequential", "scan chunked 8", "scan chunked 16", "mixer torch"]
    for r in rows[:3]:
        assert r["rel_err"] < 1e-5 and r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0  # fp32 against the fp32 recurrence
    assert json.loads(out.read_text())["rows"] == rows
    assert "scan chunked 16" in capsys.readouterr().out
