"""Flag mistakes from the fault probes: each is a ValueError naming the flag, or a warning."""

import warnings

import numpy as np
import pytest

from megatron.training.arguments import parse_args

BASE = ["--mock-data", "--vocab-size", "64"]


def validate(*argv):
    cfg = parse_args(BASE + [str(a) for a in argv]).resolve()
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--eval-interval", "0"], "--eval-interval must be >= 1, got 0"),
        (["--eval-interval", "-1"], "--eval-interval must be >= 1, got -1"),
        (["--eval-iters", "-1"], "--eval-iters must be >= 0, got -1"),
        (["--exit-interval", "-1"], "--exit-interval must be >= 1, got -1"),
        (["--exit-interval", "0"], "--exit-interval must be >= 1, got 0"),
        (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be positive"),
        (["--split", "0,100,0"], "--split 0,100,0 gives the train split no data"),
        # A value with a leading '-' reaches the --split check (argparse alone says "expected one argument").
        (["--split", "-1,2,0"], "--split '-1,2,0' needs up to three non-negative weights"),
        (["--split", "-1"], "--split '-1' needs up to three non-negative weights"),
        (["--eval-iters", "5", "--split", "100,0,0"], "--eval-iters 5 needs validation data"),
        (["--global-batch-size", "0"], "--global-batch-size must be >= 1, got 0"),
        (["--ffn-hidden-size", "0"], "--ffn-hidden-size must be positive, got 0"),
        (["--kv-channels", "0"], "--kv-channels must be positive, got 0"),
        (["--adam-beta1", "2"], "--adam-beta1 must be in [0, 1), got 2.0"),
        (["--adam-beta2", "1"], "--adam-beta2 must be in [0, 1), got 1.0"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
        (["--adam-eps", "0"], "--adam-eps must be positive"),
    ],
)
def test_flag_mistakes_name_the_flag(argv, needle):
    with pytest.raises(ValueError) as info:
        validate(*argv)
    assert needle in str(info.value)


def test_valid_neighbours_still_pass():
    validate("--eval-iters", 0, "--split", "100,0,0", "--exit-interval", 1, "--eval-interval", 1)
    validate("--adam-beta1", 0, "--weight-decay", 0, "--exit-duration-in-mins", 0.5)


def test_ignored_flags_warn():
    with pytest.warns(UserWarning, match=r"--num-query-groups 2 is ignored without --group-query-attention"):
        cfg = validate("--num-attention-heads", 4, "--hidden-size", 64, "--num-query-groups", 2)
    assert cfg.model.num_query_groups == 4
    with pytest.warns(UserWarning, match=r"--cuda-graph-scope attn has no effect without --cuda-graph-impl local"):
        validate("--cuda-graph-scope", "attn")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        validate("--num-attention-heads", 4, "--hidden-size", 64, "--num-query-groups", 2, "--group-query-attention")


def test_token_ids_beyond_the_vocabulary_name_the_data(tmp_path):
    from megatron.core.datasets.gpt_dataset import GPTDataset
    from megatron.core.datasets.indexed_dataset import IndexedDataset, IndexedDatasetBuilder

    prefix = str(tmp_path / "corpus")
    with IndexedDatasetBuilder(prefix + ".bin", np.int32) as builder:
        builder.add_document(np.arange(40) * 10)  # ids up to 390
        builder.finalize(prefix + ".idx")
    low = IndexedDataset(prefix)
    kwargs = dict(seq_length=8, seed=0, eod=63, path_prefix=prefix, cache_dir=str(tmp_path / "c"))
    ds = GPTDataset(low, np.arange(1), 4, vocab_size=64, **kwargs)
    with pytest.raises(ValueError, match=rf"{prefix}: sample \d holds token id \d+, outside the tokenizer's 64 ids"):
        for i in range(len(ds)):
            ds[i]
    assert GPTDataset(low, np.arange(1), 4, vocab_size=400, **kwargs)[0]["tokens"].max() < 400


def test_distributed_optimizer_instances_need_the_distributed_optimizer():
    argv = BASE + ["--num-distributed-optimizer-instances", "2"]
    with pytest.raises(ValueError, match=r"--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer"):
        parse_args(argv).resolve(world_size=2).validate()
    parse_args(argv + ["--use-distributed-optimizer"]).resolve(world_size=2).validate()


@pytest.mark.parametrize("bf16", [True, False])
def test_disable_bf16_reduced_precision_matmul_sets_cublas_flag_with_bf16(bf16):
    # Megatron: with --bf16, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False
    # (process-wide; the test fixture restores it).
    import torch

    from megatron.training.determinism import set_determinism

    cfg = validate("--disable-bf16-reduced-precision-matmul", *(["--bf16"] if bf16 else []))
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = True
    set_determinism(cfg, use_cuda=False)
    assert torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction is not bf16
