"""Process groups, held in one object that is passed to whoever needs it.

Unlike Megatron's module globals, ``ProcessGroups`` is built once by the trainer and
handed down (model, DDP, optimizer, schedules). The rank grid is Megatron's: tensor
parallel fastest, then context, then data, then pipeline parallel, so global rank
``r = tp + TP * (cp + CP * (dp + DP * pp))``. Expert layers use a second grid over
the same world, ``r = etp + ETP * (ep + EP * (edp + EDP * pp))`` (expert tensor
parallel size ETP defaults to TP), sharing the pipeline groups. With
``--use-tp-pp-dp-mapping`` data and pipeline parallel swap places (``tp-cp-pp-dp``,
``tp-ep-pp-dp``): the pipeline stages of one replica are then neighbours. The grid's
arithmetic is in ``rank_grid.py``.

With ``--num-distributed-optimizer-instances N`` the data-parallel axis splits into
DP / N consecutive data-parallel ranks (one optimizer instance, ``intra_dp``) and
the N instances (``inter_dp``), in both grids.

Unusual here: groups of size 1 are not created at all and read as ``None``, so every
size and rank accessor is plain Python arithmetic (no collective, no host sync), and
single-process runs (no torchrun) get a world of one without initialising
``torch.distributed``. Context parallelism stays at 1 (not implemented).
"""

import dataclasses
import datetime
import importlib
import os
import warnings

import torch
import torch.distributed as dist

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.rank_grid import embedding_groups, grid_ranks, rank_groups, wanted_groups


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
    """Explicit layer layout over pipeline stages (not supported yet)."""

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
        for name in _PIPELINE_LAYOUT_FIELDS:  # flags of the pipeline work: parsed now, run later
            require(getattr(self, name) in (None, False), f"--{name.replace('_', '-')} is not supported yet; drop it.")
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

    def validate_model(self, model, *, stages_from_pattern: bool = False) -> None:
        """Checks the model shape against the layout (``model``: a finalized ``TransformerConfig``;
        after ``resolve_model``; reads only).

        ``stages_from_pattern``: a hybrid pattern's '|' segments give the stages' layers.
        """
        from megatron.core.pipeline_parallel.layout import stage_layer_counts, virtual_stages_from_layers

        tp = self.tensor_model_parallel_size
        if stages_from_pattern:
            given = [
                _flag(n)
                for n in (
                    "num_layers_per_virtual_pipeline_stage",
                    "decoder_first_pipeline_num_layers",
                    "decoder_last_pipeline_num_layers",
                    "account_for_embedding_in_pipeline_split",
                    "account_for_loss_in_pipeline_split",
                )
                if getattr(self, n) not in (None, False)
            ]
            require(
                not given,
                f"{', '.join(given)} cannot be combined with a --hybrid-layer-pattern whose '|' marks the pipeline "
                "stages; drop it (the segments decide).",
            )
        else:
            virtual_stages_from_layers(self, model.num_layers)
            stage_layer_counts(self, model.num_layers)  # raises for layer counts that do not split
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


_PIPELINE_LAYOUT_FIELDS = ("pipeline_model_parallel_layout",)


