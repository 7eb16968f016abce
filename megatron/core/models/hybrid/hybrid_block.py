"""The hybrid stack: one model chunk of Mamba, gated delta net, attention, MLP and MoE layers from the pattern.

``HybridStack`` is to a hybrid model what ``TransformerBlock`` is to GPT: it builds the
layers of one pipeline chunk from that chunk's symbols of ``--hybrid-layer-pattern``
(``hybrid_layer_allocation.select_pipeline_segment`` picks them), numbers them
globally (``layer_offset + i + 1``), marks ``is_first_layer`` / ``is_last_layer``
within the chunk (the layers at a chunk's edges read from or feed communication),
names them to the CUDA-graph session (``graph_layers``), runs them in order (with
``--recompute-granularity full``, in recomputed chunks, as ``TransformerBlock`` does) and applies the final
norm on the last stage. Every layer takes and returns ``[s, b, h]``; attention
layers also read the rotary table, the others ignore it. ``G`` layers build the
``gdn_layer`` spec with its attention swapped for ``GatedDeltaNet2`` when
``--experimental-attention-variant gdn2`` is set, as Megatron's hybrid block does.
"""

import copy
import dataclasses
from typing import Any

from megatron.core.models.hybrid.hybrid_layer_allocation import PATTERN_FLAG, Symbols
from megatron.core.transformer.spec_utils import ModuleSpec, build_module
from megatron.core.transformer.transformer_block import LayerStack


@dataclasses.dataclass
class HybridStackSubmodules:
    """Specs of the layer kinds, one per pattern symbol (None: not available)."""

    mamba_layer: Any = None
    gdn_layer: Any = None
    attention_layer: Any = None
    mlp_layer: Any = None
    moe_layer: Any = None


_SPEC_OF = {
    Symbols.MAMBA: "mamba_layer",
    Symbols.GDN: "gdn_layer",
    Symbols.ATTENTION: "attention_layer",
    Symbols.MLP: "mlp_layer",
    Symbols.MOE: "moe_layer",
}


def gdn_layer_spec(spec, config):
    """The spec a ``G`` layer builds: ``spec``, with ``GatedDeltaNet2`` attention under ``gdn2``."""
    la = getattr(config, "linear_attention", None)
    if la is None or not la.is_gdn2:
        return spec
    from megatron.core.ssm.gated_delta_net.gdn2 import GatedDeltaNet2

    spec = copy.deepcopy(spec)
    attention = spec.submodules.self_attention
    if isinstance(attention, ModuleSpec):
        attention.module = GatedDeltaNet2
    else:
        spec.submodules.self_attention = GatedDeltaNet2
    return spec


class HybridStack(LayerStack):
    """Runs the layers of one chunk in order, then ``final_norm`` when present.

    Args:
        config: Finalized ``TransformerConfig``.
        mamba_config: ``MambaConfig`` (for the Mamba layers).
        layer_types: This chunk's pattern symbols, e.g. ``"M*M-"``.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        submodules: Layer specs per symbol (default: the local hybrid spec).
        layer_offset: Global index of this chunk's first layer.
        post_layer_norm: Add the final norm (only on the last pipeline stage).
        pre_process: This chunk is on the first pipeline stage.
        post_process: This chunk is on the last pipeline stage.
        device: Device for the parameters (default: torch's default device).
    """

    final_norm_name = "final_norm"  # Megatron's name in the hybrid stack

    def __init__(
        self,
        config,
        mamba_config,
        layer_types: str,
        pg=None,
        *,
        submodules: HybridStackSubmodules | None = None,
        layer_offset: int = 0,
        post_layer_norm: bool = True,
        pre_process: bool = True,
        post_process: bool = True,
        device=None,
    ):
        super().__init__()
        if submodules is None:
            from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec

            submodules = get_hybrid_stack_local_spec()
        self.config = config
        self.layer_types = layer_types
        self.pre_process = pre_process
        self.post_process = post_process
        layers = []
        for i, symbol in enumerate(layer_types):
            if symbol not in _SPEC_OF:
                raise ValueError(f"{PATTERN_FLAG}: {symbol!r} is not a layer symbol of a model chunk.")
            spec = getattr(submodules, _SPEC_OF[symbol])
            if spec is None:
                name = Symbols.NAMES[symbol]
                raise ValueError(
                    f"{PATTERN_FLAG}: symbol {symbol!r} ({name}) - {name} layers are not available yet; "
                    "use M, G, * and - layers."
                )
            kwargs = dict(config=config, layer_number=layer_offset + i + 1, pg=pg, device=device)
            if symbol == Symbols.MAMBA:
                kwargs["mamba_config"] = mamba_config
            if symbol == Symbols.GDN:
                spec = gdn_layer_spec(spec, config)
            layers.append(build_module(spec, **kwargs))
        self._set_layers(layers, config, post_layer_norm=post_layer_norm, post_process=post_process, device=device)
