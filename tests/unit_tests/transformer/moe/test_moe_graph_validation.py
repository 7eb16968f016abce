"""The issue's MoE graph-scope mistakes, from the command line: each build refuses with a
``ValueError`` naming the flag and the fix (scopes resolve before CUDA is needed, so
this runs on the CPU)."""

import warnings

import pytest

from megatron.training.training import build_trainer

BASE = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --max-position-embeddings 8 "
    "--micro-batch-size 1 --global-batch-size 1 --train-iters 1 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 32 --num-workers 0 --use-cpu --cuda-graph-impl local"
)
MOE = "--num-experts 4 --moe-router-topk 2"
PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"


def _build(flags: str):
    from megatron.core import parallel_state

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "CUDA is not available": graphs off, scopes still checked
        trainer = build_trainer(f"{BASE} {flags}".split())
    trainer.close()
    parallel_state.destroy(trainer.pg)
    return trainer


@pytest.mark.parametrize(
    "flags, message",
    [
        (f"{MOE} {PAD} --cuda-graph-scope moe_router moe", "--cuda-graph-scope moe_router cannot be combined with moe"),
        (f"{MOE} --cuda-graph-scope moe_preprocess", "--cuda-graph-scope moe_preprocess needs moe_router"),
        ("--cuda-graph-scope moe_router", "--cuda-graph-scope moe_router: this model has no 'moe_router' region"),
        ("--cuda-graph-scope moe", "--cuda-graph-scope moe: this model has no 'moe' region"),
        (
            f"{MOE} --cuda-graph-scope moe",
            "--cuda-graph-scope moe: not available with this model: it needs drop-and-pad",
        ),
        (f"{MOE} --cuda-graph-scope mlp", "--cuda-graph-scope mlp: this model has no 'mlp' region"),
        (f"{MOE} --cuda-graph-scope attn moe_postprocess", "unknown scope 'moe_postprocess'"),
    ],
)
def test_moe_scope_mistakes_are_refused_at_build(flags, message):
    with pytest.raises(ValueError, match=message):
        _build(flags)


def test_experts_not_divisible_by_expert_parallel_size_is_refused():
    with pytest.raises(
        ValueError, match=r"--num-experts \(4\) must be divisible by --expert-model-parallel-size \(3\)"
    ):
        from megatron.training.arguments import parse_args

        cfg = parse_args(f"{BASE} {MOE} --expert-model-parallel-size 3".split()).resolve(world_size=3)
        cfg.validate()


def test_the_same_scopes_are_accepted_where_they_apply():
    _build(f"{MOE} --cuda-graph-scope moe_router moe_preprocess attn")
    _build(f"{MOE} {PAD} --cuda-graph-scope moe")
    _build(f"{MOE} --moe-layer-freq ([0]+[1]) --cuda-graph-scope mlp")  # the dense layer's MLP
