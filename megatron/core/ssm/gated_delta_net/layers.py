"""Transformer layers whose attention is a gated delta net, and their layer specs.

They are ``TransformerLayer`` / ``MoETransformerLayer`` as they are (pre-norm, the same
parameter names: ``input_layernorm``, ``self_attention`` (the ``GatedDeltaNet``),
``pre_mlp_layernorm``, ``mlp``), with one difference in what they declare to the
CUDA-graph session: their attention is not a graph region yet. Their ``attn`` region
is unavailable (so ``--cuda-graph-scope attn`` graphs the softmax-attention layers of
the model only, and is refused with the reason when every layer is a gated delta net),
and they are never captured whole (an empty scope list, whole layers, is refused with
the reason); their MLP / MoE regions are offered as in the layers they extend.
"""

import dataclasses

from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net.gdn2 import GatedDeltaNet2
from megatron.core.transformer.cuda_graphs.regions import GraphRegions
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer, MoETransformerLayer
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

NOT_GRAPHED = "gated delta net attention is not a CUDA-graph region yet"


def _not_graphed(config) -> str:
    return NOT_GRAPHED


def attention_not_graphed(regions: GraphRegions) -> GraphRegions:
    """``regions`` with the ``attn`` region unavailable and no whole-layer capture."""
    specs = [dataclasses.replace(s, when=_not_graphed) if s.name == "attn" else s for s in regions.specs]
    return GraphRegions(*specs, whole=regions.whole, whole_when=_not_graphed, ends=regions.ends)


class GatedDeltaNetLayer(TransformerLayer):
    """A dense transformer layer with gated delta net attention (graph regions: ``mlp`` only)."""

    graph_regions = attention_not_graphed(TransformerLayer.graph_regions)


class GatedDeltaNetMoELayer(MoETransformerLayer):
    """An MoE transformer layer with gated delta net attention (graph regions: the MoE ones only)."""

    graph_regions = attention_not_graphed(MoETransformerLayer.graph_regions)


def get_gdn_layer_local_spec(moe: bool = False, gdn2: bool = False) -> ModuleSpec:
    """Spec of a GPT layer with gated delta net (``gdn2``: GDN2) attention and a dense MLP (or an ``MoELayer``)."""
    return ModuleSpec(
        module=GatedDeltaNetMoELayer if moe else GatedDeltaNetLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=GatedDeltaNet2 if gdn2 else GatedDeltaNet,
            pre_mlp_layernorm=build_norm,
            mlp=MoELayer if moe else MLP,
        ),
    )
