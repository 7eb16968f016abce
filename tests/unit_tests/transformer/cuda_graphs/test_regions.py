"""The scope resolver: one place for every scope rule, on declared layer classes."""

import types

import pytest
import torch

from megatron.core.transformer.cuda_graphs.regions import (
    WHOLE,
    GraphRegions,
    RegionSpec,
    check_scope_names,
    graphable_layers,
    head_follows,
    resolve,
)
from megatron.core.transformer.transformer_layer import TransformerLayer


def _drop_and_pad(config):
    return (
        None
        if config.pad
        else "it needs drop-and-pad (--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity)"
    )


class FakeMoELayer(torch.nn.Module):
    """Shaped like an MoE layer: attention, router, dispatcher preprocess, eager experts."""

    graph_regions = GraphRegions(
        RegionSpec("attn", "_forward_attention"),
        RegionSpec("moe_router", "_forward_router", excludes=("moe",)),
        RegionSpec("moe_preprocess", "_forward_preprocess", requires=("moe_router",), excludes=("moe",)),
        RegionSpec("moe", "_forward_moe", when=_drop_and_pad),
        whole=("attn", "moe"),
        whole_when=_drop_and_pad,
    )


class FakeMambaLayer(torch.nn.Module):
    graph_regions = GraphRegions(RegionSpec("mamba", "_forward_mamba"), whole=("mamba",))


DROPLESS = types.SimpleNamespace(pad=False)
PADDED = types.SimpleNamespace(pad=True)


def names(regions):
    return [s.name for s in regions]


def test_dense_layer_whole_attn_mlp():
    assert resolve([], [TransformerLayer]) == {TransformerLayer: (WHOLE,)}
    assert resolve(["attn", "mlp"], [TransformerLayer]) == {TransformerLayer: (WHOLE,)}
    assert resolve(["mlp", "attn"], [TransformerLayer]) == {TransformerLayer: (WHOLE,)}
    assert names(resolve(["attn"], [TransformerLayer])[TransformerLayer]) == ["attn"]
    assert names(resolve(["mlp"], [TransformerLayer])[TransformerLayer]) == ["mlp"]


def test_moe_shaped_layer_with_every_partial_region_is_not_one_layer_graph():
    plan = resolve(["attn", "moe_router", "moe_preprocess"], [FakeMoELayer], DROPLESS)
    assert names(plan[FakeMoELayer]) == ["attn", "moe_router", "moe_preprocess"]
    assert plan[FakeMoELayer] != (WHOLE,)


def test_moe_rules_are_declarations():
    with pytest.raises(ValueError, match="moe_preprocess needs moe_router"):
        resolve(["moe_preprocess"], [FakeMoELayer], DROPLESS)
    with pytest.raises(ValueError, match="moe_router cannot be combined with moe"):
        resolve(["moe_router", "moe"], [FakeMoELayer], PADDED)
    with pytest.raises(ValueError, match="moe: not available with this model: it needs drop-and-pad"):
        resolve(["moe"], [FakeMoELayer], DROPLESS)
    with pytest.raises(ValueError, match="FakeMoELayer cannot be captured whole: it needs drop-and-pad"):
        resolve([], [FakeMoELayer], DROPLESS)
    assert resolve(["moe"], [FakeMoELayer], PADDED)[FakeMoELayer][0].name == "moe"
    assert resolve(["attn", "moe"], [FakeMoELayer], PADDED) == {FakeMoELayer: (WHOLE,)}
    assert resolve([], [FakeMoELayer], PADDED) == {FakeMoELayer: (WHOLE,)}


def test_mixed_layer_types():
    classes = [FakeMambaLayer, TransformerLayer, FakeMambaLayer]
    plan = resolve(["mamba"], classes)
    assert plan == {FakeMambaLayer: (WHOLE,), TransformerLayer: ()}
    plan = resolve(["mamba", "attn"], classes)
    assert plan[FakeMambaLayer] == (WHOLE,) and names(plan[TransformerLayer]) == ["attn"]
    with pytest.raises(ValueError, match=r"no 'mamba' region \(its layers TransformerLayer offer: attn mlp\)"):
        resolve(["mamba"], [TransformerLayer])
    with pytest.raises(ValueError, match="no 'mlp' region"):
        resolve(["mlp"], [FakeMoELayer], PADDED)  # every layer is MoE


def test_unknown_and_repeated_scope_names():
    with pytest.raises(ValueError, match="unknown scope 'attention'"):
        check_scope_names(["attention"])
    with pytest.raises(ValueError, match="lists attn more than once"):
        resolve(["attn", "attn"], [TransformerLayer])


def test_head_follows_the_region_that_feeds_it():
    assert head_follows((WHOLE,), TransformerLayer)
    mlp = resolve(["mlp"], [TransformerLayer])[TransformerLayer]
    attn = resolve(["attn"], [TransformerLayer])[TransformerLayer]
    assert head_follows(mlp, TransformerLayer) and not head_follows(attn, TransformerLayer)
    assert not head_follows((), TransformerLayer)
    dropless = resolve(["attn", "moe_router"], [FakeMoELayer], DROPLESS)[FakeMoELayer]
    assert not head_follows(dropless, FakeMoELayer)


def test_only_a_blocks_own_layers_are_discovered():
    class Inner(torch.nn.Module):
        graph_regions = GraphRegions(RegionSpec("mlp", "forward"), whole=("mlp",))

    class Layer(torch.nn.Module):
        graph_regions = GraphRegions(RegionSpec("attn", "forward"), whole=("attn",))

        def __init__(self):
            super().__init__()
            self.inner = Inner()  # declares regions but is no block's layer

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Layer(), Layer()])

        def graph_layers(self):
            return list(self.layers)

    block = Block()
    assert graphable_layers(torch.nn.Sequential(block)) == list(block.layers)
