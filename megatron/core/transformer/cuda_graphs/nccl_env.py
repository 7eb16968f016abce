"""NCCL settings for CUDA graphs that capture collectives.

Tensor-parallel (and sequence-parallel, expert-parallel) collectives run inside the
captured regions. With the caching allocator's expandable segments on, NCCL's graph
buffer registration (``NCCL_GRAPH_REGISTER``, on unless set to 0) is known to corrupt
memory or hang: NCCL registers the segments a captured collective reads, and expandable
segments remap them. :func:`configure_nccl_for_graphs` runs before the process groups
exist (NCCL reads the variable when a communicator is created) and either turns the
registration off, or refuses a run where the user asked for both.

Pure environment handling: no CUDA needed, tested on the CPU.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig

NCCL_GRAPH_REGISTER = "NCCL_GRAPH_REGISTER"
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def _alloc_conf_expandable(environ: MutableMapping[str, str]) -> bool | None:
    """What the allocator configuration says of expandable segments (None: silent)."""
    for var in ALLOC_CONF_VARS:
        for entry in environ.get(var, "").replace(" ", "").split(","):
            key, _, value = entry.partition(":")
            if key == "expandable_segments":
                return value.lower() == "true"
    return None


def expandable_segments_on(config: CudaGraphConfig, environ: MutableMapping[str, str] | None = None) -> bool:
    """Whether the run will use expandable segments: the allocator configuration when it
    says, else ``--cuda-graph-expandable-segments`` (on by default with graphs)."""
    environ = os.environ if environ is None else environ
    said = _alloc_conf_expandable(environ)
    if said is not None:
        return said
    return config.captures and config.cuda_graph_expandable_segments


def configure_nccl_for_graphs(
    config: CudaGraphConfig,
    *,
    tensor_parallel: int = 1,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
    environ: MutableMapping[str, str] | None = None,
) -> str | None:
    """Makes expandable segments and captured NCCL collectives safe together.

    When graphs are on, some collective is captured (tensor, expert or expert-tensor
    parallel size > 1) and expandable segments are on: sets ``NCCL_GRAPH_REGISTER=0``
    when it is unset and returns the line to log; returns None when nothing changed.

    Raises:
        ValueError: ``NCCL_GRAPH_REGISTER`` is set to anything but 0 for such a run.
    """
    environ = os.environ if environ is None else environ
    etp = tensor_parallel if expert_tensor_parallel is None else expert_tensor_parallel
    sizes = {
        "--tensor-model-parallel-size": tensor_parallel,
        "--expert-model-parallel-size": expert_parallel,
        "--expert-tensor-parallel-size": etp,
    }
    captured = [f"{flag} {size}" for flag, size in sizes.items() if size > 1]
    if not config.captures or not captured or not expandable_segments_on(config, environ):
        return None
    value = environ.get(NCCL_GRAPH_REGISTER)
    if value is None:
        environ[NCCL_GRAPH_REGISTER] = "0"
        return (
            f"CUDA graphs capture NCCL collectives ({', '.join(captured)}) and the allocator uses expandable "
            f"segments: set {NCCL_GRAPH_REGISTER}=0 (NCCL graph registration with expandable segments can "
            "corrupt memory or hang)."
        )
    if value.strip() == "0":
        return None
    said = _alloc_conf_expandable(environ)
    source = "PYTORCH_CUDA_ALLOC_CONF says expandable_segments:True" if said else "the default with graphs"
    raise ValueError(
        f"{NCCL_GRAPH_REGISTER}={value} with --cuda-graph-impl local, collectives captured in the graphs "
        f"({', '.join(captured)}) and expandable segments ({source}): NCCL graph registration with expandable "
        f"segments can corrupt memory or hang. Unset {NCCL_GRAPH_REGISTER} or set it to 0, or turn expandable "
        "segments off (--no-cuda-graph-expandable-segments, and no expandable_segments:True in "
        "PYTORCH_CUDA_ALLOC_CONF)."
    )
