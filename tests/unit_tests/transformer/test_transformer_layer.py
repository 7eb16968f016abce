"""TransformerLayer regions, TransformerBlock annotation, norms and module specs."""

import pytest
import torch

from megatron.core.models.common.rotary import RotaryEmbedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig


def config(**kw):
    base = dict(
        num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0
    )
    base.update(kw)
    return TransformerConfig(**base).finalize()


def build_layer(cfg, layer_number=1):
    torch.manual_seed(0)
    return build_module(get_gpt_layer_local_spec(), config=cfg, layer_number=layer_number, device="cpu")


def test_forward_is_mlp_of_attention_and_regions_are_named():
    cfg = config()
    layer = build_layer(cfg)
    x = torch.randn(8, 2, 32)
    regions = type(layer).graph_regions
    assert [(s.name, s.method) for s in regions.specs] == [("attn", "_forward_attention"), ("mlp", "_forward_mlp")]
    assert regions.whole == ("attn", "mlp") and regions.ends == "mlp"
    for spec in regions.specs:
        assert callable(getattr(layer, spec.method))
    assert torch.equal(layer(x), layer._forward_mlp(layer._forward_attention(x)))


def test_regions_are_pre_norm_residual_blocks():
    cfg = config()
    layer = build_layer(cfg)
    x = torch.randn(8, 2, 32)
    out, bias = layer.self_attention(layer.input_layernorm(x))
    assert bias is None  # the output projections add their biases in the GEMM
    torch.testing.assert_close(layer._forward_attention(x), x + out)
    out, bias = layer.mlp(layer.pre_mlp_layernorm(x))
    assert bias is None
    torch.testing.assert_close(layer._forward_mlp(x), x + out)


def test_instance_wrapped_region_is_used_by_forward():
    """The CUDA-graph code replaces region methods on the instance; forward must call through them."""
    layer = build_layer(config())
    calls = []
    original = layer._forward_mlp
    layer._forward_mlp = lambda h: calls.append(h) or original(h)
    layer(torch.randn(8, 2, 32))
    assert len(calls) == 1


def test_rope_layer_requires_rotary_table():
    cfg = config(position_embedding_type="rope")
    layer = build_layer(cfg)
    x = torch.randn(8, 2, 32)
    with pytest.raises(AssertionError):
        layer(x)
    assert layer(x, rotary_pos_emb=RotaryEmbedding(cfg.kv_channels)(8, "cpu")).shape == x.shape


def test_hidden_dropout_only_in_training():
    cfg = config(hidden_dropout=0.5)
    layer = build_layer(cfg)
    x = torch.randn(8, 2, 32)
    layer.eval()
    out, _ = layer.mlp(layer.pre_mlp_layernorm(x))
    torch.testing.assert_close(layer._forward_mlp(x), x + out)
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_block_numbers_and_annotates_layers():
    cfg = config(num_layers=6)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec(), num_layers=3, layer_offset=3, device="cpu")
    assert [layer.layer_number for layer in block.layers] == [4, 5, 6]
    assert [layer.is_first_layer for layer in block.layers] == [True, False, False]
    assert [layer.is_last_layer for layer in block.layers] == [False, False, True]
    assert isinstance(block.final_layernorm, torch.nn.LayerNorm)
    x = torch.randn(8, 2, 32)
    h = x
    for layer in block.layers:
        h = layer(h)
    torch.testing.assert_close(block(x), block.final_layernorm(h))
    assert (
        TransformerBlock(cfg, get_gpt_layer_local_spec(), post_layer_norm=False, device="cpu").final_layernorm is None
    )


def test_build_norm():
    ln = build_norm(config(norm_epsilon=1e-3, params_dtype=torch.float64), 16, device="cpu")
    assert isinstance(ln, torch.nn.LayerNorm) and ln.eps == 1e-3 and ln.weight.dtype == torch.float64
    assert torch.equal(ln.weight, torch.ones(16, dtype=torch.float64)) and torch.count_nonzero(ln.bias) == 0
    rms = build_norm(config(normalization="RMSNorm"), 16, device="cpu")
    assert isinstance(rms, torch.nn.RMSNorm) and sum(p.numel() for p in rms.parameters()) == 16
    x = torch.randn(3, 16)
    torch.testing.assert_close(rms(x), x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    bad = config()
    bad.normalization = "BatchNorm"
    with pytest.raises(ValueError, match="--normalization"):
        build_norm(bad, 16)


def test_build_module_merges_params_and_submodules():
    class Thing:
        def __init__(self, a, b=0, submodules=None):
            self.a, self.b, self.submodules = a, b, submodules

    thing = build_module(ModuleSpec(Thing, params={"b": 2}, submodules="subs"), 1)
    assert (thing.a, thing.b, thing.submodules) == (1, 2, "subs")
    assert build_module(ModuleSpec(Thing, params={"b": 2}), a=1, b=5).b == 5
    assert build_module(Thing, 3).a == 3
