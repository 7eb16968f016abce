"""MambaConfig: Megatron's defaults, the pattern flags, and errors that name the flag."""

import pytest

from megatron.core.parallel_config import ParallelConfig
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig


def check(mc: MambaConfig, model=None, parallel=None) -> MambaConfig:
    """What RunConfig does with the Mamba flags: resolve, then validate."""
    mc.resolve(model, parallel)
    mc.validate(model, parallel)
    return mc


def test_megatron_defaults():
    mc = MambaConfig()
    assert (mc.mamba_state_dim, mc.mamba_head_dim, mc.mamba_num_groups, mc.mamba_num_heads) == (128, 64, 8, None)
    assert mc.hybrid_layer_pattern is None and mc.use_mamba_mem_eff_path and mc.ssm_states_dtype is None
    assert mc.num_heads(1024) == 32 and mc.d_inner(1024) == 2048


def test_pattern_sets_the_layer_count_and_the_alias_is_deprecated():
    model = TransformerConfig(hidden_size=1024, num_attention_heads=16)
    mc = MambaConfig(hybrid_layer_pattern="M*M-M*M-")
    check(mc, model, ParallelConfig())
    assert model.num_layers == 8
    model = TransformerConfig(hidden_size=1024, num_attention_heads=16, num_layers=5)
    mc = MambaConfig(hybrid_override_pattern="M*M-")
    with pytest.warns(UserWarning) as record:
        check(mc, model, ParallelConfig())
    messages = " ".join(str(w.message) for w in record)
    assert "--hybrid-override-pattern is deprecated" in messages and "ignoring --num-layers (5)" in messages
    assert mc.hybrid_layer_pattern == "M*M-" and model.num_layers == 4
    with pytest.raises(ValueError, match="--hybrid-override-pattern and --hybrid-layer-pattern"):
        check(MambaConfig(hybrid_layer_pattern="M*", hybrid_override_pattern="MM"))


def test_segments_give_the_virtual_pipeline_size():
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    check(MambaConfig(hybrid_layer_pattern="M*|M-|M*|M-"), TransformerConfig(hidden_size=1024), parallel)
    assert parallel.virtual_pipeline_model_parallel_size == 2
    parallel = ParallelConfig(pipeline_model_parallel_size=2)
    check(MambaConfig(hybrid_layer_pattern="M*|M-"), TransformerConfig(hidden_size=1024), parallel)
    assert parallel.virtual_pipeline_model_parallel_size is None
    with pytest.raises(ValueError, match="3 pipeline segments.*--pipeline-model-parallel-size"):
        check(MambaConfig(hybrid_layer_pattern="M|M|M"), TransformerConfig(hidden_size=1024), parallel)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=3)
    with pytest.raises(ValueError, match="--virtual-pipeline-model-parallel-size 3 disagrees.*give 2 virtual stages"):
        check(MambaConfig(hybrid_layer_pattern="M*|M-|M*|M-"), TransformerConfig(hidden_size=1024), parallel)
    parallel = ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(ValueError, match="1 pipeline segment.*give no virtual stages"):
        check(MambaConfig(hybrid_layer_pattern="M*M-"), TransformerConfig(hidden_size=1024), parallel)


@pytest.mark.parametrize(
    "pattern, flags",
    [
        ("M*|M-|M*|M-", {"num_virtual_stages_per_pipeline_rank": 2}),  # even where it agrees with the segments
        ("M*M-M*M-", {"num_layers_per_virtual_pipeline_stage": 2}),
        ("M*M-", {"account_for_embedding_in_pipeline_split": True}),
        ("M*M-", {"account_for_loss_in_pipeline_split": True}),
        ("M*|M-", {"decoder_first_pipeline_num_layers": 1}),
        ("M*|M-", {"decoder_last_pipeline_num_layers": 1}),
    ],
)
def test_the_pattern_places_the_layers_as_in_megatron(pattern, flags):
    """Megatron refuses every other way of placing a hybrid model's layers, and
    --decoder-first/last-pipeline-num-layers once the pattern has '|'."""
    parallel = ParallelConfig(pipeline_model_parallel_size=2, **flags)
    parallel.resolve()
    flag = "--" + next(iter(flags)).replace("_", "-")
    with pytest.raises(ValueError, match=f"{flag} cannot be combined with --hybrid-layer-pattern"):
        check(MambaConfig(hybrid_layer_pattern=pattern), TransformerConfig(hidden_size=1024), parallel)


