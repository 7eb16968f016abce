"""Flags generated from the config dataclasses: spellings, types, help, errors."""

import dataclasses
import os
import subprocess
import sys
import typing

import pytest

from megatron.training import arguments
from megatron.training.arguments import KNOWN_MEGATRON_FLAGS, build_parser, field_docstrings, flags_markdown, parse_args
from megatron.training.run_config import RunConfig

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

MEGATRON_SPELLINGS = """
--num-layers --hidden-size --ffn-hidden-size --num-attention-heads --group-query-attention --num-query-groups
--kv-channels --seq-length --max-position-embeddings --position-embedding-type --normalization --swiglu
--untie-embeddings-and-output-weights --disable-bias-linear --init-method-std --hidden-dropout --attention-dropout
--micro-batch-size --global-batch-size --train-iters --lr --min-lr --lr-decay-style --lr-warmup-iters
--lr-decay-iters --weight-decay --clip-grad --adam-beta1 --adam-beta2 --adam-eps --seed --bf16 --fp16
--loss-scale --initial-loss-scale --mock-data --tokenizer-type --vocab-size --make-vocab-size-divisible-by
--log-interval --tensorboard-dir --deterministic-mode --overlap-grad-reduce --cuda-graph-impl --cuda-graph-scope
--cuda-graph-modules --cuda-graph-warmup-steps
""".split()

# The dense command line of the upstream anchor runs (research/anchor_upstream.md).
ANCHOR = """
--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
--seq-length 2048 --max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2
--train-iters 30 --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234
--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --transformer-impl local --bf16
--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-persist-layer-norm
--attention-dropout 0.0 --hidden-dropout 0.0
--log-interval 1 --log-memory-interval 10 --eval-iters 0 --eval-interval 1000
--cuda-graph-impl local --cuda-graph-warmup-steps 3 --cuda-graph-modules attn mlp
""".split()

BASE = ["--mock-data", "--vocab-size", "64"]


def _option_strings():
    return {s for action in build_parser()._actions for s in action.option_strings}


def _action(flag):
    for action in build_parser()._actions:
        if flag in action.option_strings:
            return action
    raise KeyError(flag)


def test_every_field_without_no_flag_has_a_flag():
    options = _option_strings()
    hints_of = typing.get_type_hints(RunConfig)
    dests = {a.dest for a in build_parser()._actions}
    count = 0
    for group in dataclasses.fields(RunConfig):
        if not dataclasses.is_dataclass(hints_of[group.name]):
            continue  # ignored_flags: filled by the parser, no flag
        for field in dataclasses.fields(hints_of[group.name]):
            if field.metadata.get("no_flag"):
                continue
            dest = f"{group.name}.{field.name}"
            assert dest in dests, f"no flag for {dest}"
            count += 1
    assert count > 60
    assert "--vocab-size" in options and "--params-dtype" not in options and "--world-size" not in options


def test_megatron_spellings_exist():
    missing = [f for f in MEGATRON_SPELLINGS if f not in _option_strings()]
    assert not missing


def test_help_comes_from_attribute_docstrings():
    assert field_docstrings(arguments._groups()[0][1])["num_layers"] == "Number of transformer layers."
    assert _action("--num-layers").help == "Number of transformer layers. (default: 2)"
    # Multi-line docstrings are joined into one paragraph.
    impl_help = _action("--cuda-graph-impl").help
    assert "local (this trainer's memory-lean partial graphs); transformer_engine" in impl_help
    assert _action("--seq-length").help.endswith("(default: 128)")
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_types_defaults_and_choices():
    cfg = parse_args(BASE + ["--num-layers", "3", "--lr", "3e-4", "--ffn-hidden-size", "96", "--split", "1,0,0"])
    assert cfg.model.num_layers == 3 and isinstance(cfg.model.num_layers, int)
    assert cfg.optimizer.lr == 3e-4 and isinstance(cfg.optimizer.lr, float)
    assert cfg.model.ffn_hidden_size == 96 and isinstance(cfg.model.ffn_hidden_size, int)  # Optional[int]
    assert cfg.data.split == "1,0,0"
    assert cfg.data.vocab_size == 64
    assert cfg.model.vocab_size is None  # set by the trainer from the tokenizer, not here
    assert cfg.precision.loss_scale is None
    assert parse_args(BASE + ["--loss-scale", "128"]).precision.loss_scale == 128.0
    assert cfg.model.position_embedding_type == "learned_absolute"
    assert parse_args(BASE + ["--position-embedding-type", "rope"]).model.position_embedding_type == "rope"
    defaults = parse_args([])
    assert defaults == RunConfig()  # every default comes from the dataclasses


