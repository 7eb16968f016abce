"""One run per --save folder, unwritable or full --save folders, --load pointing at a file (CPU)."""

import errno
import io
import os
import signal
import socket
import subprocess
import sys

import pytest
import torch

from megatron.training import checkpointing
from megatron.training.checkpointing import read_tracker
from megatron.training.save_lock import LOCK_FILENAME, SaveLock
from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_checkpointing import REPO, _Counter, build, run

_HOLDER = r"""
import sys
from megatron.training.save_lock import SaveLock
with SaveLock(sys.argv[1]):
    print("locked", flush=True)
    sys.stdin.read()
"""


def _holder(folder):
    """A second process that holds the lock of ``folder`` until its stdin closes."""
    env = dict(os.environ, PYTHONPATH=REPO, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(folder)], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_second_run_on_one_save_folder_refuses_and_names_the_holder(tmp_path):
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    leftover = c / "iter_0000004.tmp-999999"  # looks like the other run's save in progress
    holder = _holder(c)
    try:
        leftover.mkdir()
        with pytest.raises(ValueError) as info:
            build("--train-iters", 4, "--save", c, "--load", c)
        msg = str(info.value)
        assert f"--save {c} is in use by another run" in msg
        assert f"host {socket.gethostname()!r}, pid {holder.pid}" in msg
        assert leftover.is_dir() and read_tracker(str(c)) == (2, False)  # nothing of the other run touched
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert not (c / LOCK_FILENAME).exists()  # released by the holder
    assert build("--train-iters", 4, "--save", c, "--load", c).iteration == 2


def test_lock_of_a_dead_process_is_removed_and_its_leftovers_cleared(tmp_path, capsys):
    c = tmp_path / "c"
    holder = _holder(c)
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=60)
    assert (c / LOCK_FILENAME).exists()
    (c / "iter_0000002.tmp-4242").mkdir()  # a save killed midway, by that process
    trainer = run("--train-iters", 2, "--save", c)
    assert f"removed the stale lock {c / LOCK_FILENAME}" in capsys.readouterr().out
    assert trainer.iteration == 2
    assert sorted(os.listdir(c)) == ["iter_0000002", "latest_checkpointed_iteration.txt"]


def test_lock_held_on_another_host_is_trusted(tmp_path):
    c = tmp_path / "c"
    c.mkdir()
    (c / LOCK_FILENAME).write_text('{"host": "node-17", "pid": 1, "started": 0}')
    with pytest.raises(ValueError, match=r"host 'node-17', pid 1 .*delete .*save.lock"):
        SaveLock(str(c)).acquire()


def test_lock_is_reentrant_in_one_process_and_released(tmp_path):
    lock = SaveLock(str(tmp_path)).acquire()
    again = SaveLock(str(tmp_path)).acquire()
    again.release()
    lock.release()
    assert os.listdir(tmp_path) == []


def test_save_and_load_paths_that_are_files(tmp_path):
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match=r"--save .*file is a file, not a folder"):
        build("--train-iters", 2, "--save", not_a_dir)
    with pytest.raises(ValueError, match=r"--save .*file/sub cannot be created \(Not a directory\)"):
        build("--train-iters", 2, "--save", not_a_dir / "sub")
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    pt = checkpointing.get_checkpoint_name(str(c), 2)
    with pytest.raises(ValueError, match=rf"--load {pt} is a file; .*e\.g\. --load {c}\."):
        build("--train-iters", 4, "--load", pt)


class _FullDisk(io.RawIOBase):
    """A file that takes ``room`` bytes, then fails like a full disk."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def writable(self):
        return True

    def write(self, b):
        if len(b) > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(b)
        return self.f.write(b)


def test_full_disk_names_the_folder_and_removes_the_partial_save(tmp_path, monkeypatch):
    c = tmp_path / "c"
    trainer = build("--train-iters", 4, "--save", c)
    trainer.train()
    assert read_tracker(str(c)) == (4, False)
    real_save = torch.save
    monkeypatch.setattr(torch, "save", lambda obj, f: real_save(obj, _FullDisk(f, 5000)))
    trainer.iteration = 5
    with pytest.raises(RuntimeError, match=rf"saving iteration 5 failed: no space left on {c}\. .*iteration 4"):
        trainer.save_checkpoint()
    assert sorted(os.listdir(c)) == ["iter_0000004", "latest_checkpointed_iteration.txt"]  # no temp folder
    assert read_tracker(str(c)) == (4, False)


def _save_fails_on_rank_1(rank, world, save_dir):
    import time

    from megatron.core.parallel_config import ParallelConfig
    from megatron.core.parallel_state import build_groups
    from megatron.training.arguments import parse_args
    from megatron.training.train_state import TrainState

    layout = ParallelConfig(world_size=world, tensor_model_parallel_size=2).resolve()
    pg = build_groups(layout, rank=rank, world_size=world, device=torch.device("cpu"))
    cfg = parse_args(["--mock-data", "--vocab-size", "64", "--save", save_dir, "--ckpt-format", "torch"])
    state = {
        "model": torch.nn.Linear(2, 2),
        "optimizer": _Counter(1),
        "opt_param_scheduler": _Counter(2),
        "train_state": TrainState(iteration=3),
    }
    if rank == 1:  # both ranks write a file (TP = 2); this one's disk is full

        def full_disk(contents, path):
            raise OSError(errno.ENOSPC, "No space left on device")

        checkpointing._write_file = full_disk
    start = time.monotonic()
    try:
        checkpointing.save_checkpoint(state, cfg, pg)
    except RuntimeError as e:
        return str(e), time.monotonic() - start
    return None, time.monotonic() - start


def test_a_failed_save_on_one_rank_stops_every_rank_naming_it(tmp_path):
    # Without the exchange, rank 0 would wait in the barrier until the collective timeout.
    c = tmp_path / "c"
    results = run_distributed(_save_fails_on_rank_1, 2, str(c), timeout=60)
    (msg0, took0), (msg1, took1) = results
    assert msg1 is not None and f"saving iteration 3 failed on rank 1: no space left on {c}" in msg1
    assert msg0 is not None and "saving iteration 3 failed on rank 1 (its log says why)" in msg0
    assert "no earlier checkpoint exists" in msg0 and max(took0, took1) < 30
    assert sorted(os.listdir(c)) == []  # no temp folder, no tracker
