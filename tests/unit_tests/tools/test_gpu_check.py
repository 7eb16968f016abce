"""tools/gpu_check.sh on the CPU, with ``python3`` and ``nvidia-smi`` replaced by stubs that log their
arguments: which commands each part runs, where their output goes, and the summary it prints. The
GPU machine's minutes are few; a broken branch of this script should fail here first."""

import os
import subprocess
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "gpu_check.sh"
STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >>"$CALLS"
echo "$PWD" >>"$CALLS.cwd"
if [[ "$*" == *"--collect-only"* ]]; then echo "tests/x_gpu.py::test_one"; fi
if [[ "$*" == *"--growth"* ]]; then
    echo "eager cache at the end, large blocks: reserved 1.0 MiB"
    echo "peak reserved per phase (MiB): the capture 3.0"
fi
exit 0
"""


def run_part(tmp_path: Path, part: str, **more_env: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for name in ("python3", "nvidia-smi"):
        (stubs / name).write_text(STUB)
        (stubs / name).chmod(0o755)
    calls = tmp_path / "calls.txt"
    env = {**os.environ, "PATH": f"{stubs}:{os.environ['PATH']}", "CALLS": str(calls), "PART": part}
    env["OUT"] = str(tmp_path / "out")
    env.update(more_env)
    done = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=120)
    return done, calls.read_text().splitlines() if calls.exists() else []


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)]).returncode == 0


def test_an_unknown_part_is_refused_with_the_parts_it_takes(tmp_path):
    done, calls = run_part(tmp_path, "everything")
    assert done.returncode == 2
    assert "PART=everything: use tests, a, b, mem, hybrid, growth, bench, gaps" in done.stderr
    assert calls == []


def test_growth_runs_eager_whole_layers_and_each_what_if_into_its_own_file(tmp_path):
    done, calls = run_part(tmp_path, "growth")
    assert done.returncode == 0, done.stdout + done.stderr
    runs = [c for c in calls if "pool_peak.py --growth" in c]
    modes = [c.split("--mode ", 1)[1].split(" --extra")[0] for c in runs]
    assert modes == [
        "eager",
        "local:layer",
        "local:layer --empty-cache-after-capture",
        "local:mamba",
        "local:attn",
        "local:mlp",
    ]
    assert all(c.endswith("--extra=--deterministic-mode") for c in runs)
    assert not any("pytest" in c for c in calls), "the growth part runs no test"
    with tarfile.open(tmp_path / "out" / "growth.tgz") as tar:  # one file: the device returns at most 8
        files = sorted(tar.getnames())
    assert len(files) == 7 and "growth/local_layer_empty-cache-after-capture.txt" in files  # and the folder
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["gpu.txt", "growth.tgz"]
    assert done.stdout.count("eager cache at the end") == 6
    assert done.stdout.count("peak reserved per phase") == 6


@pytest.mark.parametrize("part", ["hybrid", "mem", "a", "b"])
def test_test_parts_run_pytest_on_their_files(tmp_path, part):
    done, calls = run_part(tmp_path, part)
    assert done.returncode == 0, done.stdout + done.stderr
    tests = [c for c in calls if "-m pytest -m gpu" in c and "--collect-only" not in c]
    assert tests, calls
    if part == "b":
        assert "--ignore=tests/unit_tests/transformer" in tests[0]
    if part == "mem":  # one process per collected test
        assert tests == ["python3 -m pytest -m gpu -q -rfE -rP tests/x_gpu.py::test_one"]
    if part == "hybrid":
        assert "-rP" in tests[0] and "test_hybrid_graphs_gpu.py" in tests[0]
        assert sum("pool_peak.py --steady" in c for c in calls) == 3
        assert not any("pool_peak.py --growth" in c for c in calls), "PART=growth runs those"
    assert "== GPU tests" in done.stdout


def test_mem_runs_each_test_in_this_tree_and_then_in_ab_tree(tmp_path):
    other = tmp_path / "ab_tree"
    other.mkdir()
    done, calls = run_part(tmp_path, "mem", AB_TREE=str(other), MEM_SELECT="eager_turns and all")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "-k eager_turns and all" in next(c for c in calls if "--collect-only" in c)
    tests = [i for i, c in enumerate(calls) if "-m pytest -m gpu" in c and "--collect-only" not in c]
    assert [calls[i] for i in tests] == ["python3 -m pytest -m gpu -q -rfE -rP tests/x_gpu.py::test_one"] * 2
    cwd = (tmp_path / "calls.txt.cwd").read_text().splitlines()
    assert [cwd[i] for i in tests] == [str(ROOT), str(other)]
    assert (tmp_path / "out" / "pytest_gpu_ab.log").exists()
    assert f"peaks (graphed vs eager, MiB) in AB_TREE={other}" in done.stdout


def test_mem_refuses_an_ab_tree_that_is_not_there(tmp_path):
    done, _ = run_part(tmp_path, "mem", AB_TREE=str(tmp_path / "missing"))
    assert done.returncode == 2 and "AB_TREE=" in done.stderr and "no such folder" in done.stderr