class ProcessGroups:
    """The process groups of one run. ``None`` groups mean a group of one.

    Attributes:
        rank: Global rank.
        world_size: Global world size.
        device: The device this rank computes on.
        dp, tp, pp, cp, ep: Data / tensor / pipeline / context / expert-parallel groups.
        mp: Model-parallel group (TP x PP), over which gradient norms are summed.
        embd: Megatron's embedding group: the first and last pipeline stage of this
            rank's pipeline (tied word embeddings sum their gradients over it); a group
            of one on the other stages and without pipelining.
        expt_tp, expt_dp: Tensor- and data-parallel groups of the expert layers.
        tp_ep: Expert tensor x expert parallel group (the allgather token dispatcher's).
        intra_dp, intra_expt_dp: The data-parallel (expert-data-parallel) ranks of this
            rank's distributed-optimizer instance, over which the optimizer is sharded;
            ``dp`` and ``expt_dp`` themselves with one instance.
        inter_dp: The ranks at this rank's place in every distributed-optimizer instance
            (``--num-distributed-optimizer-instances`` of them), over which the reduced
            gradient shards are all-reduced; dense and expert layers share it.
        ranks: Group name -> the global ranks of this rank's group (``[rank]`` for a
            group of one); sizes and ranks within groups are read from it.
        sequence_parallel: The TP group also splits the sequence (``--sequence-parallel``
            with TP > 1): a property of the layout that every TP layer reads.
    """

    GROUP_NAMES = (
        "tp",
        "cp",
        "dp",
        "pp",
        "mp",
        "ep",
        "expt_tp",
        "expt_dp",
        "embd",
        "tp_ep",
        "intra_dp",
        "intra_expt_dp",
        "inter_dp",
    )
    # Without instance groups of their own (one optimizer instance), these are their full groups.
    _INSTANCE_DEFAULTS = {"intra_dp": "dp", "intra_expt_dp": "expt_dp"}

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        dp=None,
        ranks=None,
        sequence_parallel: bool = False,
        **groups,
    ):
        unknown = set(groups) - set(self.GROUP_NAMES)
        assert not unknown, f"unknown process groups {sorted(unknown)}"
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.owns_process_group = False  # set when initialize() called init_process_group
        self.dp = dp
        for name in self.GROUP_NAMES:
            if name != "dp":
                setattr(self, name, groups.get(name))
        self.ranks: dict[str, list[int]] = {name: [rank] for name in self.GROUP_NAMES}
        if dp is not None and ranks is None:
            # A bare data-parallel group (tests, DP-only callers): the whole world is DP,
            # and with EP = 1 the expert layers' data-parallel group is the same group.
            self.ranks["dp"] = [dist.get_global_rank(dp, i) for i in range(dist.get_world_size(dp))]
            if "expt_dp" not in groups and "ep" not in groups:
                self.expt_dp = dp
                self.ranks["expt_dp"] = list(self.ranks["dp"])
        self.ranks.update(ranks or {})
        for name, full in self._INSTANCE_DEFAULTS.items():
            if name not in groups and name not in (ranks or {}):
                setattr(self, name, getattr(self, full))
                self.ranks[name] = list(self.ranks[full])
        self.sequence_parallel = sequence_parallel and self.tp_size > 1

    def _size(self, name: str) -> int:
        return len(self.ranks[name])

    def _rank_in(self, name: str) -> int:
        return self.ranks[name].index(self.rank)

    # Sizes and ranks within groups: plain ints.
    @property
    def tp_size(self) -> int:
        return self._size("tp")

    @property
    def tp_rank(self) -> int:
        return self._rank_in("tp")

    @property
    def pp_size(self) -> int:
        return self._size("pp")

    @property
    def pp_rank(self) -> int:
        return self._rank_in("pp")

    @property
    def dp_size(self) -> int:
        return self._size("dp")

    @property
    def dp_rank(self) -> int:
        return self._rank_in("dp")

    @property
    def cp_size(self) -> int:
        return self._size("cp")

    @property
    def cp_rank(self) -> int:
        return self._rank_in("cp")

    @property
    def ep_size(self) -> int:
        return self._size("ep")

    @property
    def ep_rank(self) -> int:
        return self._rank_in("ep")

    @property
    def expt_tp_size(self) -> int:
        return self._size("expt_tp")

    @property
    def expt_tp_rank(self) -> int:
        return self._rank_in("expt_tp")

    @property
    def expt_dp_size(self) -> int:
        return self._size("expt_dp")

    @property
    def expt_dp_rank(self) -> int:
        return self._rank_in("expt_dp")

    @property
    def intra_dp_size(self) -> int:
        return self._size("intra_dp")

    @property
    def intra_dp_rank(self) -> int:
        return self._rank_in("intra_dp")

    @property
    def intra_expt_dp_size(self) -> int:
        return self._size("intra_expt_dp")

    @property
    def intra_expt_dp_rank(self) -> int:
        return self._rank_in("intra_expt_dp")

    @property
    def inter_dp_size(self) -> int:
        """Distributed-optimizer instances (1: the optimizer is sharded over all of DP)."""
        return self._size("inter_dp")

    @property
    def inter_dp_rank(self) -> int:
        """This rank's distributed-optimizer instance."""
        return self._rank_in("inter_dp")

    @property
    def tp_ep_size(self) -> int:
        return self._size("tp_ep")

    @property
    def mp_size(self) -> int:
        return self._size("mp")

    # Pipeline neighbours, as global ranks (the pipeline is a ring, as in Megatron).
    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pp_next_rank(self) -> int:
        ranks = self.ranks["pp"]
        return ranks[(self.pp_rank + 1) % len(ranks)]

    @property
    def pp_prev_rank(self) -> int:
        ranks = self.ranks["pp"]
        return ranks[(self.pp_rank - 1) % len(ranks)]

    @property
    def pp_first_rank(self) -> int:
        return self.ranks["pp"][0]

    @property
    def pp_last_rank(self) -> int:
        return self.ranks["pp"][-1]

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @classmethod
    def single(cls, device: torch.device | None = None) -> "ProcessGroups":
        """A world of one, for tests and single-process runs."""
        return cls(rank=0, world_size=1, device=device or torch.device("cpu"))


