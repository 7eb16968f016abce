"""Preemption: --exit-signal-handler and --exit-duration-in-mins save and exit 0 (subprocesses, CPU)."""

import os
import signal
import subprocess
import sys

from megatron.training.checkpointing import read_tracker
from tests.unit_tests.training.test_checkpointing import FLAGS, REPO, build

ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
PRETRAIN = os.path.join(REPO, "pretrain_gpt.py")


def test_sigterm_saves_at_the_end_of_the_iteration_and_exits_0(tmp_path):
    c = tmp_path / "c"
    argv = FLAGS + ["--train-iters", "1000", "--save", str(c), "--exit-signal-handler"]
    proc = subprocess.Popen(
        [sys.executable, PRETRAIN, *argv], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration        2/" in line:
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.stdout.read()
    assert proc.wait(timeout=120) == 0, out[-3000:]
    iteration, _ = read_tracker(str(c))
    assert 2 <= iteration < 1000
    assert f"exiting after iteration {iteration}: SIGTERM received (--exit-signal-handler)" in out
    assert f"successfully saved checkpoint from iteration {iteration:7d}" in out
    assert f"iteration {iteration + 1:8d}/" not in out  # stopped at the end of that iteration
    assert build("--train-iters", 1000, "--load", c).iteration == iteration


def test_exit_duration_saves_and_exits_0(tmp_path):
    c = tmp_path / "c"
    argv = FLAGS + ["--train-iters", "1000", "--save", str(c), "--exit-duration-in-mins", "0.0001"]
    proc = subprocess.run([sys.executable, PRETRAIN, *argv], env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert read_tracker(str(c)) == (1, False)
    assert "exiting after iteration 1: --exit-duration-in-mins 0.0001 reached" in proc.stdout
