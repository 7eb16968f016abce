"""The rank grid: which global ranks form each process group (pure arithmetic, no torch.distributed).

Megatron's order: tensor parallel fastest, then context, then data, then pipeline
parallel (``tp-cp-dp-pp``), so ``r = tp + TP * (cp + CP * (dp + DP * pp))``. Expert
layers use a second grid over the same world (``tp-ep-dp-pp`` with the expert tensor-
and data-parallel sizes), sharing the pipeline groups. ``--use-tp-pp-dp-mapping`` puts
data parallel last in both (``tp-cp-pp-dp``, ``tp-ep-pp-dp``). With
``--num-distributed-optimizer-instances N`` the data-parallel axis is read as DP / N
consecutive ranks (``dp_intra``) times the N instances (``dp_inter``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.parallel_config import ParallelConfig


def rank_groups(sizes: dict[str, int], axes: tuple[str, ...]) -> list[list[int]]:
    """Partitions the world of a rank grid into the groups that vary along ``axes``.

    Args:
        sizes: Axis name -> size, fastest-varying axis first (``{"tp": 2, "cp": 1, "dp": 2, "pp": 2}``).
        axes: The axes a group spans (``("dp",)``, or ``("tp", "pp")`` for model parallel).

    Returns:
        The groups, each as ascending global ranks, ordered by their first rank.
    """
    names = list(sizes)
    assert all(a in sizes for a in axes), (axes, names)
    world = 1
    for size in sizes.values():
        world *= size
    groups: dict[tuple, list[int]] = {}
    for rank in range(world):
        coords, rest = {}, rank
        for name in names:
            coords[name] = rest % sizes[name]
            rest //= sizes[name]
        key = tuple(coords[n] for n in names if n not in axes)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values(), key=lambda ranks: ranks[0])


def _ordered(config: ParallelConfig, inner: dict[str, int], dp: int, split_dp: bool) -> dict[str, int]:
    """``inner`` axes, then data and pipeline parallel in the layout's order. ``split_dp``
    splits the data-parallel axis into ``dp_intra`` (DP / N consecutive ranks, one
    distributed-optimizer instance) and ``dp_inter`` (the N instances)."""
    n = config.num_distributed_optimizer_instances
    dps = {"dp_intra": dp // n, "dp_inter": n} if split_dp else {"dp": dp}
    pp = {"pp": config.pipeline_model_parallel_size}
    return {**inner, **pp, **dps} if config.use_tp_pp_dp_mapping else {**inner, **dps, **pp}


def dense_grid(config: ParallelConfig, *, split_dp: bool = False) -> dict[str, int]:
    """The dense layers' grid, fastest axis first: Megatron's ``tp-cp-dp-pp``, or ``tp-cp-pp-dp``
    with ``--use-tp-pp-dp-mapping``."""
    inner = {"tp": config.tensor_model_parallel_size, "cp": config.context_parallel_size}
    return _ordered(config, inner, config.data_parallel_size, split_dp)


def expert_grid(config: ParallelConfig, *, split_dp: bool = False) -> dict[str, int]:
    """The expert layers' grid, fastest axis first: Megatron's ``tp-ep-dp-pp``, or ``tp-ep-pp-dp``
    with ``--use-tp-pp-dp-mapping``."""
    inner = {
        "tp": config.expert_tensor_parallel_size or config.tensor_model_parallel_size,
        "ep": config.expert_model_parallel_size,
    }
    return _ordered(config, inner, config.expert_data_parallel_size, split_dp)


def wanted_groups(config: ParallelConfig) -> dict[str, tuple[dict[str, int], tuple[str, ...]]]:
    dense, expert = dense_grid(config), expert_grid(config)
    dense_split, expert_split = dense_grid(config, split_dp=True), expert_grid(config, split_dp=True)
    return {
        "tp": (dense, ("tp",)),
        "cp": (dense, ("cp",)),
        "dp": (dense, ("dp",)),
        "pp": (dense, ("pp",)),
        "mp": (dense, ("tp", "pp")),
        "ep": (expert, ("ep",)),
        "expt_tp": (expert, ("tp",)),
        "expt_dp": (expert, ("dp",)),
        "tp_ep": (expert, ("tp", "ep")),
        "intra_dp": (dense_split, ("dp_intra",)),
        "intra_expt_dp": (expert_split, ("dp_intra",)),
        # Megatron builds this one from the expert grid and uses it for the dense layers too:
        # the instance boundaries fall on the same ranks in both grids.
        "inter_dp": (expert_split, ("dp_inter",)),
    }


def embedding_groups(config: ParallelConfig) -> list[list[int]]:
    """The first and last rank of every pipeline (PP > 1), Megatron's embedding groups."""
    if config.pipeline_model_parallel_size == 1:
        return []
    return [[ranks[0], ranks[-1]] for ranks in rank_groups(dense_grid(config), ("pp",))]


def grid_ranks(config: ParallelConfig, rank: int) -> dict[str, list[int]]:
    """Group name -> the global ranks of ``rank``'s group (pure: no torch.distributed)."""
    out = {}
    for name, (grid, axes) in wanted_groups(config).items():
        (out[name],) = [g for g in rank_groups(grid, axes) if rank in g]
    out["embd"] = next((g for g in embedding_groups(config) if rank in g), [rank])
    (dense_inter,) = [g for g in rank_groups(dense_grid(config, split_dp=True), ("dp_inter",)) if rank in g]
    assert dense_inter == out["inter_dp"], (dense_inter, out["inter_dp"])  # one group serves both
    return out
