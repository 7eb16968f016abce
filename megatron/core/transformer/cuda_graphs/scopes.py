"""Which regions of which layer get a graph: the one place scope names are resolved.

A layer type declares its graphable regions through ``graph_regions()`` (region name
-> method name), e.g. a GPT ``TransformerLayer`` offers ``attn`` and ``mlp``. A scope
list selects regions by name; the empty list means the whole layer (its ``forward``).
When a scope list selects every region a layer offers, the layer is captured as one
graph (``attn mlp`` on a GPT layer = one layer graph: fewer launches, same memory).

A model may also declare its loss head (``graph_postprocess_region()``). Scopes do not
name it: it joins the graphs when the region that runs right before it is graphed,
because then the head's large temporaries (logits, fp32 softmax) and the temporaries
of the first backward graphs can share pool memory, as they share cache in eager.
When that region is eager, the eager backward after the head reuses the head's
memory anyway, and a graphed head would only take it away.
"""

from collections.abc import Iterable, Sequence

import torch

from megatron.core.transformer.cuda_graphs.config import VALID_SCOPES

WHOLE_LAYER = "layer"


def graphable_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Layers that declare regions, in module order."""
    return [m for m in model.modules() if callable(getattr(m, "graph_regions", None))]


def regions_for_layer(layer: torch.nn.Module, scopes: Sequence[str]) -> list[tuple[str, str]]:
    """(region name, method name) pairs to graph in ``layer``, in execution order."""
    offered: dict[str, str] = layer.graph_regions()
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


def postprocess_region(
    model: torch.nn.Module, layers: Sequence[torch.nn.Module], scopes: Sequence[str]
) -> tuple[torch.nn.Module, str, list[torch.nn.Parameter]] | None:
    """``(module, method name, shared parameters)`` of the loss head to graph, or None.

    Only when the last layer's last region (the one that feeds the head) is graphed.
    """
    heads = [m for m in model.modules() if callable(getattr(m, "graph_postprocess_region", None))]
    declared = [(m, m.graph_postprocess_region()) for m in heads]
    declared = [(m, d) for m, d in declared if d is not None]
    if not declared or not layers:
        return None
    if len(declared) > 1:
        raise ValueError(f"{len(declared)} modules declare a loss head region; expected at most one")
    last = layers[-1]
    picked = regions_for_layer(last, scopes)
    if not picked or picked[-1][0] not in (WHOLE_LAYER, list(last.graph_regions())[-1]):
        return None
    module, (method, shared) = declared[0]
    return module, method, list(shared)
