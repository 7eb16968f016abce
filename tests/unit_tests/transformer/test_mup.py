"""muP (--use-mup): derived scales, initialisation, embedding/logit multipliers, per-group lr and eps."""

import math

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import LanguageModelEmbedding, build_gpt_model
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer
from tests.unit_tests.models.gpt.test_gpt_model import config  # the same tiny model config

VOCAB = 64


def test_derived_values_match_hand_computation():
    cfg = config(hidden_size=64, use_mup=True, mup_base_hidden_size=256)
    assert cfg.mup_width_mult == 0.25
    assert cfg.softmax_scale == 1.0 / 16  # kv_channels 16, power 1: 1 / d_head
    assert cfg.mup_output_mult == 4.0  # 1 / m
    assert cfg.hidden_init_std() == pytest.approx(0.02 / math.sqrt(0.25), rel=1e-12)
    cfg.finalize()  # idempotent: the output multiplier is not inverted twice
    assert (cfg.mup_output_mult, cfg.softmax_scale) == (4.0, 1.0 / 16)

    custom = config(hidden_size=64, use_mup=True, mup_base_hidden_size=32, mup_base_head_dim=64,
                    mup_attn_scale_power=0.5, mup_output_mult=0.3)  # fmt: skip
    assert custom.softmax_scale == pytest.approx(8.0 / 4.0, rel=1e-12)  # sqrt(64) / 16 ** 0.5
    assert custom.mup_output_mult == 0.3  # set explicitly: kept
    assert custom.mup_width_mult == 2.0

    base = config(use_mup=True)  # base hidden size defaults to the hidden size: m = 1
    assert (base.mup_base_hidden_size, base.mup_width_mult, base.mup_output_mult) == (32, 1.0, 1.0)
    assert base.softmax_scale == 1.0 / 8  # muP attention still 1 / d_head
    plain = config()
    assert (plain.softmax_scale, plain.mup_width_mult, plain.hidden_init_std()) == (None, 1.0, 0.02)


def test_bad_base_hidden_size_names_the_flag():
    with pytest.raises(ValueError, match="--mup-base-hidden-size must be positive"):
        config(use_mup=True, mup_base_hidden_size=0)


def test_init_std_follows_width_and_depth():
    """Sample std of each weight within 3% of Megatron's muP value (about 200k draws per tensor)."""
    L, h, m = 4, 256, 4.0
    cfg = config(num_layers=L, hidden_size=h, num_attention_heads=8, use_mup=True, mup_base_hidden_size=64,
                 untie_embeddings_and_output_weights=True, seq_length=16)  # fmt: skip
    torch.manual_seed(0)
    model = build_gpt_model(cfg, 1024, device="cpu")
    hidden, out_proj = 0.02 / math.sqrt(m), 0.02 / (math.sqrt(2 * L) * math.sqrt(m))
    expected = {
        "embedding.word_embeddings.weight": 0.02,
        "embedding.position_embeddings.weight": 0.02,
        "output_layer.weight": 0.02,
        "decoder.layers.0.self_attention.linear_qkv.weight": hidden,
        "decoder.layers.0.self_attention.linear_proj.weight": out_proj,
        "decoder.layers.3.mlp.linear_fc1.weight": hidden,
        "decoder.layers.3.mlp.linear_fc2.weight": out_proj,
    }
    params = dict(model.named_parameters())
    for name, std in expected.items():
        assert params[name].float().std().item() == pytest.approx(std, rel=0.03), name


