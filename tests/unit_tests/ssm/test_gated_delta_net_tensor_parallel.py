"""A GPT with gated delta net layers at TP = 2 trains like one process.

Layer 1 is a gated delta net (``--linear-attention-freq 2``: every second layer is softmax
attention), layer 2 softmax attention with ``--attention-output-gate`` and grouped-query
attention. 20 fp32 iterations through the trainer on gloo, at TP = 2, TP = 2 with sequence
parallelism, and TP = 2 with sequence parallelism and MoE MLPs (the census configs'
combination); loss and gradient-norm curves within 1e-5 relative of one process's (the
sums run in another order: partial out-projections all-reduced over TP, the shared
``out_norm`` gradient summed over TP).
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_parallel_layouts import _argv, _assert_close, _rank_runs

GDN = (
    "--experimental-attention-variant gdn --linear-attention-freq 2 --linear-key-head-dim 8 "
    "--linear-value-head-dim 8 --linear-num-key-heads 2 --linear-num-value-heads 4 --attention-output-gate "
    "--group-query-attention --num-query-groups 2 --swiglu --normalization RMSNorm --disable-bias-linear"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01"
TP2 = "--tensor-model-parallel-size 2"
LAYOUTS = {"tp2": TP2, "tp2_sp": TP2 + " --sequence-parallel", "tp2_sp_moe": TP2 + " --sequence-parallel " + MOE}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("gdn_tp_cache"))
    single = {"dense": _argv(GDN, cache), "moe": _argv(f"{GDN} {MOE}", cache)}
    tp2 = {name: _argv(f"{GDN} {flags}", cache) for name, flags in LAYOUTS.items()}
    return run_distributed(_rank_runs, 1, single, timeout=300)[0], run_distributed(_rank_runs, 2, tp2, timeout=400)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gdn_gpt_at_tp2_matches_single_process(runs, layout):
    single, tp2 = runs
    want = single["moe" if layout.endswith("moe") else "dense"]["curves"]
    for rank, r in enumerate(tp2):
        _assert_close(r[layout]["curves"], want, f"GDN GPT {layout} (rank {rank})")
