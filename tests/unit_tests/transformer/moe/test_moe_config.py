import pytest

from megatron.core.transformer.moe.moe_config import MoEConfig, parse_moe_layer_freq
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args


@pytest.mark.parametrize(
    "value, layers, expected",
    [
        (1, 3, [1, 1, 1]),
        (2, 5, [1, 0, 1, 0, 1]),
        ("2", 4, [1, 0, 1, 0]),
        ("([0]*1+[1]*3)", 4, [0, 1, 1, 1]),
        ("([1]*3+[0]*1)*2", 8, [1, 1, 1, 0, 1, 1, 1, 0]),
        ("2*[0,1]", 4, [0, 1, 0, 1]),
        ([1, 0], 2, [1, 0]),
    ],
)
def test_layer_freq_forms(value, layers, expected):
    assert parse_moe_layer_freq(value, layers) == expected


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",
        "[0]*(lambda: 3)()",
        "[x for x in range(3)]",
        "[0] - [1]",
        "[True, 1]",
        "[0.5, 1]",
        "sum([[1]], [])",
        "[0]*10**9",
    ],
)
def test_layer_freq_rejects_anything_but_list_arithmetic(text):
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_moe_layer_freq(text, 4)


def test_layer_freq_pattern_length_and_values():
    with pytest.raises(ValueError, match="--num-layers is 3"):
        parse_moe_layer_freq("[1,1]", 3)
    with pytest.raises(ValueError, match="0 .dense layer. and 1"):
        parse_moe_layer_freq("[1,2,1]", 3)
    with pytest.raises(ValueError, match=">= 1"):
        parse_moe_layer_freq(0, 3)


def _validate(ep=1, etp=1, **moe):
    cfg = TransformerConfig(num_layers=2, hidden_size=8, num_attention_heads=2, moe=MoEConfig(**moe)).finalize()
    cfg.moe.validate(cfg, ep, etp)
    return cfg


@pytest.mark.parametrize(
    "kwargs, ep, message",
    [
        (dict(num_moe_experts=6), 4, "--num-experts .6. must be divisible by --expert-model-parallel-size .4."),
        (dict(num_moe_experts=4, moe_router_topk=5), 1, "--moe-router-topk"),
        (dict(num_moe_experts=4, moe_pad_expert_input_to_capacity=True), 1, "--moe-expert-capacity-factor"),
        (dict(num_moe_experts=4, moe_router_num_groups=2), 1, "--moe-router-group-topk"),
        (dict(num_moe_experts=6, moe_router_num_groups=4, moe_router_group_topk=2), 1, "divisible by --moe-router"),
        (dict(num_moe_experts=4, moe_router_enable_expert_bias=True), 1, "--moe-router-score-function sigmoid"),
        (dict(num_moe_experts=4, moe_router_topk=1), 1, "--moe-router-pre-softmax"),
        (dict(num_moe_experts=4, etp=2), 1, "biases in experts split over --expert-tensor-parallel-size 2"),
        (dict(num_moe_experts=4, etp=3), 1, "--moe-ffn-hidden-size .32. must be divisible by --expert-tensor"),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type=["sinkhorn", "aux_loss"]),
            1,
            "cannot be combined with other types",
        ),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_aux_loss_coeff=[0.01]),
            1,
            "Sinkhorn routing does not support aux loss: pass --moe-aux-loss-coeff 0",
        ),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type=["sinkhorn"], moe_expert_capacity_factor=1.0),
            1,
            "--moe-expert-capacity-factor only works with",
        ),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type=["aux_loss", "z"], moe_aux_loss_coeff=[0.1, 0.1]),
            1,
            "load-balancing-type z",
        ),
        (
            dict(num_moe_experts=4, moe_router_load_balancing_type=["aux_loss"], moe_aux_loss_coeff=[0.1, 0.1]),
            1,
            "--moe-aux-loss-coeff needs one value",
        ),
        (dict(moe_ffn_hidden_size=8), 1, "need --num-experts"),
        (dict(), 2, "--expert-model-parallel-size > 1 needs --num-experts"),
    ],
)
def test_validation_errors_name_the_flag(kwargs, ep, message):
    with pytest.raises(ValueError, match=message):
        _validate(ep, **kwargs)


