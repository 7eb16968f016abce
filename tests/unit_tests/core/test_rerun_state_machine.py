"""--rerun-mode: re-running an iteration whose loss check fails, and its outcomes (CPU, gloo)."""

import math
import os

import pytest
import torch

from megatron.core import parallel_state
from megatron.core import rerun_state_machine as rerun
from megatron.training import checkpointing
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.dist_utils import run_distributed

# Dropout on: a re-run only reproduces if the RNG streams were restored.
FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 "
    "--hidden-dropout 0.1 --attention-dropout 0.1 --lr 1e-3 --log-interval 1 --ckpt-format torch"
).split()
EXPLODE = ["--lr", "1e6", "--lr-decay-style", "constant", "--clip-grad", "0", "--hidden-dropout", "0.0"]


def trainer_for(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def run_to_exit(*extra):
    trainer = trainer_for(*extra)
    with pytest.raises(rerun.RerunExit) as info:
        trainer.train()
    return trainer, info.value.code


def weights(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


def test_healthy_run_gives_the_numbers_of_a_disabled_one():
    flags = ["--train-iters", 3]
    runs = {}
    for mode in ("disabled", "validate_results", "report_determinism_stats"):
        trainer = trainer_for(*flags, "--rerun-mode", mode, "--check-for-spiky-loss")
        history = trainer.train()  # one after the other: the trainers share torch's global generator
        runs[mode] = ([(r["lm loss"], r["grad-norm"]) for r in history], weights(trainer), trainer.rerun)
    base, base_weights, _ = runs["disabled"]
    for mode in ("validate_results", "report_determinism_stats"):
        numbers, w, machine = runs[mode]
        assert numbers == base, mode
        assert all(torch.equal(a, b) for a, b in zip(w, base_weights)), mode
        assert machine.diagnoses == []
    assert runs["report_determinism_stats"][2].stats == [0.0] * 3  # every iteration re-run, bitwise the same
    assert rerun.summarize([0.0] * 4) == "4 samples, all identical"


def test_upstream_default_and_flag_checks():
    cfg = parse_args(FLAGS).resolve()
    assert cfg.training.rerun_mode == "validate_results"
    assert parse_args(FLAGS + ["--rerun-mode", "report_stats"]).resolve().training.rerun_mode == (
        "report_determinism_stats"
    )
    bad = parse_args(FLAGS + ["--rerun-mode", "disabled", "--error-injection-rate", "5"]).resolve()
    with pytest.raises(ValueError, match="--error-injection-rate .*--rerun-mode disabled"):
        bad.validate()
    with pytest.raises(ValueError, match="--error-injection-rate must be >= 0"):
        parse_args(FLAGS + ["--error-injection-rate", "-1"]).resolve().validate()


def test_transient_error_exits_17_without_saving(tmp_path):
    save = tmp_path / "c"
    reference = trainer_for("--train-iters", 1, "--rerun-mode", "disabled")
    reference.train()
    trainer, code = run_to_exit(
        "--train-iters", 3, "--error-injection-rate", 1, "--error-injection-type", "transient_error", "--save", save
    )
    assert code == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION
    assert trainer.rerun.diagnoses == ["transient_error"]
    assert trainer.iteration == 1  # iteration 2 was re-run and never applied
    assert all(torch.equal(a, b) for a, b in zip(weights(trainer), weights(reference)))
    assert not os.path.exists(checkpointing.tracker_path(str(save)))  # nothing saved: resume from an earlier one


@pytest.mark.parametrize(
    "kind,diagnosis,fmt",
    [("persistent_error", "persistent_error", "torch"), ("correct_result", "correct_result", "torch_dist")],
)
def test_reproducible_result_checkpoints_exits_16_and_the_resumed_job_decides(
    tmp_path, monkeypatch, kind, diagnosis, fmt
):
    save = tmp_path / "c"
    flags = ["--train-iters", 3, "--error-injection-rate", 1, "--error-injection-type", kind, "--save", save]
    flags += ["--ckpt-format", fmt]
    trainer, code = run_to_exit(*flags)
    assert code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert trainer.rerun.diagnoses == ["reproducible"]
    assert checkpointing.read_tracker(str(save)) == (1, False)  # the state before iteration 2
    pending = rerun.read_state(str(save / "iter_0000001"))
    assert pending["iteration"] == 2 and pending["message"] == rerun.NAN_MESSAGE
    assert pending["injected_error_type"] == kind
    # The resumed job on the same node and device cannot tell: 16 again, nothing saved.
    again, code = run_to_exit(*flags, "--load", save)
    assert code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE and again.rerun.diagnoses == ["same_device"]
    assert again.iteration == 1 and checkpointing.read_tracker(str(save)) == (1, False)
    # On another device: the re-run decides, and the job exits with 17.
    monkeypatch.setattr(rerun, "device_identity", lambda device: ("other-node", "cuda:7"))
    other, code = run_to_exit(*flags, "--load", save)
    assert code == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION and other.rerun.diagnoses == [diagnosis]


def test_a_reproducible_nan_is_checkpointed_before_it_and_never_saved(tmp_path):
    save = tmp_path / "c"
    trainer, code = run_to_exit(*EXPLODE, "--train-iters", 3, "--save", save, "--save-interval", 1)
    assert code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE
    assert trainer.rerun.diagnoses == ["reproducible"]
    assert checkpointing.read_tracker(str(save)) == (1, False)
    assert sorted(os.listdir(save)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    state = torch.load(checkpointing.get_checkpoint_name(str(save), 1), weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["model"].values() if isinstance(v, torch.Tensor))
    assert math.isnan(rerun.read_state(str(save / "iter_0000001"))["initial_result"])


def test_a_reproducible_nan_without_save_exits_17():
    trainer, code = run_to_exit(*EXPLODE, "--train-iters", 3)
    assert code == rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION and trainer.rerun.diagnoses == ["reproducible"]


def test_spiky_loss_is_not_fatal_and_training_goes_on_with_the_same_numbers():
    flags = ["--train-iters", 3, "--no-check-for-nan-in-loss-and-grad", "--check-for-spiky-loss"]
    base = trainer_for(*flags, "--rerun-mode", "disabled").train()
    trainer = trainer_for(*flags, "--error-injection-rate", 1)
    history = trainer.train()
    assert trainer.rerun.diagnoses == ["transient_error"] * 2  # injected at iterations 2-3, each continued
    assert [r["lm loss"] for r in history] == [r["lm loss"] for r in base]


def test_spike_detection_follows_the_first_samples():
    machine = rerun.RerunStateMachine("validate_results", check_nan=False, check_spiky=True)
    for _ in range(rerun.SPIKY_LOSS_SAMPLES):
        assert not machine.rejections(torch.tensor(2.0)).any()
    assert not machine.rejections(torch.tensor(19.9)).any()
    assert machine.rejections(torch.tensor(-20.0)).all()  # |loss| >= 10 x the largest sample
    assert not machine.rejections(torch.tensor(float("inf"))).any()  # non-finite values are the NaN check's


def test_compare_floats():
    assert rerun.compare_floats(float("nan"), float("nan")) == 0.0
    assert rerun.compare_floats(float("inf"), float("inf")) == 0.0
    assert rerun.compare_floats(float("nan"), 1.0) == math.inf
    assert rerun.compare_floats(1.0, 3.0) == 1.0


def _dp2_transient(rank, world_size, folder):
    flags = FLAGS + ["--global-batch-size", "8", "--train-iters", "3", "--save", folder]
    try:
        pretrain(flags + ["--error-injection-rate", "1"])
    except rerun.RerunExit as e:
        return e.code
    return None


def test_data_parallel_ranks_take_the_same_decision(tmp_path):
    codes = run_distributed(_dp2_transient, 2, str(tmp_path / "c"), timeout=240)
    assert codes == [rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION] * 2