def test_embedding_and_output_multipliers_and_attention_scale():
    """Same weights: the muP model's logits are mup_output_mult x those of a plain model given muP's
    attention scale (fp32, 1e-6 relative: one extra multiplication per element)."""
    mup = config(use_mup=True, mup_base_hidden_size=64)
    plain = config()
    torch.manual_seed(0)
    a = build_gpt_model(mup, VOCAB, device="cpu")
    b = build_gpt_model(plain, VOCAB, device="cpu")
    b.load_state_dict(a.state_dict())
    for layer in b.decoder.layers:
        assert layer.self_attention.softmax_scale == 1.0 / math.sqrt(8)
        layer.self_attention.softmax_scale = 1.0 / 8
    ids = torch.randint(0, VOCAB, (2, 8))
    la, lb = a(ids), b(ids)
    assert mup.mup_output_mult == 2.0
    torch.testing.assert_close(la, 2.0 * lb, rtol=1e-6, atol=0)

    emb_cfg = config(use_mup=True, mup_embedding_mult=3.0)
    torch.manual_seed(1)
    emb = LanguageModelEmbedding(emb_cfg, VOCAB, 8, "learned_absolute", device="cpu")
    torch.manual_seed(1)
    ref = LanguageModelEmbedding(config(), VOCAB, 8, "learned_absolute", device="cpu")
    assert torch.equal(emb(ids), 3.0 * ref(ids))


FLAGS = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 1 --lr 1e-3 --min-lr 1e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 1 --weight-decay 0.1 --rerun-mode disabled "
    "--untie-embeddings-and-output-weights --use-mup --mup-base-hidden-size 16 --adam-eps 1e-8"
).split()
EMBEDDING_CLASS = ("embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output_layer.weight")


def trainer_for(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def groups_by_name(trainer):
    group_of = {id(p): g for g in trainer.optimizer.param_groups for p in g["params"]}
    return {n: group_of[id(p)] for n, p in trainer.model.module.named_parameters()}


def test_adam_hidden_matrices_get_lr_and_eps_over_m():
    trainer = trainer_for("--train-iters", 3)  # m = 64 / 16 = 4
    records = trainer.train()
    assert all(math.isfinite(r["lm loss"]) for r in records)
    for name, group in groups_by_name(trainer).items():
        param = dict(trainer.model.module.named_parameters())[name]
        if param.ndim >= 2 and name not in EMBEDDING_CLASS:
            assert (group["max_lr"], group["min_lr"], group["eps"]) == (1e-3 / 4, 1e-4 / 4, 1e-8 / 4), name
            assert group["lr"] == trainer.scheduler.get_lr(3, 1e-3 / 4, 1e-4 / 4)
        else:
            assert "max_lr" not in group and group["eps"] == 1e-8, name


def test_sgd_vector_like_params_get_lr_times_m_and_decoupled_lr_wins():
    trainer = trainer_for("--train-iters", 2, "--optimizer", "sgd")
    for name, group in groups_by_name(trainer).items():
        param = dict(trainer.model.module.named_parameters())[name]
        if param.ndim <= 1 or name in EMBEDDING_CLASS:
            assert (group["max_lr"], group["min_lr"]) == (1e-3 * 4, 1e-4 * 4), name
        else:
            assert "max_lr" not in group, name
    trainer = trainer_for("--train-iters", 2, "--decoupled-lr", 5e-3)
    groups = groups_by_name(trainer)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert (groups[name]["max_lr"], groups[name]["eps"]) == (5e-3, 1e-8)
    assert groups["embedding.position_embeddings.weight"]["eps"] == 1e-8
    assert groups["decoder.layers.0.mlp.linear_fc1.weight"]["max_lr"] == 1e-3 / 4


def test_distributed_optimizer_state_dict_keeps_each_groups_eps():
    trainer = trainer_for("--train-iters", 2, "--use-distributed-optimizer")
    trainer.train()
    eps = sorted(g["eps"] for g in trainer.optimizer.state_dict()["optimizer"]["param_groups"])
    assert eps[0] == 1e-8 / 4 and eps[-1] == 1e-8


def test_width_mult_one_is_plain_training_but_for_attention_scale():
    """m = 1: no lr, eps, init or logit change; only the attention scale (1 / d_head) differs."""
    args = parse_args(FLAGS + ["--mup-base-hidden-size", "64"]).resolve()
    assert args.model.mup_width_mult == 1.0 and args.model.mup_output_mult == 1.0
    trainer = trainer_for("--mup-base-hidden-size", 64, "--train-iters", 2)
    assert all("max_lr" not in g for g in trainer.optimizer.param_groups)
