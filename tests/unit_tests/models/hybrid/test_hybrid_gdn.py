"""Hybrid models with ``G`` (gated delta net) layers: names, GDN2 under gdn2, graph scopes, training, checkpoints.

A ``G`` layer is a transformer layer with gated delta net attention and no MLP, named as
Megatron's (``input_layernorm``, ``self_attention.{in_proj, conv1d, dt_bias, A_log,
out_norm, out_proj}``); with ``--experimental-attention-variant gdn2`` its attention is
``GatedDeltaNet2``. Its one graph region is ``attn`` (Megatron graphs a transformer
layer with gated delta net attention under ``attn``), and it may be captured whole.
"""

import warnings

import pytest
import torch

import pretrain_hybrid
from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, GDNLayer, MLPLayer
from megatron.core.models.hybrid.hybrid_model import (
    build_hybrid_model,
    check_graph_scopes,
    gdn_layer_flops,
    num_floating_point_operations,
    pattern_layer_classes,
)
from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig
from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net.gdn2 import GatedDeltaNet2
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.cuda_graphs.regions import resolve
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB = 64
SIZES = dict(linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4)


def configs(pattern="M*G-", variant=None, **kw):
    mc = MambaConfig(hybrid_layer_pattern=pattern, mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)
    la = LinearAttentionConfig(experimental_attention_variant=variant, **SIZES)
    base = dict(hidden_size=32, num_attention_heads=4, seq_length=16, hidden_dropout=0.0, attention_dropout=0.0)
    cfg = TransformerConfig(**{**base, **kw}, linear_attention=la)
    mc.resolve(cfg)
    mc.validate(cfg)
    la.finalize(cfg)
    la.validate(cfg, hybrid_pattern=pattern)
    return cfg.finalize(), mc


@pytest.mark.parametrize("variant,attention", [(None, GatedDeltaNet), ("gdn2", GatedDeltaNet2)])
def test_g_layers_have_megatrons_names_and_attention(variant, attention):
    cfg, mc = configs(variant=variant, normalization="RMSNorm")
    torch.manual_seed(0)
    model = build_hybrid_model(cfg, mc, VOCAB, device="cpu")
    assert [type(layer) for layer in model.decoder.layers] == [MambaLayer, AttentionLayer, GDNLayer, MLPLayer]
    g = model.decoder.layers[2]
    assert type(g.self_attention) is attention and g.self_attention.layer_number == 3
    names = {n for n, _ in model.named_parameters() if n.startswith("decoder.layers.2.")}
    suffixes = ("input_layernorm.weight", "in_proj.weight", "conv1d.weight", "dt_bias", "A_log", "out_norm.weight")
    assert names == {
        "decoder.layers.2.input_layernorm.weight",
        *(f"decoder.layers.2.self_attention.{s}" for s in suffixes[1:]),
        "decoder.layers.2.self_attention.out_proj.weight",
    }
    tokens = torch.randint(0, VOCAB, (2, 16))
    loss = model(tokens, labels=torch.roll(tokens, -1, 1))
    loss.mean().backward()
    assert torch.isfinite(loss).all()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in g.named_parameters()), "every G param learns"


def test_a_g_layer_is_a_residual_gated_delta_net_on_the_normed_input():
    cfg, mc = configs(pattern="G", variant="gdn2")
    layer = build_hybrid_model(cfg, mc, VOCAB, device="cpu").decoder.layers[0].double()
    x = torch.randn(16, 2, 32, dtype=torch.float64)
    out, _ = layer.self_attention(layer.input_layernorm(x))
    assert torch.equal(layer(x), x + out)


def test_flops_count_the_g_layers():
    for variant, in_proj in ((None, 2 * 16 + 2 * 32 + 2 * 4), ("gdn2", 4 * 16 + 3 * 32)):
        cfg, _ = configs(variant=variant)
        tokens = 2 * 16
        # Megatron's gdn_layer_flops: in_proj, conv over q/k/v, 4 * value heads * dv^2 for the rule, out_proj.
        want = 2 * tokens * (32 * in_proj + 4 * (2 * 16 + 32) + 4 * 8 * 8 * 4 + 32 * 32)
        assert gdn_layer_flops(cfg, tokens) == want
        with_g = num_floating_point_operations(cfg, MambaConfig(hybrid_layer_pattern="*G-"), 2, 16, VOCAB)
        without = num_floating_point_operations(cfg, MambaConfig(hybrid_layer_pattern="*-"), 2, 16, VOCAB)
        assert with_g - without == 3 * want


# ------------------------------------------------------------------------------------------- CUDA graphs


PATTERN = MambaConfig(hybrid_layer_pattern="M*G-M*G-", mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)


def names(plan):
    return {cls.__name__: [s.name for s in specs] for cls, specs in plan.items()}


@pytest.mark.parametrize(
    "scopes,expected",
    [
        ([], {"MambaLayer": ["layer"], "AttentionLayer": ["layer"], "GDNLayer": ["layer"], "MLPLayer": ["layer"]}),
        (["attn"], {"MambaLayer": [], "AttentionLayer": ["layer"], "GDNLayer": ["layer"], "MLPLayer": []}),
        (["mamba"], {"MambaLayer": ["layer"], "AttentionLayer": [], "GDNLayer": [], "MLPLayer": []}),
        (
            ["mamba", "attn", "mlp"],
            {"MambaLayer": ["layer"], "AttentionLayer": ["layer"], "GDNLayer": ["layer"], "MLPLayer": ["layer"]},
        ),
    ],
)
def test_the_attn_scope_graphs_the_g_layers(scopes, expected):
    assert pattern_layer_classes(PATTERN) == [MambaLayer, AttentionLayer, GDNLayer, MLPLayer] * 2
    check_graph_scopes(scopes, PATTERN)
    assert names(resolve(scopes, pattern_layer_classes(PATTERN))) == expected