def test_bool_flags():
    cfg = parse_args(BASE)
    assert cfg.model.add_bias_linear is True and cfg.model.gated_linear_unit is False
    cfg = parse_args(BASE + ["--disable-bias-linear", "--swiglu", "--bf16", "--group-query-attention"])
    assert cfg.model.add_bias_linear is False
    assert cfg.model.gated_linear_unit is True
    assert cfg.precision.bf16 is True and cfg.model.group_query_attention is True
    assert _action("--disable-bias-linear").option_strings == ["--disable-bias-linear"]
    assert "--add-bias-linear" not in _option_strings()
    # Default-True field without an explicit flag: --no-<name> turns it off,
    # the positive Megatron spelling is accepted and leaves it on.
    assert parse_args(BASE + ["--no-attention-softmax-in-fp32"]).precision.attention_softmax_in_fp32 is False
    assert parse_args(BASE + ["--attention-softmax-in-fp32"]).precision.attention_softmax_in_fp32 is True
    assert parse_args(BASE + ["--no-check-for-nan-in-loss-and-grad"]).ddp.check_for_nan_in_loss_and_grad is False
    assert "Turn off" in _action("--disable-bias-linear").help


def test_cuda_graph_scope_lists():
    assert parse_args(BASE + ["--cuda-graph-scope", "attn", "mlp"]).cuda_graph.cuda_graph_scope == ["attn", "mlp"]
    assert parse_args(BASE + ["--cuda-graph-modules", "attn"]).cuda_graph.cuda_graph_scope == ["attn"]
    assert parse_args(BASE + ["--cuda-graph-scope"]).cuda_graph.cuda_graph_scope == []
    assert parse_args(BASE).cuda_graph.cuda_graph_scope == []
    assert parse_args(["--data-path", "0.3", "a", "0.7", "b"]).data.data_path == ["0.3", "a", "0.7", "b"]


def test_lists_are_not_shared_between_parses():
    a = parse_args(BASE + ["--cuda-graph-scope", "attn"])
    a.cuda_graph.cuda_graph_scope.append("mlp")
    assert parse_args(BASE).cuda_graph.cuda_graph_scope == []


def test_anchor_command_line_parses_and_validates():
    cfg = parse_args(ANCHOR).resolve()
    cfg.validate()
    assert cfg.model.hidden_size == 1024 and cfg.optimizer.min_lr == 1e-5
    assert cfg.cuda_graph.cuda_graph_impl == "local" and cfg.cuda_graph.cuda_graph_scope == ["attn", "mlp"]
    assert cfg.logging.log_memory_interval == 10 and cfg.training.eval_iters == 0


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["--hidden-size", "100", "--num-attention-heads", "3"],
            "--hidden-size (100) must be divisible by --num-attention-heads",
        ),
        (["--micro-batch-size", "2", "--global-batch-size", "7"], "--global-batch-size (7) must be divisible"),
        (["--bf16", "--fp16"], "--bf16 and --fp16"),
        (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible by --tensor-model-parallel-size (2)"),
        (
            ["--context-parallel-size", "2"],
            "--context-parallel-size 2 is not supported: this trainer does not do context parallelism",
        ),
        (["--overlap-param-gather"], "--overlap-param-gather needs --use-distributed-optimizer"),
    ],
)
def test_validate_errors(argv, needle):
    with pytest.raises(ValueError) as info:
        parse_args(BASE + argv).resolve().validate()
    assert needle in str(info.value)


