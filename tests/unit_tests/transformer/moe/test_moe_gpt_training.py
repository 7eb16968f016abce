"""An MoE GPT trains on the CPU through ``pretrain``, and its aux losses reach the log."""

import json

import pytest

from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training.arguments import parse_args
from megatron.training.training import pretrain

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 3e-3 --lr-decay-style constant --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 64 --num-workers 0 --hidden-dropout 0.0 --attention-dropout 0.0 --use-cpu "
    "--swiglu --disable-bias-linear --num-experts 4 --moe-router-topk 2 --moe-layer-freq ([0]+[1])"
).split()


def test_moe_gpt_trains_and_logs_its_aux_losses(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    trainer = pretrain(
        FLAGS
        + "--train-iters 16 --log-interval 4 --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001".split()
        + ["--metrics-file", str(path)]
    )
    layers = trainer.model.module.decoder.layers
    assert [type(layer) for layer in layers] == [TransformerLayer, MoETransformerLayer]
    losses = [h["lm loss"] for h in trainer.history]
    assert losses[-1] < losses[0] - 0.3, losses
    records = [json.loads(line) for line in open(path)]
    for r in records:
        assert 0.5 < r["load_balancing_loss"] < 4.0  # E * sum f_i P_i: 1 when perfectly balanced
        assert r["z_loss"] > 0
    out = capsys.readouterr().out
    assert "load_balancing_loss:" in out and "z_loss:" in out


def test_moe_gpt_expert_bias_is_updated_after_each_step():
    trainer = pretrain(
        FLAGS
        + "--train-iters 2 --log-interval 1 --moe-router-score-function sigmoid --moe-router-enable-expert-bias "
        "--moe-router-load-balancing-type none".split()
    )
    router = trainer.model.module.decoder.layers[1].mlp.router
    # Two sign steps of 1e-3: every expert's bias moved (ties would leave one at 0).
    assert router.expert_bias.abs().max() > 0
    assert router.expert_bias.abs().max() <= 2e-3 + 1e-9


def test_moe_gpt_drop_and_pad_alltoall_grouped_trains():
    trainer = pretrain(
        FLAGS
        + "--train-iters 4 --log-interval 2 --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity "
        "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --moe-aux-loss-coeff 0.01".split()
    )
    losses = [h["lm loss"] for h in trainer.history]
    assert losses[-1] < losses[0]


def test_experts_must_divide_across_expert_parallel_ranks():
    with pytest.raises(ValueError, match="--num-experts .4. must be divisible by --expert-model-parallel-size .3."):
        parse_args(FLAGS + ["--expert-model-parallel-size", "3"]).resolve(world_size=6).validate()


def test_moe_gpt_trains_with_sinkhorn_top1():
    trainer = pretrain(
        FLAGS + "--train-iters 6 --log-interval 3 --moe-router-load-balancing-type sinkhorn --moe-router-topk 1".split()
    )
    losses = [h["lm loss"] for h in trainer.history]
    assert losses[-1] < losses[0]