def test_attn_on_a_pattern_with_g_but_no_softmax_attention_graphs_the_g_layers():
    only_g = MambaConfig(hybrid_layer_pattern="MG-")
    check_graph_scopes(["attn"], only_g)
    assert names(resolve(["attn"], pattern_layer_classes(only_g)))["GDNLayer"] == ["layer"]
    with pytest.raises(ValueError, match=r"--cuda-graph-scope attn.*it has no \* \(attention\) or G \(gated"):
        check_graph_scopes(["attn"], MambaConfig(hybrid_layer_pattern="MM-"))


@pytest.mark.parametrize(
    "scopes,regions",
    [
        (["attn"], ["1.layer", "2.layer", "5.layer", "6.layer"]),
        (["mamba", "attn"], ["0.layer", "1.layer", "2.layer", "4.layer", "5.layer", "6.layer"]),
        ([], [f"{i}.layer" for i in range(8)] + ["postprocess"]),
    ],
)
@pytest.mark.parametrize("variant", [None, "gdn2"])
def test_session_records_the_g_layers_in_order(scopes, regions, variant):
    """The graph session attached to an M*G- hybrid records its regions in execution order (CPU: record only)."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.models.gpt.loss import masked_mean_loss
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
    from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, Event
    from megatron.training.config import DDPConfig

    cfg, mc = configs(pattern="M*G-M*G-", variant=variant)
    torch.manual_seed(0)
    model = build_hybrid_model(cfg, mc, VOCAB, device="cpu")
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    check_graph_scopes(scopes, mc, cfg)
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)
    assert [r.name.removeprefix("decoder.layers.") for r in session.regions] == regions
    tokens = torch.randint(0, VOCAB, (2, 16))
    loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 16))
    loss.backward()
    n = len(regions)
    plan = session.make_plans()[0]  # slot 0: one micro-batch in flight
    assert plan.cycle == [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]
    session.close()


# ------------------------------------------------------------------------------------ training, checkpoint


def _flags(pattern: str, tmp_path, extra: str = "") -> list[str]:
    return [
        "--hybrid-layer-pattern", pattern, "--hidden-size", "32", "--num-attention-heads", "4",
        "--mamba-state-dim", "8", "--mamba-head-dim", "8", "--mamba-num-groups", "2",
        "--linear-key-head-dim", "8", "--linear-value-head-dim", "8", "--linear-num-key-heads", "2",
        "--linear-num-value-heads", "4", "--swiglu",
        "--position-embedding-type", "none", "--normalization", "RMSNorm", "--disable-bias-linear",
        "--seq-length", "32", "--micro-batch-size", "4", "--global-batch-size", "4",
        "--lr", "3e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "constant",
        "--mock-data", "--vocab-size", "64", "--tokenizer-type", "NullTokenizer", "--num-workers", "0",
        "--hidden-dropout", "0.0", "--attention-dropout", "0.0", "--log-interval", "1", "--eval-iters", "0",
        "--data-cache-path", str(tmp_path / "cache"), "--use-cpu", *extra.split(),
    ]  # fmt: skip


@pytest.mark.parametrize("variant", ["", "--experimental-attention-variant gdn2"], ids=["gdn", "gdn2"])
def test_a_g_hybrid_trains_and_resumes_from_its_checkpoint_exactly(tmp_path, variant):
    """12 iterations straight; then 6, saved, and 6 more loaded from the checkpoint: the same losses."""
    from megatron.training.training import pretrain

    def run(extra):
        flags = _flags("M*G-", tmp_path, f"{variant} {extra}")
        trainer = pretrain(
            flags, model_provider=pretrain_hybrid.model_provider, forward_step=pretrain_hybrid.forward_step
        )
        return trainer, [r["lm loss"] for r in trainer.history]

    trainer, straight = run("--train-iters 12")
    kinds = [type(m).__name__ for m in trainer.model.module.decoder.layers]
    assert kinds == ["MambaLayer", "AttentionLayer", "GDNLayer", "MLPLayer"]
    want = GatedDeltaNet2 if variant else GatedDeltaNet
    assert type(trainer.model.module.decoder.layers[2].self_attention) is want
    assert len(straight) == 12 and all(torch.isfinite(torch.tensor(straight)))
    assert straight[-1] < straight[0] - 0.3, straight
    ckpt = tmp_path / "ckpt"
    _, first = run(f"--train-iters 12 --save {ckpt} --save-interval 6 --exit-interval 6")
    resumed_trainer, second = run(f"--train-iters 12 --load {ckpt}")
    assert first == straight[:6]
    assert second == straight[6:], (second, straight[6:])  # same kernels, same order: bitwise on the CPU
    state = resumed_trainer.model.module.state_dict()
    for key in ("dt_bias", "A_log", "in_proj.weight", "conv1d.weight", "out_norm.weight", "out_proj.weight"):
        assert f"decoder.layers.2.self_attention.{key}" in state
