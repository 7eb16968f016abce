"""A Mamba layer of a hybrid model: ``x + dropout(mixer(norm(x)))``, one graphable region.

Like ``TransformerLayer`` it holds no capture code: the class declares
``_forward_mamba`` as its graph region (the ``mamba`` scope). ``_forward_mamba`` is a pure
function of its tensor argument and the parameters (no host syncs, static shapes,
nothing stored on ``self``), and it is all of ``forward``, so the layer may be captured
whole as well.
"""

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.spec_utils import build_module


@dataclasses.dataclass
class MambaLayerSubmodules:
    """Specs of a Mamba layer's parts: the pre-norm and the mixer."""

    norm: Any = build_norm
    mixer: Any = MambaMixer


class MambaLayer(torch.nn.Module):
    """Pre-norm Mamba layer on ``[s, b, h]``.

    Args:
        config: Finalized ``TransformerConfig`` (norm type, dropout).
        mamba_config: ``MambaConfig`` of the mixer.
        layer_number: 1-based global layer number.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        submodules: Specs of the norm and the mixer.
        device: Device for the parameters (default: torch's default device).
    """

    graph_regions = GraphRegions(RegionSpec("mamba", "_forward_mamba"), whole=("mamba",))

    def __init__(
        self,
        config,
        mamba_config,
        layer_number: int = 1,
        pg=None,
        *,
        submodules: MambaLayerSubmodules | None = None,
        device=None,
    ):
        super().__init__()
        submodules = submodules or MambaLayerSubmodules()
        self.config = config
        self.layer_number = layer_number
        self.hidden_dropout = config.hidden_dropout
        # Set by the block: position of this layer within its chunk.
        self.is_first_layer = False
        self.is_last_layer = False
        self.norm = build_module(submodules.norm, config=config, hidden_size=config.hidden_size, device=device)
        self.mixer = build_module(
            submodules.mixer, config=config, mamba_config=mamba_config, layer_number=layer_number, pg=pg, device=device
        )

    def forward(self, hidden_states: torch.Tensor, rotary_pos_emb=None, attention_mask=None) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``; ``rotary_pos_emb`` and ``attention_mask`` are accepted for a uniform
        layer call and unused (the scan runs across documents, as upstream's)."""
        return self._forward_mamba(hidden_states)

    def _forward_mamba(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Mamba region: norm -> mixer -> dropout-add onto the residual."""
        out, bias = self.mixer(self.norm(hidden_states))
        if bias is not None:
            out = out + bias
        if self.training and self.hidden_dropout > 0.0:
            out = F.dropout(out, p=self.hidden_dropout, training=True)
        return hidden_states + out
