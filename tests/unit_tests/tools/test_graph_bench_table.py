"""tools/graph_bench.py's table: ratios against eager of the same config, lean rows (CPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import graph_bench  # noqa: E402


def _row(mode, ms, pipe, peak_gib, losses, graphs=None):
    peak = int(peak_gib * 2**30)
    return {"config": "dense8", "mode": mode, "ms_per_iter": ms, "pipelined_ms_per_iter": pipe,
            "tflops_per_gpu": 100.0, "peak_device_bytes": peak, "steady_peak_device_bytes": peak,
            "losses": losses, "graphs": graphs or {}}


def test_table_ratios_lean_and_footnote():
    rows = [
        _row("eager", 20.0, 18.0, 4.0, [1.0, 2.0]),
        _row("lean", 12.0, 11.0, 3.9, [5.0, 6.0]),
        _row("local:layer", 10.0, 9.5, 4.04, [1.0, 2.0], {"pool_reserved_bytes": 2**30, "graphs": 18}),
    ]
    lines = graph_bench.table(rows).splitlines()
    eager, lean, layer = lines[2], lines[3], lines[4]
    assert eager.split()[:4] == ["dense8", "eager", "20.00", "1.000"]
    assert lean.split()[-1] == "-"  # another model: its losses are not compared
    assert layer.split()[2:5] == ["10.00", "0.500", "9.50"]
    assert "+1.00%" in layer and "1024.0" in layer and layer.split()[-1] == "True"
    assert lines[-1].startswith("loss==eager: bit for bit only")
