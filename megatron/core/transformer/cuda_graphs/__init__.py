"""Memory-lean partial CUDA graphs: the public entry point is :func:`attach`.

``attach(model, config, model_config=..., grad_sinks=[ddp])`` routes the regions that
``--cuda-graph-scope`` selects through a :class:`GraphSession`; the session records
iteration 1, captures every graph into one pool per micro-batch slot in execution
order, and replays from iteration 2 on. ``session.close()`` restores the model.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from megatron.core.transformer.cuda_graphs import regions as regions_lib
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.session import GradSink, GraphSession, GraphState
from megatron.core.transformer.cuda_graphs.turn import enabled as eager_turn_enabled

__all__ = ["attach", "CudaGraphConfig", "GraphSession", "GraphState", "GradSink", "eager_turn_enabled"]


def attach(
    model: torch.nn.Module,
    config: CudaGraphConfig,
    *,
    model_config: Any = None,
    grad_sinks: Sequence[GradSink] = (),
    record_without_cuda: bool = False,
    scope_group: Any = None,
) -> GraphSession:
    """Resolves the scopes against ``model``'s layers and routes them through a new session.

    Args:
        model: The model (not the DDP wrapper); its blocks name their layers.
        config: The ``--cuda-graph-*`` settings.
        model_config: The model config that region conditions read (default: the first
            layer's ``config``).
        grad_sinks: Where backward graphs report finished weight gradients.
        record_without_cuda: Record even without CUDA, to inspect the recorded order and
            the plans on the CPU (tests); nothing is captured then.
        scope_group: The process group whose ranks hold the other parts of the model (the
            pipeline group; collective: every rank of it calls ``attach``). The scopes are
            checked against the layers of all of them, so a pipeline stage without, say,
            attention layers accepts ``attn`` and graphs what it has.

    Raises:
        ValueError: a scope the model cannot graph (the resolver's message).
        RuntimeError: the model is already attached.
    """
    session = GraphSession(config, grad_sinks=grad_sinks)
    if not config.enabled:
        return session
    layers = regions_lib.graphable_layers(model)
    if model_config is None and layers:
        model_config = getattr(layers[0], "config", None)
    stage_classes = [type(layer) for layer in layers]
    classes = stage_classes
    if scope_group is not None:
        gathered: list[Any] = [None] * torch.distributed.get_world_size(scope_group)
        torch.distributed.all_gather_object(gathered, list(dict.fromkeys(classes)), group=scope_group)
        classes = [c for part in gathered for c in part]
    selected = regions_lib.resolve(config.cuda_graph_scope, classes, model_config)
    if record_without_cuda:
        session.start_recording()
    if not session.active:
        return session
    session.watch_model_output(model)
    names = {m: n for n, m in model.named_modules()}
    for layer in layers:
        for spec in selected[type(layer)]:
            session.route(layer, spec.method, f"{names[layer]}.{spec.name}")
    head = regions_lib.head_region(model)
    # This stage's layers only: they alone share its memory with the head.
    if head is not None and config.cuda_graph_postprocess and regions_lib.head_joins(selected, stage_classes):
        module, spec = head
        name = f"{names[module]}.postprocess".lstrip(".")
        session.route(module, spec.method, name, shared_params=spec.shared_params(module))
    return session
