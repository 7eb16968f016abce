"""CUDA-graph configuration (``--cuda-graph-impl``, ``--cuda-graph-scope`` ...)."""

import dataclasses
import warnings

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.transformer.cuda_graphs.regions import check_scope_names

DEPRECATED_SCOPES = ("full_iteration", "full_iteration_inference")
"""Megatron's old ``--cuda-graph-scope`` values for whole-iteration graphs (``resolve`` migrates them)."""


@dataclasses.dataclass
class CudaGraphConfig(Freezable):
    """Partial CUDA graphs: which regions of each layer are captured and how."""

    cuda_graph_impl: str = flag_field("none", choices=("none", "local", "transformer_engine", "full_iteration"))
    """CUDA-graph implementation: none (eager); local (this trainer's memory-lean partial graphs);
    transformer_engine (Megatron's Transformer Engine graphs of the same regions: runs the local
    graphs, the same computation); full_iteration (every micro-batch's forward and backward of
    an iteration as one graph, the optimizer eager)."""

    cuda_graph_scope: list[str] = flag_field(
        default_factory=list, flag="--cuda-graph-scope", aliases=("--cuda-graph-modules",), nargs="*"
    )
    """Regions to graph in every layer: attn mlp moe moe_router moe_preprocess mamba.
    Empty (the default) means the whole layer."""

    cuda_graph_warmup_steps: int = 3
    """Eager forward+backward passes per region, on sample data, before its graphs are captured.
    One pass always runs (it finds the region's parameters), so 0 and 1 mean the same; the
    recording iteration has already run every kernel once. With full_iteration: the eager
    training iterations before the capture (at least one)."""

    cuda_graph_expandable_segments: bool = flag_field(True, flag="--no-cuda-graph-expandable-segments")
    """With graphs on, switch the caching allocator to expandable segments (unless
    PYTORCH_CUDA_ALLOC_CONF already says): the graph pool then packs activations and
    backward temporaries with less fragmentation."""

    cuda_graph_postprocess: bool = flag_field(True, flag="--no-cuda-graph-postprocess")
    """Also graph the loss head (final norm, output layer, cross entropy) into the same
    pool whenever the region that runs right before it is graphed (the last layer's MLP
    or whole layer): the head's logits and the first backward graphs then share memory,
    as they do in eager. With only attn graphed, or a Mamba layer eager, the head stays
    eager either way."""

    cuda_graph_debug: bool = False
    """Poison released graph buffers and check the first replays against eager runs."""

    cuda_graph_debug_replays: int = 2
    """With --cuda-graph-debug: how many replays of each region are checked against eager."""

    def resolve(self) -> "CudaGraphConfig":
        """Normalises the scope list (a string splits; Megatron's ``full`` is the whole layer) and
        migrates Megatron's deprecated scope values as Megatron does: ``full_iteration`` becomes
        ``--cuda-graph-impl full_iteration``; ``full_iteration_inference`` chooses inference graphs,
        which training never runs, so it is dropped. Returns self."""
        if isinstance(self.cuda_graph_scope, str):
            self.cuda_graph_scope = self.cuda_graph_scope.split()
        if self.cuda_graph_scope == ["full"]:
            self.cuda_graph_scope = []
        scope = self.cuda_graph_scope
        if "full_iteration" in scope:
            require(
                self.cuda_graph_impl in ("none", "local", "full_iteration"),
                f"--cuda-graph-scope full_iteration cannot be combined with --cuda-graph-impl {self.cuda_graph_impl} "
                "(as in Megatron); use --cuda-graph-impl full_iteration without a scope.",
            )
            warnings.warn(
                "--cuda-graph-scope full_iteration is deprecated (as in Megatron): setting --cuda-graph-impl "
                "full_iteration instead.",
                stacklevel=3,
            )
            self.cuda_graph_impl = "full_iteration"
        if "full_iteration_inference" in scope:
            warnings.warn(
                "--cuda-graph-scope full_iteration_inference is deprecated and chooses inference CUDA graphs, which "
                "training does not run: it has no effect here.",
                stacklevel=3,
            )
        self.cuda_graph_scope = [s for s in scope if s not in DEPRECATED_SCOPES]
        return self

    def validate(self) -> None:
        """Raises ``ValueError`` for an unknown impl or scope name (after ``resolve``; reads only)."""
        scope = self.cuda_graph_scope.split() if isinstance(self.cuda_graph_scope, str) else self.cuda_graph_scope
        scope = [] if list(scope) == ["full"] else list(scope)
        require(
            not (self.full_iteration and scope),
            f"--cuda-graph-scope {' '.join(scope)} with --cuda-graph-impl full_iteration: the whole iteration is "
            "one graph, so no scope applies (as in Megatron); drop the scope, or use --cuda-graph-impl local.",
        )
        check_scope_names(scope)
        require(
            self.cuda_graph_warmup_steps >= 0,
            f"--cuda-graph-warmup-steps must be >= 0, got {self.cuda_graph_warmup_steps}.",
        )

    @property
    def enabled(self) -> bool:
        """Partial (per-region) graphs: local, or transformer_engine run as local."""
        return self.cuda_graph_impl in ("local", "transformer_engine")

    @property
    def full_iteration(self) -> bool:
        return self.cuda_graph_impl == "full_iteration"

    @property
    def captures(self) -> bool:
        """Whether any CUDA graph is captured (partial graphs or the full iteration)."""
        return self.enabled or self.full_iteration
