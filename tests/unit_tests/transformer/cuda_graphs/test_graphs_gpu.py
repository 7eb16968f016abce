"""Graphed training equals eager training, on a GPU (``pytest -m gpu``).

Bitwise: the same kernels run eagerly and inside the graphs (deterministic mode, dropout
0), and the backward graph adds weight gradients into ``main_grad`` with the same
``add_`` the DDP hook uses, so losses and every ``main_grad`` are compared with
``torch.equal``.
"""

import functools
import gc
import itertools
import sys
import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.pipeline_parallel import schedules, simulate
from megatron.core.transformer.cuda_graphs.plan import BWD
from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments
from megatron.core.transformer.cuda_graphs.session import GraphState
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.conftest import assert_bitwise_same, bitwise_record, report_to_parent, run_in_own_process

pytestmark = pytest.mark.gpu

MODULE = "tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu"  # imported by a child process

DENSE8 = (
    "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2"
)
SMALL = (
    "--num-layers 3 --hidden-size 256 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2"
)
COMMON = (
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer "
    "--vocab-size 32000 --mock-data --log-interval 1000000 --num-workers 0 --deterministic-mode"
)
NO_DROPOUT = "--attention-dropout 0.0 --hidden-dropout 0.0"
SCOPES = {"layer": "", "attn": "attn", "mlp": "mlp", "attn mlp": "attn mlp"}


def graph_flags(scope):
    return f"--cuda-graph-impl local --cuda-graph-scope {SCOPES[scope]}".rstrip()


def train(flags: str, iters: int, snapshot_at: int = 3, batches=None, schedule=None, peaks=None):
    """Trains ``iters`` iterations; returns (losses, main_grads after ``snapshot_at``, trainer).
    ``peaks``: a list to append each iteration's peak reserved bytes to (the peak statistics are
    reset after each)."""
    trainer = build_trainer(f"{flags} --train-iters {iters}".split())
    if schedule is not None:
        trainer.schedule = schedule
    try:
        it = batches if batches is not None else build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses, grads = [], None
        for i in range(1, iters + 1):
            loss = trainer.train_step(it)[0]
            losses.append(loss.detach().clone())
            if peaks is not None:
                torch.cuda.synchronize()
                peaks.append(torch.cuda.max_memory_reserved())
                torch.cuda.reset_peak_memory_stats()
            if i == snapshot_at:
                grads = [p.main_grad.detach().cpu() for p in trainer.model.module.parameters()]  # off the device
        torch.cuda.synchronize()
        return losses, grads, trainer
    finally:
        parallel_state.destroy(trainer.pg)


def assert_same(eager, graphed, what):
    """``train()``'s results of two runs equal bit for bit (losses, and main_grads after iteration 3)."""
    assert_bitwise_same(eager[:2], graphed[:2], what)


@pytest.mark.parametrize("precision", ["--bf16", ""], ids=["bf16", "fp32"])
def test_dense8_graphed_equals_eager_every_scope(precision):
    flags = f"{DENSE8} {COMMON} {NO_DROPOUT} {precision}"
    eager = train(flags, 50)
    assert eager[2].graphs.active is False
    for scope in SCOPES:
        graphed = train(f"{flags} {graph_flags(scope)}", 50)
        trainer = graphed[2]
        assert trainer.graphs.captured
        # + the loss head, graphed whenever the last layer's MLP is.
        n_regions = {"layer": 9, "attn": 8, "mlp": 9, "attn mlp": 9}[scope]
        assert len(trainer.graphs.regions) == n_regions
        assert trainer.graphs.num_graphs() == 2 * n_regions
        # The embedding's output goes to the backward pool (cuda_graphs/feed.py) where the first graph
        # is the first layer's attention or whole layer and the loss head is graphed (no first turn);
        # with `mlp`, the eager attention's norm keeps it for its backward.
        assert trainer.graphs.feed_open == (scope in ("layer", "attn mlp")), trainer.graphs.summary_line()
        assert_same(eager, graphed, f"scope {scope!r} {precision or 'fp32'}")
        del graphed, trainer
        torch.cuda.empty_cache()


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_grad_accumulation_and_overlap(scope):
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 6 --overlap-grad-reduce"
    eager = train(flags, 8)
    graphed = train(f"{flags} {graph_flags(scope)}", 8)
    assert_same(eager, graphed, f"3 micro-batches, overlap, scope {scope}")


