"""The graph session under simulated pipeline ranks, on the CPU (recording and order checks).

A tiny GPT runs as one model chunk (1F1B) or two (interleaved) in one process
(``pipeline_parallel/simulate.py``) while the session records. Checked for every
layout of 1, 2, 4, 8 micro-batches on 2-4 stages and every rank: the recorded order
is the schedule's execution order with the slots the schedule assigned; there are as
many slots as micro-batches of all chunks in flight at once (a slot serves any chunk),
so the graph count is bounded by regions x micro-batches in flight, never regions x
micro-batches; a chunk's first graph reads the received tensor and keeps that static
input for good.

The replay-order check runs on the recorded plans with the state set to captured (the
check is pure Python; no graph replays on the CPU): a changed micro-batch count or
schedule raises before the iteration, and another rank's order, replayed against the
recorded one, raises at the first event that differs, past the end, or at the end of
the iteration, never silently.
"""

import types
import warnings

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import build_gpt_model
from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.core.parallel_state import ProcessGroups
from megatron.core.pipeline_parallel import simulate
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs import capture
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, OWN, Event, backward_runs_alone
from megatron.core.transformer.cuda_graphs.session import GraphSession, GraphState
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import DDPConfig
from tests.unit_tests.pipeline_parallel.test_simulate import (  # one_thread: its autouse fixture applies here too
    LAYOUTS,
    layout_id,
    one_thread,  # noqa: F401
)

LAYERS = 2  # one per chunk with two chunks
SEQ, BATCH, VOCAB = 4, 1, 16


def tiny_model():
    cfg = TransformerConfig(
        num_layers=LAYERS,
        hidden_size=8,
        num_attention_heads=2,
        seq_length=SEQ,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    ).finalize()
    torch.manual_seed(0)
    model = build_gpt_model(cfg, VOCAB)
    return DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())


def batch():
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))
    return {"tokens": tokens, "position_ids": None, "labels": tokens, "loss_mask": torch.ones(BATCH, SEQ)}


def record(layout, scope=(), deallocate=False):
    """A session that recorded one iteration of ``layout``; its plans are made."""
    schedule, m, stages, rank, chunks = layout
    ddp = tiny_model()
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=list(scope))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(ddp.module, config, grad_sinks=[ddp], record_without_cuda=True)
    simulate.forward_backward_chunks(
        forward_step=gpt_forward_step,
        next_batch=batch,
        model=ddp,
        num_microbatches=m,
        num_chunks=chunks,
        pp_size=stages,
        pp_rank=rank,
        no_sync=ddp.no_sync,
        graphs=session,
        deallocate_pipeline_outputs=deallocate,
    )
    session.make_plans()
    return session


def chunk_regions(session, chunks):
    """Region indices of every chunk, in forward order (the head ends the last chunk)."""
    bounds = simulate.chunk_boundaries(LAYERS, chunks)
    layers = [r.index for r in session.regions if r.name.endswith(".layer")]
    assert len(layers) == LAYERS
    out = [layers[bounds[c] : bounds[c + 1]] for c in range(chunks)]
    out[-1] += [r.index for r in session.regions if r.name == "postprocess"]
    return out


