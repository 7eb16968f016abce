"""CUDA-graph configuration (``--cuda-graph-impl``, ``--cuda-graph-scope`` ...)."""

import dataclasses

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.transformer.cuda_graphs.regions import check_scope_names


@dataclasses.dataclass
class CudaGraphConfig(Freezable):
    """Partial CUDA graphs: which regions of each layer are captured and how."""

    cuda_graph_impl: str = flag_field("none", choices=("none", "local", "transformer_engine", "full_iteration"))
    """CUDA-graph implementation: none (eager) or local (this trainer's memory-lean partial graphs).
    transformer_engine and full_iteration are Megatron values that are not supported here."""

    cuda_graph_scope: list[str] = flag_field(
        default_factory=list, flag="--cuda-graph-scope", aliases=("--cuda-graph-modules",), nargs="*"
    )
    """Regions to graph in every layer: attn mlp moe moe_router moe_preprocess mamba.
    Empty (the default) means the whole layer."""

    cuda_graph_warmup_steps: int = 3
    """Eager forward+backward passes per region, on sample data, before its graphs are captured.
    One pass always runs (it finds the region's parameters), so 0 and 1 mean the same; the
    recording iteration has already run every kernel once."""

    cuda_graph_expandable_segments: bool = flag_field(True, flag="--no-cuda-graph-expandable-segments")
    """With graphs on, switch the caching allocator to expandable segments (unless
    PYTORCH_CUDA_ALLOC_CONF already says): the graph pool then packs activations and
    backward temporaries with less fragmentation."""

    cuda_graph_postprocess: bool = flag_field(True, flag="--no-cuda-graph-postprocess")
    """Also graph the loss head (final norm, output layer, cross entropy) into the same
    pool whenever the region that runs right before it is graphed (the last layer's MLP
    or whole layer): the head's logits and the first backward graphs then share memory,
    as they do in eager. With only attn graphed the head stays eager either way."""

    cuda_graph_debug: bool = False
    """Poison released graph buffers and check the first replays against eager runs."""

    cuda_graph_debug_replays: int = 2
    """With --cuda-graph-debug: how many replays of each region are checked against eager."""

    def resolve(self) -> "CudaGraphConfig":
        """Normalises the scope list (a string splits; Megatron's ``full`` is the whole layer); returns self."""
        if isinstance(self.cuda_graph_scope, str):
            self.cuda_graph_scope = self.cuda_graph_scope.split()
        if self.cuda_graph_scope == ["full"]:
            self.cuda_graph_scope = []
        return self

    def validate(self) -> None:
        """Raises ``ValueError`` for an unknown impl or scope name (after ``resolve``; reads only)."""
        require(
            self.cuda_graph_impl in ("none", "local"),
            f"--cuda-graph-impl {self.cuda_graph_impl} is not supported yet; use --cuda-graph-impl local "
            "(partial graphs, the centrepiece of this trainer) or none.",
        )
        scope = self.cuda_graph_scope.split() if isinstance(self.cuda_graph_scope, str) else self.cuda_graph_scope
        check_scope_names([] if list(scope) == ["full"] else scope)
        require(
            self.cuda_graph_warmup_steps >= 0,
            f"--cuda-graph-warmup-steps must be >= 0, got {self.cuda_graph_warmup_steps}.",
        )

    @property
    def enabled(self) -> bool:
        return self.cuda_graph_impl == "local"