def test_a_pattern_without_stages_splits_as_the_decoder_flags_say():
    """Without '|' (deprecated upstream, still run), --decoder-first/last-pipeline-num-layers
    place the pattern's layers over the pipeline ranks, as Megatron's auto-split does."""
    from megatron.core.models.hybrid.hybrid_layer_allocation import parse_hybrid_pattern, select_pipeline_segment
    from megatron.core.pipeline_parallel.layout import rank_layer_counts

    parallel = ParallelConfig(pipeline_model_parallel_size=3, decoder_first_pipeline_num_layers=1)
    check(MambaConfig(hybrid_layer_pattern="M*M-M"), TransformerConfig(hidden_size=1024), parallel)
    counts = rank_layer_counts(parallel, 5)
    assert counts == [1, 2, 2]
    pattern = parse_hybrid_pattern("M*M-M")
    assert [select_pipeline_segment(pattern, r, 3, None, counts) for r in range(3)] == [("M", 0), ("*M", 1), ("-M", 3)]
    assert [select_pipeline_segment(pattern, r, 1) for r in range(1)] == [("M*M-M", 0)]


@pytest.mark.parametrize(
    "kw,hidden,tp,needle",
    [
        ({"mamba_state_dim": 0}, 64, 1, "--mamba-state-dim must be positive"),
        ({"mamba_head_dim": -1}, 64, 1, "--mamba-head-dim must be positive"),
        ({"mamba_num_groups": 0}, 64, 1, "--mamba-num-groups must be positive"),
        ({"mamba_num_heads": 0}, 64, 1, "--mamba-num-heads must be positive"),
        ({"mamba_head_dim": 48}, 64, 1, r"2 \* --hidden-size \(128\) must be divisible by --mamba-head-dim \(48\)"),
        ({"mamba_head_dim": 16, "mamba_num_groups": 3}, 64, 1, "must be divisible by --mamba-num-groups"),
        ({"mamba_head_dim": 16, "mamba_num_groups": 4, "mamba_num_heads": 6}, 64, 1, "--mamba-num-groups \\(4\\)"),
        ({"mamba_head_dim": 16, "mamba_num_groups": 2}, 64, 4, "--tensor-model-parallel-size \\(4\\)"),
    ],
)
def test_mamba_size_errors_name_the_flag(kw, hidden, tp, needle):
    mc = MambaConfig(hybrid_layer_pattern="M*", **kw)
    with pytest.raises(ValueError, match=needle):
        check(mc, TransformerConfig(hidden_size=hidden), ParallelConfig(tensor_model_parallel_size=tp))


def test_mamba_sizes_are_not_checked_without_mamba_layers():
    check(MambaConfig(hybrid_layer_pattern="*-*-", mamba_num_groups=3), TransformerConfig(hidden_size=64))


def test_moe_symbol_needs_the_moe_flags():
    with pytest.raises(ValueError, match="--hybrid-layer-pattern 'M\\*E-'.*'E' \\(MoE\\) layers need --num-experts"):
        check(MambaConfig(hybrid_layer_pattern="M*E-"), TransformerConfig(hidden_size=1024))
    model = TransformerConfig(hidden_size=1024, moe=MoEConfig(num_moe_experts=4))
    check(MambaConfig(hybrid_layer_pattern="M*E-"), model)
    assert model.num_layers == 4