def expected_order(layout, regions):
    schedule, m, stages, rank, chunks = layout
    events = []
    for step in simulate.slot_steps(simulate.rank_order(schedule, m, stages, rank, chunks)):
        mine = regions[step.chunk]
        if step.phase == "F":
            events += [Event(FWD, r, step.slot) for r in mine]
        else:
            events += [Event(BWD, r, step.slot) for r in reversed(mine)]
    return events


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_slots_follow_the_schedule_and_bound_the_graph_count(layout):
    schedule, m, stages, rank, chunks = layout
    session = record(layout)
    regions = chunk_regions(session, chunks)
    # Capture order is the schedule's execution order, in the slots it assigned.
    assert session.order == expected_order(layout, regions)
    assert session.recorded_microbatches == m
    assert session.recorded_schedule == simulate.schedule_key(schedule, stages, rank, chunks)
    order = simulate.rank_order(schedule, m, stages, rank, chunks)
    graphs = 0
    for s, runs in session.runs.items():
        for c, events in runs:  # one forward and one backward graph per region of the chunk
            assert sorted((e.region, e.phase) for e in events) == sorted((r, p) for r in regions[c] for p in (FWD, BWD))
            graphs += len(events)
        assert session.cycles[s] == [e for _, events in runs for e in events]
    in_flight = simulate.max_in_flight(order)  # of all chunks at once
    assert len(session.cycles) == in_flight <= sum(simulate.max_in_flight(order, c) for c in range(chunks))
    n_regions = len(session.regions)
    assert graphs <= 2 * n_regions * in_flight
    if in_flight < m:
        assert graphs < 2 * n_regions * m  # never one graph pair per micro-batch
    # Each backward step runs alone, so with several slots their backward graphs share a pool.
    assert backward_runs_alone(session.order, session.runs) == (len(session.cycles) > 1)
    # Chunk edges: a later chunk's first graph reads the received tensor, kept for good.
    for c in range(1, chunks):
        first = regions[c][0]
        assert (first, 0) in session.received_inputs
        for s, plan in session.plans.items():
            if first in {e.region for e in session.cycles[s]}:
                spec = plan.buffers[("input", first, 0)]
                assert spec.release_after is None and spec.alias_of is None
    assert session.received_inputs == {(regions[c][0], 0) for c in range(1, chunks)}
    # Capture warms up (and finds the parameters of) every chunk's regions, not only
    # those of the first slot, which are one chunk's.
    assert capture.warmup_order(session.cycles) == [r for c in range(chunks) for r in regions[c]]
    # ... and every chunk but the last sends its last graph's output, waited on before the slot's next
    # event (the region's backward), so kept as any output is: until that backward.
    assert set(session.sent_outputs) == {(regions[c][-1], 0) for c in range(chunks - 1)}
    for s, plan in session.plans.items():
        for r, j in session.sent_outputs:
            if r in {e.region for e in session.cycles[s]}:
                assert plan.buffers[("output", r, j)].release_after == plan.position(BWD, r)


def test_recording_with_deallocated_pipeline_outputs():
    """A graphed region's output is sent and its storage freed (Megatron refuses views):
    the recording is the same as without deallocation."""
    layout = ("interleaved", 4, 2, 0, 2)
    freed, kept = record(layout, deallocate=True), record(layout)
    assert freed.order == kept.order and freed.received_inputs == kept.received_inputs


def test_received_tensor_that_no_graph_reads_directly_is_not_a_static_input():
    """With only the MLP graphed the received tensor feeds eager attention first."""
    session = record(("interleaved", 4, 2, 0, 2), scope=["mlp"])
    assert not session.received_inputs


def as_captured(session):
    """The recorded session in the captured state, with CPU stand-ins for its buffers."""
    session.state = GraphState.CAPTURED
    session.cursor = 0
    session.buffers = {
        s: {key: torch.empty(1) for key, spec in plan.buffers.items() if spec.alias_of is None}
        for s, plan in session.plans.items()
    }
    return session


def replay(session, events):
    for e in events:
        session._advance(e, session.regions[e.region])


def test_changed_micro_batch_count_or_schedule_raises_before_the_iteration():
    session = as_captured(record(("interleaved", 4, 2, 0, 2)))
    key = simulate.schedule_key("interleaved", 2, 0, 2)
    session.expect_microbatches(4, schedule=key)
    with pytest.raises(
        ValueError,
        match="captured for 4 micro-batches per iteration in 5 slot.s. under the schedule .*this iteration has 8",
    ):
        session.expect_microbatches(8, schedule=key)
    with pytest.raises(
        ValueError, match=r"captured under the schedule \('interleaved', 2, 0, 2\).*'interleaved', 2, 1"
    ):
        session.expect_microbatches(4, schedule=simulate.schedule_key("interleaved", 2, 1, 2))
    with pytest.raises(ValueError, match="captured under the schedule"):
        session.expect_microbatches(4)  # a schedule that does not say which it is


def test_recorded_order_replays_every_iteration():
    session = as_captured(record(("1f1b", 4, 3, 0, 1)))
    for _ in range(3):
        replay(session, session.order)
        assert session.cursor == len(session.order)
        session.end_of_iteration()
        assert session.cursor == 0


