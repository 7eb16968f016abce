"""A stack of transformer layers (one pipeline chunk) plus the final norm.

Layers get 1-based *global* layer numbers (``layer_offset + i + 1``) so a layer
knows where it sits in the whole model (initialisation, logging, graph names), and
are annotated with ``is_first_layer`` / ``is_last_layer`` *within this block* (one
pipeline chunk): the layers at a chunk's edges read from or feed communication.
``graph_layers()`` tells the CUDA-graph session which layers are this block's own.
"""

import torch

from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.recompute import run_layers
from megatron.core.transformer.spec_utils import build_module


class LayerStack(torch.nn.Module):
    """What a transformer block and a hybrid stack share: their layers in order, marked at the
    chunk's edges, the final norm on the last pipeline stage (named ``final_norm_name``, as Megatron
    names it in each), and the forward pass (with ``--recompute-granularity full``, in recomputed
    chunks). A subclass builds its layers and hands them to :meth:`_set_layers`."""

    final_norm_name = "final_layernorm"

    def _set_layers(self, layers, config, *, post_layer_norm: bool, post_process: bool, device) -> None:
        self.layers = torch.nn.ModuleList(layers)
        for i, layer in enumerate(self.layers):
            layer.is_first_layer = i == 0
            layer.is_last_layer = i == len(self.layers) - 1
        norm = build_norm(config, config.hidden_size, device=device) if post_layer_norm and post_process else None
        setattr(self, self.final_norm_name, norm)

    @property
    def final_norm_layer(self) -> torch.nn.Module | None:
        """The final norm (on the last pipeline stage), whatever its name in this stack."""
        return getattr(self, self.final_norm_name)

    def graph_layers(self) -> list[torch.nn.Module]:
        """The layers the CUDA-graph session may route (this chunk's own, in order)."""
        return list(self.layers)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        *,
        final_norm: bool = True,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``.

        ``final_norm=False`` leaves the final norm to the caller (the language model applies it
        inside its loss head, so the head is one graphable region). ``attention_mask``: bool
        ``[b, 1, s, s]``, True where attention is allowed, or None (causal); layers without
        attention ignore it and the rotary table.
        """
        hidden_states = run_layers(self.layers, hidden_states, rotary_pos_emb, self.config, attention_mask)
        if final_norm and self.final_norm_layer is not None:
            hidden_states = self.final_norm_layer(hidden_states)
        return hidden_states


class TransformerBlock(LayerStack):
    """Runs ``layers`` in order, then ``final_layernorm`` when present.

    Args:
        config: Finalized ``TransformerConfig``.
        layer_spec: Spec of one layer (``ModuleSpec``), built once per layer, or a list with
            one spec per layer of this block (MoE models mix dense and MoE layers).
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        num_layers: Layers in this block (default: ``config.num_layers``).
        layer_offset: Global index of this block's first layer (pipeline chunks).
        post_layer_norm: Add the final norm (only on the last pipeline stage).
        pre_process: This block is on the first pipeline stage.
        post_process: This block is on the last pipeline stage.
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        config,
        layer_spec,
        pg=None,
        *,
        num_layers: int | None = None,
        layer_offset: int = 0,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        device=None,
    ):
        super().__init__()
        self.config = config
        self.pre_process = pre_process
        self.post_process = post_process
        num_layers = config.num_layers if num_layers is None else num_layers
        specs = list(layer_spec) if isinstance(layer_spec, list | tuple) else [layer_spec] * num_layers
        if len(specs) == config.num_layers != num_layers:  # the whole model's list: take this chunk's part
            specs = specs[layer_offset : layer_offset + num_layers]
        assert len(specs) == num_layers, f"{len(specs)} layer specs for {num_layers} layers"
        layers = [
            build_module(specs[i], config=config, layer_number=layer_offset + i + 1, pg=pg, device=device)
            for i in range(num_layers)
        ]
        self._set_layers(layers, config, post_layer_norm=post_layer_norm, post_process=post_process, device=device)
