"""tools/graph_bench.py's table: ratios against eager of the same config, lean rows (CPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import graph_bench  # noqa: E402


def _row(mode, ms, pipe, peak_gib, losses, graphs=None):
    peak = int(peak_gib * 2**30)
    return {
        "config": "dense8",
        "mode": mode,
        "ms_per_iter": ms,
        "pipelined_ms_per_iter": pipe,
        "tflops_per_gpu": 100.0,
        "peak_device_bytes": peak,
        "steady_peak_device_bytes": peak,
        "losses": losses,
        "graphs": graphs or {},
    }


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


def test_rows_without_an_eager_run_show_dashes_not_nan():
    line = graph_bench.table([_row("local:mlp", 16.2, 15.1, 4.4, [1.0])]).splitlines()[2]
    assert "nan" not in line
    assert line.split()[2:5] == ["16.20", "-", "15.10"] and line.split()[7:9] == ["-", "-"]


def test_repeat_runs_round_robin_and_merges_medians(tmp_path, monkeypatch, capsys):
    order = []
    ms = {"eager": iter([17.0, 15.0, 16.0]), "lean": iter([13.0, 12.0, 14.0])}

    def fake_child(config, mode, args, stem):
        order.append((mode, Path(stem).name))
        t = next(ms[mode])
        return _row(mode, t, t - 1, 4.0 if mode == "eager" else 3.9 + t / 1000, [t])

    monkeypatch.setattr(graph_bench, "run_child", fake_child)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "graph_bench.py",
            "--configs",
            "dense8",
            "--modes",
            "eager",
            "lean",
            "--repeat",
            "3",
            "--out",
            str(tmp_path),
            "--no-matmul-peak",
        ],
    )
    graph_bench.main()
    assert [m for m, _ in order] == ["eager", "lean"] * 3  # alternating: drift hits both alike
    assert order[-1][1] == "dense8_lean_run3"
    out = capsys.readouterr().out
    eager = next(line for line in out.splitlines() if line.startswith("dense8    eager"))
    lean = next(line for line in out.splitlines() if line.startswith("dense8    lean"))
    assert eager.split()[2:5] == ["16.00", "1.000", "15.00"]  # medians
    assert lean.split()[2:4] == ["13.00", "0.812"]
    assert "dense8 eager: ms/it of each run, in run order: 17.00 15.00 16.00" in out
    merged = graph_bench.merge_runs([_row("lean", 13.0, 12.0, 3.9, []), _row("lean", 12.0, 11.0, 3.95, [])])
    assert merged["peak_device_bytes"] == int(3.95 * 2**30) and merged["tflops_per_gpu"] == 100.0 * 13.0 / 12.5


def test_extra_flags_reach_the_child_run_even_when_they_start_with_dashes():
    parser = graph_bench.build_parser()
    args = parser.parse_args(["--configs", "dense8", "--extra=--deterministic-mode --bf16"])
    cmd = graph_bench.child_command("dense8", "local:attn", args, "out.json")
    child = parser.parse_args(cmd[2:])
    assert (child.config, child.mode, child.json) == ("dense8", "local:attn", "out.json")
    assert child.extra == "--deterministic-mode --bf16"
