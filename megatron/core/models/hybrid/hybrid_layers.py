"""The ``*`` and ``-`` layers of a hybrid model: a transformer layer with only attention / only the MLP.

Both reuse ``TransformerLayer`` as it is: its constructor, with the absent part's specs
building nothing (``absent``), and its region methods ``_forward_attention`` /
``_forward_mlp``. Each offers its one region and may be captured whole. Parameter
names are the transformer layer's (``input_layernorm``, ``self_attention`` /
``pre_mlp_layernorm``, ``mlp``), as Megatron's hybrid attention and MLP layers have.
"""

import torch

from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec
from megatron.core.transformer.transformer_layer import TransformerLayer


def absent(*args, **kwargs) -> None:
    """Spec of a part a layer does not have: builds nothing."""
    return None


class AttentionLayer(TransformerLayer):
    """``x + attn(norm(x))``: a transformer layer without its MLP (pattern symbol ``*``)."""

    graph_regions = GraphRegions(RegionSpec("attn", "_forward_attention"), whole=("attn",))

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        return self._forward_attention(hidden_states, rotary_pos_emb)


class MLPLayer(TransformerLayer):
    """``x + mlp(norm(x))``: a transformer layer without attention (pattern symbol ``-``)."""

    graph_regions = GraphRegions(RegionSpec("mlp", "_forward_mlp"), whole=("mlp",))

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb: torch.Tensor | None = None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary_pos_emb`` is accepted for a uniform layer call and unused."""
        return self._forward_mlp(hidden_states)