@pytest.mark.parametrize("fusion", ["", "--no-gradient-accumulation-fusion"], ids=["fused-wgrad", "unfused-wgrad"])
@pytest.mark.parametrize("untie", [False, True], ids=["tied", "untied"])
def test_loss_head_graphed_equals_eager(untie, fusion):
    # 3 micro-batches, overlap. Tied and unfused: the graph leaves the output layer's wgrad
    # in .grad, eager autograd adds the embedding's in bf16, DDP folds the sum. Tied and
    # fused: the graph adds the output layer's part into main_grad, the bucket waits on
    # the graph's event, and the embedding's part completes it later.
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 6 --overlap-grad-reduce {fusion}"
    if untie:
        flags += " --untie-embeddings-and-output-weights"
    eager = train(flags, 6)
    graphed = train(f"{flags} {graph_flags('layer')}", 6)
    head = graphed[2].graphs.regions[-1]
    assert head.name == "postprocess" and head.slots[0].bwd_graph is not None
    assert len(head.shared_params) == (1 if not untie and fusion else 0)
    assert len(head.fused_shared_params) == (1 if not untie and not fusion else 0)
    assert_same(eager, graphed, f"loss head, {'untied' if untie else 'tied'} {fusion}")
    without = train(f"{flags} {graph_flags('layer')} --no-cuda-graph-postprocess", 6)
    assert all(r.name != "postprocess" for r in without[2].graphs.regions)
    assert_same(eager, without, "layers graphed, loss head eager")


def test_rope_gqa_swiglu_graphed_equals_eager():
    flags = (
        f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --position-embedding-type rope --group-query-attention "
        "--num-query-groups 2 --swiglu --disable-bias-linear --normalization RMSNorm"
    )
    eager = train(flags, 8)
    for scope in ("layer", "attn", "mlp"):
        graphed = train(f"{flags} {graph_flags(scope)}", 8)
        # The rotary table is one buffer shared by every layer's graph (MLPs take none).
        plan = graphed[2].graphs.plans[0]
        assert any(k[0] == "shared" for k in plan.buffers) == (scope != "mlp")
        assert_same(eager, graphed, f"rope/gqa/swiglu scope {scope}")


@pytest.mark.parametrize(
    "variant",
    ["--qk-l2-norm", "--no-rope-freq 3", "--qk-layernorm --no-rope-freq [0,1,0]", "--reset-attention-mask"],
    ids=["l2", "no-rope", "ln", "document-mask"],
)
def test_query_key_variants_graphed_equals_eager(variant):
    """Llama-4's query/key L2 norm and layers without RoPE (every 3rd; a list), inside graphed attention;
    and --reset-attention-mask, whose document mask of each micro-batch is one static input every graphed
    attention shares (masked SDPA kernels in both runs)."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --position-embedding-type rope --normalization RMSNorm {variant}"
    eager = train(flags, 6)
    for scope in ("layer", "attn"):
        graphed = train(f"{flags} {graph_flags(scope)}", 6)
        assert graphed[2].graphs.captured
        assert_same(eager, graphed, f"{variant} scope {scope}")


def test_dropout_masks_change_between_replays():
    flags = (
        f"{SMALL} {COMMON} --bf16 --hidden-dropout 0.1 --attention-dropout 0.1 --lr 0 --min-lr 0 {graph_flags('layer')}"
    )
    probe = build_trainer(f"{flags} --train-iters 1".split())
    batch = next(build_data_iterators(probe.cfg, probe.tokenizer, probe.pg, 0)[0])
    parallel_state.destroy(probe.pg)
    losses, _, trainer = train(flags, 4, batches=itertools.repeat(batch))
    assert trainer.graphs.captured
    values = [x.item() for x in losses]
    assert all(torch.isfinite(torch.tensor(values)))
    # Same batch, lr 0 (weights fixed): only fresh dropout masks can change the loss.
    assert len(set(values[1:])) == len(values[1:]), values


def test_pool_accounting_and_release():
    _, _, trainer = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags('layer')}", 2)
    s = trainer.graphs.stats()
    assert s["graphs"] == 8  # 3 layers + the loss head, forward and backward
    assert 0 <= s["pool_live_bytes"] <= s["pool_reserved_bytes"] and s["pool_reserved_bytes"] > 0
    # Hand-offs released: we hold far less than one buffer per graph input and output,
    # plus the tied embedding's wgrad buffer (read by eager autograd after each replay).
    hidden_bytes = 256 * 2 * 256 * 2
    tied_wgrad_bytes = 32000 * 256 * 2
    assert s["strong_bytes"] <= 3 * hidden_bytes + tied_wgrad_bytes, s
    assert len(s["regions"]) == 4 and all(r["pool_reserved_after_bwd"] for r in s["regions"])


def private_pools() -> set:
    """The ids of the allocator's private pools (graph pools) that hold a segment now."""
    return {tuple(s["segment_pool_id"]) for s in torch.cuda.memory_snapshot()} - {(0, 0)}


