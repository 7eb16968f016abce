"""Selective recompute with partial CUDA graphs equals eager training, on a GPU (``pytest -m gpu``).

A module recomputed inside a graphed region is recomputed by the region's backward graph;
one outside the graphs recomputes eagerly between them. Either way the same kernels run
on the same inputs as in eager training, so (deterministic mode, dropout 0) every lm loss
and every ``main_grad`` are compared with ``torch.equal``: against eager with the same
recompute, and against eager without recompute (recompute changes no value).

That the recompute really runs inside the graphs is checked by memory: graphing whole
layers with ``core_attn mlp layernorm`` recomputed must reserve at least the MLP
activations of all but one layer less than graphing them without recompute.
"""

import functools

import pytest
import torch

from megatron.core.pipeline_parallel import schedules
from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments
from tests.unit_tests.models.hybrid import test_hybrid_graphs_gpu as hybrid
from tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu import (
    COMMON,
    DENSE8,
    NO_DROPOUT,
    SCOPES,
    SMALL,
    VPP_FLAGS,
    assert_same,
    check_chunk_session,
    chunk_schedule,
    graph_flags,
    peak_reserved,
    train,
)
from tests.unit_tests.transformer.moe import test_moe_graphs_gpu as moe

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

SELECTIVE = "--recompute-granularity selective --recompute-modules"
MiB = 2**20


def test_dense8_selective_recompute_graphed_equals_eager_every_scope():
    """The 8-layer dense config, bf16, 50 iterations: core_attn, mlp and layernorm recomputed."""
    use_expandable_segments()  # every run on the allocator settings graphed runs use
    flags = f"{DENSE8} {COMMON} {NO_DROPOUT} --bf16"
    recompute = f"{SELECTIVE} core_attn mlp layernorm"
    plain, _ = peak_reserved(flags, 50, None)
    eager, eager_peak = peak_reserved(f"{flags} {recompute}", 50, None)
    assert_same(plain, eager, "eager with recompute vs without")
    peaks = {"eager": eager_peak}
    for scope in SCOPES:
        graphed, peaks[scope] = peak_reserved(f"{flags} {recompute} {graph_flags(scope)}", 50, None)
        assert graphed[2].graphs.captured
        assert_same(eager, graphed, f"recompute, scope {scope!r}")
        del graphed
    no_recompute, peaks["layer without recompute"] = peak_reserved(f"{flags} {graph_flags('layer')}", 50, None)
    del no_recompute
    table = ", ".join(f"{k}: {v / MiB:.0f}" for k, v in peaks.items())
    print(f"peak reserved (MiB) with core_attn mlp layernorm recomputed: {table}")
    # The fc1 output and its activation (2 x 2 x 2048 x 4096 bf16 = 64 MiB per layer) are
    # recomputed in backward; all but the layer being recomputed must be missing from the peak.
    saved = peaks["layer without recompute"] - peaks["layer"]
    assert saved >= 7 * 64 * MiB, f"recompute inside the whole-layer graphs saved only {saved / MiB:.0f} MiB; {table}"


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_recompute_with_micro_batches_in_flight_and_interleaved_chunks_equals_sequential(scope):
    """The pipeline shapes on one GPU: a 1F1B order with 2 micro-batches in flight, and a
    pipeline rank's interleaved order of two chunks; recomputed modules inside and outside
    the graphs, bitwise equal to the sequential run with the same recompute."""
    recompute = f"{SELECTIVE} core_attn mlp layernorm"
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 8 {recompute}"  # 4 micro-batches
    sequential = train(flags, 6)
    in_flight = functools.partial(schedules.forward_backward_in_flight, num_warmup=1)
    graphed = train(f"{flags} {graph_flags(scope)}", 6, schedule=in_flight)
    assert graphed[2].graphs.captured and len(graphed[2].graphs.pools) == 2
    assert_same(sequential, graphed, f"2 in flight, recompute, scope {scope}")
    del graphed
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {VPP_FLAGS} {recompute}"
    sequential = train(flags, 6)
    graphed = train(f"{flags} {graph_flags(scope)}", 6, schedule=chunk_schedule(0))
    check_chunk_session(graphed[2].graphs, 0)
    assert_same(sequential, graphed, f"interleaved rank 0, recompute, scope {scope}")


# scope -> (needs drop-and-pad, --recompute-modules): each recomputed module wholly inside
# one graphed region or wholly eager.
MOE_CASES = {
    "attn moe_router moe_preprocess": (False, "core_attn shared_experts moe_act"),
    "attn": (False, "core_attn moe layernorm"),
    "moe": (True, "core_attn moe layernorm moe_act"),
    "": (True, "core_attn shared_experts layernorm moe_act"),
}


@pytest.mark.parametrize("scope", list(MOE_CASES), ids=[s or "layer" for s in MOE_CASES])
def test_small_moe_selective_recompute_graphed_equals_eager(scope):
    """Grouped experts with a shared expert; dropless unless the scope graphs the whole block."""
    pad, modules = MOE_CASES[scope]
    flags = f"{moe.SMALL} {moe.COMMON} --moe-grouped-gemm --moe-shared-expert-intermediate-size 256"
    if pad:
        flags += f" {moe.DROP_AND_PAD}"
    recompute = f"{SELECTIVE} {modules}"
    plain = moe.train(flags, 8)
    eager = moe.train(f"{flags} {recompute}", 8)
    moe.assert_same(plain, eager, f"eager with --recompute-modules {modules} vs without")
    graphed = moe.train(f"{flags} {recompute} --cuda-graph-impl local --cuda-graph-scope {scope}".rstrip(), 8)
    assert graphed["captured"]
    moe.assert_same(eager, graphed, f"scope {scope!r}, --recompute-modules {modules}")


def test_small_hybrid_selective_recompute_graphed_equals_eager():
    """M*M-M*M- with mamba, attn and mlp graphed; core_attn, mlp and layernorm recomputed."""
    flags = f"{hybrid.SMALL} {hybrid.COMMON} {SELECTIVE} core_attn mlp layernorm"
    eager = hybrid.train(flags, 8)
    for scope in ("mamba attn mlp", ""):
        graphed = hybrid.train(f"{flags} --cuda-graph-impl local --cuda-graph-scope {scope}".rstrip(), 8)
        assert graphed[2]["captured"]
        hybrid.assert_same(eager, graphed, f"hybrid, scope {scope!r}")
