"""TP, TP + SP, DP with the distributed optimizer and TP x DP follow the single-process run.

Each layout trains the same small GPT (fp32, dropout 0) through ``pretrain(argv)`` on
gloo CPU processes; its loss and gradient-norm curves must match one process's within
1e-5 relative. They cannot match bitwise: the sums run in another order (partial
products all-reduced over TP, the softmax denominator summed over vocabulary shards,
gradients reduced over DP instead of accumulated over micro-batches). The vocabulary
(255 ids + end of document = 256) pads to 256 at TP = 1 and TP = 2 alike, so every
layout trains the same model from the same full initial weights.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters {iters} --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1"
)
ITERS = 20
RTOL = 1e-5


def _curves(argv):
    from megatron.training.training import pretrain

    trainer = pretrain(argv)
    return [(r["lm loss"], r["grad-norm"]) for r in trainer.history]


def _rank_curves(rank, world_size, argv):
    import torch

    torch.set_num_threads(1)
    return _curves(argv)


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One index cache for every run here: the mock data's indices are built once."""
    return str(tmp_path_factory.mktemp("index_cache"))


def _argv(extra: str, cache: str, iters: int = ITERS) -> list[str]:
    return (FLAGS.format(iters=iters) + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def single_curves(data_cache):
    return run_distributed(_rank_curves, 1, _argv("", data_cache))[0]


def _assert_close(got, want, what):
    assert len(got) == len(want) == ITERS
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what}, iteration {i + 1}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), (
            f"{what}, iteration {i + 1}: grad norm {norm} vs {ref_norm}"
        )
    assert want[-1][0] < want[0][0] - 0.1, "the loss should clearly decrease"


@pytest.mark.parametrize(
    "world,flags",
    [
        (2, "--tensor-model-parallel-size 2"),
        (2, "--tensor-model-parallel-size 2 --sequence-parallel"),
        (2, "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 2000"),
        (4, "--tensor-model-parallel-size 2 --use-distributed-optimizer"),
    ],
    ids=["tp2", "tp2_sp", "dp2_distopt_overlap", "tp2_dp2_distopt"],
)
def test_layout_matches_single_process(single_curves, data_cache, world, flags):
    curves = run_distributed(_rank_curves, world, _argv(flags, data_cache), timeout=300)
    for rank, got in enumerate(curves):
        _assert_close(got, single_curves, f"{flags} rank {rank}")
