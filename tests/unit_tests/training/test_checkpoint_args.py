"""--use-checkpoint-args: a run takes the saving run's model flags, as Megatron's load_args_from_checkpoint."""

import json

import pytest
import torch

from megatron.training import checkpoint_args
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer, pretrain

BASE = (
    "--micro-batch-size 2 --global-batch-size 4 --lr 1e-3 --lr-decay-iters 4 --mock-data --tokenizer-type "
    "NullTokenizer --vocab-size 64 --num-workers 0 --log-interval 1"
).split()
MODEL = (
    "--num-layers 2 --hidden-size 48 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 16 --max-position-embeddings 16 --position-embedding-type rope --swiglu --normalization RMSNorm "
    "--disable-bias-linear --untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0"
).split()


def _losses(path) -> dict[int, float]:
    return {r["iteration"]: r["lm loss"] for r in map(json.loads, path.read_text().splitlines()) if "lm loss" in r}


@pytest.fixture(params=["torch", "torch_dist"])
def saved(request, tmp_path):
    """A run of MODEL saved at iteration 2 (of 4), and the losses of the whole run."""
    fmt = ["--ckpt-format", request.param]
    whole = tmp_path / "whole.jsonl"
    pretrain(BASE + MODEL + fmt + ["--train-iters", "4", "--metrics-file", str(whole)])
    save = tmp_path / "ckpt"
    pretrain(BASE + MODEL + fmt + ["--train-iters", "2", "--save", str(save)])
    return save, fmt, _losses(whole), tmp_path


def test_a_run_without_model_flags_resumes_the_checkpoint_bitwise(saved, capsys):
    save, fmt, whole, tmp_path = saved
    metrics = tmp_path / "resumed.jsonl"
    capsys.readouterr()
    trainer = pretrain(
        BASE + fmt + f"--train-iters 4 --load {save} --use-checkpoint-args --metrics-file {metrics}".split()
    )
    out = capsys.readouterr().out
    assert "Setting hidden_size to 48 from checkpoint" in out and "Setting gated_linear_unit to True" in out
    m = trainer.cfg.model
    assert (m.num_layers, m.hidden_size, m.num_query_groups, m.normalization) == (2, 48, 2, "RMSNorm")
    assert m.gated_linear_unit and not m.add_bias_linear and m.untie_embeddings_and_output_weights
    assert _losses(metrics) == {3: whole[3], 4: whole[4]}


def test_sizes_given_on_the_command_line_win_the_form_never_does(saved):
    save, fmt, _, _ = saved
    # --seq-length is a size (kept); --hidden-dropout is part of the form (the checkpoint's 0 wins);
    # --normalization too (the checkpoint's RMSNorm wins over the command line's LayerNorm).
    flags = f"--load {save} --use-checkpoint-args --seq-length 8 --hidden-dropout 0.3 --normalization LayerNorm"
    cfg = parse_args(BASE + fmt + flags.split()).resolve()
    assert cfg.model.seq_length == 8 and cfg.model.hidden_size == 48
    assert cfg.model.hidden_dropout == 0 and cfg.model.normalization == "RMSNorm"


def _fake_checkpoint(folder, config: dict):
    """A torch_dist-style folder holding only the common file with a run config (nothing else is read)."""
    (folder / "iter_0000003").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("3")
    torch.save({"checkpoint_version": 1, "iteration": 3, "config": config}, folder / "iter_0000003" / "common.pt")


def test_parallel_sizes_and_tokenizer_follow_their_switches(tmp_path):
    _fake_checkpoint(
        tmp_path,
        {
            "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2},
            "data": {"tokenizer_type": "GPT2BPETokenizer", "tokenizer_model": None},
            "model": {"hidden_size": 96},
        },
    )
    given = parse_args(BASE + MODEL + ["--load", str(tmp_path), "--use-checkpoint-args"])
    checkpoint_args.apply(given)
    assert given.parallel.tensor_model_parallel_size == 1  # only with --use-mp-args-from-checkpoint-args
    assert given.data.tokenizer_type == "GPT2BPETokenizer" and given.model.hidden_size == 48  # given: kept
    for off in ("--no-use-tokenizer-model-from-checkpoint-args", "--disable-use-tokenizer-model-from-checkpoint-args"):
        given = parse_args(BASE + ["--load", str(tmp_path), "--use-checkpoint-args", off])
        lines = checkpoint_args.apply(given)
        assert given.data.tokenizer_type == "NullTokenizer" and given.model.hidden_size == 96
        assert lines == ["Setting hidden_size to 96 from checkpoint"]
    given = parse_args(BASE + ["--load", str(tmp_path), "--use-checkpoint-args", "--use-mp-args-from-checkpoint-args"])
    checkpoint_args.apply(given)
    assert (given.parallel.tensor_model_parallel_size, given.parallel.pipeline_model_parallel_size) == (2, 2)


def test_ckpt_step_picks_the_checkpoint_whose_flags_are_read(tmp_path):
    _fake_checkpoint(tmp_path, {"model": {"hidden_size": 96}})
    (tmp_path / "iter_0000001").mkdir()
    torch.save(
        {"checkpoint_version": 1, "config": {"model": {"hidden_size": 80}}}, tmp_path / "iter_0000001" / "common.pt"
    )
    given = parse_args(BASE + ["--load", str(tmp_path), "--use-checkpoint-args", "--ckpt-step", "1"])
    checkpoint_args.apply(given)
    assert given.model.hidden_size == 80


def test_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="--use-checkpoint-args needs --load or --pretrained-checkpoint"):
        build_trainer(BASE + ["--use-checkpoint-args"])
    first_launch = parse_args(BASE + ["--load", str(tmp_path / "none"), "--use-checkpoint-args"])
    assert checkpoint_args.apply(first_launch) == [
        "Checkpoint not found to provide arguments, using provided arguments."
    ]
    _fake_checkpoint(tmp_path, None)
    with pytest.raises(ValueError, match="holds no run config; give the model flags instead"):
        parse_args(BASE + ["--load", str(tmp_path), "--use-checkpoint-args"]).resolve()