@pytest.mark.parametrize(
    "scope, extra, vpp_rank",
    [
        ("layer", "", None),
        ("attn", "", None),
        ("mlp", "", None),
        ("layer", "--overlap-grad-reduce --global-batch-size 6", None),
        ("layer", "--global-batch-size 8 --untie-embeddings-and-output-weights", None),  # one slot, 4 micro-batches
        ("layer", "--global-batch-size 8 --untie-embeddings-and-output-weights", 1),
    ],
)
def test_a_dropped_graphed_trainer_frees_its_session_and_pools(scope, extra, vpp_rank):
    """No cycle keeps a graphed run alive once its trainer is dropped without close(): the recording's
    hooks on region inputs once kept the session, the model and every graph pool (with attn or mlp:
    eager turns). With --overlap-grad-reduce, DDP's hooks on the parameters held DDP strongly, and so
    the model and the session (whose output buffers keep autograd graphs that reach the parameters).
    With two chunks in a pipeline rank's order (several slots, a shared backward pool), too; where one
    survives, ``tools/holders.py`` names what holds it."""
    before = private_pools()
    schedule = chunk_schedule(vpp_rank) if vpp_rank is not None else None
    _, _, trainer = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags(scope)} {extra}", 3, schedule=schedule)
    assert trainer.graphs.state is GraphState.CAPTURED and private_pools() - before
    ref = weakref.ref(trainer.graphs)
    del trainer
    gc.collect()
    torch.cuda.empty_cache()
    assert ref() is None, "the dropped trainer's graph session is still alive"
    assert private_pools() - before == set(), "the dropped trainer's graph pools are still reserved"


def test_shape_change_after_capture_is_a_clear_error():
    _, _, trainer = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags('layer')}", 2)
    model = trainer.model
    tokens = torch.zeros(2, 128, dtype=torch.long, device="cuda")
    with pytest.raises(ValueError, match=r"changed since capture.*shape=\(256, 2, 256\)"):
        model(tokens, None, tokens)


def test_out_of_order_replay_raises():
    _, _, trainer = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags('layer')}", 2)
    model = trainer.model
    tokens = torch.zeros(2, 256, dtype=torch.long, device="cuda")
    model(tokens, None, tokens)  # a forward cycle without its backward ...
    with pytest.raises(RuntimeError, match="out of capture order"):
        model(tokens, None, tokens)  # ... then another forward


def test_debug_mode_checks_replays():
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags('layer')} --cuda-graph-debug"
    eager = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16", 5)
    graphed = train(flags, 5)
    assert_same(eager, graphed, "debug mode")
    assert graphed[2].graphs._poison, "debug mode should poison released buffers"


