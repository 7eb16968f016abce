"""Process groups, held in one object that is passed to whoever needs it.

The layout flags are ``parallel_config.ParallelConfig``. Unlike Megatron's module
globals, ``ProcessGroups`` is built once by the trainer and
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

import datetime
import importlib
import os

import torch
import torch.distributed as dist

from megatron.core.parallel_config import ParallelConfig
from megatron.core.rank_grid import embedding_groups, grid_ranks, rank_groups, wanted_groups


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
