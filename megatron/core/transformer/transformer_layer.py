"""A pre-norm transformer layer split into graphable regions.

``forward`` is literally ``_forward_mlp(_forward_attention(x))``. Unusual here: the
class declares those two methods as graph regions (``graph_regions``); the CUDA-graph
session (``transformer/cuda_graphs``) routes them through itself once attached, so
this file holds no capture code. For that to be correct each region method is a pure function of its tensor
arguments and the parameters: no Python state that changes between calls, no host
syncs, no data-dependent control flow (only ``self.training`` and the config choose
branches).
"""

import contextlib
import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec
from megatron.core.transformer.offload import offloader_for
from megatron.core.transformer.recompute import OutputDiscarder, checkpointed, recomputes
from megatron.core.transformer.spec_utils import build_module


@dataclasses.dataclass
class TransformerLayerSubmodules:
    """Specs (``ModuleSpec``, class or factory) of a layer's parts."""

    input_layernorm: Any = None
    self_attention: Any = None
    pre_mlp_layernorm: Any = None
    mlp: Any = None


class TransformerLayer(torch.nn.Module):
    """Pre-norm layer: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, with dropout on each branch.

    Graph regions: ``attn`` and ``mlp``; both together capture the whole layer.

    Args:
        config: Finalized ``TransformerConfig``.
        submodules: Specs of the norms, the attention and the MLP.
        layer_number: 1-based global layer number.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    graph_regions = GraphRegions(
        RegionSpec("attn", "_forward_attention"),
        RegionSpec("mlp", "_forward_mlp"),
        whole=("attn", "mlp"),
    )

    def __init__(self, config, submodules: TransformerLayerSubmodules, layer_number: int, pg=None, *, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        self.uses_rope = config.position_embedding_type == "rope"
        # Set by TransformerBlock: position of this layer within its block (pipeline chunk).
        self.is_first_layer = False
        self.is_last_layer = False
        h = config.hidden_size
        self.input_layernorm = build_module(submodules.input_layernorm, config=config, hidden_size=h, device=device)
        self.self_attention = build_module(
            submodules.self_attention, config=config, layer_number=layer_number, pg=pg, device=device
        )
        self.pre_mlp_layernorm = build_module(submodules.pre_mlp_layernorm, config=config, hidden_size=h, device=device)
        self.mlp = build_module(submodules.mlp, config=config, pg=pg, device=device)
        # Selective recompute (--recompute-modules): norm outputs discarded, the dense MLP checkpointed.
        self.recompute_layernorm = recomputes(config, "layernorm")
        self.recompute_mlp = recomputes(config, "mlp")
        self.offload = offloader_for(config)  # --offload-modules attn_norm mlp_norm

    def _recomputing(self) -> bool:
        return self.training and torch.is_grad_enabled()

    def _norm_discarder(self) -> OutputDiscarder | None:
        """An ``OutputDiscarder`` for this call's norm output when layernorm is recomputed."""
        return OutputDiscarder() if self.recompute_layernorm and self._recomputing() else None

    @staticmethod
    def _norm(norm, hidden_states: torch.Tensor, discarder: OutputDiscarder | None) -> torch.Tensor:
        return norm(hidden_states) if discarder is None else discarder.run(norm, hidden_states)

    @staticmethod
    def _readers(discarder: OutputDiscarder | None):
        return contextlib.nullcontext() if discarder is None else discarder.hooks()

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        return self._forward_mlp(self._forward_attention(hidden_states, rotary_pos_emb, attention_mask))

    def _forward_attention(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention region: norm -> self-attention -> bias-dropout-add onto the residual."""
        assert rotary_pos_emb is not None or not self.uses_rope, "a RoPE model must pass rotary_pos_emb"
        discarder = self._norm_discarder()
        with self._readers(discarder):
            with self.offload.scope("attn_norm", self.training):
                ln_out = self._norm(self.input_layernorm, hidden_states, discarder)
            out, bias = self.self_attention(ln_out, rotary_pos_emb=rotary_pos_emb, attention_mask=attention_mask)
        return self._bias_dropout_add(out, bias, hidden_states)

    def _forward_mlp(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """MLP region: norm -> MLP -> bias-dropout-add onto the residual."""
        discarder = self._norm_discarder()
        with self._readers(discarder):
            with self.offload.scope("mlp_norm", self.training):
                ln_out = self._norm(self.pre_mlp_layernorm, hidden_states, discarder)
            if self.recompute_mlp and self._recomputing():
                out, bias = checkpointed(self.mlp, ln_out)
            else:
                out, bias = self.mlp(ln_out)
        return self._bias_dropout_add(out, bias, hidden_states)

    def _bias_dropout_add(self, out: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor) -> torch.Tensor:
        # residual + dropout(out + bias), Megatron's order of operations.
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0.0:
            out = F.dropout(out, p=self.hidden_dropout, training=True)
        return residual + out