def test_unknown_flag_exits_with_name_and_suggestion(capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(BASE + ["--num-layer", "4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --num-layer" in err
    assert "did you mean --num-layers?" in err


def test_no_abbreviations(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--hidden", "64"])
    assert "--hidden" in capsys.readouterr().err


def test_bad_value_exits(capsys):
    with pytest.raises(SystemExit):
        parse_args(BASE + ["--num-layers", "two"])
    assert "--num-layers" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--moe-enable-routing-replay"], "--moe-enable-routing-replay"),
        (["--fp8-format", "hybrid"], "--fp8-format"),
        (["--multi-latent-attention"], "--multi-latent-attention"),
        (["--spec", "moe_spec", "moe_block_spec"], "--spec"),
        (["--split-sentences"], "--split-sentences"),
        (["--export-model-type", "HybridModel"], "--export-model-type"),
    ],
)
def test_known_unsupported_flags_raise(argv, flag):
    with pytest.raises(ValueError) as info:
        parse_args(BASE + argv)
    assert flag in str(info.value)


def test_all_rejections_are_reported_together():
    with pytest.raises(ValueError) as info:
        parse_args(BASE + ["--moe-enable-routing-replay", "--fp8-format", "hybrid"])
    assert "--moe-enable-routing-replay" in str(info.value) and "--fp8-format" in str(info.value)


def test_known_accepted_flags_are_no_ops():
    accepted = [
        "--use-flash-attn", "--use-mcore-models", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-persist-layer-norm", "--cross-entropy-loss-fusion",
    ]  # fmt: skip
    with_flags = parse_args(BASE + accepted)
    assert with_flags.ignored_flags == ["--use-flash-attn", "--use-mcore-models", "--no-masked-softmax-fusion",
                                        "--no-bias-gelu-fusion", "--no-persist-layer-norm"]  # fmt: skip
    with_flags.ignored_flags = []
    assert with_flags == parse_args(BASE)


def test_speed_only_pipeline_and_optimizer_knobs_are_accepted_no_ops():
    knobs = [
        "--test-mode", "--overlap-param-gather-with-optimizer-step", "--overlap-p2p-communication-warmup-flush",
        "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit", "2", "--no-use-layer-wise-param-layout",
    ]  # fmt: skip
    cfg = parse_args(BASE + knobs)
    assert cfg.ignored_flags == [k for k in knobs if k.startswith("--")]
    cfg.ignored_flags = []
    assert cfg == parse_args(BASE)


def test_example_script_knobs_are_no_ops_and_removed_flags_say_so():
    # Knobs of upstream's example scripts and docs whose Megatron meaning changes no value here.
    knobs = ["--tiktoken-pattern", "v2", "--use-nccl-ub", "--enable-experimental", "--data-parallel-sharding-strategy",
             "no_shard", "--dataloader-fast-cache-load", "--per-dataset-sequences-path", "s.json", "--enable-gpt-oss",
             "--rope-type", "rope"]  # fmt: skip
    cfg = parse_args(BASE + knobs)
    assert sorted(cfg.ignored_flags) == sorted(k for k in knobs if k.startswith("--"))  # in table order
    cfg.ignored_flags = []
    assert cfg == parse_args(BASE)
    with pytest.raises(ValueError, match="--rope-type yarn is not supported: Megatron's standard attention"):
        parse_args(BASE + ["--rope-type", "yarn"])
    with pytest.raises(ValueError, match="--checkpoint-activations is no longer valid .* --recompute-activations"):
        parse_args(BASE + ["--checkpoint-activations"])


def test_precision_aware_optimizer_dtypes_are_accepted_as_fp32_only():
    dtypes = ["--main-grads-dtype", "--main-params-dtype", "--exp-avg-dtype", "--exp-avg-sq-dtype"]
    cfg = parse_args(BASE + [a for flag in dtypes for a in (flag, "fp32")])
    assert sorted(cfg.ignored_flags) == sorted(dtypes)
    cfg.ignored_flags = []
    assert cfg == parse_args(BASE)
    with pytest.raises(ValueError, match="--main-grads-dtype bf16 needs --use-precision-aware-optimizer"):
        parse_args(BASE + ["--main-grads-dtype", "bf16"])
    with pytest.raises(
        ValueError, match=r"--use-precision-aware-optimizer \(Adam with low-precision .* not supported yet"
    ):
        parse_args(BASE + ["--use-precision-aware-optimizer"])


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--bf16"], None),
        (["--fp16", "--accumulate-allreduce-grads-in-fp32"], None),
        ([], None),
        (["--bf16", "--grad-reduce-in-bf16"], "with bf16 gradient buffers .* drop --grad-reduce-in-bf16"),
        (["--fp16"], "with fp16 gradient buffers .* add --accumulate-allreduce-grads-in-fp32"),
    ],
)
def test_fp32_accumulating_reduce_scatter_needs_nothing_with_fp32_gradients(argv, needle):
    """Megatron turns --ddp-reduce-scatter-with-fp32-accumulation off when gradients are
    fp32 (the reduction sums in fp32 anyway); with bf16 or fp16 buffers it would change
    the sums, which is not supported yet."""
    cfg = parse_args(BASE + argv + ["--ddp-reduce-scatter-with-fp32-accumulation"]).resolve()
    if needle is None:
        cfg.validate()
        assert cfg.ignored_flags == ["--ddp-reduce-scatter-with-fp32-accumulation"]
    else:
        with pytest.raises(ValueError, match=needle):
            cfg.validate()


