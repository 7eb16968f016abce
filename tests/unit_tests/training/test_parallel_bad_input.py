"""The issue's list of bad parallel layouts, through the command line: each is a ``ValueError``
naming the flags involved (sizes that do not divide, virtual stages without a pipeline, a
padded vocabulary that another TP size changes)."""

import pytest

from megatron.training.arguments import parse_args

BASE = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 255"
)
PP2 = "--pipeline-model-parallel-size 2"


def _resolve(extra: str, world: int):
    return parse_args((BASE + " " + extra).split()).resolve(world_size=world).validate()


@pytest.mark.parametrize(
    "extra, world, needles",
    [
        (f"{PP2} --num-layers 3", 2, ["--num-layers (3)", "--pipeline-model-parallel-size (2)"]),
        (
            f"{PP2} --num-layers 6 --num-virtual-stages-per-pipeline-rank 2",
            2,
            ["--num-layers (6)", "--pipeline-model-parallel-size (2)", "--num-virtual-stages-per-pipeline-rank"],
        ),
        (
            f"{PP2} --num-layers 6 --num-layers-per-virtual-pipeline-stage 2",
            2,
            ["--num-layers (6)", "--num-layers-per-virtual-pipeline-stage (2)", "--pipeline-model-parallel-size (2)"],
        ),
        (
            "--tensor-model-parallel-size 4 --num-attention-heads 6 --hidden-size 96",
            4,
            ["--num-attention-heads (6)", "--tensor-model-parallel-size (4)"],
        ),
        (
            "--tensor-model-parallel-size 4 --num-attention-heads 8 --group-query-attention --num-query-groups 2",
            4,
            ["--num-query-groups (2)", "--tensor-model-parallel-size (4)"],
        ),
        (
            f"--tensor-model-parallel-size 2 {PP2}",
            6,
            [
                "world size 6",
                "--tensor-model-parallel-size (2)",
                "--pipeline-model-parallel-size (2)",
                "--context-parallel-size (1)",
            ],
        ),
        (
            "--num-experts 6 --expert-model-parallel-size 4",
            4,
            ["--num-experts (6)", "--expert-model-parallel-size (4)"],
        ),
        ("--virtual-pipeline-model-parallel-size 2", 1, ["--pipeline-model-parallel-size", "--virtual-pipeline"]),
        ("--num-virtual-stages-per-pipeline-rank 2", 1, ["--pipeline-model-parallel-size", "--num-virtual-stages"]),
        (
            "--num-layers-per-virtual-pipeline-stage 1",
            1,
            ["--pipeline-model-parallel-size", "--num-layers-per-virtual-pipeline-stage"],
        ),
    ],
    ids=[
        "layers_by_pp",
        "layers_by_pp_x_vpp",
        "layers_by_layers_per_virtual_stage",
        "heads_by_tp",
        "query_groups_by_tp",
        "world_by_tp_pp_cp",
        "experts_by_ep",
        "vpp_with_pp1",
        "virtual_stages_with_pp1",
        "layers_per_virtual_stage_with_pp1",
    ],
)
def test_bad_parallel_layout_is_a_value_error_naming_the_flags(extra, world, needles):
    with pytest.raises(ValueError) as info:
        _resolve(extra, world)
    for needle in needles:
        assert needle in str(info.value), f"{needle!r} not in: {info.value}"


def test_a_padded_vocabulary_changed_by_another_tp_size_is_refused_naming_the_flags(tmp_path):
    """A torch_dist checkpoint loads at another TP size only if the padded vocabulary is the same:
    300 tokens pad to 384 (x 128) at TP=1 and to 512 (x 256) at TP=2; the same folder read
    with --make-vocab-size-divisible-by 256 in one process takes the same path."""
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    flags = (BASE.replace("--vocab-size 255", "--vocab-size 300") + " --global-batch-size 2 --train-iters 2").split()
    saver = build_trainer([*flags, "--save", str(tmp_path)])
    saver.save_checkpoint()
    saver.close()
    parallel_state.destroy(saver.pg)
    with pytest.raises(ValueError) as info:
        build_trainer([*flags, "--load", str(tmp_path), "--make-vocab-size-divisible-by", "256"])
    message = str(info.value)
    assert "vocab_size=384, this run has 512" in message
    assert "--make-vocab-size-divisible-by x --tensor-model-parallel-size" in message
    with pytest.raises(ValueError, match="--make-vocab-size-divisible-by must be >= 1"):
        build_trainer([*flags, "--make-vocab-size-divisible-by", "0"])
