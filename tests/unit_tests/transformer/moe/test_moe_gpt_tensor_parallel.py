"""An MoE GPT at TP = 2 with sequence parallelism (expert TP = 2 by default) trains like one
process: 20 fp32 iterations through ``pretrain`` on gloo, both dispatchers, loss and
gradient-norm curves within 1e-5 relative (the sums run in another order: partial expert
outputs reduce-scattered over TP, token counts summed over the sequence shards).

The layouts whose expert gradients must also be summed over an expert-data-parallel group
(TP = 2 with ETP = 1: every TP rank's replica of an expert sees only its own shard's
tokens; TP = 2 x EP = 2) are covered at the layer level in
``test_moe_expert_tensor_parallel.py``; through ``pretrain`` they need that reduction in
the data-parallel wrapper.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_parallel_layouts import _argv, _assert_close, _rank_runs

MOE = "--num-experts 4 --moe-router-topk 2 --swiglu --disable-bias-linear --moe-aux-loss-coeff 0.01"
TP2 = "--tensor-model-parallel-size 2 --sequence-parallel"
DISPATCHERS = ("alltoall", "allgather")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_tp_cache"))


@pytest.fixture(scope="module")
def runs(data_cache):
    single = {d: _argv(f"{MOE} --moe-token-dispatcher-type {d}", data_cache) for d in DISPATCHERS}
    tp2 = {d: _argv(f"{MOE} {TP2} --moe-token-dispatcher-type {d}", data_cache) for d in DISPATCHERS}
    return run_distributed(_rank_runs, 1, single, timeout=300)[0], run_distributed(_rank_runs, 2, tp2, timeout=400)


@pytest.mark.parametrize("dispatcher", DISPATCHERS)
def test_moe_gpt_tp2_etp2_matches_single_process(runs, dispatcher):
    single, tp2 = runs
    for rank, r in enumerate(tp2):
        _assert_close(r[dispatcher]["curves"], single[dispatcher]["curves"], f"MoE TP=2 {dispatcher} (rank {rank})")
