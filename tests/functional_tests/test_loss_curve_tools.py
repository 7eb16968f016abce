"""tools/compare_loss_curves.py, tools/plot_loss_curves.py and tools/regenerate_goldens.py."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _tool(name):
    spec = importlib.util.spec_from_file_location(f"tool_under_test_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


compare = _tool("compare_loss_curves")


def write_metrics(path, losses, start=1, extra=None):
    with open(path, "w") as f:
        for i, loss in enumerate(losses, start=start):
            f.write(json.dumps(dict({"iteration": i, "lm loss": loss, "grad-norm": 1.0}, **(extra or {}))) + "\n")
    return str(path)


def test_load_curve_reads_both_formats(tmp_path):
    jsonl = write_metrics(tmp_path / "m.jsonl", [10.123456789, 9.5, 9.25])
    curve = compare.load_curve(jsonl)
    assert curve == {1: 10.123456789, 2: 9.5, 3: 9.25}
    golden = compare.golden_from_curves({"lm loss": curve})
    assert golden == {
        "lm loss": {"start_step": 1, "end_step": 3, "step_interval": 1, "values": {"1": 10.12346, "2": 9.5, "3": 9.25}}
    }
    path = tmp_path / "golden.json"
    path.write_text(json.dumps(golden))
    assert compare.load_curve(str(path)) == {1: 10.12346, 2: 9.5, 3: 9.25}
    # A single-line metrics file is still a metrics file, not a golden.
    one = write_metrics(tmp_path / "one.jsonl", [7.0])
    assert compare.load_curve(one) == {1: 7.0}
    with pytest.raises(ValueError, match="no 'num-zeros'"):
        compare.load_curve(jsonl, "num-zeros")
    with pytest.raises(ValueError, match="refusing"):
        compare.golden_from_curves({"lm loss": {1: float("nan")}})


def test_resumed_metrics_file_keeps_the_later_record(tmp_path):
    path = tmp_path / "m.jsonl"
    write_metrics(path, [5.0, 4.0, 3.0])
    with open(path, "a") as f:
        f.write(json.dumps({"iteration": 3, "lm loss": 2.5}) + "\n")
    assert compare.load_curve(str(path))[3] == 2.5


def test_exact_mode_rounds_to_five_decimals():
    ref = {1: 10.123454, 2: 9.0, 3: 8.0}
    assert compare.compare_curves(ref, {1: 10.1234541, 2: 9.0, 3: 8.0}).ok
    result = compare.compare_curves(ref, {1: 10.123454, 2: 9.00002, 3: 7.9})
    assert not result.ok and result.first_mismatch == 2
    text = result.text()
    assert "first differing step: 2" in text and "MISMATCH at 2 of 3 steps" in text


def test_tolerance_and_missing_steps():
    ref = {1: 10.0, 2: 9.0, 3: 8.0}
    assert compare.compare_curves(ref, {1: 10.001, 2: 9.0009, 3: 8.0}, rtol=1e-3).ok
    assert not compare.compare_curves(ref, {1: 10.02, 2: 9.0, 3: 8.0}, rtol=1e-3).ok
    result = compare.compare_curves(ref, {1: 10.0, 2: 9.0})
    assert not result.ok and result.first_mismatch == 3 and "missing in actual" in result.text()
    # A sampled golden (steps 1 and 3) against a run logged every step: the common steps count.
    sampled = compare.compare_curves({1: 10.0, 3: 8.0}, {1: 10.0, 2: 9.5, 3: 8.0, 4: 7.0})
    assert sampled.ok and "2 steps only in actual not compared (2..4)" in sampled.text()
    nan = compare.compare_curves(ref, {1: 10.0, 2: float("nan"), 3: 8.0})
    assert not nan.ok and nan.first_mismatch == 2


def test_compare_cli_exit_codes(tmp_path):
    a = write_metrics(tmp_path / "a.jsonl", [6.0, 5.5, 5.25])
    b = write_metrics(tmp_path / "b.jsonl", [6.0, 5.5, 5.3])
    tool = os.path.join(REPO, "tools", "compare_loss_curves.py")
    same = subprocess.run([sys.executable, tool, a, a], capture_output=True, text=True)
    assert same.returncode == 0 and "MATCH" in same.stdout
    differ = subprocess.run([sys.executable, tool, a, b], capture_output=True, text=True)
    assert differ.returncode == 1 and "first differing step: 3" in differ.stdout
    loose = subprocess.run([sys.executable, tool, a, b, "--rtol", "0.02", "--metric", "lm loss", "--metric", "grad-norm"],
                           capture_output=True, text=True)  # fmt: skip
    assert loose.returncode == 0, loose.stdout
    missing = subprocess.run([sys.executable, tool, a, str(tmp_path / "nope.jsonl")], capture_output=True, text=True)
    assert missing.returncode == 2 and "nope.jsonl" in missing.stderr


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    plot = _tool("plot_loss_curves")
    a = write_metrics(tmp_path / "a.jsonl", [6.0, 5.5, 5.25])
    b = write_metrics(tmp_path / "b.jsonl", [6.0, 5.4, 5.3])
    out = plot.plot([a, b], str(tmp_path / "out" / "loss.png"), labels=["eager", "graphs"])
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="2 runs"):
        plot.plot([a, b], str(tmp_path / "x.png"), labels=["one"])


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch):
    plot = _tool("plot_loss_curves")
    a = write_metrics(tmp_path / "a.jsonl", [6.0, 5.5])
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    with pytest.raises(SystemExit, match="pip install matplotlib"):
        plot.plot([a], str(tmp_path / "x.png"))


def test_regenerate_refuses_borrowed_goldens(capsys):
    regen = _tool("regenerate_goldens")
    assert regen.main(["--case", "gpt_dense_gpu_cuda_graph"]) == 2
    assert "regenerate gpt_dense_gpu instead" in capsys.readouterr().err
    assert regen.main(["--case", "no_such_case"]) == 2
