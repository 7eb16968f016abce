"""The hybrid layer pattern: parsing, errors naming the flag and the symbol, pipeline segments."""

import pytest

from megatron.core.models.hybrid.hybrid_layer_allocation import (
    parse_hybrid_pattern,
    select_pipeline_segment,
    virtual_pipeline_size,
)


def test_parse_counts_layers_and_segments():
    p = parse_hybrid_pattern("M*M-M*M-")
    assert (p.num_layers, p.num_segments, p.segments) == (8, 1, ("M*M-M*M-",))
    assert (p.count("M"), p.count("*"), p.count("-")) == (4, 2, 2)
    p = parse_hybrid_pattern("M*|M-|M*|ME")
    assert p.num_layers == 8 and p.segments == ("M*", "M-", "M*", "ME") and p.layers == "M*M-M*ME"


@pytest.mark.parametrize(
    "pattern,needle",
    [
        ("M*X-", r"--hybrid-layer-pattern 'M\*X-': 'X' at position 2 is not a layer symbol"),
        ("MM m", r"' ' at position 2 is not a layer symbol"),
        ("M*GD", r"symbol 'D' at position 3 \(DSA attention\) is not supported here"),
        ("M+", r"symbol '\+' at position 1 \(MLA attention\)"),
        ("M*M*/MM", r"symbol '/' at position 4 \(MTP pattern separator\)"),
        ("", r"--hybrid-layer-pattern '' has no layers"),
        ("||", r"has no layers"),
    ],
)
def test_errors_name_the_flag_and_the_symbol(pattern, needle):
    with pytest.raises(ValueError, match=needle):
        parse_hybrid_pattern(pattern)


def test_gated_delta_net_layers_count_and_split_over_pipeline_stages():
    p = parse_hybrid_pattern("MGM*|GG-E")
    assert (p.count("G"), p.count("M"), p.num_layers, p.segments) == (3, 2, 8, ("MGM*", "GG-E"))
    assert select_pipeline_segment(p, 1, 2) == ("GG-E", 4)
    assert select_pipeline_segment(parse_hybrid_pattern("G*G-G*G-"), 1, 4) == ("G-", 2)


def test_errors_name_the_alias_when_it_was_given():
    with pytest.raises(ValueError, match="--hybrid-override-pattern 'Mx'"):
        parse_hybrid_pattern("Mx", flag="--hybrid-override-pattern")


def test_segments_select_the_chunk_of_each_rank_and_virtual_stage():
    p = parse_hybrid_pattern("M*|M-|*M|-M")
    assert virtual_pipeline_size(p, 2) == 2 and virtual_pipeline_size(p, 4) is None
    # Segment vp * PP + rank, as Megatron: rank 0 holds segments 0 and 2, rank 1 holds 1 and 3.
    assert select_pipeline_segment(p, 0, 2, 0) == ("M*", 0)
    assert select_pipeline_segment(p, 1, 2, 0) == ("M-", 2)
    assert select_pipeline_segment(p, 0, 2, 1) == ("*M", 4)
    assert select_pipeline_segment(p, 1, 2, 1) == ("-M", 6)
    with pytest.raises(ValueError, match="4 pipeline segments, which is not a multiple of --pipeline-model"):
        virtual_pipeline_size(p, 3)


def test_pattern_without_separators_splits_evenly_over_pipeline_ranks():
    p = parse_hybrid_pattern("M*M-M*M-")
    assert virtual_pipeline_size(p, 2) is None
    assert select_pipeline_segment(p) == ("M*M-M*M-", 0)
    assert select_pipeline_segment(p, 1, 2) == ("M*M-", 4)
    with pytest.raises(ValueError, match="do not split evenly over --pipeline-model-parallel-size 3"):
        select_pipeline_segment(p, 0, 3)
    with pytest.raises(ValueError, match="no '\\|' separators"):
        select_pipeline_segment(p, 0, 2, 1)
