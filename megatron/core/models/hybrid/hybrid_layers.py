"""The ``G``, ``*``, ``-`` and ``E`` layers of a hybrid model: a transformer layer with only
attention (gated delta net or softmax), only the MLP, or only the MoE block.

They reuse ``TransformerLayer`` / ``MoETransformerLayer`` as they are: the constructor,
with the absent part's specs building nothing (``absent``), and the region methods.
Attention, gated delta net and MLP layers offer their one region and may be captured
whole (a ``G`` layer's region is ``attn``, as Megatron graphs a transformer layer with
gated delta net attention under its ``attn`` scope); the MoE
layer offers the MoE layer's ``moe_router``, ``moe_preprocess`` and ``moe`` regions with
their rules (whole only with drop-and-pad). Parameter names are the transformer
layer's (``input_layernorm``, ``self_attention`` / ``pre_mlp_layernorm``, ``mlp``), as
Megatron's hybrid layers have.
"""

import torch

from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec
from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
from megatron.core.transformer.transformer_layer import TransformerLayer


def absent(*args, **kwargs) -> None:
    """Spec of a part a layer does not have: builds nothing."""
    return None


class AttentionLayer(TransformerLayer):
    """``x + attn(norm(x))``: a transformer layer without its MLP (pattern symbol ``*``)."""

    graph_regions = GraphRegions(RegionSpec("attn", "_forward_attention"), whole=("attn",))

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        return self._forward_attention(hidden_states, rotary_pos_emb, attention_mask)


class GDNLayer(AttentionLayer):
    """``x + gdn(norm(x))``: a transformer layer with gated delta net (or GDN2) attention and no MLP
    (pattern symbol ``G``)."""


class MLPLayer(TransformerLayer):
    """``x + mlp(norm(x))``: a transformer layer without attention (pattern symbol ``-``)."""

    graph_regions = GraphRegions(RegionSpec("mlp", "_forward_mlp"), whole=("mlp",))

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb=None, attention_mask=None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary_pos_emb`` and ``attention_mask`` are accepted for a uniform
        layer call and unused."""
        return self._forward_mlp(hidden_states)


_MOE_REGIONS = MoETransformerLayer.graph_regions


class MoEOnlyLayer(MoETransformerLayer):
    """``x + moe(norm(x))``: an MoE transformer layer without attention (pattern symbol ``E``)."""

    graph_regions = GraphRegions(
        *(spec for spec in _MOE_REGIONS.specs if spec.name != "attn"),
        whole=("moe",),
        whole_when=_MOE_REGIONS.whole_when,
    )

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb=None, attention_mask=None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; router statistics are added up as in ``MoETransformerLayer``
        (``rotary_pos_emb`` and ``attention_mask`` are unused)."""
        return self._forward_moe_counted(hidden_states)