def order_session(layout):
    """A session whose recording was ``layout``'s order over stand-in regions (two per
    chunk); its plans made and its state captured. Pure Python."""
    schedule, m, stages, rank, chunks = layout
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = GraphSession(CudaGraphConfig(cuda_graph_impl="local"))
    session.regions = [
        types.SimpleNamespace(
            name=f"chunk{r // 2}.r{r % 2}", sources=[OWN], input_requires_grad=[True], output_requires_grad=[True]
        )
        for r in range(2 * chunks)
    ]
    regions = [[2 * c, 2 * c + 1] for c in range(chunks)]
    session.recorder.order = expected_order(layout, regions)
    session._chunk_of = {r: r // 2 for r in range(2 * chunks)}  # what recording learns from the schedule
    session.make_plans()
    return as_captured(session), regions


def other_rank_pairs():
    by_m = {}
    for layout in LAYOUTS:
        by_m.setdefault((layout[1], layout[4]), []).append(layout)
    return [(a, b) for group in by_m.values() for a in group for b in group if a != b]


def test_another_ranks_order_never_replays_silently():
    """Every pair of layouts with the same micro-batch count and chunks: the schedule
    says nothing (as one that passes no key), the order check alone must raise."""
    raised = 0
    for recorded, replayed in other_rank_pairs():
        session, regions = order_session(recorded)
        events = expected_order(replayed, regions)
        try:
            replay(session, events)
            session.end_of_iteration()
        except RuntimeError as err:
            assert any(
                what in str(err)
                for what in ("out of capture order", "past the recorded iteration", "the iteration ended after")
            ), err
            raised += 1
        else:
            assert events == session.order, f"{replayed} replayed against {recorded} without an error"
    assert raised > 100


def test_replaying_more_micro_batches_than_recorded_raises():
    session = as_captured(record(("1f1b", 2, 2, 1, 1)))  # no warm-up: one slot, cycle repeated
    with pytest.raises(RuntimeError, match="past the recorded iteration"):
        replay(session, session.order + session.order[: len(session.cycles[0])])


def test_receive_buffer_is_the_first_graphs_input_and_refused_mid_run():
    session = as_captured(record(("interleaved", 4, 2, 0, 2)))
    regions = chunk_regions(session, 2)
    first = regions[1][0]
    # A slot that serves both chunks: chunk 1's micro-batches receive into its first graph.
    slot = next(s for s, runs in session.runs.items() if len(runs) == 2)
    plan = session.plans[slot]
    assert session.receive_buffer(slot, 1) is session.buffers[slot][plan.owner(("input", first, 0))]
    assert session.receive_buffer(slot, 0) is None  # chunk 0 embeds, receives nothing
    # Replay up to the slot's first event: its micro-batch is now in flight.
    upto = next(i for i, e in enumerate(session.order) if e.slot == slot)
    replay(session, session.order[: upto + 1])
    with pytest.raises(RuntimeError, match="in the middle of its run"):
        session.receive_buffer(slot, 1)
    # After the slot's first micro-batch (a run of one chunk) it may receive again.
    first_run = next(events for c, events in session.runs[slot] if session.order[upto] in events)
    end = [i for i, e in enumerate(session.order) if e.slot == slot][len(first_run) - 1]
    replay(session, session.order[upto + 1 : end])
    with pytest.raises(RuntimeError, match="in the middle of its run"):
        session.receive_buffer(slot, 1)
    replay(session, session.order[end : end + 1])
    assert session.receive_buffer(slot, 1) is not None
    with pytest.raises(RuntimeError, match="no micro-batch slot 99"):
        session.receive_buffer(99)


def test_capture_line_names_the_pipeline_rank():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = GraphSession(CudaGraphConfig(cuda_graph_impl="local"))
    assert session.summary_line(stage=(1, 4)).startswith("graph pool | pipeline rank: 1 of 4 | graphs: 0 |")
    assert session.summary_line(stage=(0, 1)).startswith("graph pool | graphs: 0 |")
    assert session.summary_line() == session.summary_line(stage=(0, 1))
