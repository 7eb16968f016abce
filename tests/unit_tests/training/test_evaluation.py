"""Evaluation as Megatron runs it, end to end on the CPU: when it runs, what it reads, how it averages,
how it resumes, --eval-global-batch-size / --eval-micro-batch-size and --skip-train."""

import json
import math

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.dist_utils import run_distributed

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 2"
).split()


def _records(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(records, name) -> list[tuple[int, float]]:
    return [(r["iteration"], r[name]) for r in records if name in r]


def test_validation_during_and_after_training_and_the_test_split_at_the_end(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    flags = "--train-iters 5 --eval-iters 2 --eval-interval 2 --log-params-norm --metrics-file"
    pretrain(TINY + flags.split() + [str(metrics)])
    out = capsys.readouterr().out
    assert " validation loss at iteration 2 | lm loss value: " in out
    assert " validation loss at iteration 4 | lm loss value: " in out
    # Megatron's evaluations after training: the validation split once more, then the test split.
    assert " validation loss at iteration 5 on validation set | lm loss value: " in out
    assert " validation loss at iteration 5 on test set | lm loss value: " in out
    assert out.count("Evaluating on 8 samples") == 2  # --eval-iters 2 x --global-batch-size 4, verbose at the end
    assert "Evaluating iter 2/2" in out
    assert "| params norm: " in out
    records = _records(metrics)
    assert [i for i, _ in _losses(records, "lm loss validation")] == [2, 4, 5]
    assert [i for i, _ in _losses(records, "lm loss test")] == [5]
    assert all(v > 0 for _, v in _losses(records, "lm loss validation") + _losses(records, "lm loss test"))
    assert all("params-norm" in r for r in records if "lm loss" in r)


def test_no_evaluation_by_default(capsys):
    pretrain(TINY + ["--train-iters", "2"])
    out = capsys.readouterr().out
    assert "validation loss" not in out and "Evaluating" not in out


def test_final_validation_runs_even_after_an_evaluation_at_the_last_iteration(tmp_path):
    """Megatron budgets train_iters // eval_interval + 1 evaluations: the last reads new samples."""
    metrics = tmp_path / "m.jsonl"
    trainer = pretrain(TINY + f"--train-iters 4 --eval-iters 2 --eval-interval 2 --metrics-file {metrics}".split())
    valid = _losses(_records(metrics), "lm loss validation")
    assert [i for i, _ in valid] == [2, 4, 4]
    assert valid[1][1] != valid[2][1]  # other samples, the same weights
    assert trainer.state.consumed_valid_samples == 3 * 2 * 4


def test_no_evaluation_at_the_end_when_the_loop_stops_early(capsys):
    pretrain(TINY + "--train-iters 6 --eval-iters 1 --eval-interval 2 --exit-interval 3".split())
    out = capsys.readouterr().out
    assert " validation loss at iteration 2 | " in out
    assert "on validation set" not in out and "on test set" not in out


def _reference_loss(trainer, micro_batches: int, eval_micro_batch_size: int) -> float:
    """The token-weighted loss of the first ``micro_batches`` validation micro-batches, computed here."""
    valid = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).valid
    loss_sum = tokens = 0.0
    trainer.model.eval()
    with torch.no_grad():
        for _ in range(micro_batches):
            batch = next(valid)
            assert batch["tokens"].shape[0] == eval_micro_batch_size
            loss, metrics = gpt_forward_step(batch, trainer.model)
            loss_sum += float(loss.double() * metrics["num_tokens"])
            tokens += float(metrics["num_tokens"])
    trainer.model.train()
    return loss_sum / tokens


@pytest.mark.parametrize("eval_mbs", [1, 2, 4])
def test_the_loss_is_weighted_by_loss_tokens_over_eval_micro_batches(eval_mbs):
    """--eod-mask-loss gives micro-batches unequal loss-token counts: the mean over micro-batch means
    would differ from Megatron's sum over tokens / token count."""
    flags = (
        f"--train-iters 1 --eval-iters 3 --eod-mask-loss --eval-global-batch-size 8 --eval-micro-batch-size {eval_mbs}"
    )
    trainer = build_trainer(TINY + flags.split())
    try:
        assert trainer.cfg.eval_num_microbatches == 8 // eval_mbs
        valid = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).valid
        got = trainer.evaluate(valid, "iteration 0")
        want = _reference_loss(trainer, 3 * 8 // eval_mbs, eval_mbs)
        assert math.isclose(got, want, rel_tol=1e-6), (got, want)  # fp32 losses summed in another order
        assert trainer.state.consumed_valid_samples == 3 * 8
    finally:
        trainer.close()
        trainer.graphs.close()
        parallel_state.destroy(trainer.pg)


def test_eval_micro_batch_size_splits_the_same_samples_otherwise(tmp_path):
    """Token weighting makes the loss independent of how an evaluation batch is cut into micro-batches."""

    def valid_losses(mbs):
        metrics = tmp_path / f"m{mbs}.jsonl"
        flags = f"--train-iters 2 --eval-iters 2 --eval-interval 2 --eod-mask-loss --eval-micro-batch-size {mbs}"
        trainer = pretrain(TINY + flags.split() + ["--metrics-file", str(metrics)])
        assert trainer.state.consumed_valid_samples == 2 * 2 * 4
        return [v for _, v in _losses(_records(metrics), "lm loss validation")]

    for a, b in zip(valid_losses(1), valid_losses(4), strict=True):
        assert math.isclose(a, b, rel_tol=1e-6), (a, b)


@pytest.mark.parametrize("ckpt_format", ["torch", "torch_dist"])
def test_a_resumed_run_reads_the_validation_samples_an_uninterrupted_run_reads(tmp_path, ckpt_format):
    common = TINY + f"--eval-iters 2 --eval-interval 2 --lr-decay-iters 6 --ckpt-format {ckpt_format}".split()
    whole = tmp_path / "whole.jsonl"
    pretrain(common + f"--train-iters 6 --metrics-file {whole}".split())
    save, resumed = tmp_path / "ckpt", tmp_path / "resumed.jsonl"
    pretrain(common + f"--train-iters 4 --save {save}".split())
    trainer = pretrain(common + f"--train-iters 6 --load {save} --save {save} --metrics-file {resumed}".split())
    want = _losses(_records(whole), "lm loss validation")
    assert [i for i, _ in want] == [2, 4, 6, 6]
    assert _losses(_records(resumed), "lm loss validation") == want[2:]  # both at iteration 6, bitwise
    assert _losses(_records(resumed), "lm loss test") == _losses(_records(whole), "lm loss test")
    assert trainer.state.consumed_valid_samples == 4 * 2 * 4


def test_skip_train_evaluates_the_loaded_checkpoint_and_trains_nothing(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    save = tmp_path / "ckpt"
    pretrain(TINY + f"--train-iters 4 --save {save}".split())
    (save / "iter_0000004").touch()  # nothing may be written: a save would replace the folder's contents
    before = sorted(p.name for p in save.rglob("*"))
    capsys.readouterr()
    metrics, tb = tmp_path / "m.jsonl", tmp_path / "tb"
    with pytest.warns(UserWarning, match="enabling --no-load-optim when skipping training"):
        trainer = pretrain(
            TINY
            + f"--train-iters 4 --skip-train --eval-iters 2 --load {save} --save {save} --metrics-file {metrics}".split()
            + ["--tensorboard-dir", str(tb)]
        )
    out = capsys.readouterr().out
    assert "skipping training (--skip-train is on) ..." in out
    assert " validation loss at iteration 4 on validation set | " in out
    assert " validation loss at iteration 4 on test set | " in out
    assert " iteration        " not in out  # no training line
    assert trainer.iteration == 4 and trainer.cfg.checkpoint.no_load_optim
    assert trainer.state.consumed_valid_samples == 0  # --skip-train reads validation from sample 0
    assert sorted(p.name for p in save.rglob("*")) == before
    records = _records(metrics)
    assert [i for i, _ in _losses(records, "lm loss validation")] == [4]
    assert [i for i, _ in _losses(records, "lm loss test")] == [4]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb))
    events.Reload()
    assert events.Tags()["scalars"] == []  # as Megatron: --skip-train writes no TensorBoard scalars


