"""``ParallelConfig``: the parallel layout flags (Megatron's names) and their checks.

Tensor, pipeline (and virtual pipeline), expert and expert-tensor parallel sizes, sequence
parallelism, the rank order and the distributed-optimizer instances. The data-parallel
size is derived from the world size at ``resolve``; ``validate`` reads only these flags,
``validate_model`` checks them against the model (divisibility of heads, layers,
experts). ``parallel_state.py`` builds the process groups from it.
"""

import dataclasses
import warnings

from megatron.core.config_utils import Freezable, flag_field, require

# Flags that place the layers another way, which an explicit layout string replaces (as in Megatron).
_LAYOUT_CONFLICTS = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


@dataclasses.dataclass
class ParallelConfig(Freezable):
    """Parallel layout. The data-parallel size is derived: world / (TP * PP * CP)."""

    tensor_model_parallel_size: int = 1
    """Tensor model parallel size: ranks that split every linear layer, the heads and the vocabulary."""

    pipeline_model_parallel_size: int = 1
    """Pipeline model parallel size: ranks that split the layers into stages."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule."""

    context_parallel_size: int = 1
    """Context parallel size (not supported above 1 yet)."""

    expert_model_parallel_size: int = 1
    """Expert model parallel size: ranks that split the experts of a MoE layer."""

    expert_tensor_parallel_size: int | None = None
    """Tensor parallel size of the expert layers. Defaults to --tensor-model-parallel-size."""

    sequence_parallel: bool = False
    """Split the sequence across tensor-parallel ranks outside the tensor-parallel regions
    (norms, dropout, residuals); needs --tensor-model-parallel-size > 1."""

    distributed_backend: str = flag_field("auto", choices=("auto", "nccl", "gloo"))
    """torch.distributed backend; auto = NCCL when CUDA is available, else gloo."""

    distributed_timeout_minutes: int = 10
    """Timeout of collective operations, in minutes."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (model chunk) for the interleaved schedule; sets the virtual
    stages per rank to layers per pipeline rank / this."""

    num_virtual_stages_per_pipeline_rank: int | None = None
    """Virtual pipeline stages (model chunks) per pipeline rank, for the interleaved schedule."""

    pipeline_model_parallel_layout: str | None = None
    """Layers of every (virtual) pipeline stage, e.g. "Et*3|(tt|)*2tL": stages split by '|', E embedding,
    t transformer layer, L loss, x*N and (...)*N repeat, commas cosmetic; the stage count / PP gives
    the virtual stages per rank."""

    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (uneven pipelines); the other stages split the rest evenly."""

    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (uneven pipelines); the other stages split the rest evenly."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the input embedding as a layer when splitting the layers over pipeline stages: the first
    stage builds one transformer layer fewer."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss (output layer) as a layer when splitting the layers over pipeline stages: the last
    stage builds one transformer layer fewer."""

    microbatch_group_size_per_virtual_pipeline_stage: int | None = None
    """Consecutive micro-batches each model chunk runs in the interleaved schedule before the next
    chunk's turn. Defaults to --pipeline-model-parallel-size."""

    use_tp_pp_dp_mapping: bool = False
    """Order the ranks tensor, context, (expert,) pipeline, then data parallel (Megatron's
    tp-cp-ep-pp-dp) instead of data before pipeline parallel (tp-cp-ep-dp-pp)."""

    num_distributed_optimizer_instances: int = 1
    """Copies of the distributed optimizer across the data-parallel ranks: each shards its state
    over data-parallel size / N consecutive ranks, and gradients are all-reduced across the copies.
    Needs --use-distributed-optimizer."""

    world_size: int = flag_field(1, no_flag=True)
    """Number of processes, taken from torchrun's WORLD_SIZE."""

    data_parallel_size: int = flag_field(1, no_flag=True)
    """Derived: world size / (TP * PP * CP)."""

    expert_data_parallel_size: int = flag_field(1, no_flag=True)
    """Derived: world size / (expert TP * EP * PP)."""

    def resolve(self) -> "ParallelConfig":
        """Fills the derived sizes from ``world_size`` (where the layout allows); returns self.

        ``--sequence-parallel`` with TP = 1 is turned off with a warning (Megatron's behaviour).
        Layouts that cannot be built are left for ``validate`` to name.
        """
        if self.expert_tensor_parallel_size is None:
            self.expert_tensor_parallel_size = self.tensor_model_parallel_size
        if self.virtual_pipeline_model_parallel_size is None:  # a disagreeing pair is left for validate
            self.virtual_pipeline_model_parallel_size = self.num_virtual_stages_per_pipeline_rank
        if self.virtual_pipeline_model_parallel_size is None and self.pipeline_model_parallel_layout is not None:
            self.virtual_pipeline_model_parallel_size = self._virtual_stages_of_layout()
        if self.sequence_parallel and self.tensor_model_parallel_size == 1:
            warnings.warn(
                "--sequence-parallel has no effect with --tensor-model-parallel-size 1; it is turned off.",
                stacklevel=2,
            )
            self.sequence_parallel = False
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        if model_parallel >= 1 and self.world_size % model_parallel == 0:
            self.data_parallel_size = self.world_size // model_parallel
        expert_parallel = (
            self.expert_tensor_parallel_size * self.expert_model_parallel_size * self.pipeline_model_parallel_size
        )
        if expert_parallel >= 1 and self.world_size % expert_parallel == 0:
            self.expert_data_parallel_size = self.world_size // expert_parallel
        return self

    def validate(self) -> None:
        """Raises ``ValueError`` for layouts that cannot be built (after ``resolve``; reads only)."""
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            size = getattr(self, name)
            require(size >= 1, f"{_flag(name)} must be >= 1, got {size}.")
        require(
            self.context_parallel_size == 1,
            f"--context-parallel-size {self.context_parallel_size} is not supported: this trainer does not do context parallelism; use --context-parallel-size 1.",
        )
        require(
            self.expert_tensor_parallel_size is not None and self.expert_tensor_parallel_size >= 1,
            f"--expert-tensor-parallel-size must be >= 1, got {self.expert_tensor_parallel_size}.",
        )
        self._validate_layout_string()
        self._validate_virtual_stages()
        tp, pp, cp = self.tensor_model_parallel_size, self.pipeline_model_parallel_size, self.context_parallel_size
        model_parallel = tp * pp * cp
        require(
            self.world_size % model_parallel == 0,
            f"world size {self.world_size} is not divisible by --tensor-model-parallel-size ({tp}) x "
            f"--pipeline-model-parallel-size ({pp}) x --context-parallel-size ({cp}) = {model_parallel}; "
            "launch a multiple of that many processes or change the sizes.",
        )
        etp, ep = self.expert_tensor_parallel_size, self.expert_model_parallel_size
        expert_parallel = etp * ep * pp
        require(
            self.world_size % expert_parallel == 0,
            f"world size {self.world_size} is not divisible by --expert-tensor-parallel-size ({etp}) x "
            f"--expert-model-parallel-size ({ep}) x --pipeline-model-parallel-size ({pp}) = {expert_parallel}.",
        )
        dp, edp = self.data_parallel_size, self.expert_data_parallel_size
        if self.use_tp_pp_dp_mapping and pp > 1:
            require(
                edp == dp,
                f"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size {pp} needs the expert layers' "
                f"data-parallel size ({edp} = world / (ETP x EP x PP)) equal to the dense layers' ({dp} = world / "
                "(TP x CP x PP)), as in Megatron: make --expert-tensor-parallel-size x --expert-model-parallel-size "
                "equal --tensor-model-parallel-size x --context-parallel-size, or drop --use-tp-pp-dp-mapping.",
            )
        n = self.num_distributed_optimizer_instances
        require(n >= 1, f"--num-distributed-optimizer-instances must be >= 1, got {n}.")
        for what, size in (("data-parallel size", dp * cp), ("expert data-parallel size", edp)):
            require(
                size % n == 0,
                f"--num-distributed-optimizer-instances ({n}) must divide the {what} ({size}); launch a multiple "
                f"of {n} data-parallel replicas or lower the instances.",
            )

    def _virtual_stages_of_layout(self) -> int | None:
        """Virtual stages per rank that ``--pipeline-model-parallel-layout`` gives (None: one, or a
        string ``validate`` refuses)."""
        from megatron.core.pipeline_parallel.layout_string import parse_layout

        pp = self.pipeline_model_parallel_size
        try:
            stages = len(parse_layout(self.pipeline_model_parallel_layout))
        except ValueError:
            return None
        return stages // pp if pp >= 1 and stages % pp == 0 and stages > pp else None

    def _validate_layout_string(self) -> None:
        """``--pipeline-model-parallel-layout``: alone among the layer-placing flags, a readable
        string, and the virtual stages it gives."""
        text = self.pipeline_model_parallel_layout
        if text is None:
            return
        from megatron.core.pipeline_parallel.layout_string import FLAG, check_stages

        given = [_flag(n) for n in _LAYOUT_CONFLICTS if getattr(self, n) not in (None, False)]
        require(
            not given,
            f"{FLAG} places every layer itself and cannot be combined with {', '.join(given)} (as in Megatron); "
            "drop one of them.",
        )
        pp = self.pipeline_model_parallel_size
        stages = len(check_stages(text, pp))
        vpp = self.virtual_pipeline_model_parallel_size or 1
        require(
            vpp * pp == stages,
            f"--virtual-pipeline-model-parallel-size ({vpp}) disagrees with {FLAG}, whose {stages} stages on "
            f"--pipeline-model-parallel-size {pp} give {stages // pp} per rank; drop the flag (the stages decide).",
        )

    def _validate_virtual_stages(self) -> None:
        """The virtual-stage flags: one spelling at most, PP > 1, a sane group size."""
        pp = self.pipeline_model_parallel_size
        per_stage = self.num_layers_per_virtual_pipeline_stage
        per_rank = self.num_virtual_stages_per_pipeline_rank
        require(
            per_stage is None or per_rank is None,
            "--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank both set the "
            "virtual pipeline stages; give one of them.",
        )
        for name in (
            "num_layers_per_virtual_pipeline_stage",
            "num_virtual_stages_per_pipeline_rank",
            "virtual_pipeline_model_parallel_size",
        ):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{_flag(name)} must be >= 1, got {value}.")
        vpp = self.virtual_pipeline_model_parallel_size
        if per_rank is not None:
            require(
                vpp is None or vpp == per_rank,
                f"--virtual-pipeline-model-parallel-size ({vpp}) and --num-virtual-stages-per-pipeline-rank "
                f"({per_rank}) disagree; give one of them.",
            )
        given = [  # the spellings a user gives first: resolve() copies the per-rank count into the size
            _flag(n)
            for n in (
                "num_layers_per_virtual_pipeline_stage",
                "num_virtual_stages_per_pipeline_rank",
                "virtual_pipeline_model_parallel_size",
            )
            if getattr(self, n) is not None
        ]
        if given:
            require(
                pp > 1,
                f"virtual pipeline stages need --pipeline-model-parallel-size > 1; drop {given[0]} or raise "
                "the pipeline size.",
            )
        group = self.microbatch_group_size_per_virtual_pipeline_stage
        if group is not None:
            require(
                group >= pp,
                f"--microbatch-group-size-per-virtual-pipeline-stage ({group}) must be at least "
                f"--pipeline-model-parallel-size ({pp}).",
            )
        for name in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
            value = getattr(self, name)
            if value is not None:
                require(pp > 1, f"{_flag(name)} needs --pipeline-model-parallel-size > 1; drop it.")
                require(value >= 1, f"{_flag(name)} must be >= 1, got {value}.")

    def resolve_model(self, model, *, stages_from_pattern: bool = False) -> "ParallelConfig":
        """Fills the virtual stages per rank from --num-layers-per-virtual-pipeline-stage and the
        model's layer count (``model``: a finalized ``TransformerConfig``); returns self.

        Layouts that do not split are left for ``validate_model`` to name.
        """
        from megatron.core.pipeline_parallel.layout import resolve_virtual_stages

        if not stages_from_pattern:
            resolve_virtual_stages(self, model.num_layers)
        return self

    def validate_model(self, model, *, pattern=None) -> None:
        """Checks the model shape against the layout (``model``: a finalized ``TransformerConfig``;
        after ``resolve_model``; reads only).

        ``pattern``: a hybrid model's parsed ``--hybrid-layer-pattern``, which places the layers
        (``MambaConfig.validate`` checks the flags it excludes).
        """
        from megatron.core.pipeline_parallel.layout import (
            rank_layer_counts,
            stage_layer_counts,
            virtual_stages_from_layers,
        )

        tp = self.tensor_model_parallel_size
        if pattern is None:
            virtual_stages_from_layers(self, model.num_layers)
            stage_layer_counts(self, model.num_layers)  # raises for layer counts that do not split
        elif pattern.num_segments == 1 and (
            self.decoder_first_pipeline_num_layers is not None or self.decoder_last_pipeline_num_layers is not None
        ):  # no '|': the pattern's layers split over the ranks as those flags say
            rank_layer_counts(self, model.num_layers)
        require(
            model.num_attention_heads % tp == 0,
            f"--num-attention-heads ({model.num_attention_heads}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}).",
        )
        groups = model.num_query_groups or model.num_attention_heads
        require(
            groups % tp == 0,
            f"--num-query-groups ({groups}) must be divisible by --tensor-model-parallel-size ({tp}); "
            "every tensor-parallel rank needs whole key/value groups.",
        )
        require(
            model.ffn_hidden_size is None or model.ffn_hidden_size % tp == 0,
            f"--ffn-hidden-size ({model.ffn_hidden_size}) must be divisible by --tensor-model-parallel-size ({tp}).",
        )
        experts = getattr(getattr(model, "moe", None), "num_moe_experts", None)
        ep = self.expert_model_parallel_size
        if experts:
            require(
                experts % ep == 0,
                f"--num-experts ({experts}) must be divisible by --expert-model-parallel-size ({ep}).",
            )
        else:
            require(ep == 1, f"--expert-model-parallel-size {ep} needs a MoE model (--num-experts); drop it.")


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")
