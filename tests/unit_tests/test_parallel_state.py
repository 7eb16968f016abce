"""The rank grid (Megatron's order), layout validation and the accessors, without torch.distributed.

The groups themselves carry collectives in tests/unit_tests/training/test_parallel_layouts.py.
"""

import warnings

import pytest
import torch

from megatron.core.parallel_state import ParallelConfig, ProcessGroups, dense_grid, expert_grid, grid_ranks, rank_groups
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
        (4, dict(context_parallel_size=2), "--context-parallel-size 2 is not supported yet"),
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
            "x virtual pipeline stages per rank (2)",
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
