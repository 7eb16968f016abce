"""Muon across layouts: TP = 2 (duplicated and distributed Newton-Schulz), DP = 2 with the distributed
optimizer (``--use-distributed-optimizer`` and the ``dist_muon`` spelling) and EP = 2 follow one process.

Each run trains the same small GPT (fp32, dropout 0, 10 iterations, ``--muon-fp32-matmul-prec
high``: float32 Newton-Schulz, as bfloat16 would round the layouts' 1e-7 differences up) on
gloo CPU processes. Loss and gradient norm must match the single-process run within 1e-5
relative: the sums run in another order (TP partial products, DP reductions), so not bitwise.
``blockwise`` orthogonalizes each TP shard on its own, a different update by design: it only
has to train. The 2-rank runs share one set of processes; TP = 2 x DP = 2 runs on 4.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed, train_curves

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 10 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 "
    "--optimizer muon --muon-fp32-matmul-prec high --muon-extra-scale-factor 0.2 --muon-nesterov"
)
MOE = "--num-experts 2 --moe-ffn-hidden-size 16 --moe-grouped-gemm --moe-router-topk 2"
ITERS = 10
RTOL = 1e-5
LAYOUTS = {
    "tp2_duplicated": ("", "--tensor-model-parallel-size 2"),
    "tp2_distributed": ("", "--tensor-model-parallel-size 2 --muon-tp-mode distributed"),
    "dp2_distopt": ("", "--use-distributed-optimizer --ddp-bucket-size 3000"),
    "dp2_dist_muon": ("", "--optimizer dist_muon"),
    "ep2_distopt": (MOE, f"{MOE} --expert-model-parallel-size 2 --use-distributed-optimizer"),
}


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def singles(cache):
    argvs = {"dense": _argv("", cache), "moe": _argv(MOE, cache), "blockwise": _argv("", cache)}
    return run_distributed(train_curves, 1, argvs, timeout=300)[0]


@pytest.fixture(scope="module")
def two_rank(cache):
    argvs = {name: _argv(flags, cache) for name, (_ref, flags) in LAYOUTS.items()}
    argvs["tp2_blockwise"] = _argv("--tensor-model-parallel-size 2 --muon-tp-mode blockwise", cache)
    return run_distributed(train_curves, 2, argvs, timeout=600)


def _assert_close(got, want, what):
    assert len(got) == len(want) == ITERS
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what}, iteration {i + 1}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), f"{what}, iteration {i + 1}: norm {norm} vs {ref_norm}"
    assert want[-1][0] < want[0][0] - 0.05, "the loss should clearly decrease"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_matches_single_process(singles, two_rank, name):
    reference = singles["moe" if LAYOUTS[name][0] else "dense"]
    for rank, runs in enumerate(two_rank):
        _assert_close(runs[name], reference, f"{name} (rank {rank})")


def test_blockwise_orthogonalizes_shards_on_their_own(singles, two_rank):
    curve = [loss for loss, _ in two_rank[0]["tp2_blockwise"]]
    assert curve[-1] < curve[0] - 0.05
    assert curve[1:] != [loss for loss, _ in singles["blockwise"]][1:]  # another update rule than the whole matrix


def test_tp2_dp2_distributed_optimizer_matches_single_process(singles, cache):
    argv = _argv("--tensor-model-parallel-size 2 --use-distributed-optimizer --muon-tp-mode distributed", cache)
    for rank, runs in enumerate(run_distributed(train_curves, 4, {"tp2_dp2": argv}, timeout=600)):
        _assert_close(runs["tp2_dp2"], singles["dense"], f"TP=2 x DP=2 (rank {rank})")


@pytest.mark.gpu
def test_cuda_newton_schulz_follows_the_cpu_one_gpu():
    import torch

    from megatron.core.optimizer.newton_schulz import newton_schulz

    torch.manual_seed(0)
    x = torch.randn(3, 96, 64)
    want = newton_schulz(x, 5, "quintic")
    got = newton_schulz(x.cuda(), 5, "quintic").cpu()  # float32 (TF32 off by default for matmuls)
    assert ((got - want).norm() / want.norm()).item() < 1e-4
    low = newton_schulz(x.cuda(), 5, "quintic", bf16=True).cpu()  # --muon-fp32-matmul-prec medium
    assert ((low - want).norm() / want.norm()).item() < 2e-2
