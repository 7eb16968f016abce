"""GPT-OSS's model flags (quick-GEGLU with offset and clamp, learnable softmax sinks, sliding windows on
every other layer) train the same under TP + SP (and expert parallelism) as in one process.

Each layout trains through ``pretrain(argv)`` on gloo CPU processes in fp32 with dropout 0; loss
and gradient-norm curves must match one process's within 1e-5 relative (the sums run in another
order: partial products all-reduced over TP, gradients reduced over DP). The sink logits are split
by head over TP like the attention heads, and drawn layout-independently, so every layout trains
the same model from the same weights.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --group-query-attention --num-query-groups 2 "
    "--seq-length 16 --max-position-embeddings 16 --position-embedding-type rope --micro-batch-size 2 "
    "--global-batch-size 4 --train-iters 12 --lr 3e-3 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 "
    "--disable-bias-linear --quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 "
    "--softmax-type learnable --window-size 5,0 --window-attn-skip-freq 2"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 1e-3 "
MOE += "--moe-token-dispatcher-type alltoall"
ITERS = 12
RTOL = 1e-5
RUNS = {
    "dense": ("", "--tensor-model-parallel-size 2 --sequence-parallel"),
    "moe_tp2": (MOE, "--tensor-model-parallel-size 2 --sequence-parallel"),
    "moe_ep2": (MOE, "--expert-model-parallel-size 2"),
}


def _train(argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)
    history = trainer.train()
    parallel_state.destroy(trainer.pg)
    return [(r["lm loss"], r["grad-norm"]) for r in history]


def _rank_runs(rank, world_size, argvs):
    return {name: _train(argv) for name, argv in argvs.items()}


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def curves(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("index_cache"))
    single = {"dense": _argv("", cache), "moe": _argv(MOE, cache)}
    two = {name: _argv(f"{model} {layout}", cache) for name, (model, layout) in RUNS.items()}
    return run_distributed(_rank_runs, 1, single)[0], run_distributed(_rank_runs, 2, two, timeout=400)


@pytest.mark.parametrize("name", list(RUNS))
def test_layout_matches_single_process(curves, name):
    single, two = curves
    want = single["moe" if name.startswith("moe") else "dense"]
    assert len(want) == ITERS and want[-1][0] < want[0][0] - 0.1, "the loss should clearly decrease"
    for rank, runs in enumerate(two):
        got = runs[name]
        assert len(got) == ITERS
        for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{name} rank {rank} it {i + 1}: {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), f"{name} rank {rank} it {i + 1}: {norm} vs {ref_norm}"
