"""Muon with expert tensor parallelism (``--expert-tensor-parallel-size 2``), every ``--muon-tp-mode`` (CPU, gloo).

Per expert, against float64: each rank holds its ETP shard of stacked ``[experts, out, in]``
weights, split by rows (fc1) or columns (fc2); ``duplicated`` and ``distributed`` must give
this rank's block of the whole matrix's scaled Newton-Schulz, ``blockwise`` its own shard's
(scaled by the shard's shape). Tolerance 1e-5 relative (float32 against float64, as in
``test_newton_schulz``).

Training: ETP = 2 (grouped and per-expert-module experts; with TP = 1, and with TP = 2 and
sequence parallelism), ETP = 2 x EP = 2, and ETP = 2 with the distributed optimizer over two
expert-data-parallel ranks follow one process's loss and gradient norm within 1e-5 relative
(fp32, float32 Newton-Schulz; the sums run in another order, so not bitwise). The gradient
norm also checks that the expert shards are summed over expert TP when TP = 1. ``blockwise``
is another update rule by design: it only has to train.
"""

import types

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed, train_curves
from tests.unit_tests.optimizer.test_newton_schulz import reference

RTOL = 1e-5
ITERS = 8
MODES = ("duplicated", "distributed", "blockwise")


def _config(mode):
    return types.SimpleNamespace(
        muon_tp_mode=mode,
        muon_num_ns_steps=5,
        muon_coefficient_type="quintic",
        muon_fp32_matmul_prec="high",
        muon_scale_mode="spectral",
        muon_extra_scale_factor=0.5,
    )


def _orthogonalize_shards(rank, world_size, wholes):
    """Every ``(mode, partition)``'s result for this rank's shard of ``wholes[partition]`` (one spawn)."""
    import torch.distributed as dist

    from megatron.core.optimizer.muon import MatrixInfo, orthogonalize

    out = {}
    for partition, whole in wholes.items():
        shard = whole.chunk(world_size, dim=partition + 1)[rank].contiguous()
        info = MatrixInfo(tuple(shard.shape), None, partition, dist.group.WORLD, world_size)
        for mode in MODES:
            out[mode, partition] = orthogonalize(shard, info, _config(mode))
    return out


def _wholes():
    torch.manual_seed(0)
    return {0: torch.randn(3, 24, 16), 1: torch.randn(3, 16, 24)}  # 3 experts; fc1 rows split, fc2 columns


@pytest.fixture(scope="module")
def orthogonalized():
    return run_distributed(_orthogonalize_shards, 2, _wholes(), timeout=300)


def _expected(whole, mode, partition, world_size):
    from megatron.core.optimizer.newton_schulz import coefficients, scale_factor

    schedule = list(coefficients("quintic", 5))
    if mode == "blockwise":
        blocks = []
        for shard in whole.chunk(world_size, dim=partition + 1):
            blocks.append(reference(shard, schedule) * scale_factor(*shard.shape[-2:], "spectral"))
        return blocks
    full = reference(whole, schedule) * scale_factor(*whole.shape[-2:], "spectral")
    return list(full.chunk(world_size, dim=partition + 1))


@pytest.mark.parametrize("partition", [0, 1], ids=["rows_fc1", "columns_fc2"])
@pytest.mark.parametrize("mode", MODES)
def test_each_expert_follows_float64(orthogonalized, mode, partition):
    wants = _expected(_wholes()[partition], mode, partition, 2)
    for rank, want in enumerate(wants):
        block = orthogonalized[rank][mode, partition]
        want = want * 0.5  # --muon-extra-scale-factor
        for e in range(3):  # each expert on its own: not one matrix over the stack
            err = ((block[e].double() - want[e]).norm() / want[e].norm()).item()
            assert err < RTOL, (rank, e, err)


FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --lr 1e-2 --min-lr 1e-3 --lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--num-workers 0 --log-interval 1 --optimizer muon --muon-fp32-matmul-prec high --muon-extra-scale-factor 0.2 "
    f"--muon-nesterov --train-iters {ITERS} --num-experts 2 --moe-ffn-hidden-size 16 --moe-router-topk 2 "
    "--disable-bias-linear --swiglu"
)
GROUPED = "--moe-grouped-gemm"
ETP2 = "--expert-tensor-parallel-size 2"


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def singles(cache):
    argvs = {
        "grouped": _argv(f"{GROUPED} --global-batch-size 4", cache),
        "modules": _argv("--global-batch-size 4", cache),
        "grouped_gbs8": _argv(f"{GROUPED} --global-batch-size 8", cache),
    }
    return run_distributed(train_curves, 1, argvs, timeout=400)[0]


def _assert_close(got, want, what):
    assert len(got) == len(want) == ITERS
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what}, iteration {i + 1}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), f"{what}, iteration {i + 1}: norm {norm} vs {ref_norm}"
    assert want[-1][0] < want[0][0] - 0.05, "the loss should clearly decrease"


TWO_RANK = {
    "duplicated": ("grouped", f"{GROUPED} {ETP2} --muon-tp-mode duplicated"),
    "distributed": ("grouped", f"{GROUPED} {ETP2} --muon-tp-mode distributed"),
    "modules_duplicated": ("modules", f"{ETP2} --muon-tp-mode duplicated"),
    "modules_distributed": ("modules", f"{ETP2} --muon-tp-mode distributed"),
    "tp2_sp": ("grouped", f"{GROUPED} --tensor-model-parallel-size 2 --sequence-parallel"),  # ETP = TP = 2
}


@pytest.fixture(scope="module")
def two_rank(cache):
    argvs = {name: _argv(f"{flags} --global-batch-size 4", cache) for name, (_ref, flags) in TWO_RANK.items()}
    argvs["blockwise"] = _argv(f"{GROUPED} {ETP2} --muon-tp-mode blockwise --global-batch-size 4", cache)
    return run_distributed(train_curves, 2, argvs, timeout=600)


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_etp2_matches_single_process(singles, two_rank, name):
    reference_run = singles[TWO_RANK[name][0]]
    for rank, runs in enumerate(two_rank):
        _assert_close(runs[name], reference_run, f"ETP=2 {name} (rank {rank})")


def test_etp2_blockwise_orthogonalizes_each_shard_on_its_own(singles, two_rank):
    curve = [loss for loss, _ in two_rank[0]["blockwise"]]
    assert curve[-1] < curve[0] - 0.05
    assert curve[1:] != [loss for loss, _ in singles["grouped"]][1:]  # another update rule than the whole matrix
    assert two_rank[0]["blockwise"] == two_rank[1]["blockwise"]


FOUR_RANK = {
    "etp2_ep2_duplicated": f"{ETP2} --expert-model-parallel-size 2 --muon-tp-mode duplicated",
    "etp2_ep2_distributed": f"{ETP2} --expert-model-parallel-size 2 --muon-tp-mode distributed",
    "etp2_distopt": f"{ETP2} --use-distributed-optimizer --muon-tp-mode distributed --ddp-bucket-size 3000",
}


def test_four_ranks_match_single_process(singles, cache):
    argvs = {name: _argv(f"{GROUPED} {flags} --global-batch-size 8", cache) for name, flags in FOUR_RANK.items()}
    for rank, runs in enumerate(run_distributed(train_curves, 4, argvs, timeout=600)):
        for name in FOUR_RANK:
            _assert_close(runs[name], singles["grouped_gbs8"], f"{name} (rank {rank})")
