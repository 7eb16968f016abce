"""Mamba and hybrid-model configuration (``--hybrid-layer-pattern``, ``--mamba-state-dim`` ...).

Field names, flags and defaults are Megatron's (upstream keeps them in
``TransformerConfig``; here they are their own concern, so a GPT run carries none of
them). ``resolve()`` takes the deprecated ``--hybrid-override-pattern``, sets
``--num-layers`` from the pattern (the pattern wins, with a warning when the two
differ, as in Megatron) and derives the virtual pipeline size from the ``|``
segments; ``validate()`` then only reads, and checks the Mamba sizes only when the
pattern has Mamba layers.
"""

import dataclasses
import warnings

import torch

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    HybridPattern,
    Symbols,
    parse_hybrid_pattern,
    virtual_pipeline_size,
)

MAMBA_EXPAND = 2  # Megatron's fixed expansion: d_inner = 2 * hidden size (unless --mamba-num-heads)


@dataclasses.dataclass
class MambaConfig(Freezable):
    """Hybrid Mamba/attention models: the layer pattern and the Mamba mixer's sizes."""

    hybrid_layer_pattern: str | None = None
    """One symbol per layer: M (Mamba), G (gated delta net; GDN2 with --experimental-attention-variant
    gdn2), * (attention), - (MLP), E (MoE); | separates pipeline segments (their count / PP gives the
    virtual pipeline size). Sets the number of layers."""

    hybrid_override_pattern: str | None = None
    """Deprecated alias of --hybrid-layer-pattern."""

    mamba_state_dim: int = 128
    """The dimensionality of the state representation in Mamba layers."""

    mamba_head_dim: int = 64
    """The dimensionality of the heads in the Mamba layers."""

    mamba_num_groups: int = 8
    """The number of groups (of B and C projections) used in Mamba layers."""

    mamba_num_heads: int | None = None
    """The number of heads used in Mamba layers. Defaults to 2 * hidden size / --mamba-head-dim."""

    mamba_training_ssm_states_dtype: str | None = flag_field(None, choices=("fp32", "bf16"))
    """Dtype of the materialized inter-chunk SSM states in Mamba training. Defaults to the activation dtype."""

    use_mamba_mem_eff_path: bool = flag_field(True, flag="--disable-mamba-mem-eff-path")
    """With the mamba-ssm kernels installed, run conv, scan and gating as one fused kernel
    (mamba_split_conv1d_scan_combined) instead of the separate conv and scan kernels."""

    @property
    def parsed_pattern(self) -> HybridPattern | None:
        """The parsed ``--hybrid-layer-pattern`` (None when unset)."""
        if self.hybrid_layer_pattern is None:
            return None
        return parse_hybrid_pattern(self.hybrid_layer_pattern)

    @property
    def is_hybrid(self) -> bool:
        return self.hybrid_layer_pattern is not None or self.hybrid_override_pattern is not None

    def num_heads(self, hidden_size: int) -> int:
        """Mamba heads of the whole layer (all TP ranks)."""
        if self.mamba_num_heads is not None:
            return self.mamba_num_heads
        return MAMBA_EXPAND * hidden_size // self.mamba_head_dim

    def d_inner(self, hidden_size: int) -> int:
        """Width of the mixer's inner (x, z) activations: heads * head dim."""
        return self.num_heads(hidden_size) * self.mamba_head_dim

    @property
    def ssm_states_dtype(self) -> torch.dtype | None:
        return {None: None, "fp32": torch.float32, "bf16": torch.bfloat16}[self.mamba_training_ssm_states_dtype]

    def resolve(self, model=None, parallel=None) -> "MambaConfig":
        """Resolves the pattern flags into the run's configs; returns self.

        Args:
            model: The run's ``TransformerConfig``: ``num_layers`` is set from the pattern.
            parallel: The run's ``ParallelConfig``: the virtual pipeline size is derived
                from the segments (when not given).

        Raises:
            ValueError: The pattern cannot be parsed or split over the pipeline stages.
        """
        if self.hybrid_override_pattern is not None and self.hybrid_layer_pattern in (
            None,
            self.hybrid_override_pattern,
        ):
            warnings.warn("--hybrid-override-pattern is deprecated; use --hybrid-layer-pattern.", stacklevel=2)
            self.hybrid_layer_pattern = self.hybrid_override_pattern
            self.hybrid_override_pattern = None
        if self.hybrid_override_pattern is not None:
            return self  # both given and different: validate() names them
        parsed = self.parsed_pattern
        if parsed is None:
            return self
        if model is not None:
            default_layers = next(f.default for f in dataclasses.fields(model) if f.name == "num_layers")
            if model.num_layers not in (default_layers, parsed.num_layers):
                warnings.warn(
                    f"--hybrid-layer-pattern is set; ignoring --num-layers ({model.num_layers}) and using the "
                    f"layer count of the pattern ({parsed.num_layers}).",
                    stacklevel=2,
                )
            model.num_layers = parsed.num_layers
            model.is_hybrid_model = True
        if parallel is not None and parallel.virtual_pipeline_model_parallel_size is None:
            vpp = virtual_pipeline_size(parsed, parallel.pipeline_model_parallel_size)
            parallel.virtual_pipeline_model_parallel_size = vpp
        if parallel is not None and parallel.pipeline_model_parallel_size > 1 and parsed.num_segments == 1:
            warnings.warn(
                f"--hybrid-layer-pattern {parsed.pattern!r} has no '|' with --pipeline-model-parallel-size > 1, "
                "which Megatron deprecates: its layers split over the ranks evenly (or as "
                "--decoder-first/last-pipeline-num-layers say); mark the stages with '|' instead.",
                stacklevel=2,
            )
        return self

    def validate(self, model=None, parallel=None) -> None:
        """Checks the pattern flags and the Mamba sizes (after ``resolve``; reads only).

        Args:
            model: The run's ``TransformerConfig``: ``hidden_size`` gives the default head count.
            parallel: The run's ``ParallelConfig``: the TP size must divide heads and groups.

        Raises:
            ValueError: Naming the flag.
        """
        require(
            self.hybrid_override_pattern is None,
            "--hybrid-override-pattern and --hybrid-layer-pattern cannot both be given; "
            "--hybrid-override-pattern is deprecated: keep only --hybrid-layer-pattern.",
        )
        parsed = self.parsed_pattern
        if parsed is None:
            return
        if parsed.count(Symbols.MOE) and model is not None:
            moe = getattr(model, "moe", None)
            require(
                moe is not None and moe.enabled,
                f"--hybrid-layer-pattern {parsed.pattern!r}: symbol 'E' (MoE) layers need --num-experts N "
                "(and the other MoE flags); or use M, * and - layers.",
            )
        if model is not None:
            require(
                model.num_layers == parsed.num_layers,
                f"--num-layers ({model.num_layers}) differs from the layer count of --hybrid-layer-pattern "
                f"({parsed.num_layers}); resolve() sets it from the pattern.",
            )
        if parallel is not None:
            self._validate_stage_flags(parsed, parallel)
        if parsed.count(Symbols.MAMBA):
            self._validate_mamba_sizes(model, parallel)

    @staticmethod
    def _validate_stage_flags(parsed: HybridPattern, parallel) -> None:
        """Megatron's rules: the pattern places the layers, its '|' segments give the stages and the
        virtual stages; without '|' the layers split evenly over the pipeline ranks, or as
        --decoder-first/last-pipeline-num-layers say."""
        placing = [
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "account_for_embedding_in_pipeline_split",
            "account_for_loss_in_pipeline_split",
        ]
        if parsed.num_segments > 1:
            placing += ["decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"]
        given = ["--" + n.replace("_", "-") for n in placing if getattr(parallel, n, None) not in (None, False)]
        require(
            not given,
            f"{', '.join(given)} cannot be combined with --hybrid-layer-pattern {parsed.pattern!r} (as in Megatron): "
            "the pattern places the layers, its '|' segments being the pipeline stages (their count / "
            "--pipeline-model-parallel-size the virtual stages per rank); drop the flag and place them with '|'.",
        )
        pp = parallel.pipeline_model_parallel_size
        vpp, given_vpp = virtual_pipeline_size(parsed, pp), parallel.virtual_pipeline_model_parallel_size
        implied = f"{vpp} virtual stages per rank" if vpp else "no virtual stages"
        require(
            given_vpp == vpp,
            f"--virtual-pipeline-model-parallel-size {given_vpp} disagrees with --hybrid-layer-pattern "
            f"{parsed.pattern!r}, whose {parsed.num_segments} pipeline segment(s) on --pipeline-model-parallel-size {pp} "
            f"give {implied}; drop the flag (the segments decide).",
        )

    def _validate_mamba_sizes(self, model, parallel) -> None:
        for name in ("mamba_state_dim", "mamba_head_dim", "mamba_num_groups"):
            value = getattr(self, name)
            require(value > 0, f"--{name.replace('_', '-')} must be positive, got {value}.")
        require(
            self.mamba_num_heads is None or self.mamba_num_heads > 0,
            f"--mamba-num-heads must be positive, got {self.mamba_num_heads}.",
        )
        if model is None:
            return
        h = model.hidden_size
        if self.mamba_num_heads is None:
            require(
                MAMBA_EXPAND * h % self.mamba_head_dim == 0,
                f"2 * --hidden-size ({MAMBA_EXPAND * h}) must be divisible by --mamba-head-dim "
                f"({self.mamba_head_dim}); change one, or set --mamba-num-heads.",
            )
        heads = self.num_heads(h)
        require(
            heads % self.mamba_num_groups == 0,
            f"Mamba heads ({heads}, from --mamba-num-heads or 2 * --hidden-size / --mamba-head-dim) must be "
            f"divisible by --mamba-num-groups ({self.mamba_num_groups}).",
        )
        tp = 1 if parallel is None else parallel.tensor_model_parallel_size
        require(
            heads % tp == 0 and self.mamba_num_groups % tp == 0,
            f"Mamba heads ({heads}) and --mamba-num-groups ({self.mamba_num_groups}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}).",
        )
