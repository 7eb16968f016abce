"""The NaN guard: non-finite steps never reach the weights or a checkpoint (CPU)."""

import json
import math
import os

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs.session import GraphState
from megatron.training import checkpointing
from megatron.training.finite_state import NonFiniteCheckpointError
from megatron.training.training import build_trainer
from megatron.training.training_log import LossWindow

FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --rerun-mode disabled"
).split()  # the guard alone; with upstream's default --rerun-mode validate_results see test_rerun.py
# An update so large that iteration 2's loss (and every one after it) is not finite.
EXPLODE = ["--lr", "1e6", "--lr-decay-style", "constant", "--clip-grad", "0"]


def trainer_for(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def finite_weights(trainer):
    return all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_loss_window_averages_finite_iterations_only():
    w = LossWindow(torch.device("cpu"))
    for it, value in enumerate([1.0, float("nan"), 3.0, float("inf")], start=1):
        loss = torch.tensor(value)
        w.add(loss, ~torch.isfinite(loss), it)
    assert w.read_nan() == (2, 2)
    assert w.read_and_reset() == (2.0, 2, 2)  # (1 + 3) / 2, not (1 + 0 + 3 + 0) / 4
    w.add(torch.tensor(float("nan")), torch.tensor(True), 5)
    mean, nan, first = w.read_and_reset()
    assert math.isnan(mean) and nan == 1 and first == 2  # first since the run started


def test_guard_stops_at_the_save_and_keeps_weights_finite(tmp_path):
    save = tmp_path / "c"
    trainer = trainer_for(*EXPLODE, "--train-iters", 12, "--log-interval", 10, "--save-interval", 5, "--save", save)
    with pytest.raises(RuntimeError, match=r"non-finite lm loss or grad norm at iteration 2 .*up to iteration 5"):
        trainer.train()
    assert trainer.iteration == 5 and finite_weights(trainer)
    assert not os.path.exists(checkpointing.tracker_path(str(save)))  # nothing saved, tracker never moved
    assert not (save / "iter_0000005").exists()


def test_guard_stops_at_the_log_line_after_printing_it(tmp_path, capsys):
    metrics = tmp_path / "m.jsonl"
    trainer = trainer_for(*EXPLODE, "--train-iters", 12, "--log-interval", 3, "--metrics-file", metrics)
    with pytest.raises(RuntimeError, match=r"at iteration 2 .*2 such iteration\(s\) up to iteration 3"):
        trainer.train()
    assert trainer.iteration == 3 and finite_weights(trainer)
    assert "number of nan iterations:   2 |" in capsys.readouterr().out
    # Megatron's log points: after iteration 1 (finite), then at 3 (iterations 2-3, none finite).
    first, last = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert (first["iteration"], last["iteration"]) == (1, 3)
    assert math.isfinite(first["lm loss"]) and not math.isfinite(last["lm loss"])


def test_guard_skips_the_update_and_a_save_refuses_non_finite_weights(tmp_path):
    # A finite checkpoint, then poisoned weights: the save is refused, the tracker stays.
    save = tmp_path / "c"
    trainer = trainer_for("--train-iters", 3, "--save", save, "--log-interval", 1)
    trainer.train()
    assert checkpointing.read_tracker(str(save)) == (3, False)
    with torch.no_grad():
        next(trainer.model.parameters()).view(-1)[0] = float("nan")
    trainer.iteration = 4
    with pytest.raises(NonFiniteCheckpointError, match=r"refusing to save iteration 4: .*1 of \d+ "):
        trainer.save_checkpoint()
    assert checkpointing.read_tracker(str(save)) == (3, False)
    assert sorted(os.listdir(save)) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


def test_without_the_guard_training_goes_on_and_logs_nan(tmp_path, capsys):
    save, metrics = tmp_path / "c", tmp_path / "m.jsonl"
    flags = [*EXPLODE, "--train-iters", 6, "--log-interval", 3, "--save-interval", 3, "--save", save]
    trainer = trainer_for(*flags, "--metrics-file", metrics, "--no-check-for-nan-in-loss-and-grad")
    history = trainer.train()
    assert trainer.iteration == 6 and not finite_weights(trainer)  # Megatron applies the update
    first, *later = [r["lm loss"] for r in history]  # after iteration 1, then at 3 and 6
    assert len(later) == 2 and math.isfinite(first)
    assert all(math.isnan(v) for v in later)  # nan, not 0 and not averaged with zeros
    assert trainer.nan_iters == 5
    out = capsys.readouterr().out
    # Counted per log interval, as Megatron: 2 in iterations 2-3, 3 in 4-6.
    assert "lm loss: NAN |" in out
    assert "number of nan iterations:   2 |" in out and "number of nan iterations:   3 |" in out
    assert out.count("WARNING: refusing to save iteration") == 2  # at 3 and 6; nothing written
    assert not os.path.exists(checkpointing.tracker_path(str(save)))
    recorded = [json.loads(line)["lm loss"] for line in metrics.read_text().splitlines()]
    assert recorded[0] == first and math.isnan(recorded[1])


def test_static_fp16_loss_scale_that_skips_every_step_warns(capsys):
    trainer = trainer_for("--fp16", "--loss-scale", "1e30", "--train-iters", 10, "--log-interval", 10)
    trainer.train()
    assert trainer.skipped_iters == 10
    out = capsys.readouterr().out
    assert "WARNING: the last 10 iterations all overflowed with the static loss scale --loss-scale 1e+30" in out


def test_guard_changes_no_number_of_a_finite_run():
    flags = ["--train-iters", 3, "--log-interval", 1, "--hidden-dropout", 0.1, "--lr", "1e-3"]
    guarded = trainer_for(*flags)
    a = guarded.train()  # one after the other: the trainers share torch's global generator
    unguarded = trainer_for(*flags, "--no-check-for-nan-in-loss-and-grad")
    b = unguarded.train()
    assert [r["lm loss"] for r in a] == [r["lm loss"] for r in b]
    assert [r["grad-norm"] for r in a] == [r["grad-norm"] for r in b]
    for p, q in zip(guarded.model.parameters(), unguarded.model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.gpu
@pytest.mark.parametrize("scope", [[], ["attn"]], ids=["whole_layer", "attn"])
def test_guard_with_cuda_graphs_gpu(tmp_path, scope):
    # The skip happens on the device (fused AdamW's found_inf), with graphs replaying.
    graphs = ["--cuda-graph-impl", "local", "--bf16", "--deterministic-mode"]
    if scope:
        graphs += ["--cuda-graph-scope", *scope]
    save = tmp_path / "c"
    trainer = trainer_for(*graphs, *EXPLODE, "--train-iters", 12, "--log-interval", 10, "--save-interval", 5,
                          "--save", save)  # fmt: skip
    with pytest.raises(RuntimeError, match=r"non-finite lm loss or grad norm at iteration 2 .*up to iteration 5"):
        trainer.train()
    assert trainer.graphs.state is GraphState.CAPTURED and finite_weights(trainer)
    assert all(torch.isfinite(m).all() for m in trainer.optimizer.main_params)
    assert not os.path.exists(checkpointing.tracker_path(str(save)))
