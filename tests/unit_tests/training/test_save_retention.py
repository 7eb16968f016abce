"""--save-retain-interval: a save deletes the previous checkpoint unless it is a retained one (CPU)."""

import os

import pytest

from megatron.core import parallel_state
from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer

FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 "
    "--log-interval 10 --rerun-mode disabled"
).split()


def train(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    trainer.train()
    return trainer


@pytest.mark.parametrize("fmt", ["torch", "torch_dist_async"])
def test_only_retained_and_latest_checkpoints_stay(tmp_path, fmt):
    save = tmp_path / "c"
    extra = ["--ckpt-format", "torch"] if fmt == "torch" else ["--ckpt-format", "torch_dist", "--async-save"]
    train("--train-iters", 7, "--save", save, "--save-interval", 1, "--save-retain-interval", 3, *extra)
    kept = sorted(n for n in os.listdir(save) if n.startswith("iter_"))
    assert kept == ["iter_0000003", "iter_0000006", "iter_0000007"]
    assert checkpointing.read_tracker(str(save)) == (7, False)


def test_without_the_flag_every_checkpoint_stays(tmp_path):
    save = tmp_path / "c"
    train("--train-iters", 3, "--save", save, "--save-interval", 1, "--ckpt-format", "torch")
    assert sorted(n for n in os.listdir(save) if n.startswith("iter_")) == [f"iter_000000{i}" for i in (1, 2, 3)]


def test_retain_interval_must_be_a_multiple_of_the_save_interval():
    with pytest.raises(ValueError, match=r"--save-retain-interval \(5\) must be a multiple of --save-interval \(2\)"):
        parse_args(FLAGS + ["--save", "x", "--save-interval", "2", "--save-retain-interval", "5"]).resolve().validate()
    with pytest.raises(ValueError, match="--save-retain-interval 4 needs --save-interval"):
        parse_args(FLAGS + ["--save", "x", "--save-retain-interval", "4"]).resolve().validate()