def test_eval_mode_runs_eagerly_between_replays():
    losses, _, trainer = train(f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {graph_flags('layer')}", 3)
    model = trainer.model
    model.eval()
    tokens = torch.ones(2, 256, dtype=torch.long, device="cuda")
    with torch.no_grad():
        out = model(tokens, None, tokens)
    assert torch.isfinite(out).all()
    assert trainer.graphs.cursor == 0


@pytest.mark.parametrize("in_flight", [2, 3])
@pytest.mark.parametrize("scope", ["layer", "attn mlp", "attn"])
def test_micro_batches_in_flight_equal_sequential(scope, in_flight):
    """A 1F1B order on one GPU (the shape a pipeline stage sees): one graph pair per
    region per micro-batch in flight, one pool per slot; bitwise equal to sequential."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 8"  # 4 micro-batches
    sequential = train(flags, 6)
    schedule = functools.partial(schedules.forward_backward_in_flight, num_warmup=in_flight - 1)
    graphed = train(f"{flags} {graph_flags(scope)}", 6, schedule=schedule)
    session = graphed[2].graphs
    n_regions = len(session.regions)
    assert session.captured and len(session.pools) == in_flight
    assert session.num_graphs() == 2 * n_regions * in_flight
    assert_same(sequential, graphed, f"{in_flight} in flight, scope {scope}")


VPP_FLAGS = "--num-layers 4 --global-batch-size 8 --untie-embeddings-and-output-weights"  # 4 micro-batches
"""Two chunks of two layers. Untied: a weight shared by two chunks gets its gradients in
two backward steps under a pipeline (Megatron reduces them between stages), which is
not the sequential sum."""


def chunk_schedule(pp_rank: int):
    """Rank ``pp_rank`` of a 2-stage pipeline with 2 virtual chunks, both chunks here."""
    return functools.partial(simulate.forward_backward_chunks, num_chunks=2, pp_size=2, pp_rank=pp_rank)


def check_chunk_session(session, pp_rank: int, num_microbatches: int = 4):
    """Slots, graph count and chunk edges of a session captured under ``chunk_schedule``."""
    order = simulate.rank_order("interleaved", num_microbatches, 2, pp_rank, 2)
    in_flight = simulate.max_in_flight(order)  # of both chunks at once: a slot serves either
    assert session.captured and len(session.pools) == in_flight == len(session.cycles)
    assert in_flight < sum(simulate.max_in_flight(order, c) for c in range(2))
    regions = [
        sorted({e.region for runs in session.runs.values() for ch, run in runs if ch == c for e in run})
        for c in range(2)
    ]
    # One forward and one backward graph per region of every chunk a slot served.
    pairs = {(c, s) for s, runs in session.runs.items() for c, _ in runs}
    assert session.num_graphs() == sum(2 * len(regions[c]) for c, _ in pairs)
    assert session.num_graphs() <= 2 * len(session.regions) * in_flight
    return regions


@pytest.mark.parametrize("pp_rank", [0, 1])
@pytest.mark.parametrize("scope", ["layer", "attn", "mlp"])
def test_interleaved_chunks_equal_sequential(scope, pp_rank):
    """Two model chunks in one process in a pipeline rank's interleaved order (VPP 2):
    the chunk boundary goes through a "send" of chunk 0's last output and a receive
    straight into chunk 1's first graph's static input, and the dgrad back; one graph
    pair per region per slot, slots as many as micro-batches of both chunks in flight at
    once (a slot serves either chunk); bitwise equal to sequential."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {VPP_FLAGS}"
    sequential = train(flags, 6)
    graphed = train(f"{flags} {graph_flags(scope)}", 6, schedule=chunk_schedule(pp_rank))
    session = graphed[2].graphs
    regions = check_chunk_session(session, pp_rank)
    if scope == "mlp":  # eager attention reads the received tensor first: nothing to receive into
        assert not session.received_inputs
    else:
        first = regions[1][0]
        assert session.received_inputs == {(first, 0)}
        for slot, runs in session.runs.items():
            if any(c == 1 for c, _ in runs):
                buffer = session.receive_buffer(slot, 1)
                region = session.regions[first].slots[slot]
                assert buffer is not None and buffer.data_ptr() == region.replay_inputs[0][1].data_ptr()
    assert_same(sequential, graphed, f"interleaved rank {pp_rank}, scope {scope}")


@pytest.mark.parametrize("scope", ["layer", "attn"])
def test_interleaved_chunks_with_deallocated_outputs_equal_sequential(scope):
    """As above, with each sent chunk output's storage freed after the send (Megatron's
    --deallocate-pipeline-outputs): neither the recording nor the replays need it."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {VPP_FLAGS}"
    sequential = train(flags, 6)
    schedule = functools.partial(chunk_schedule(0), deallocate_pipeline_outputs=True)
    graphed = train(f"{flags} {graph_flags(scope)}", 6, schedule=schedule)
    check_chunk_session(graphed[2].graphs, 0)
    assert_same(sequential, graphed, f"interleaved rank 0, deallocated outputs, scope {scope}")


def peak_reserved(flags: str, iters: int, schedule):
    """(train()'s result, peak bytes reserved above what was reserved before the run)."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    peaks = []
    result = train(flags, iters, schedule=schedule, peaks=peaks)
    return result, max(peaks) - base


def fresh_chunk_run(flags: str, pp_rank: int) -> dict:
    """Trains 6 iterations of rank ``pp_rank``'s two-chunk order in a process of its own, as a
    training process runs one trainer; returns what ``_chunk_run_child`` reports."""
    return run_in_own_process(MODULE, "_chunk_run_child", flags, str(pp_rank), timeout=300)


def _chunk_run_child() -> None:
    """``fresh_chunk_run``'s process: each iteration's peak reserved bytes, the losses (exact, as
    hex) and a digest of every ``main_grad`` after iteration 3 (bitwise comparison across
    processes), and for a graphed run its session's slots and pools."""
    flags, pp_rank = sys.argv[1], int(sys.argv[2])
    use_expandable_segments()
    peaks = []
    losses, grads, trainer = train(flags, 6, schedule=chunk_schedule(pp_rank), peaks=peaks)
    result = {"peaks": peaks, **bitwise_record(losses, grads)}
    session = trainer.graphs
    if session is not None and session.captured:
        check_chunk_session(session, pp_rank)
        assert session.backward_pool is not None  # each backward step runs alone: one backward pool
        result["pools"] = {slot: pool.stats().reserved_bytes for slot, pool in session.pools.items()}
        result["backward"] = session.backward_pool.stats().reserved_bytes
        result["routed"] = sum(r.transients_routed for r in session.regions)
    report_to_parent(result)


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_interleaved_chunks_peak_memory_within_2_percent(pp_rank):
    """The same two-chunk schedule eager and graphed (whole layers): peak reserved
    memory (graph pools included) at most 2% above eager's, bitwise equal.

    Each run has a process of its own, as a training process runs one trainer: in one process,
    the cache an earlier run leaves is reused by a later eager run but not by graph pools (the
    README has the numbers).

    Rank 0 runs its loss head eagerly (``--no-cuda-graph-postprocess``) in both runs: a
    real pipeline's rank 0 has no head (the last stage, rank 1's chunk 1, does), but the
    one-process simulation needs one to make a loss, and graphing it in chunk 1 of rank
    0's order, where other steps run between its forward and backward, is a layout no
    pipeline has."""
    flags = f"{DENSE8} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 8 --untie-embeddings-and-output-weights"
    head = " --no-cuda-graph-postprocess" if pp_rank == 0 else ""
    eager = fresh_chunk_run(flags, pp_rank)
    graphed = fresh_chunk_run(f"{flags} {graph_flags('layer')}{head}", pp_rank)
    what = f"interleaved rank {pp_rank}, dense8"
    assert_bitwise_same((eager["losses"], eager["grads"]), (graphed["losses"], graphed["grads"]), what)
    eager_peak, graphed_peak = max(eager["peaks"]), max(graphed["peaks"])
    assert graphed["routed"] > 0, "several slots share the backward pool: the forwards' transients go there"
    pools_text = (
        f"pool reserved per slot (MiB): { {int(s): round(b / 2**20) for s, b in graphed['pools'].items()} }, shared "
        f"backward pool {graphed['backward'] / 2**20:.0f} MiB, {graphed['routed']} forward ops' transients in it; "
        f"per iteration (MiB): eager {[round(b / 2**20) for b in eager['peaks']]}, graphed "
        f"{[round(b / 2**20) for b in graphed['peaks']]}"
    )
    print(f"rank {pp_rank}: graphed {graphed_peak / 2**20:.0f} vs eager {eager_peak / 2**20:.0f} MiB; {pools_text}")
    assert graphed_peak <= eager_peak * 1.02, (
        f"rank {pp_rank}: graphed peak reserved {graphed_peak / 2**20:.0f} MiB > eager {eager_peak / 2**20:.0f} MiB "
        f"+ 2%; {pools_text}"
    )


def test_changed_micro_batch_count_replays_the_cycle_that_often():
    """--rampup-batch-size 2 2 8 to 6: 1, 1, 2, 3, 3, 3 micro-batches per step after capture at
    iteration 1; graphed losses bitwise equal to eager's (same kernels)."""
    flags = (
        f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 6 --rampup-batch-size 2 2 8 "
        "--log-interval 1 --train-iters 6"
    )
    eager = build_trainer(flags.split()).train()
    graphed_trainer = build_trainer(f"{flags} {graph_flags('layer')}".split())
    graphed = graphed_trainer.train()
    assert graphed_trainer.graphs.recorded_microbatches == 3
    assert [r["batch-size"] for r in graphed] == [2, 2, 4, 6, 6, 6]
    for a, b in zip(eager, graphed, strict=True):
        assert a["lm loss"] == b["lm loss"], (a, b)


@pytest.mark.parametrize("switch", ["0", "1", "all"])
@pytest.mark.parametrize("scope", ["attn", "mlp", "attn mlp"])
@pytest.mark.parametrize("head", ["", "--no-cuda-graph-postprocess", "--no-gradient-accumulation-fusion"])
def test_eager_turns_graphed_equal_eager_and_default_peak_within_2_percent(scope, head, switch, monkeypatch):
    """MEGATRON_CG_EAGER_TURN=1: the eager work between the last forward graph and the first
    backward graph allocates in the backward graphs' pool; ``all`` (the default): the eager work
    between backward graphs too (also where the first turn stays closed); ``0``: none. Losses and
    main_grads bitwise equal to eager over 20 iterations of dense8 in deterministic mode (2
    micro-batches) under each; with the default, peak reserved memory at most 2% over eager's.
    The first turn opens wherever the head is eager, also without gradient-accumulation fusion: the
    tied output weight's wgrad, which waits in autograd for the embedding's part, is made outside
    the turn (turn.outside_turn)."""
    from megatron.core.transformer.cuda_graphs import turn

    use_expandable_segments()
    flags = f"{DENSE8} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 4 {head}"
    eager, eager_peak = peak_reserved(flags, 20, None)
    eager = (*eager[:2], None)
    monkeypatch.setenv(turn.ENV_SWITCH, switch)
    graphed, graphed_peak = peak_reserved(f"{flags} {graph_flags(scope)}", 20, None)
    session = graphed[2].graphs
    head_graphed = any(r.name.endswith("postprocess") for r in session.regions)
    first = session._turn is not None and session._turn.last_forward is not None
    assert first == (switch != "0" and not head_graphed), session.summary_line()
    assert_same(eager, graphed, f"eager turn, scope {scope} {head}")
    # With `attn` or `mlp`, eager layer halves run between the backward graphs: turns there with `all`,
    # whether or not the first turn opened (it stays closed with a graphed head). After the last
    # backward graph, the rest of the backward pass (the embedding's) turns with `all` in every scope.
    last = max(session.plans[0].position(BWD, r.index) for r in session.regions)
    after = session._turn.after_backward if session._turn is not None else frozenset()
    routed = sum(r.transients_routed for r in session.regions)
    # An open turn gives the backward graphs a pool of their own, and the forwards' transients go there
    # too. With `1` and a graphed head no turn opens.
    print(
        f"{switch} {scope} {head}: peak reserved {graphed_peak / 2**20:.0f} MiB, eager {eager_peak / 2**20:.0f} MiB, "
        f"{routed} forward ops' transients in the backward pool"
    )
    assert (routed > 0) == (session.backward_pool is not None) == (first or bool(after)), session.summary_line()
    assert bool(after - {last}) == (switch == "all" and scope != "attn mlp"), session.summary_line()
    assert (last in after) == (switch == "all"), session.summary_line()
    if first and switch == "1":  # the turn found the segments the capture shaped for it
        captured = max(r.slots[0].pool_reserved_after.get(BWD, 0) for r in session.regions)
        grown = session.backward_pool.stats().reserved_bytes - captured
        assert grown == 0, f"scope {scope} {head}: the turns grew the backward pool by {grown / 2**20:.0f} MiB"
    if switch != "all":  # the first turn alone moves the peak to an eager layer's backward: no bound
        return
    assert graphed_peak <= eager_peak * 1.02, (
        f"scope {scope} {head}: graphed peak reserved {graphed_peak / 2**20:.0f} MiB > eager "
        f"{eager_peak / 2**20:.0f} MiB + 2%; {session.summary_line()}"
    )
