"""The rank grid (Megatron's order), layout validation and the accessors, without torch.distributed.

The groups themselves carry collectives in tests/unit_tests/training/test_parallel_layouts.py.
"""

import warnings

import pytest
import torch

from megatron.core.parallel_config import ParallelConfig
from megatron.core.parallel_state import ProcessGroups
from megatron.core.rank_grid import dense_grid, expert_grid, grid_ranks, rank_groups
from megatron.core.transformer.transformer_config import TransformerConfig


def layout(world, **sizes) -> ParallelConfig:
    cfg = ParallelConfig(world_size=world, **sizes).resolve()
    cfg.validate()
    return cfg


def test_dense_grid_is_tp_fastest_then_dp_then_pp():
    cfg = layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    grid = dense_grid(cfg)
    assert cfg.data_parallel_size == 2
    assert rank_groups(grid, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(grid, ("dp",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(grid, ("pp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert rank_groups(grid, ("tp", "pp")) == [[0, 1, 4, 5], [2, 3, 6, 7]]


def test_expert_grid_defaults_expert_tp_to_tp():
    cfg = layout(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    assert cfg.expert_tensor_parallel_size == 2 and cfg.expert_data_parallel_size == 2
    grid = expert_grid(cfg)
    assert rank_groups(grid, ("tp",)) == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert rank_groups(grid, ("ep",)) == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert rank_groups(grid, ("dp",)) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    cfg = layout(8, tensor_model_parallel_size=2, expert_model_parallel_size=4, expert_tensor_parallel_size=1)
    assert rank_groups(expert_grid(cfg), ("ep",)) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cfg.expert_data_parallel_size == 2


@pytest.mark.parametrize(
    "world, sizes, needle",
    [
        (6, dict(tensor_model_parallel_size=4), "world size 6 is not divisible by --tensor-model-parallel-size (4)"),
        (
            4,
            dict(context_parallel_size=2),
            "--context-parallel-size 2 is not supported: this trainer does not do context parallelism",
        ),
        (
            4,
            dict(virtual_pipeline_model_parallel_size=2),
            "virtual pipeline stages need --pipeline-model-parallel-size",
        ),
        (4, dict(expert_model_parallel_size=3), "--expert-model-parallel-size (3)"),
        (4, dict(tensor_model_parallel_size=0), "--tensor-model-parallel-size must be >= 1"),
    ],
)
def test_bad_layouts_name_the_flags(world, sizes, needle):
    with pytest.raises(ValueError) as info:
        layout(world, **sizes)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "sizes, model, needle",
    [
        (dict(pipeline_model_parallel_size=2), dict(num_layers=3), "--num-layers (3) must be divisible by"),
        (
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
            dict(num_layers=6),
            "x virtual pipeline stages per rank (2, --num-virtual-stages-per-pipeline-rank)",
        ),
        (dict(tensor_model_parallel_size=4), dict(num_attention_heads=6, hidden_size=96), "--num-attention-heads (6)"),
        (
            dict(tensor_model_parallel_size=4),
            dict(num_attention_heads=8, group_query_attention=True, num_query_groups=2),
            "--num-query-groups (2)",
        ),
        (dict(expert_model_parallel_size=2), dict(), "needs a MoE model"),
    ],
)
def test_model_against_layout_names_the_flags(sizes, model, needle):
    cfg = layout(8, **sizes)
    with pytest.raises(ValueError) as info:
        cfg.validate_model(TransformerConfig(**model).finalize())
    assert needle in str(info.value)


def test_model_that_fits_the_layout_passes():
    cfg = layout(
        8, tensor_model_parallel_size=2, pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2
    )
    cfg.validate_model(TransformerConfig(num_layers=8, num_attention_heads=4).finalize())


def test_experts_by_ep():
    cfg = layout(4, expert_model_parallel_size=4)
    model = TransformerConfig().finalize()
    model.moe.num_moe_experts = 6  # the MoE flags live in the model config's moe part
    with pytest.raises(
        ValueError, match=r"--num-experts \(6\) must be divisible by --expert-model-parallel-size \(4\)"
    ):
        cfg.validate_model(model)
    model.moe.num_moe_experts = 8
    cfg.validate_model(model)


def test_sequence_parallel_with_tp1_warns_and_turns_off():
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect"):
        cfg = layout(2, sequence_parallel=True)
    assert cfg.sequence_parallel is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert layout(2, tensor_model_parallel_size=2, sequence_parallel=True).sequence_parallel


def test_accessors_tp2_pp2_on_four_ranks():
    cfg = layout(4, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    for rank in range(4):
        pg = ProcessGroups(rank=rank, world_size=4, device=torch.device("cpu"), ranks=grid_ranks(cfg, rank))
        tp_rank, pp_rank = rank % 2, rank // 2
        assert (pg.tp_size, pg.pp_size, pg.dp_size, pg.ep_size, pg.expt_tp_size, pg.mp_size) == (2, 2, 1, 1, 2, 4)
        assert (pg.tp_rank, pg.pp_rank, pg.dp_rank) == (tp_rank, pp_rank, 0)
        assert (pg.is_pipeline_first_stage, pg.is_pipeline_last_stage) == (pp_rank == 0, pp_rank == 1)
        other = tp_rank + 2 * (1 - pp_rank)
        assert (pg.pp_prev_rank, pg.pp_next_rank) == (other, other)  # a ring of two
        assert (pg.pp_first_rank, pg.pp_last_rank) == (tp_rank, tp_rank + 2)


def test_pipeline_ring_of_four():
    cfg = layout(8, tensor_model_parallel_size=2, pipeline_model_parallel_size=4)
    pg = ProcessGroups(rank=3, world_size=8, device=torch.device("cpu"), ranks=grid_ranks(cfg, 3))
    assert pg.ranks["pp"] == [1, 3, 5, 7] and pg.pp_rank == 1
    assert (pg.pp_prev_rank, pg.pp_next_rank) == (1, 5)
    last = ProcessGroups(rank=7, world_size=8, device=torch.device("cpu"), ranks=grid_ranks(cfg, 7))
    assert last.is_pipeline_last_stage and last.pp_next_rank == 1  # wraps, as Megatron's


def test_single_world_is_all_ones():
    pg = ProcessGroups.single()
    assert (pg.tp_size, pg.pp_size, pg.dp_size, pg.tp_rank, pg.pp_rank, pg.dp_rank) == (1, 1, 1, 0, 0, 0)
    assert pg.is_pipeline_first_stage and pg.is_pipeline_last_stage and pg.tp is None and not pg.sequence_parallel


# --------------------------------------------------------------- --use-tp-pp-dp-mapping


def _groups(cfg, grid_of, *axes, split_dp=False):
    return rank_groups(grid_of(cfg, split_dp=split_dp), axes)


@pytest.mark.parametrize(
    "world, sizes, want",
    [
        # Megatron's tp-cp-pp-dp: rank = tp + TP * (pp + PP * dp).
        (4, dict(pipeline_model_parallel_size=2), dict(pp=[[0, 1], [2, 3]], dp=[[0, 2], [1, 3]])),
        (
            8,
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2),
            dict(
                tp=[[0, 1], [2, 3], [4, 5], [6, 7]],
                pp=[[0, 2], [1, 3], [4, 6], [5, 7]],
                dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
                mp=[[0, 1, 2, 3], [4, 5, 6, 7]],
            ),
        ),
        (
            12,
            dict(pipeline_model_parallel_size=3),
            dict(pp=[[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]], dp=[[0, 3, 6, 9], [1, 4, 7, 10], [2, 5, 8, 11]]),
        ),
        (
            16,
            dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=4),
            dict(
                pp=[[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]],
                dp=[[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]],
                mp=[[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15]],
            ),
        ),
        # Without pipelining the two orders are one.
        (4, dict(tensor_model_parallel_size=2), dict(tp=[[0, 1], [2, 3]], dp=[[0, 2], [1, 3]])),
    ],
)
def test_tp_pp_dp_mapping_puts_data_parallel_last(world, sizes, want):
    cfg = layout(world, use_tp_pp_dp_mapping=True, **sizes)
    axes = {"tp": ("tp",), "pp": ("pp",), "dp": ("dp",), "mp": ("tp", "pp")}
    for name, groups in want.items():
        assert rank_groups(dense_grid(cfg), axes[name]) == groups, name
    if cfg.pipeline_model_parallel_size > 1:  # the embedding groups: first and last stage of each pipeline
        pg = ProcessGroups(
            rank=world - 1, world_size=world, device=torch.device("cpu"), ranks=grid_ranks(cfg, world - 1)
        )
        assert pg.ranks["embd"] == [want["pp"][-1][0], world - 1] and pg.is_last_rank and pg.is_pipeline_last_stage


def test_tp_pp_dp_mapping_lays_out_the_expert_grid_alike():
    # TP=2 x PP=2 x DP=2 with EP=2, ETP=1: expert rank = ep + EP * (pp + PP * edp).
    cfg = layout(
        8,
        use_tp_pp_dp_mapping=True,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=1,
    )
    assert _groups(cfg, expert_grid, "ep") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert _groups(cfg, expert_grid, "dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert _groups(cfg, expert_grid, "pp") == _groups(cfg, dense_grid, "pp") == [[0, 2], [1, 3], [4, 6], [5, 7]]
    # The census config moe/gpt3_mcore_tp2_pp2_ep2_etp2_te_4experts2parallel_dp_last at two replicas:
    # TP=4, PP=2, EP=2, ETP=2 on 16 ranks.
    cfg = layout(
        16,
        use_tp_pp_dp_mapping=True,
        tensor_model_parallel_size=4,
        pipeline_model_parallel_size=2,
        expert_model_parallel_size=2,
        expert_tensor_parallel_size=2,
    )
    assert _groups(cfg, dense_grid, "tp") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert _groups(cfg, dense_grid, "pp") == [[0, 4], [1, 5], [2, 6], [3, 7], [8, 12], [9, 13], [10, 14], [11, 15]]
    assert _groups(cfg, dense_grid, "dp") == [[r, r + 8] for r in range(8)]
    assert _groups(cfg, expert_grid, "tp") == [[r, r + 1] for r in range(0, 16, 2)]
    assert _groups(cfg, expert_grid, "ep") == [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
    assert _groups(cfg, expert_grid, "tp", "ep") == _groups(cfg, dense_grid, "tp")
    assert _groups(cfg, expert_grid, "dp") == [[r, r + 8] for r in range(8)]
    assert _groups(cfg, expert_grid, "pp") == _groups(cfg, dense_grid, "pp")


def test_tp_pp_dp_mapping_needs_equal_dense_and_expert_data_parallel_sizes():
    sizes = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, expert_model_parallel_size=2)
    layout(16, **sizes)  # the default order shares the pipeline groups anyway
    with pytest.raises(ValueError, match=r"--use-tp-pp-dp-mapping with --pipeline-model-parallel-size 2 needs"):
        layout(16, use_tp_pp_dp_mapping=True, **sizes)  # DP = 4, expert DP = 2
    layout(16, use_tp_pp_dp_mapping=True, tensor_model_parallel_size=2, expert_model_parallel_size=2)  # PP = 1


# --------------------------------------------------------------- --num-distributed-optimizer-instances


@pytest.mark.parametrize(
    "world, sizes, want",
    [
        (
            8,
            dict(),
            dict(intra_dp=[[0, 1, 2, 3], [4, 5, 6, 7]], inter_dp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
        ),
        (
            8,
            dict(tensor_model_parallel_size=2),  # DP groups [0, 2, 4, 6] and [1, 3, 5, 7], halved
            dict(intra_dp=[[0, 2], [1, 3], [4, 6], [5, 7]], inter_dp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
        ),
        (
            8,
            dict(pipeline_model_parallel_size=2, use_tp_pp_dp_mapping=True),  # DP groups [0, 2, 4, 6], [1, 3, 5, 7]
            dict(intra_dp=[[0, 2], [1, 3], [4, 6], [5, 7]], inter_dp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
        ),
        (
            8,
            dict(pipeline_model_parallel_size=2),  # DP groups [0, 1, 2, 3], [4, 5, 6, 7]
            dict(intra_dp=[[0, 1], [2, 3], [4, 5], [6, 7]], inter_dp=[[0, 2], [1, 3], [4, 6], [5, 7]]),
        ),
        (
            8,
            dict(expert_model_parallel_size=4),  # expert DP groups [0, 4], [1, 5], [2, 6], [3, 7]
            dict(
                intra_dp=[[0, 1, 2, 3], [4, 5, 6, 7]],
                intra_expt_dp=[[r] for r in range(8)],
                inter_dp=[[0, 4], [1, 5], [2, 6], [3, 7]],
            ),
        ),
        (
            8,
            dict(expert_model_parallel_size=2),  # expert DP groups [0, 2, 4, 6], [1, 3, 5, 7]
            dict(intra_expt_dp=[[0, 2], [1, 3], [4, 6], [5, 7]], inter_dp=[[0, 4], [1, 5], [2, 6], [3, 7]]),
        ),
    ],
)
def test_distributed_optimizer_instances_split_data_parallel_into_consecutive_blocks(world, sizes, want):
    cfg = layout(world, num_distributed_optimizer_instances=2, **sizes)
    for rank in range(world):
        got = grid_ranks(cfg, rank)
        for name, groups in want.items():
            (mine,) = [g for g in groups if rank in g]
            assert got[name] == mine, (name, rank)
        pg = ProcessGroups(rank=rank, world_size=world, device=torch.device("cpu"), ranks=got)
        assert pg.inter_dp_size == 2 and pg.intra_dp_size * 2 == pg.dp_size
        assert pg.intra_expt_dp_size * 2 == pg.expt_dp_size and pg.inter_dp_rank == got["inter_dp"].index(rank)


def test_one_optimizer_instance_is_the_whole_data_parallel_group():
    cfg = layout(8, tensor_model_parallel_size=2, expert_model_parallel_size=2)
    for rank in range(8):
        got = grid_ranks(cfg, rank)
        assert got["intra_dp"] == got["dp"] and got["intra_expt_dp"] == got["expt_dp"] and got["inter_dp"] == [rank]
    pg = ProcessGroups.single()
    assert (pg.intra_dp_size, pg.inter_dp_size, pg.inter_dp_rank, pg.intra_dp) == (1, 1, 0, None)


@pytest.mark.parametrize(
    "world, sizes, needle",
    [
        (8, dict(num_distributed_optimizer_instances=3), "must divide the data-parallel size (8)"),
        (
            4,
            dict(num_distributed_optimizer_instances=2, expert_model_parallel_size=4),
            "must divide the expert data-parallel size (1)",
        ),
        (4, dict(num_distributed_optimizer_instances=0), "--num-distributed-optimizer-instances must be >= 1"),
    ],
)
def test_bad_instance_counts_name_the_flag(world, sizes, needle):
    with pytest.raises(ValueError) as info:
        layout(world, **sizes)
    assert needle in str(info.value)
