"""The pipelined schedule's exchange decisions for CUDA graphs, against the timetable (pure Python).

For every 1F1B layout of 2-4 stages and every interleaved layout of 2 and 4 stages
(2 chunks), 1, 2, 4 and 8 micro-batches, every rank:

- ``plan_graph_comm`` agrees with an independent walk over the rank's ticks: a receive
  lands in place exactly when its slot holds no micro-batch (of any chunk: a slot serves
  both chunks) at that exchange; a slot
  sends its dgrad uncopied exactly when no tick runs its backward and then its next
  forward before the exchange that sends that dgrad.
- The whole iteration, tick by tick, against the hostile LIFO pool of
  ``test_plan_simulation.py`` (each slot's pool, plus the backward pool the slots
  share): with those decisions no exchange reads or writes a block that a graph has
  meanwhile reused, and no graph reads what a receive overwrote; a schedule that sends
  every dgrad uncopied, or receives every input in place, is caught.
"""

import pytest

from megatron.core.pipeline_parallel import graph_comm, schedules, simulate
from megatron.core.pipeline_parallel.slots import assign_slots
from megatron.core.pipeline_parallel.timetable import build_timetable
from megatron.core.transformer.cuda_graphs.plan import (
    BWD,
    FWD,
    CommRead,
    CommRecv,
    backward_runs_alone,
    build_plan,
    run_cycle,
    slot_runs,
)
from tests.unit_tests.transformer.cuda_graphs.test_plan_simulation import Pool, simulate_capture
from tests.unit_tests.transformer.cuda_graphs.test_slots import CHUNK_OF, REGIONS_PER_CHUNK, chunk_regions, record


def layouts():
    for m in (1, 2, 4, 8):
        for pp in (2, 3, 4):
            for rank in range(pp):
                yield m, pp, rank, 1
    for m in (2, 4, 8):
        for pp in (2, 4):
            if m % pp == 0:
                for rank in range(pp):
                    yield m, pp, rank, 2


LAYOUTS = list(layouts())


def layout_id(layout):
    m, pp, rank, chunks = layout
    return f"{'1f1b' if chunks == 1 else 'vpp2'}-m{m}-pp{pp}-rank{rank}"


def rank_ticks(layout):
    m, pp, rank, chunks = layout
    orders = [schedules.rank_order(m, pp, r, chunks) for r in range(pp)]
    return orders[rank], build_timetable(orders, chunks)[rank]


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_decisions_follow_the_slots_tick_by_tick(layout):
    m, pp, rank, chunks = layout
    order, ticks = rank_ticks(layout)
    decided = graph_comm.plan_graph_comm(order, ticks)
    slot_of = {(s.chunk, s.microbatch): s.slot for s in simulate.slot_steps(order)}
    assert decided.slot_of == slot_of == assign_slots(order)
    assert len(set(slot_of.values())) == simulate.max_in_flight(order)  # equal chunks share slots
    holder: dict[int, tuple[int, int]] = {}  # slot -> (chunk, micro-batch) in it
    unsafe_slots = set()
    receives = 0
    for tick in ticks:
        freed_here = set()
        for phase, c, mb in tick.steps:
            s = slot_of[(c, mb)]
            if phase == "F":
                assert s not in holder
                if s in freed_here:  # its backward ran earlier in this tick: the dgrad is not sent yet
                    unsafe_slots.add(s)
                holder[s] = (c, mb)
            else:
                del holder[s]
                freed_here.add(s)
        if tick.recv_prev is not None:
            receives += 1
            assert decided.receive_in_place[tick.recv_prev] == (slot_of[tick.recv_prev] not in holder)
    assert len(decided.receive_in_place) == receives
    assert decided.grad_sent_in_place == {s: s not in unsafe_slots for s in set(slot_of.values())}


