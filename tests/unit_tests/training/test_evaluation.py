"""Evaluation on the validation split and the params-norm log field, end to end on the CPU."""

import json

from megatron.training.training import pretrain

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --log-interval 2"
).split()


def test_validation_loss_lines_and_metrics(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    pretrain(
        TINY
        + [
            "--train-iters",
            "5",
            "--eval-iters",
            "2",
            "--eval-interval",
            "2",
            "--log-params-norm",
            "--metrics-file",
            str(metrics),
        ]
    )
    out = capsys.readouterr().out
    assert " validation loss at iteration 2 | lm loss value: " in out
    assert " validation loss at iteration 4 | lm loss value: " in out
    assert " validation loss at the end of training for val data | " in out
    assert "| params norm: " in out
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    valid = [r for r in records if "lm loss validation" in r]
    assert [r["iteration"] for r in valid] == [2, 4, 5]
    assert all(r["lm loss validation"] > 0 for r in valid)
    assert all("params-norm" in r for r in records if "lm loss" in r)


def test_no_evaluation_by_default(capsys):
    pretrain(TINY + ["--train-iters", "2"])
    assert "validation loss" not in capsys.readouterr().out
