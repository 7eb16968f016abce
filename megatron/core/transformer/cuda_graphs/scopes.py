"""Which regions of which layer get a graph: the one place scope names are resolved.

A layer type declares its graphable regions through ``graph_regions()`` (region name
-> method name), e.g. a GPT ``TransformerLayer`` offers ``attn`` and ``mlp``. A scope
list selects regions by name; the empty list means the whole layer (its ``forward``).
When a scope list selects every region a layer offers, the layer is captured as one
graph (``attn mlp`` on a GPT layer = one layer graph: fewer launches, same memory).
"""

from typing import Dict, Iterable, List, Sequence, Tuple

import torch

from megatron.core.transformer.cuda_graphs.config import VALID_SCOPES

WHOLE_LAYER = "layer"


def graphable_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """Layers that declare regions, in module order."""
    return [m for m in model.modules() if callable(getattr(m, "graph_regions", None))]


def regions_for_layer(layer: torch.nn.Module, scopes: Sequence[str]) -> List[Tuple[str, str]]:
    """(region name, method name) pairs to graph in ``layer``, in execution order."""
    offered: Dict[str, str] = layer.graph_regions()
    if not scopes:
        return [(WHOLE_LAYER, "forward")]
    picked = [name for name in offered if name in scopes]
    if picked and len(picked) == len(offered):
        return [(WHOLE_LAYER, "forward")]
    return [(name, offered[name]) for name in picked]


def validate_scopes(layers: Iterable[torch.nn.Module], scopes: Sequence[str]) -> None:
    """Raises ``ValueError`` for a scope no layer of this model offers."""
    for scope in scopes:
        if scope not in VALID_SCOPES:
            raise ValueError(f"--cuda-graph-scope: unknown scope {scope!r}; valid: {' '.join(VALID_SCOPES)}")
    layers = list(layers)
    offered = {name for layer in layers for name in layer.graph_regions()}
    kinds = sorted({type(layer).__name__ for layer in layers})
    for scope in scopes:
        if scope not in offered:
            raise ValueError(
                f"--cuda-graph-scope {scope}: this model has no {scope!r} region "
                f"(its layers {', '.join(kinds) or '(none)'} offer: {' '.join(sorted(offered)) or 'nothing'}). "
                "Drop the scope, or leave the list empty to graph whole layers."
            )