def test_fusion_flags_turn_fusions_off():
    cfg = parse_args(BASE)
    assert cfg.model.gradient_accumulation_fusion and cfg.model.cross_entropy_loss_fusion
    cfg = parse_args(BASE + ["--no-gradient-accumulation-fusion", "--no-cross-entropy-loss-fusion"])
    assert not cfg.model.gradient_accumulation_fusion and not cfg.model.cross_entropy_loss_fusion


def test_known_table_covers_brief_and_has_no_clash():
    for flag in ("--fp8-format", "--multi-latent-attention", "--mtp-num-layers",
                 "--tp-comm-overlap", "--use-megatron-fsdp", "--spec", "--split-sentences"):  # fmt: skip
        assert KNOWN_MEGATRON_FLAGS[flag].message, flag
    for flag in ("--use-flash-attn", "--use-mcore-models", "--no-bias-gelu-fusion"):
        assert KNOWN_MEGATRON_FLAGS[flag].message is None
    generated = {s for ff in arguments.field_flags() for s in ff.flags}
    assert not generated & set(KNOWN_MEGATRON_FLAGS)


def test_flags_markdown():
    text = flags_markdown()
    assert text.startswith("## Command-line flags")
    assert "### cuda graphs" in text and "### model" in text
    assert "| `--num-layers N`, `--encoder-num-layers N` | 2 | Number of transformer layers" in text
    assert "`--cuda-graph-scope STR ...`, `--cuda-graph-modules STR ...`" in text
    assert "| `--fp8-format` | rejected |" in text
    assert "### mixture of experts" in text and "`--num-experts N`" in text
    assert "| `--use-flash-attn` | accepted |" in text
    for flag in MEGATRON_SPELLINGS:
        assert f"`{flag}" in text, flag


def test_list_flags_tool_prints_markdown():
    out = subprocess.run(
        [sys.executable, os.path.join(REPO, "tools", "list_flags.py")],
        capture_output=True,
        text=True,
        check=True,
        cwd="/",
    ).stdout
    assert out.strip() == flags_markdown().strip()


def test_readme_flag_list_is_current():
    import importlib.util
    import os

    root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
    spec = importlib.util.spec_from_file_location("list_flags", os.path.join(root, "tools", "list_flags.py"))
    list_flags = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(list_flags)
    with open(os.path.join(root, "README.md")) as f:
        text = f.read()
    assert list_flags.readme_section().strip() in text, (
        "README flag list is stale: run python3 tools/list_flags.py --update-readme"
    )
