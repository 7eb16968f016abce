"""HybridModel and pretrain_hybrid.py: names, shapes, loss head, and a tiny M*M-M*M- model trained on the CPU."""

import pytest
import torch

import pretrain_hybrid
from megatron.core.models.hybrid.hybrid_model import HybridModel, build_hybrid_model, num_floating_point_operations
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.conftest import count_forwards

VOCAB = 64


def configs(pattern="M*M-M*M-", **kw):
    mc = MambaConfig(hybrid_layer_pattern=pattern, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)
    base = dict(hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = TransformerConfig(**{**base, **kw})
    mc.resolve(cfg)
    mc.validate(cfg)
    cfg.finalize()
    cfg.validate()
    return cfg, mc


def test_parameter_names_follow_megatron_and_shapes():
    cfg, mc = configs(position_embedding_type="none", normalization="RMSNorm")
    torch.manual_seed(0)
    model = build_hybrid_model(cfg, mc, VOCAB, device="cpu")
    assert cfg.num_layers == 8 and model.layer_types == "M*M-M*M-"
    names = [n for n, _ in model.named_parameters()]
    assert names[0] == "embedding.word_embeddings.weight" and names[-1] == "decoder.final_norm.weight"
    for suffix in ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight"):
        assert f"decoder.layers.0.mixer.{suffix}" in names
    assert "decoder.layers.1.self_attention.linear_qkv.weight" in names
    assert "decoder.layers.3.mlp.linear_fc1.weight" in names
    assert not any("position_embeddings" in n for n in names)  # none, as Megatron's hybrid default
    tokens = torch.randint(0, VOCAB, (2, 16))
    loss = model(tokens, labels=torch.roll(tokens, -1, 1))
    assert loss.shape == (2, 16) and loss.dtype == torch.float32
    assert model(tokens).shape == (2, 16, VOCAB)


def test_residual_output_projections_use_megatrons_hybrid_init():
    """Megatron inits a hybrid model's residual output projections with std / sqrt(L) (a GPT's:
    std / sqrt(2 L)); every other hidden weight keeps --init-method-std."""
    cfg, mc = configs(hidden_size=256, num_attention_heads=4, ffn_hidden_size=512, init_method_std=0.05)
    assert cfg.is_hybrid_model and cfg.num_layers == 8
    torch.manual_seed(0)
    params = dict(build_hybrid_model(cfg, mc, VOCAB, device="cpu").named_parameters())
    out = 0.05 / 8**0.5
    for name in ("mixer.out_proj.weight", "self_attention.linear_proj.weight", "mlp.linear_fc2.weight"):
        found = [p for n, p in params.items() if n.endswith(name)]
        assert found, name
        for p in found:
            assert abs(p.std().item() - out) < 0.05 * out, name
    for name in ("mixer.in_proj.weight", "self_attention.linear_qkv.weight", "mlp.linear_fc1.weight"):
        for p in (p for n, p in params.items() if n.endswith(name)):
            assert abs(p.std().item() - 0.05) < 0.05 * 0.05, name


def test_needs_a_pattern_and_a_known_position_type():
    cfg, mc = configs()
    with pytest.raises(ValueError, match="--hybrid-layer-pattern"):
        HybridModel(cfg, MambaConfig(), VOCAB, 16)
    with pytest.raises(ValueError, match="--position-embedding-type 'alibi'"):
        HybridModel(cfg, mc, VOCAB, 16, position_embedding_type="alibi")


def test_rope_and_learned_positions_work():
    for kind in ("rope", "learned_absolute"):
        cfg, mc = configs(pattern="*M-", position_embedding_type=kind)
        model = build_hybrid_model(cfg, mc, VOCAB, device="cpu")
        tokens = torch.randint(0, VOCAB, (1, 16))
        assert torch.isfinite(model(tokens, labels=tokens)).all()


def test_flops_count_each_layer_kind():
    cfg, mc = configs(hidden_size=1024, num_attention_heads=16, seq_length=2048)
    mc = MambaConfig(hybrid_layer_pattern="M*M-M*M-")
    only_mamba = num_floating_point_operations(cfg, MambaConfig(hybrid_layer_pattern="M"), 2, 2048, 0)
    h, t = 1024, 2 * 2048
    # in_proj (z, x, B, C, dt), scan, out_proj: Megatron's hybrid formula, times 3 for fwd + bwd.
    assert only_mamba == 3 * (2 * t * h * (2 * 2048 + 2 * 8 * 128 + 32) + 7 * t * 2048 * 128 + 2 * t * 2048 * h)
    total = num_floating_point_operations(cfg, mc, 2, 2048, 32000)
    assert total > 4 * only_mamba


def test_pretrain_hybrid_trains_on_the_cpu_and_the_loss_decreases(tmp_path):
    from megatron.training.training import pretrain

    flags = [
        "--hybrid-layer-pattern", "M*M-M*M-", "--hidden-size", "32", "--num-attention-heads", "4",
        "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
        "--position-embedding-type", "none", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "constant", "--train-iters", "12",
        "--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--num-workers", "0",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--log-interval", "3", "--eval-iters", "0",
        "--data-cache-path", str(tmp_path), "--use-cpu",
    ]  # fmt: skip
    trainer = pretrain(flags, model_provider=pretrain_hybrid.model_provider, forward_step=pretrain_hybrid.forward_step)
    assert trainer.cfg.model.num_layers == 8
    assert [type(m).__name__ for m in trainer.model.module.decoder.layers][:4] == [
        "MambaLayer", "AttentionLayer", "MambaLayer", "MLPLayer"
    ]  # fmt: skip
    losses = [r["lm loss"] for r in trainer.history]
    assert len(losses) >= 4 and all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses


def test_pretrain_hybrid_needs_the_pattern():

    class Cfg:
        mamba = MambaConfig()

    with pytest.raises(ValueError, match="pretrain_hybrid.py needs --hybrid-layer-pattern"):
        pretrain_hybrid.model_provider(Cfg(), VOCAB, None, "cpu")


def test_pretrain_hybrid_with_moe_layers_trains_on_the_cpu(tmp_path):
    from megatron.training.training import pretrain

    flags = [
        "--hybrid-layer-pattern", "M*E-", "--hidden-size", "32", "--num-attention-heads", "4",
        "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
        "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "1e-2",
        "--seq-length", "16", "--micro-batch-size", "2", "--global-batch-size", "2",
        "--lr", "3e-3", "--train-iters", "4", "--mock-data", "--vocab-size", "64", "--num-workers", "0",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--log-interval", "2", "--eval-iters", "0",
        "--data-cache-path", str(tmp_path), "--use-cpu",
    ]  # fmt: skip
    trainer = pretrain(flags, model_provider=pretrain_hybrid.model_provider, forward_step=pretrain_hybrid.forward_step)
    kinds = [type(m).__name__ for m in trainer.model.module.decoder.layers]
    assert kinds == ["MambaLayer", "AttentionLayer", "MoEOnlyLayer", "MLPLayer"]
    assert all(torch.isfinite(torch.tensor(r["lm loss"])) for r in trainer.history)


def test_pretrain_gpt_refuses_a_hybrid_pattern(tiny_argv):
    from megatron.training.training import build_trainer

    with pytest.raises(ValueError, match="run pretrain_hybrid.py with the same flags"):
        build_trainer(tiny_argv("--train-iters 1 --hybrid-layer-pattern M* --mamba-num-groups 1 --mamba-head-dim 16"))


@pytest.mark.parametrize("method,layers", [("uniform", 2), ("block", 3)])
def test_full_recompute_of_a_hybrid_stack_recomputes_and_trains_like_none(method, layers, tmp_path):
    """--recompute-granularity full in a hybrid model, as Megatron's hybrid block does: the recomputed
    layers run their forward again in backward, and losses, gradient norms and final weights are bit
    for bit those without recompute (dropout on: the recompute replays the masks)."""
    from megatron.training.training import build_trainer

    flags = (
        "--hybrid-layer-pattern M*M- --hidden-size 32 --num-attention-heads 4 --mamba-state-dim 8 "
        "--mamba-head-dim 8 --mamba-num-groups 2 --position-embedding-type none --normalization RMSNorm "
        "--seq-length 16 --micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --train-iters 3 --mock-data "
        "--vocab-size 64 --tokenizer-type NullTokenizer --num-workers 0 --hidden-dropout 0.1 "
        f"--attention-dropout 0.1 --log-interval 1 --eval-iters 0 --use-cpu --data-cache-path {tmp_path}"
    ).split()
    recompute = f"--recompute-granularity full --recompute-method {method} --recompute-num-layers {layers}".split()
    runs, histories, calls = [], [], []
    for extra in ([], recompute):
        trainer = build_trainer(flags + extra, pretrain_hybrid.model_provider, pretrain_hybrid.forward_step)
        count = count_forwards(trainer.model.module.decoder.layers)
        histories.append(trainer.train())
        runs.append(trainer)
        calls.append(count)
    for key in ("lm loss", "grad-norm"):
        values = [[r[key] for r in history] for history in histories]
        assert len(values[0]) == 3 and values[0] == values[1], key
    for (name, a), (_, b) in zip(*(run.model.module.named_parameters() for run in runs)):
        assert torch.equal(a, b), name
    runs_per_layer = 3 * 2  # iterations x micro-batches
    recomputed = [2, 2, 2, 2] if method == "uniform" else [2, 2, 2, 1]
    assert calls == [[runs_per_layer] * 4, [runs_per_layer * n for n in recomputed]]