def test_defaults_and_derived_fields():
    cfg = _validate(num_moe_experts=8, moe_layer_freq="([0]+[1])")
    moe = cfg.moe
    assert moe.moe_ffn_hidden_size == cfg.ffn_hidden_size
    assert moe.moe_layer_pattern == [0, 1]
    assert moe.moe_router_topk == 2 and moe.moe_token_dispatcher_type == "allgather"
    assert moe.aux_loss_coeffs() == {}  # Megatron's default coefficient is 0
    assert not moe.drop_and_pad
    neg = _validate(num_moe_experts=4, moe_expert_capacity_factor=-1.0)
    assert neg.moe.moe_expert_capacity_factor is None  # Megatron: negative = dropless


def test_flags_reach_the_model_config():
    cfg = parse_args(
        "--mock-data --vocab-size 64 --num-layers 4 --num-experts 8 --moe-layer-freq ([0]*1+[1]*3) "
        "--moe-router-load-balancing-type aux_loss seq_aux_loss --moe-aux-loss-coeff 0.01 0.001 "
        "--moe-router-dtype fp64 --moe-token-dispatcher-type alltoall --moe-expert-capacity-factor 1.5 "
        "--moe-pad-expert-input-to-capacity --moe-grouped-gemm".split()
    ).resolve(world_size=1)
    cfg.validate()
    moe = cfg.model.moe
    assert moe is cfg.moe and moe.num_moe_experts == 8 and moe.moe_layer_pattern == [0, 1, 1, 1]
    assert moe.aux_loss_coeffs() == {"aux_loss": 0.01, "seq_aux_loss": 0.001}
    assert moe.moe_router_dtype == "fp64" and moe.drop_and_pad and moe.moe_grouped_gemm


def _tp2_moe(*extra):
    flags = (
        "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--global-batch-size 1 --num-experts 4 --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 32"
    ).split()
    cfg = parse_args(flags + list(extra)).resolve(world_size=2)
    cfg.validate()
    return cfg


def test_moe_with_tensor_parallelism_needs_sequence_parallel():
    with pytest.raises(
        ValueError, match="--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel"
    ):
        _tp2_moe()
    assert _tp2_moe("--sequence-parallel").parallel.sequence_parallel


def test_expert_parallel_runs_save_and_load_in_both_formats(tmp_path):
    flags = (
        "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--global-batch-size 2 --num-experts 4 --expert-model-parallel-size 2 --mock-data "
        "--tokenizer-type NullTokenizer --vocab-size 32"
    ).split()
    for ckpt_format in ("torch", "torch_dist"):
        extra = ["--save", str(tmp_path), "--load", str(tmp_path), "--ckpt-format", ckpt_format]
        cfg = parse_args(flags + extra).resolve(world_size=2)
        cfg.validate()


def _overlap_run(*extra, world=2):
    flags = (
        "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
        "--num-experts 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 32"
    ).split()
    cfg = parse_args(flags + list(extra)).resolve(world_size=world)
    cfg.validate()
    return cfg


EP_OVERLAP = (
    "--overlap-moe-expert-parallel-comm --expert-model-parallel-size 2 --moe-token-dispatcher-type alltoall --bf16"
)


def test_overlap_switches_are_accepted_with_no_effect_and_named_in_the_log():
    from megatron.training.logging_utils import startup_lines

    cfg = _overlap_run(*EP_OVERLAP.split(), "--delay-wgrad-compute", "--moe-permute-fusion", "--moe-router-fusion")
    assert cfg.ignored_flags == [
        "--moe-permute-fusion",
        "--moe-router-fusion",
        "--overlap-moe-expert-parallel-comm",
        "--delay-wgrad-compute",
    ]
    assert any("--overlap-moe-expert-parallel-comm --delay-wgrad-compute" in line for line in startup_lines(cfg))
    shared = _overlap_run(
        *"--moe-shared-expert-overlap --moe-shared-expert-intermediate-size 32 --moe-token-dispatcher-type alltoall".split(),
        world=1,
    )
    assert shared.ignored_flags == ["--moe-shared-expert-overlap"]


