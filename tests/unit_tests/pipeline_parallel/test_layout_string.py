"""``--pipeline-model-parallel-layout``: the string's grammar, its checks, and the chunks it gives.

Expectations are worked by hand from upstream's grammar; the strings are upstream's own
(its functional-test configs and its --help) plus small ones for the edge cases.
"""

import pytest

from megatron.core.parallel_config import ParallelConfig
from megatron.core.pipeline_parallel import layout
from megatron.core.pipeline_parallel.layout_string import check_stages, describe, layer_counts, parse_layout
from megatron.training.arguments import parse_args
from megatron.training.logging_utils import startup_lines


@pytest.mark.parametrize(
    "text, stages",
    [
        # megatron/core/transformer/pipeline_parallel_layer_layout.py's docstring example
        ("Et*3|(tt|)*29,m|L", ["Ettt"] + ["tt"] * 29 + ["m", "L"]),
        # tests/functional_tests/test_cases/mixtral/deepseekv3_proxy_flex_tp1pp4emp16etp1cp1_release
        ("Et*2|(tt|)*5t|tmL", ["Ett"] + ["tt"] * 5 + ["t", "tmL"]),
        # ... deepseekv3_proxy_flex_tp2pp2emp16etp1cp1_gb_200_release
        ("Et*7|t*7mL", ["E" + "t" * 7, "t" * 7 + "mL"]),
        # moe/gpt3_mcore_te_tp2_pp2_ep4_etp1_selective_recompute_experimental
        ("Et*3|(tt|)*6tmL", ["Ettt"] + ["tt"] * 6 + ["tmL"]),
        # moe/gpt3_moe_mcore_te_tp2_pp2_ep4_etp1_no_mtp_no_a2a_ovlp_fine_grained_offloading
        ("Et*3|(tt|)*6L", ["Ettt"] + ["tt"] * 6 + ["L"]),
        # moe/gpt3_moe_mcore_te_tp4_ep2_etp2_pp2_scoped_cudagraph
        ("Et|(tt|)*6mL", ["Et"] + ["tt"] * 6 + ["mL"]),
        # upstream's --help: an empty stage between the two m stages
        ("E|(t|)*3,m|m||L", ["E", "t", "t", "t", "m", "m", "", "L"]),
        ("Et*3|tL", ["Ettt", "tL"]),
        ("E,t,t|t,t,L", ["Ett", "ttL"]),  # commas are cosmetic
        ("Et*0|t*12L", ["E", "t" * 12 + "L"]),  # *0 and two-digit counts
        ("Et|*3tL", ["Et", "", "", "tL"]),  # a repeated '|' gives empty stages
        ("(Et|)*1(t)*2L", ["Et", "ttL"]),  # a group without '|', a group repeated once
    ],
)
def test_strings_expand_to_the_stages_worked_by_hand(text, stages):
    assert list(parse_layout(text)) == stages


@pytest.mark.parametrize("text", ["Et(t|tL", "Et)*2|tL", "((t|)*2)*2L", "Et x|tL", "Et*|tL", "Ed|tL"])
def test_unreadable_strings_name_the_flag_and_the_grammar(text):
    with pytest.raises(ValueError, match=r"--pipeline-model-parallel-layout .*: cannot read .* the symbols are E"):
        parse_layout(text)


@pytest.mark.parametrize(
    "text, pp, needle",
    [
        ("Et*3|(tt|)*6tmL", 2, "'m' (multi-token prediction layers) is not supported"),
        ("Ett|t|tL", 2, "has 3 stages, which is not a multiple of --pipeline-model-parallel-size (2)"),
        ("Et|tL", 1, "has 2 stages: virtual pipeline stages need --pipeline-model-parallel-size > 1"),
        ("tt|ttL", 2, "the embedding 'E' must appear once, as the first symbol of the first stage"),
        ("tE|ttL", 2, "the embedding 'E' must appear once"),
        ("Et|EtL", 2, "the embedding 'E' must appear once"),
        ("|Et|t|tL", 2, "the embedding 'E' must appear once"),  # upstream would take it; stage 0 runs E
        ("Ett|tt", 2, "the loss 'L' must appear once, as the last symbol of the last stage"),
        ("Ett|tLt", 2, "the loss 'L' must appear once"),
        ("EtL|t|t|L", 2, "the loss 'L' must appear once"),
        ("Et|t|tL|", 2, "the loss 'L' must appear once"),  # upstream would take it; the last stage runs L
    ],
)
def test_layouts_this_trainer_cannot_run_name_the_flag_and_the_fix(text, pp, needle):
    with pytest.raises(ValueError) as info:
        check_stages(text, pp)
    assert needle in str(info.value) and "--pipeline-model-parallel-layout" in str(info.value)


def test_layer_count_must_match_num_layers():
    stages = check_stages("Et*3|tL", 2)
    assert layer_counts(stages, 4, "Et*3|tL") == [3, 1]
    with pytest.raises(ValueError, match=r"holds 4 transformer layers \('t'\) but --num-layers is 6"):
        layer_counts(stages, 6, "Et*3|tL")


