"""Global non-persistent checkpoints (--non-persistent-save-interval, --non-persistent-ckpt-type global):
frequent saves into their own folder, of which only the latest is kept, and a resume that loads them when
they are newer than --load's latest, as Megatron does. On the CPU; the crash is a SIGKILL."""

import json
import os
import signal
import subprocess
import sys

import pytest

from megatron.training.checkpointing import read_tracker
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.training.test_checkpointing import FLAGS, REPO

ENV = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
NON_PERSISTENT = ["--non-persistent-save-interval", "1", "--non-persistent-ckpt-type", "global"]


def _losses(path) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in map(json.loads, path.read_text().splitlines())}


def test_only_the_latest_non_persistent_checkpoint_is_kept(tmp_path):
    save = tmp_path / "ckpt"
    pretrain(FLAGS + ["--train-iters", "5", "--save", str(save), "--save-interval", "100"] + NON_PERSISTENT)
    folder = save / "non_persistent"
    assert sorted(p.name for p in folder.iterdir()) == ["iter_0000005", "latest_checkpointed_iteration.txt"]
    assert read_tracker(str(folder)) == (5, False)
    assert read_tracker(str(save)) == (5, False)  # the save at the end of training is a persistent one


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_a_killed_run_resumes_from_its_newest_checkpoint_and_loses_nothing(tmp_path, fmt):
    save, whole, resumed = tmp_path / "ckpt", tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl"
    flags = FLAGS + ["--train-iters", "8", "--ckpt-format", fmt, "--lr-decay-iters", "8"]
    pretrain(flags + ["--metrics-file", str(whole)])
    run = flags + ["--save", str(save), "--save-interval", "3"] + NON_PERSISTENT
    proc = subprocess.Popen(
        [sys.executable, os.path.join(REPO, "pretrain_gpt.py"), *run],
        env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    for line in proc.stdout:
        if "successfully saved checkpoint from iteration       5" in line and "non_persistent" in line:
            proc.send_signal(signal.SIGKILL)  # a crash right after the non-persistent save of iteration 5
            break
    proc.wait(timeout=120)
    assert read_tracker(str(save)) == (3, False) and read_tracker(str(save / "non_persistent")) == (5, False)
    trainer = build_trainer(run + ["--load", str(save)])
    assert trainer.iteration == 5  # not --load's 3
    trainer.graphs.close()
    from megatron.core import parallel_state

    parallel_state.destroy(trainer.pg)
    pretrain(run + ["--load", str(save), "--metrics-file", str(resumed)])
    assert _losses(resumed) == {i: v for i, v in _losses(whole).items() if i > 5}  # bitwise


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--non-persistent-save-interval", "2", "--save", "x"], "needs --non-persistent-ckpt-type global"),
        (["--non-persistent-save-interval", "2", "--non-persistent-ckpt-type", "global"], "needs --save"),
        (["--non-persistent-ckpt-type", "local"], r"local \(nvidia-resiliency-ext's local checkpoints\) is not"),
    ],
)
def test_non_persistent_flags_are_checked(flags, match):
    with pytest.raises(ValueError, match=match):
        build_trainer(FLAGS + flags)


def test_persistent_save_interval_is_megatrons_other_spelling_of_save_interval():
    from megatron.training.arguments import parse_args

    assert parse_args(["--persistent-save-interval", "7"]).checkpoint.save_interval == 7