def test_which_receives_land_in_place():
    """What ``graph_comm.py`` says of the layouts: the last stage of 1F1B and two-chunk
    interleaving on 2 and 4 stages receive everything in place; 1F1B middle stages copy some."""
    for layout in LAYOUTS:
        m, pp, rank, chunks = layout
        decided = graph_comm.plan_graph_comm(*rank_ticks(layout))
        if (chunks == 1 and rank == pp - 1) or chunks == 2:
            assert all(decided.receive_in_place.values()), layout
        if chunks == 1 and rank == pp - 1:
            assert all(decided.grad_sent_in_place.values()), layout
    decided = graph_comm.plan_graph_comm(*rank_ticks((8, 4, 1, 1)))
    assert sum(decided.receive_in_place.values()) == 5 and len(decided.receive_in_place) == 8
    assert not all(decided.grad_sent_in_place.values())


def test_a_timetable_of_another_order_is_refused():
    order, ticks = rank_ticks((4, 2, 0, 1))
    with pytest.raises(ValueError, match="does not run this rank's order"):
        graph_comm.plan_graph_comm(order[:-1], ticks)


# ---------------------------------------------------------------------- hostile pool, tick by tick


def captured_slots(layout, decided):
    """Each slot's (cycle, plan, block, temps), captured as the session would for this rank."""
    m, pp, rank, chunks = layout
    order, _ = rank_ticks(layout)
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    runs = slot_runs(events, CHUNK_OF)
    backward_pool = Pool(first_block=10**6) if backward_runs_alone(events, runs) else None
    last_stage = pp * chunks - 1
    slots = {}
    for s, slot_runs_ in runs.items():
        cycle = run_cycle(slot_runs_)
        comm = []
        for c, _ in slot_runs_:  # each chunk the slot serves has its edges
            first, last = c * REGIONS_PER_CHUNK, (c + 1) * REGIONS_PER_CHUNK - 1
            stage = c * pp + rank
            if stage > 0:
                comm.append(CommRecv(("input", first, 0)))
                if decided.grad_sent_in_place[s]:
                    comm.append(CommRead(("grad_input", first, 0)))
            if stage < last_stage:  # waited in the forward's tick: before the slot's next event
                comm.append(CommRead(("output", last, 0), until=(BWD, last)))
        plan = build_plan(cycle, regions, comm, CHUNK_OF)
        block, temps = simulate_capture(
            cycle, regions, plan, saves_inputs=True, pool=Pool(first_block=1000 * s), backward_pool=backward_pool
        )
        slots[s] = (cycle, plan, block, temps)
    return regions, slots


