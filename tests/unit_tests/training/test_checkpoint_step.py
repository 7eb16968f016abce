"""--ckpt-step (load a chosen iteration's checkpoint) and --override-ckpt-iteration (continue from another
iteration's data position), in both checkpoint formats, on the CPU."""

import json

import pytest
import torch

from megatron.training.training import build_trainer, pretrain

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --lr-decay-iters 6 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 64 --hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 1"
).split()


def _losses(path) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in map(json.loads, path.read_text().splitlines()) if "lm loss" in r}


@pytest.fixture(params=["torch", "torch_dist"])
def saved(request, tmp_path):
    """Checkpoints at iterations 2, 4 and 6 (the tracker names 6), and the run's losses."""
    save, metrics = tmp_path / "ckpt", tmp_path / "whole.jsonl"
    fmt = ["--ckpt-format", request.param]
    pretrain(TINY + fmt + f"--train-iters 6 --save {save} --save-interval 2 --save-retain-interval 2".split()
             + ["--metrics-file", str(metrics)])  # fmt: skip
    return save, fmt, _losses(metrics), tmp_path


def test_ckpt_step_loads_that_iteration_and_resumes_bitwise(saved):
    save, fmt, whole, tmp_path = saved
    metrics = tmp_path / "from2.jsonl"
    trainer = pretrain(TINY + fmt + f"--train-iters 6 --load {save} --ckpt-step 2 --metrics-file {metrics}".split())
    assert trainer.iteration == 6
    assert _losses(metrics) == {i: whole[i] for i in (3, 4, 5, 6)}


def test_ckpt_step_of_a_missing_iteration_names_the_saved_ones(saved):
    save, fmt, _, _ = saved
    with pytest.raises(ValueError, match=r"--ckpt-step 3: .* no iter_0000003 folder \(saved iterations: 2, 4, 6\)"):
        build_trainer(TINY + fmt + f"--train-iters 6 --load {save} --ckpt-step 3".split())


def test_override_ckpt_iteration_moves_the_counter_and_the_data_not_the_schedule(saved, capsys):
    save, fmt, whole, tmp_path = saved
    metrics = tmp_path / "override.jsonl"
    capsys.readouterr()
    trainer = pretrain(
        TINY + fmt + f"--train-iters 6 --load {save} --ckpt-step 4 --override-ckpt-iteration 2".split()
        + ["--metrics-file", str(metrics)]
    )  # fmt: skip
    assert "--override-ckpt-iteration: start at iteration 2 (consumed_train_samples 8)" in capsys.readouterr().out
    assert sorted(_losses(metrics)) == [3, 4, 5, 6]  # the weights of iteration 4 trained on iterations 3..6's data
    assert trainer.consumed_samples == 6 * 4
    assert trainer.scheduler.num_steps == 4 + 4  # the checkpoint's schedule went on for four steps
    first = _losses(metrics)[3]
    # Iteration 4's weights on iteration 3's batch: not the whole run's iteration 3 (iteration 2's weights),
    # nor its iteration 5 (the batch the loaded counter would have read next).
    assert first != whole[3] and first != whole[5]


@pytest.mark.parametrize(
    "flags, match",
    [
        ("--ckpt-step 2", "--ckpt-step 2 needs --load"),
        ("--override-ckpt-iteration 2", "--override-ckpt-iteration 2 needs --load"),
        ("--load x --ckpt-step -1", "--ckpt-step must be >= 0, got -1"),
    ],
)
def test_checkpoint_selection_flags_are_checked(flags, match):
    with pytest.raises(ValueError, match=match):
        build_trainer(TINY + flags.split())


@pytest.mark.parametrize("optimizer", [[], ["--use-distributed-optimizer"]], ids=["optimizer", "distributed"])
@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_load_main_params_from_ckpt_keeps_the_fp32_weights_without_the_moments(tmp_path, fmt, optimizer):
    """--no-load-optim rebuilds the fp32 main params from the bf16 weights (rounded); with
    --load-main-params-from-ckpt they are the checkpoint's, bit for bit, and the moments start afresh."""
    from megatron.core import parallel_state

    save = tmp_path / "ckpt"
    common = TINY + ["--bf16", "--ckpt-format", fmt] + optimizer
    saved = pretrain(common + f"--train-iters 2 --save {save}".split())
    want = [m.clone() for m in saved.optimizer._lowp_main]

    def main_params(*extra):
        trainer = build_trainer(common + f"--train-iters 4 --load {save} --no-load-optim".split() + list(extra))
        got = [m.clone() for m in trainer.optimizer._lowp_main]
        moments = [s for s in trainer.optimizer.optimizer.state.values() if s]
        trainer.graphs.close()
        parallel_state.destroy(trainer.pg)
        return got, moments

    exact, moments = main_params("--load-main-params-from-ckpt")
    assert len(exact) == len(want) > 0 and all(torch.equal(a, b) for a, b in zip(exact, want))
    assert not moments  # no optimizer state was loaded
    rounded, _ = main_params()
    assert not all(torch.equal(a, b) for a, b in zip(rounded, want))  # bf16 weights lose the fp32 bits
    with pytest.raises(ValueError, match="--load-main-params-from-ckpt needs --no-load-optim"):
        build_trainer(common + f"--load {save} --load-main-params-from-ckpt".split())