@pytest.mark.parametrize(
    "flags, match",
    [
        ("--eval-global-batch-size 5", r"--eval-global-batch-size \(5\) must be a positive multiple of --eval-micro"),
        ("--eval-micro-batch-size 3", r"--eval-global-batch-size \(4\) must be a positive multiple"),
        ("--eval-micro-batch-size 0", "--eval-micro-batch-size must be >= 1, got 0"),
    ],
)
def test_eval_batch_sizes_are_checked(flags, match):
    with pytest.raises(ValueError, match=match):
        build_trainer(TINY + flags.split())


def _pipelined_eval(rank, world_size, argv):
    pretrain(argv)


def test_pipelined_evaluation_with_another_micro_batch_size_matches_one_process(tmp_path):
    """The pipeline exchanges tensors of the eval micro-batch size (a schedule of its own)."""
    flags = "--num-layers 2 --train-iters 2 --eval-iters 2 --eval-interval 2 --eval-micro-batch-size 1"
    single, piped = tmp_path / "single.jsonl", tmp_path / "piped.jsonl"
    pretrain(TINY + flags.split() + ["--metrics-file", str(single)])
    run_distributed(
        _pipelined_eval,
        2,
        TINY + flags.split() + ["--pipeline-model-parallel-size", "2", "--metrics-file", str(piped)],
    )
    for name in ("lm loss validation", "lm loss test"):
        want, got = _losses(_records(single), name), _losses(_records(piped), name)
        assert [i for i, _ in got] == [i for i, _ in want]
        for (_, a), (_, b) in zip(got, want):
            assert math.isclose(a, b, rel_tol=1e-5), (name, a, b)