@pytest.mark.parametrize(
    "extra, world, message",
    [
        ("--overlap-moe-expert-parallel-comm --moe-token-dispatcher-type alltoall --bf16", 1, "needs --expert-model"),
        (EP_OVERLAP.replace("alltoall", "allgather"), 2, "needs --moe-token-dispatcher-type alltoall"),
        (EP_OVERLAP.replace(" --bf16", ""), 2, "needs --bf16 or --fp16"),
        (
            f"{EP_OVERLAP} --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
            2,
            "full recomputation",
        ),
        (f"{EP_OVERLAP} --moe-shared-expert-overlap", 2, "cannot be combined; drop --moe-shared-expert-overlap"),
        (f"{EP_OVERLAP} --pipeline-model-parallel-size 2 --num-layers 4", 4, "needs virtual pipeline stages"),
        ("--delay-wgrad-compute", 1, "--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm"),
        (
            "--moe-shared-expert-overlap --moe-shared-expert-intermediate-size 32",
            1,
            "--moe-shared-expert-overlap only works with --moe-token-dispatcher-type alltoall",
        ),
        ("--moe-use-grouped-tensor", 1, "--moe-use-grouped-tensor needs --moe-grouped-gemm"),
        ("--moe-single-grouped-weight", 1, "--moe-single-grouped-weight needs --moe-grouped-gemm"),
        ("--moe-single-grouped-bias", 1, "--moe-single-grouped-bias needs --moe-grouped-gemm"),
        (f"{EP_OVERLAP} --overlap-dispatch-backward-with-experts-wgrad", 2, "and --overlap-moe-expert-parallel-comm"),
        ("--ep-overlap-early-attn-memory-release", 1, "needs --overlap-moe-expert-parallel-comm"),
    ],
)
def test_overlap_switches_keep_megatrons_rules(extra, world, message):
    with pytest.raises(ValueError, match=message):
        _overlap_run(*extra.split(), world=world)


def test_moe_kernel_switches_are_accepted_with_their_rules():
    cfg = _overlap_run(*"--moe-grouped-gemm --moe-use-grouped-tensor --moe-single-grouped-weight".split(), world=1)
    assert cfg.ignored_flags == ["--moe-use-grouped-tensor", "--moe-single-grouped-weight"]


def test_moe_layer_recompute_is_selective_recompute_of_moe():
    """Megatron's deprecated --moe-layer-recompute: selective recompute with moe added to the modules."""
    import warnings

    base = "--mock-data --vocab-size 64 --num-experts 4 --moe-layer-recompute".split()
    with pytest.warns(UserWarning, match="--moe-layer-recompute is deprecated"):
        model = parse_args(base).resolve().model
    assert (model.recompute_granularity, model.recompute_modules) == ("selective", ["core_attn", "moe"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        given = parse_args(base + ["--recompute-granularity", "selective", "--recompute-modules", "mlp"]).resolve()
        assert given.model.recompute_modules == ["mlp", "moe"]
        given.model.finalize()  # again, as model builders do: nothing changes
        assert given.model.recompute_modules == ["mlp", "moe"]
        with pytest.raises(ValueError, match="Do not set --moe-layer-recompute with --recompute-granularity full"):
            parse_args(base + ["--recompute-granularity", "full"]).resolve()


def test_apply_probs_on_input_needs_top1():
    argv = "--mock-data --vocab-size 64 --num-experts 4 --moe-router-topk 2 --moe-apply-probs-on-input".split()
    cfg = parse_args(argv).resolve()
    with pytest.raises(ValueError, match="--moe-apply-probs-on-input needs --moe-router-topk 1"):
        cfg.validate()