def build_groups(config: ParallelConfig, *, rank: int, world_size: int, device: torch.device) -> ProcessGroups:
    """Creates this layout's groups with ``dist.new_group`` (every rank calls it identically).

    Groups of one are not created. A group whose ranks equal one made already (the
    expert TP group when ETP == TP and EP == 1, say) reuses that handle.
    """
    made: dict[tuple, object] = {}  # ranks -> handle
    handles = {}
    mine = grid_ranks(config, rank)
    for name, (grid, axes) in wanted_groups(config).items():
        own = mine[name]
        if len(own) == 1:
            handles[name] = None
            continue
        if len(own) == world_size:
            handles[name] = made.setdefault(tuple(own), dist.group.WORLD)
            continue
        for ranks in rank_groups(grid, axes):  # every rank creates every group, in the same order
            key = tuple(ranks)
            if key not in made:
                made[key] = dist.new_group(list(ranks))
        handles[name] = made[tuple(own)]
    for ranks in embedding_groups(config):  # after the grid's groups, on every rank alike
        key = tuple(ranks)
        if key not in made:
            made[key] = dist.group.WORLD if len(ranks) == world_size else dist.new_group(list(ranks))
    handles["embd"] = made[tuple(mine["embd"])] if len(mine["embd"]) > 1 else None
    dp = handles.pop("dp")
    return ProcessGroups(
        rank=rank,
        world_size=world_size,
        device=device,
        dp=dp,
        ranks=mine,
        sequence_parallel=config.sequence_parallel,
        **handles,
    )


def world_size_from_env() -> int:
    """Number of processes of this run (torchrun's WORLD_SIZE; 1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def initialize(config: ParallelConfig, *, use_cuda: bool) -> ProcessGroups:
    """Builds process groups from torchrun's environment.

    Args:
        config: Parallel layout, resolved and validated for this world
            (``world_size_from_env()``); it is only read.
        use_cuda: Compute on CUDA (NCCL) or on the CPU (gloo).
    """
    world_size = world_size_from_env()
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    assert config.world_size == world_size, (
        f"the parallel config was resolved for {config.world_size} processes, but WORLD_SIZE is {world_size}"
    )
    if use_cuda:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if world_size == 1:
        return ProcessGroups(rank=0, world_size=1, device=device)
    backend = config.distributed_backend
    if backend == "auto":
        backend = "nccl" if use_cuda else "gloo"
    owns = not dist.is_initialized()
    if owns:
        # A process group that outlives destroy() is freed at interpreter shutdown, where
        # gloo's worker threads sometimes abort ("terminate called without an active
        # exception"). torch.optim imports
        # torch._dynamo, which, imported after the group exists, keeps hidden references
        # to it; imported first it keeps none. destroy() drops our own handle.
        try:
            importlib.import_module("torch._dynamo")
        except ImportError:
            pass
        kwargs = dict(backend=backend, timeout=datetime.timedelta(minutes=config.distributed_timeout_minutes))
        if use_cuda and backend == "nccl":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    groups = build_groups(config, rank=rank, world_size=world_size, device=device)
    groups.owns_process_group = owns
    return groups


def destroy(groups: ProcessGroups, *, failed: bool = False) -> None:
    """Tears down torch.distributed if this run initialised it.

    Args:
        groups: The run's process groups.
        failed: This rank is unwinding an error; skip the closing barrier (a peer that
            died would make it wait for the whole collective timeout).
    """
    if groups.owns_process_group and dist.is_initialized():
        if not failed:
            # Let every rank finish its last collective first: tearing gloo down while
            # a peer is still sending aborts the process ("terminate called without an
            # active exception") after an otherwise finished run.
            dist.barrier()
        dist.destroy_process_group()
        # Our last handles: the groups (and gloo's threads) end here.
        for name in ProcessGroups.GROUP_NAMES:
            setattr(groups, name, None)