@pytest.mark.parametrize("start, evaluated", [(3, [4, 6]), (4, [4, 6]), (5, [6]), (0, [2, 4, 6])])
def test_start_eval_at_iter(tmp_path, start, evaluated):
    metrics = tmp_path / "m.jsonl"
    flags = f"--train-iters 6 --eval-iters 1 --eval-interval 2 --start-eval-at-iter {start} --metrics-file {metrics}"
    trainer = pretrain(TINY + flags.split())
    valid = [i for i, _ in _losses(_records(metrics), "lm loss validation")]
    assert valid == evaluated + [6]  # the validation after training runs whatever the start
    assert trainer.state.consumed_valid_samples == len(valid) * 4


def test_a_checkpoint_without_the_validation_count_resumes_where_an_uninterrupted_run_reads(tmp_path):
    """Checkpoints written before consumed_valid_samples was saved: Megatron's estimate, the validations
    up to the loaded iteration, gives the same stream when the evaluation flags are unchanged."""
    common = TINY + "--eval-iters 2 --eval-interval 2 --lr-decay-iters 6 --ckpt-format torch".split()
    whole, resumed, save = tmp_path / "whole.jsonl", tmp_path / "resumed.jsonl", tmp_path / "ckpt"
    pretrain(common + f"--train-iters 6 --metrics-file {whole}".split())
    pretrain(common + f"--train-iters 4 --save {save}".split())
    (path,) = save.glob("iter_0000004/*/model_optim_rng.pt")
    contents = torch.load(path, weights_only=True)
    del contents["consumed_valid_samples"]
    torch.save(contents, path)
    pretrain(common + f"--train-iters 6 --load {save} --metrics-file {resumed}".split())
    assert _losses(_records(resumed), "lm loss validation") == _losses(_records(whole), "lm loss validation")[2:]
