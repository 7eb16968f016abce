"""HybridStack: layers from the pattern, global numbering, first/last marks, the layer kinds' parts."""

import pytest
import torch

from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, MLPLayer, MoEOnlyLayer
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig

H = 32


def configs(**kw):
    cfg = TransformerConfig(
        hidden_size=H, num_attention_heads=4, num_layers=8, hidden_dropout=0.0, attention_dropout=0.0, **kw
    ).finalize()
    return cfg, MambaConfig(mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)


def test_layers_follow_the_pattern_and_are_marked():
    cfg, mc = configs()
    stack = HybridStack(cfg, mc, "M*M-", layer_offset=4, device="cpu")
    kinds = [type(layer) for layer in stack.layers]
    assert kinds == [MambaLayer, AttentionLayer, MambaLayer, MLPLayer]
    assert [layer.layer_number for layer in stack.layers] == [5, 6, 7, 8]
    assert [layer.is_first_layer for layer in stack.layers] == [True, False, False, False]
    assert [layer.is_last_layer for layer in stack.layers] == [False, False, False, True]
    # Attention layers have no MLP and MLP layers no attention (Megatron's parameter names).
    names = {n.split(".")[2] for n, _ in stack.named_parameters() if n.startswith("layers.1.")}
    assert names == {"input_layernorm", "self_attention"}
    names = {n.split(".")[2] for n, _ in stack.named_parameters() if n.startswith("layers.3.")}
    assert names == {"pre_mlp_layernorm", "mlp"}
    assert {n.split(".")[2] for n, _ in stack.named_parameters() if n.startswith("layers.0.")} == {"norm", "mixer"}
    assert stack.final_norm is not None
    assert HybridStack(cfg, mc, "M", post_process=False, device="cpu").final_norm is None


def test_each_layer_kind_is_a_residual_branch_with_one_region():
    cfg, mc = configs()
    stack = HybridStack(cfg, mc, "M*-", device="cpu")
    x = torch.randn(6, 2, H)
    expected = {MambaLayer: "_forward_mamba", AttentionLayer: "_forward_attention", MLPLayer: "_forward_mlp"}
    for layer in stack.layers:
        regions = type(layer).graph_regions
        (spec,) = regions.specs
        assert spec.method == expected[type(layer)] and regions.whole == (spec.name,)
        assert getattr(layer, spec.method)
        assert torch.equal(layer(x), getattr(layer, spec.method)(x))  # the region is the whole forward
    assert stack.graph_layers() == list(stack.layers)
    mamba, attn, mlp = stack.layers
    torch.testing.assert_close(mamba(x), x + mamba.mixer(mamba.norm(x))[0])
    torch.testing.assert_close(mlp(x), x + mlp.mlp(mlp.pre_mlp_layernorm(x))[0])
    out = stack(x)
    torch.testing.assert_close(out, stack.final_norm(mlp(attn(mamba(x)))))


def test_moe_layers_are_moe_blocks_without_attention():
    cfg, mc = configs(moe=MoEConfig(num_moe_experts=4, moe_router_topk=2))
    cfg.moe.validate(cfg)
    stack = HybridStack(cfg, mc, "ME", device="cpu")
    layer = stack.layers[1]
    assert isinstance(layer, MoEOnlyLayer) and layer.self_attention is None and layer.input_layernorm is None
    assert {n.split(".")[2] for n, _ in stack.named_parameters() if n.startswith("layers.1.")} == {
        "pre_mlp_layernorm",
        "mlp",
    }
    assert [s.name for s in MoEOnlyLayer.graph_regions.specs] == [
        "moe_router",
        "moe_preprocess",
        "moe_postprocess",
        "moe",
    ]
    x = torch.randn(6, 2, H, requires_grad=True)
    out = stack(x)
    out.sum().backward()
    assert out.shape == x.shape and torch.isfinite(x.grad).all()
    assert layer.mlp.router.weight.grad is not None


def test_a_layer_kind_without_a_spec_is_a_clear_error():
    from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules

    cfg, mc = configs()
    with pytest.raises(ValueError, match="--hybrid-layer-pattern: symbol 'E' \\(MoE\\) - MoE layers are not available"):
        HybridStack(cfg, mc, "ME", submodules=HybridStackSubmodules(mamba_layer=MambaLayer), device="cpu")


def test_attention_layers_read_rope():
    cfg, mc = configs(position_embedding_type="rope")
    stack = HybridStack(cfg, mc, "*M", device="cpu")
    with pytest.raises(AssertionError, match="rotary_pos_emb"):
        stack(torch.randn(4, 1, H))
