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


def _run_until_iteration_2(argv, send, **popen):
    proc = subprocess.Popen(
        [sys.executable, PRETRAIN, *argv], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen
    )
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "iteration        2/" in line:
            send(proc)
            break
    out = "".join(lines) + proc.stdout.read()
    return proc.wait(timeout=120), out


def test_exit_signal_sent_to_the_process_group_leaves_the_data_workers_serving(tmp_path):
    """--exit-signal SIGUSR1 to the launcher's whole process group (as a scheduler sends it): the data-loader
    workers outlive it (forked ones inherit the trainer's handler; spawned ones ignore it, see
    test_worker_lifetime.py), the trainer saves and exits 0."""
    c = tmp_path / "c"
    argv = FLAGS + ["--train-iters", "1000", "--save", str(c), "--exit-signal-handler", "--exit-signal", "SIGUSR1",
                    "--num-workers", "2", "--global-batch-size", "64"]  # fmt: skip
    code, out = _run_until_iteration_2(argv, lambda p: os.killpg(p.pid, signal.SIGUSR1), start_new_session=True)
    assert code == 0, out[-3000:]
    iteration, _ = read_tracker(str(c))
    assert f"exiting after iteration {iteration}: SIGUSR1 received (--exit-signal-handler)" in out


def test_exit_signal_handler_for_training_ends_in_order_with_status_0(tmp_path):
    argv = FLAGS + ["--train-iters", "1000", "--exit-signal-handler-for-training"]
    code, out = _run_until_iteration_2(argv, lambda p: p.send_signal(signal.SIGINT))
    assert code == 0, out[-3000:]
    assert "Termination requested. Performing orderly shutdown." in out and "Traceback" not in out


def test_exit_signal_must_be_catchable():
    import pytest

    with pytest.raises(ValueError, match="--exit-signal SIGKILL is not a signal a process can catch"):
        build("--exit-signal", "SIGKILL")
