"""``--optimizer lion``: Lion for every parameter, through the trainer (Megatron's flag).

The update itself is checked against a float64 reference in ``test_lion.py``; here: the
trainer's first step on real gradients equals that reference (fp32 main parameters, 1e-6
relative), weight decay follows Megatron's groups (none on biases and norms), the run
trains, resumes bitwise in both checkpoint formats, and the unsupported choices name
the flag.
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer.lion import Lion
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.optimizer.test_lion import RTOL, _rel, reference_step

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine "
    "--seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 --weight-decay 0.1 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 --optimizer lion "
    "--lion-beta1 0.9 --lion-beta2 0.99"
).split()


def test_first_step_is_lion_on_every_parameter_with_megatrons_decay_groups():
    from megatron.training.data import build_data_iterators

    trainer = build_trainer(FLAGS + ["--train-iters", "2", "--clip-grad", "0"])
    try:
        opt = trainer.optimizer
        assert isinstance(opt.optimizer, Lion)
        before = [m.detach().clone().double() for m in opt.main_params]
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        lr = opt.optimizer.param_groups[0]["lr"]  # the scheduler moves it after the step
        trainer.train_step(it)
        decays = {id(p): g["weight_decay"] for g in opt.optimizer.param_groups for p in g["params"]}
        assert {0.0, 0.1} == set(decays.values())  # biases and norms get no decay, as Megatron's groups
        for main, w0 in zip(opt.main_params, before):
            g = opt.optimizer.state[main]["exp_avg"].double() / (1 - 0.99)  # m_1 = (1 - beta2) g
            ref_w, _ = reference_step(w0, torch.zeros_like(w0), g, lr, decays[id(main)], 0.9, 0.99)
            assert _rel(main.detach(), ref_w) < RTOL
    finally:
        parallel_state.destroy(trainer.pg)


def test_tiny_gpt_trains_with_lion():
    trainer = pretrain(FLAGS + ["--train-iters", "24"])
    losses = [r["lm loss"] for r in trainer.history]
    assert losses[-1] < losses[0] - 0.05


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_bitwise(tmp_path, fmt):
    straight = [r["lm loss"] for r in pretrain(FLAGS + ["--train-iters", "6"]).history]
    ckpt = ["--save", str(tmp_path), "--load", str(tmp_path), "--ckpt-format", fmt, "--save-interval", "3"]
    pretrain(FLAGS + ["--train-iters", "6", "--exit-interval", "3"] + ckpt)
    resumed = [r["lm loss"] for r in pretrain(FLAGS + ["--train-iters", "6"] + ckpt).history]
    assert resumed == straight[3:]


@pytest.mark.parametrize("name", ["soap", "adaptive_muon"])
def test_optimizers_not_built_yet_name_the_flag(name):
    with pytest.raises(ValueError, match=f"--optimizer {name} is not supported yet"):
        build_trainer(FLAGS + ["--train-iters", "2", "--optimizer", name])


def test_the_distributed_optimizer_steps_the_same():
    plain = [r["lm loss"] for r in pretrain(FLAGS + ["--train-iters", "4"]).history]
    sharded = [r["lm loss"] for r in pretrain(FLAGS + ["--train-iters", "4", "--use-distributed-optimizer"]).history]
    assert sharded == plain