def replay_ticks(layout, decided, iterations=2):
    """Replays ``iterations`` iterations tick by tick: steps, then the tick's exchange
    (sends read their buffers, an in-place receive writes the first graph's input).
    Block contents are labelled (slot, buffer, micro-batch of the slot); returns the
    reads that found something else."""
    m, pp, rank, chunks = layout
    order, ticks = rank_ticks(layout)
    regions, slots = captured_slots(layout, decided)
    slot_of = decided.slot_of
    last_stage = pp * chunks - 1
    content, bad = {}, []
    gen = {s: 0 for s in slots}
    landed: set[tuple[int, int]] = set()  # (chunk, mb) received in place, not yet forwarded

    def owner(s, key):
        return slots[s][1].owner(key)

    def write(s, key, g=None):
        key = owner(s, key)
        content[slots[s][2][key]] = (s, key, gen[s] if g is None else g)

    def read(s, key, when, g=None):
        key = owner(s, key)
        want = (s, key, gen[s] if g is None else g)
        got = content.get(slots[s][2][key])
        if got != want:
            bad.append((when, s, key, got))

    for _ in range(iterations):
        for t, tick in enumerate(ticks):
            exchange_reads = []
            for phase, c, mb in tick.steps:
                s = slot_of[(c, mb)]
                _, plan, _, temps = slots[s]
                first = c * REGIONS_PER_CHUNK
                stage = c * pp + rank
                chunk_regions_ = list(range(first, first + REGIONS_PER_CHUNK))
                for r in chunk_regions_ if phase == "F" else reversed(chunk_regions_):
                    io = regions[r]
                    pos = plan.position(FWD if phase == "F" else BWD, r)
                    if phase == "F" and r == first:  # the slot's next micro-batch starts
                        gen[s] += 1
                    when = f"tick {t}: {phase}{r} of micro-batch {mb} in slot {s}"
                    if phase == "F":
                        for i, src in enumerate(io.inputs):
                            key = owner(s, ("input", r, i))
                            if (r, i) == (first, 0) and (c, mb) in landed:
                                continue  # the receive wrote it
                            if src.kind == "own" or (src.kind == "shared" and plan.buffers[key].readers[0] == pos):
                                write(s, key)  # the replay's copy into the static input
                        for b in temps[pos]:
                            content[b] = ("temp", s, pos)
                        for i in range(len(io.inputs)):
                            read(s, ("input", r, i), when)
                        write(s, ("output", r, 0))
                    else:
                        if plan.buffers[("grad_output", r, 0)].alias_of is None:
                            write(s, ("grad_output", r, 0))
                        for b in temps[pos]:
                            content[b] = ("temp", s, pos)
                        read(s, ("grad_output", r, 0), when)
                        for i in range(len(io.inputs)):
                            read(s, ("input", r, i), f"{when} (saved)")
                        write(s, ("grad_input", r, 0))
                        if plan.buffers[("grad_input", r, 0)].copy_out:
                            read(s, ("grad_input", r, 0), f"copy-out after {when}")
                landed.discard((c, mb))
                last = first + REGIONS_PER_CHUNK - 1
                if phase == "F" and stage < last_stage:
                    exchange_reads.append((s, ("output", last, 0), gen[s], f"send of {c, mb} in tick {t}"))
                if phase == "B" and stage > 0 and not plan.buffers[("grad_input", first, 0)].copy_out:
                    exchange_reads.append((s, ("grad_input", first, 0), gen[s], f"dgrad of {c, mb} in tick {t}"))
            for s, key, g, when in exchange_reads:
                read(s, key, when, g)
            if tick.recv_prev is not None and decided.receive_in_place[tick.recv_prev]:
                c, _ = tick.recv_prev
                s = slot_of[tick.recv_prev]
                write(s, ("input", c * REGIONS_PER_CHUNK, 0), gen[s] + 1)  # the slot's next micro-batch
                landed.add(tick.recv_prev)
    return bad


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_exchanges_never_meet_a_reused_block(layout):
    decided = graph_comm.plan_graph_comm(*rank_ticks(layout))
    assert replay_ticks(layout, decided) == []


def override(decided, receive=None, grad=None):
    return graph_comm.GraphCommPlan(
        decided.slot_of,
        decided.previous,
        {k: receive for k in decided.receive_in_place} if receive is not None else decided.receive_in_place,
        {k: grad for k in decided.grad_sent_in_place} if grad is not None else decided.grad_sent_in_place,
    )


def test_every_dgrad_sent_uncopied_is_caught():
    caught = 0
    for layout in LAYOUTS:
        decided = graph_comm.plan_graph_comm(*rank_ticks(layout))
        if all(decided.grad_sent_in_place.values()) or layout[2] == 0 and layout[3] == 1:
            continue  # nothing to get wrong (the first stage sends no dgrad)
        assert replay_ticks(layout, override(decided, grad=True)) != [], layout
        caught += 1
    assert caught == 6  # middle stages of 1F1B on 3 and 4 stages, 4 and 8 micro-batches


def test_every_receive_in_place_is_caught():
    caught = 0
    for layout in LAYOUTS:
        decided = graph_comm.plan_graph_comm(*rank_ticks(layout))
        if all(decided.receive_in_place.values()):
            continue
        assert replay_ticks(layout, override(decided, receive=True)) != [], layout
        caught += 1
    assert caught == 6
