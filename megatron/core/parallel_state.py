"""Process groups, held in one object that is passed to whoever needs it.

Unlike Megatron's module globals, ``ProcessGroups`` is built once by the trainer and
handed down (model, DDP, optimizer, schedules). Data parallelism works today; tensor,
pipeline, context and expert sizes exist in the config and API, and values above 1
raise a clear "not supported yet" error until the parallelism issues fill them in.
Single-process runs (no torchrun) get a world of one without initialising
``torch.distributed``.
"""

import dataclasses
import datetime
import importlib
import os

import torch
import torch.distributed as dist

from megatron.core.config_utils import flag_field, require


@dataclasses.dataclass
class ParallelConfig:
    """Parallel layout. The data-parallel size is derived: world / (TP * PP * CP)."""

    tensor_model_parallel_size: int = 1
    """Tensor model parallel size (not supported above 1 yet)."""

    pipeline_model_parallel_size: int = 1
    """Pipeline model parallel size (not supported above 1 yet)."""

    virtual_pipeline_model_parallel_size: int | None = None
    """Virtual pipeline stages per rank (not supported yet)."""

    context_parallel_size: int = 1
    """Context parallel size (not supported above 1 yet)."""

    expert_model_parallel_size: int = 1
    """Expert model parallel size (not supported above 1 yet)."""

    sequence_parallel: bool = False
    """Sequence parallelism with tensor parallelism (not supported yet)."""

    distributed_backend: str = flag_field("auto", choices=("auto", "nccl", "gloo"))
    """torch.distributed backend; auto = NCCL when CUDA is available, else gloo."""

    distributed_timeout_minutes: int = 10
    """Timeout of collective operations, in minutes."""

    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers per virtual pipeline stage (not supported yet)."""

    num_virtual_stages_per_pipeline_rank: int | None = None
    """Virtual pipeline stages per pipeline rank (not supported yet)."""

    pipeline_model_parallel_layout: str | None = None
    """Explicit layer layout over pipeline stages (not supported yet)."""

    decoder_first_pipeline_num_layers: int | None = None
    """Layers on the first pipeline stage (not supported yet)."""

    decoder_last_pipeline_num_layers: int | None = None
    """Layers on the last pipeline stage (not supported yet)."""

    account_for_embedding_in_pipeline_split: bool = False
    """Count the embedding as a layer when splitting over pipeline stages (not supported yet)."""

    account_for_loss_in_pipeline_split: bool = False
    """Count the loss as a layer when splitting over pipeline stages (not supported yet)."""

    microbatch_group_size_per_virtual_pipeline_stage: int | None = None
    """Micro-batches per virtual-stage group in the interleaved schedule (not supported yet)."""

    overlap_p2p_communication_warmup_flush: bool = False
    """Overlap pipeline sends/receives in warm-up and flush (not supported yet)."""

    world_size: int = flag_field(1, no_flag=True)
    """Number of processes, taken from torchrun's WORLD_SIZE."""

    data_parallel_size: int = flag_field(1, no_flag=True)
    """Derived: world size / (TP * PP * CP)."""

    def validate(self) -> None:
        """Raises ``ValueError`` for layouts this trainer cannot run yet."""
        cp = self.context_parallel_size
        require(
            cp <= 1, f"--context-parallel-size {cp} is not supported: this trainer does not do context parallelism."
        )
        for name in (
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "context_parallel_size",
            "expert_model_parallel_size",
        ):
            size = getattr(self, name)
            flag = "--" + name.replace("_", "-")
            require(size >= 1, f"{flag} must be >= 1, got {size}.")
            require(size == 1, f"{flag} {size} is not supported yet: only data parallelism works today; use {flag} 1.")
        require(
            self.virtual_pipeline_model_parallel_size is None,
            "--virtual-pipeline-model-parallel-size is not supported yet; drop the flag.",
        )
        require(not self.sequence_parallel, "--sequence-parallel is not supported yet (it needs tensor parallelism).")
        for name in _PIPELINE_LAYOUT_FIELDS:  # flags of the pipeline issue: parse now, run later
            require(getattr(self, name) in (None, False), f"--{name.replace('_', '-')} is not supported yet; drop it.")
        model_parallel = (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )
        require(
            self.world_size % model_parallel == 0,
            f"world size {self.world_size} is not divisible by TP*PP*CP = {model_parallel}.",
        )
        self.data_parallel_size = self.world_size // model_parallel


_PIPELINE_LAYOUT_FIELDS = (
    "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank",
    "pipeline_model_parallel_layout",
    "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
    "microbatch_group_size_per_virtual_pipeline_stage",
    "overlap_p2p_communication_warmup_flush",
)


class ProcessGroups:
    """The process groups of one run. ``None`` groups mean a world of one.

    Attributes:
        rank: Global rank.
        world_size: Global world size.
        dp: Data-parallel group (``None`` when DP = 1 or not distributed).
        tp, pp, cp, ep: Model-parallel groups; ``None`` while their sizes are 1.
        device: The device this rank computes on.
    """

    def __init__(self, *, rank: int, world_size: int, device: torch.device, dp=None):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.dp = dp
        self.owns_process_group = False  # set when initialize() called init_process_group
        self.tp = None
        self.pp = None
        self.cp = None
        self.ep = None

    @property
    def dp_size(self) -> int:
        return 1 if self.dp is None else dist.get_world_size(self.dp)

    @property
    def dp_rank(self) -> int:
        return 0 if self.dp is None else dist.get_rank(self.dp)

    @property
    def tp_size(self) -> int:
        return 1

    @property
    def pp_size(self) -> int:
        return 1

    @property
    def is_last_rank(self) -> bool:
        return self.rank == self.world_size - 1

    @classmethod
    def single(cls, device: torch.device | None = None) -> "ProcessGroups":
        """A world of one, for tests and single-process runs."""
        return cls(rank=0, world_size=1, device=device or torch.device("cpu"))


def initialize(config: ParallelConfig, *, use_cuda: bool) -> ProcessGroups:
    """Builds process groups from torchrun's environment.

    Args:
        config: Parallel layout; ``world_size`` and ``data_parallel_size`` are filled in.
        use_cuda: Compute on CUDA (NCCL) or on the CPU (gloo).
    """
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    config.world_size = world_size
    config.validate()
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
        # gloo's worker threads abort about one exit in 15 ("terminate called without an
        # active exception", torch 2.13, DP=2 on the CPU). torch.optim imports
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
    # With TP = PP = CP = 1 every rank is its own model replica, so the data-parallel
    # group is the world. Later layouts carve the world into rank grids here.
    groups = ProcessGroups(rank=rank, world_size=world_size, device=device, dp=dist.group.WORLD)
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
        groups.dp = None  # our last handle: the group (and gloo's threads) ends here
