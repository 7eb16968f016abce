"""The experimental attention variant flags: --linear-attention-freq patterns, defaults, refusals naming the flag."""

import pytest

from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig, parse_linear_attention_freq

TINY = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 63"
)


def validated(flags: str, world_size: int = 1):
    from megatron.training.arguments import parse_args

    cfg = parse_args(f"{TINY} {flags}".split()).resolve(world_size=world_size)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    "value, layers, pattern",
    [
        (3, 7, [1, 1, 0, 1, 1, 0, 1]),  # every 3rd layer (1-based) is softmax attention
        ("4", 4, [1, 1, 1, 0]),
        (1, 3, [0, 0, 0]),  # N = 1: no linear layer
        (5, 2, [1, 1]),  # fewer layers than N: all linear
        ("([1]*3+[0]*1)*2", 8, [1, 1, 1, 0, 1, 1, 1, 0]),
        ("([0]+[1]*3)", 4, [0, 1, 1, 1]),
        ([1, 0], 2, [1, 0]),
    ],
)
def test_linear_attention_freq_patterns_follow_megatron(value, layers, pattern):
    assert parse_linear_attention_freq(value, layers) == pattern


@pytest.mark.parametrize(
    "value, layers, message",
    [
        ("0", 4, "must be >= 1"),
        ("three", 4, "expected an int N"),
        ("[1]*3", 4, "has 3 entries but --num-layers is 4"),
        ("[1, 2, 0, 1]", 4, "may only hold 1 .* and 0"),
        ("[1]*len('ab')", 2, "only list literals, integers"),
        ("([1]*2", 2, "not a valid expression"),
        (True, 2, "expected an int or a list"),
    ],
)
def test_bad_linear_attention_freq_names_the_flag(value, layers, message):
    with pytest.raises(ValueError, match=f"--linear-attention-freq.*{message}"):
        parse_linear_attention_freq(value, layers)


def test_defaults_are_megatrons():
    la = LinearAttentionConfig()
    assert la.experimental_attention_variant is None and la.linear_attention_freq is None and not la.enabled
    assert (la.linear_conv_kernel_dim, la.linear_key_head_dim, la.linear_value_head_dim) == (4, 128, 128)
    assert (la.linear_num_key_heads, la.linear_num_value_heads) == (16, 32)
    assert not validated("").model.attention_output_gate


def test_flags_reach_the_model_config():
    cfg = validated(
        "--experimental-attention-variant gdn --linear-attention-freq ([1]*3+[0]*1) --linear-conv-kernel-dim 2 "
        "--linear-key-head-dim 8 --linear-value-head-dim 16 --linear-num-key-heads 2 --linear-num-value-heads 6 "
        "--attention-output-gate"
    )
    la = cfg.model.linear_attention
    assert la is cfg.linear_attention and la.enabled and la.linear_attention_pattern == [1, 1, 1, 0]
    assert (la.linear_conv_kernel_dim, la.linear_key_head_dim, la.linear_value_head_dim) == (2, 8, 16)
    assert (la.linear_num_key_heads, la.linear_num_value_heads) == (2, 6)
    assert cfg.model.attention_output_gate


def test_deprecated_spelling_is_gdn_with_a_warning():
    with pytest.warns(UserWarning, match="gated_delta_net is deprecated; use gdn"):
        cfg = validated("--experimental-attention-variant gated_delta_net --linear-attention-freq 2")
    assert cfg.linear_attention.experimental_attention_variant == "gdn"
    assert cfg.linear_attention.linear_attention_pattern == [1, 0, 1, 0]


def test_linear_flags_without_a_variant_are_ignored():
    cfg = validated("--linear-attention-freq 2 --linear-num-key-heads 3")
    assert not cfg.linear_attention.enabled and cfg.linear_attention.linear_attention_pattern is None


@pytest.mark.parametrize(
    "flags, message",
    [
        ("--experimental-attention-variant gdn", "needs --linear-attention-freq"),
        ("--experimental-attention-variant gdn2", "gdn2 needs --linear-attention-freq"),
        (
            "--hybrid-layer-pattern *G-G --linear-num-key-heads 4 --linear-num-value-heads 6",
            r"--linear-num-value-heads \(6\) must be a multiple of --linear-num-key-heads \(4\)",
        ),
        ("--hybrid-layer-pattern *G-G --experimental-attention-variant gdn", "gdn needs --linear-attention-freq"),
        ("--experimental-attention-variant dsa", "dsa is not supported"),
        (
            "--experimental-attention-variant gdn --linear-attention-freq 2 --linear-num-key-heads 4 "
            "--linear-num-value-heads 6",
            r"--linear-num-value-heads \(6\) must be a multiple of --linear-num-key-heads \(4\)",
        ),
        ("--experimental-attention-variant gdn --linear-attention-freq 2 --linear-key-head-dim 0", "must be >= 1"),
        ("--experimental-attention-variant gdn --linear-attention-freq [1]*3", "--num-layers is 4"),
    ],
)
def test_user_mistakes_name_the_flag(flags, message):
    with pytest.raises(ValueError, match=message):
        validated(flags)


def test_tensor_parallel_size_must_divide_the_heads():
    flags = (
        "--experimental-attention-variant gdn --linear-attention-freq 2 --linear-num-key-heads 1 "
        "--linear-num-value-heads 2 --tensor-model-parallel-size 2"
    )
    with pytest.raises(ValueError, match=r"--linear-num-key-heads \(1\) .* --tensor-model-parallel-size \(2\)"):
        validated(flags, world_size=2)


def test_gdn2_in_a_hybrid_model_needs_no_linear_attention_freq():
    cfg = validated("--hybrid-layer-pattern *G-G --experimental-attention-variant gdn2")
    assert cfg.linear_attention.is_gdn2 and cfg.linear_attention.linear_attention_pattern is None
    cfg = validated("--experimental-attention-variant gdn2 --linear-attention-freq 2")
    assert cfg.linear_attention.enabled and cfg.linear_attention.linear_attention_pattern == [1, 0, 1, 0]


def test_tensor_parallel_size_must_divide_the_heads_of_hybrid_g_layers():
    flags = (
        "--hybrid-layer-pattern *G-G --linear-num-key-heads 1 --linear-num-value-heads 2 --tensor-model-parallel-size 2"
    )
    with pytest.raises(ValueError, match=r"--linear-num-key-heads \(1\) .* --tensor-model-parallel-size \(2\)"):
        validated(flags, world_size=2)