def _parallel(world=2, **kw):
    cfg = ParallelConfig(world_size=world, **kw).resolve()
    cfg.validate()
    return cfg


def test_upstream_layout_gives_virtual_stages_and_chunks_in_megatron_order():
    # 8 stages on PP=2: 4 virtual stages per rank; stage i is chunk i // 2 of rank i % 2.
    cfg = _parallel(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et*3|(tt|)*6L")
    assert cfg.virtual_pipeline_model_parallel_size == 4 and layout.num_chunks(cfg) == 4
    assert layout.stage_layer_counts(cfg, 15) == [3, 2, 2, 2, 2, 2, 2, 0]
    assert layout.chunk_layers(cfg, 15, 0) == [(0, 3), (5, 2), (9, 2), (13, 2)]
    assert layout.chunk_layers(cfg, 15, 1) == [(3, 2), (7, 2), (11, 2), (15, 0)]
    assert layout.rank_layer_counts(cfg, 15) == [9, 6]
    assert layout.resolve_virtual_stages(cfg, 15) == 4


def test_one_stage_per_rank_is_no_interleaving():
    cfg = _parallel(4, pipeline_model_parallel_size=4, pipeline_model_parallel_layout="Et|tt|(t)*3|L")
    assert cfg.virtual_pipeline_model_parallel_size is None and layout.num_chunks(cfg) == 1
    assert [layout.chunk_layers(cfg, 6, r) for r in range(4)] == [[(0, 1)], [(1, 2)], [(3, 3)], [(6, 0)]]
    # A one-stage layout on one rank is the whole model.
    cfg = _parallel(1, pipeline_model_parallel_layout="Et*4L")
    assert layout.chunk_layers(cfg, 4, 0) == [(0, 4)]


@pytest.mark.parametrize(
    "flag, value",
    [
        ("num_layers_per_virtual_pipeline_stage", 1),
        ("num_virtual_stages_per_pipeline_rank", 2),
        ("decoder_first_pipeline_num_layers", 1),
        ("decoder_last_pipeline_num_layers", 1),
        ("account_for_embedding_in_pipeline_split", True),
        ("account_for_loss_in_pipeline_split", True),
    ],
)
def test_layout_cannot_be_combined_with_the_other_layer_placing_flags(flag, value):
    with pytest.raises(ValueError) as info:
        _parallel(pipeline_model_parallel_size=2, pipeline_model_parallel_layout="Et|t|t|tL", **{flag: value})
    name = "--" + flag.replace("_", "-")
    assert f"--pipeline-model-parallel-layout places every layer itself and cannot be combined with {name}" in str(
        info.value
    )


def test_given_virtual_pipeline_size_must_agree_with_the_layout():
    text = "Et|t|t|tL"
    assert _parallel(
        pipeline_model_parallel_size=2, pipeline_model_parallel_layout=text, virtual_pipeline_model_parallel_size=2
    ).virtual_pipeline_model_parallel_size == 2  # fmt: skip
    with pytest.raises(ValueError, match=r"--virtual-pipeline-model-parallel-size \(3\) disagrees with --pipeline"):
        _parallel(
            pipeline_model_parallel_size=2, pipeline_model_parallel_layout=text, virtual_pipeline_model_parallel_size=3
        )  # fmt: skip


def test_describe_names_every_chunk_of_every_rank():
    stages = check_stages("E|tt||t|t|L", 2)
    assert describe(stages, 2) == [
        "pipeline rank 0: embedding | (no layers) | layer 4",
        "pipeline rank 1: layers 1-2 | layer 3 | loss",
    ]


def _run_config(extra: str):
    flags = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    flags += "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    return parse_args((flags + extra).split()).resolve(world_size=2)


def test_command_line_layout_validates_and_says_where_the_layers_are():
    cfg = _run_config("--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout E|tt|t|tL")
    cfg.validate()
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    lines = startup_lines(cfg)
    assert "> --pipeline-model-parallel-layout E|tt|t|tL, model chunks in order:" in lines
    assert ">   pipeline rank 1: layers 1-2 | layer 4 + loss" in lines


@pytest.mark.parametrize(
    "extra, needle",
    [
        ("--pipeline-model-parallel-layout Ett|tL", "holds 3 transformer layers ('t') but --num-layers is 4"),
        ("--pipeline-model-parallel-layout Ettt|tmL", "'m' (multi-token prediction layers) is not supported"),
        (
            "--pipeline-model-parallel-layout Et|tL --hybrid-layer-pattern M*|M-",
            "--pipeline-model-parallel-layout cannot be combined with --hybrid-layer-pattern",
        ),
    ],
)
def test_command_line_layout_errors(extra, needle):
    with pytest.raises(ValueError) as info:
        _run_config("--pipeline-model-parallel-size 2 " + extra).validate()
    assert needle in str(info.value)
