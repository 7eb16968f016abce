"""Megatron's param groups: --decoupled-lr (embedding/output), --apply-wd-to-qk-layernorm (CPU)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.training.training import build_trainer

FLAGS = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 1 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --rerun-mode disabled"
).split()
EMBEDDING_OUTPUT = ("embedding.word_embeddings.weight", "output_layer.weight")


def trainer_for(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def group_by_name(trainer):
    """Parameter name -> its param group (plain optimizer, fp32: the main param is the param)."""
    group_of = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    return {n: group_of[id(p)] for n, p in trainer.model.module.named_parameters()}


def test_decoupled_lr_groups_follow_their_own_range():
    trainer = trainer_for("--untie-embeddings-and-output-weights", "--decoupled-lr", 1e-2, "--decoupled-min-lr", 2e-3,
                          "--train-iters", 3)  # fmt: skip
    trainer.train()
    groups = group_by_name(trainer)
    sched = trainer.scheduler
    for name, group in groups.items():
        if name in EMBEDDING_OUTPUT:
            assert (group["max_lr"], group["min_lr"]) == (1e-2, 2e-3)
            assert group["lr"] == sched.get_lr(3, 1e-2, 2e-3)
            assert group["weight_decay"] == 0.1
        else:
            assert "max_lr" not in group and group["lr"] == sched.get_lr(3)
    assert sched.get_lr(3, 1e-2, 2e-3) == pytest.approx(2e-3)  # the end of the cosine decay: its own minimum
    assert sched.get_lr(1, 1e-2, 2e-3) == 1e-2  # end of warm-up: its own peak


def test_decoupled_min_lr_defaults_to_min_lr_and_tied_embeddings_are_one_weight():
    trainer = trainer_for("--decoupled-lr", 5e-3, "--train-iters", 2)
    groups = group_by_name(trainer)
    assert groups["embedding.word_embeddings.weight"]["min_lr"] == 1e-4
    assert sum(1 for g in trainer.optimizer.param_groups if "max_lr" in g) == 1


def test_decoupled_lr_equal_to_lr_changes_no_number():
    flags = ["--train-iters", 3, "--untie-embeddings-and-output-weights"]
    base = trainer_for(*flags).train()
    same = trainer_for(*flags, "--decoupled-lr", 1e-3, "--decoupled-min-lr", 1e-4).train()
    other = trainer_for(*flags, "--decoupled-lr", 1e-1).train()
    assert [r["lm loss"] for r in same] == [r["lm loss"] for r in base]
    assert [r["grad-norm"] for r in same] == [r["grad-norm"] for r in base]
    assert [r["lm loss"] for r in other][1:] != [r["lm loss"] for r in base][1:]


@pytest.mark.parametrize("fmt,extra", [("torch", ["--use-distributed-optimizer"]), ("torch_dist", []), ("torch", [])])
def test_decoupled_lr_resumes_bitwise(tmp_path, fmt, extra):
    flags = ["--decoupled-lr", 1e-2, "--decoupled-min-lr", 2e-3, "--untie-embeddings-and-output-weights",
             "--ckpt-format", fmt, "--train-iters", 4, *extra]  # fmt: skip
    full = trainer_for(*flags).train()
    trainer_for(*flags, "--exit-interval", 2, "--save", tmp_path / "c").train()
    resumed = trainer_for(*flags, "--load", tmp_path / "c")
    history = resumed.train()
    assert [r["lm loss"] for r in history] == [r["lm loss"] for r in full][2:]
    lrs = sorted(g["lr"] for g in resumed.optimizer.param_groups)
    assert lrs[-1] == resumed.scheduler.get_lr(4, 1e-2, 2e-3)


def test_distributed_optimizer_groups_match_the_plain_one():
    flags = ["--decoupled-lr", 1e-2, "--untie-embeddings-and-output-weights", "--train-iters", 2]
    plain = trainer_for(*flags).train()
    dist = trainer_for(*flags, "--use-distributed-optimizer").train()
    assert [r["lm loss"] for r in dist] == [r["lm loss"] for r in plain]


@pytest.mark.parametrize("qk_wd", [False, True])
def test_weight_decay_of_qk_layernorm(qk_wd):
    trainer = trainer_for("--qk-layernorm", "--train-iters", 2, *(["--apply-wd-to-qk-layernorm"] if qk_wd else []))
    for name, group in group_by_name(trainer).items():
        if "q_layernorm." in name or "k_layernorm." in name:
            assert group["weight_decay"] == (0.1 if qk_wd else 0.0), name
        elif name.endswith(".bias") or "layernorm" in name:
            assert group["weight_decay"] == 0.0, name
        else:
            assert group["weight_decay"] == 0.1, name


def test_bad_decoupled_flags_name_the_flag():
    from megatron.training.arguments import parse_args

    with pytest.raises(ValueError, match="--decoupled-min-lr needs --decoupled-lr"):
        parse_args(FLAGS + ["--decoupled-min-lr", "1e-4"]).resolve().validate()
    with pytest.raises(ValueError, match="--decoupled-min-lr"):
        parse_args(FLAGS + ["--decoupled-lr", "1e-5"]).resolve().validate()  # below --min-lr
    with pytest.raises(ValueError, match="--decoupled-lr must be finite"):
        parse_args(FLAGS + ["--decoupled-lr=-1"]).resolve().validate()


def test_group_settings_are_plain():
    trainer = trainer_for("--decoupled-lr", 1e-2, "--train-iters", 2)
    state = trainer.optimizer.state_dict()
    for group in state["optimizer"]["param_groups"]:
        assert all(not isinstance(v, torch.Tensor) for k, v in group.items() if k != "params")
