"""Micro-batch slots under 1F1B and interleaved orders (pure Python, simulated pools).

A recorded iteration is built from a schedule's order over a stack of regions per
model chunk; each micro-batch takes the slot ``slots.assign_slots`` gives it (with
equal chunks, the lowest free slot of all: a slot serves micro-batches of any chunk).
Checked: the slot count is the micro-batches of all chunks in flight at once (never the
micro-batch count), each slot's events are runs of its chunks, and replaying the whole
iteration against the hostile LIFO pool never corrupts with one pool per slot, while
one pool shared by the slots does (why slots get pools of their own).
"""

import pytest

from megatron.core.pipeline_parallel.schedules import interleaved_order, one_f_one_b_order
from megatron.core.pipeline_parallel.simulate import max_in_flight
from megatron.core.pipeline_parallel.slots import assign_slots
from megatron.core.transformer.cuda_graphs.plan import (
    BWD,
    FWD,
    OWN,
    Event,
    RegionIO,
    Source,
    build_plan,
    slot_cycles,
    slot_runs,
)
from tests.unit_tests.transformer.cuda_graphs.test_plan_simulation import Pool, replay_iteration, simulate_capture

REGIONS_PER_CHUNK = 3


def chunk_regions(num_chunks, handoff=True):
    regions = []
    for c in range(num_chunks):
        for i in range(REGIONS_PER_CHUNK):
            r = c * REGIONS_PER_CHUNK + i
            hidden = Source("handoff", r - 1, 0) if handoff and i else OWN  # a chunk's input is received
            regions.append(RegionIO(f"c{c}r{i}", [hidden, Source("shared", index=0)], [True, False], [True]))
    return regions


def record(order, num_chunks, weights=None):
    """The recorded iteration of an order of ``(phase, chunk, micro-batch)`` steps."""
    slot_of, events = assign_slots(order, weights), []
    for phase, chunk, mb in order:
        first, slot = chunk * REGIONS_PER_CHUNK, slot_of[(chunk, mb)]
        if phase == "F":
            events += [Event(FWD, first + i, slot) for i in range(REGIONS_PER_CHUNK)]
        else:
            events += [Event(BWD, first + i, slot) for i in reversed(range(REGIONS_PER_CHUNK))]
    return events


def chunk_of(num_chunks):
    """Region -> model chunk of :func:`chunk_regions`."""
    return {r: r // REGIONS_PER_CHUNK for r in range(num_chunks * REGIONS_PER_CHUNK)}


CHUNK_OF = chunk_of(8)  # region -> chunk for any recorded order here


def cycles_of(events, num_chunks):
    return slot_cycles(events, chunk_of(num_chunks))


def orders():
    for m in (1, 2, 4, 8):
        for stages in (2, 3, 4):
            for rank in range(stages):
                warmup = stages - rank - 1
                yield f"1f1b m{m} pp{stages} rank{rank}", [(p, 0, mb) for p, mb in one_f_one_b_order(m, warmup)], 1
    for m in (2, 4, 8):
        for stages in (2, 4):
            if m % stages:
                continue
            for rank in range(stages):
                yield f"interleaved m{m} pp{stages} rank{rank}", interleaved_order(m, stages, rank, 2), 2


ORDERS = {name: (order, chunks) for name, order, chunks in orders()}


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_graphs_bounded_by_micro_batches_in_flight(name):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    runs = slot_runs(events, chunk_of(chunks))
    num_microbatches = len({mb for _, _, mb in order})
    in_flight = max_in_flight(order)  # of all chunks at once
    # As many slots as micro-batches in flight (eager's peak), fewer than one per chunk's.
    assert len(runs) == in_flight <= sum(max_in_flight(order, c) for c in range(chunks))
    # One graph pair per region per slot it ran in: layers x micro-batches in flight at most.
    graphs = sum(len(events) for slot_runs_ in runs.values() for _, events in slot_runs_)
    assert graphs <= REGIONS_PER_CHUNK * chunks * 2 * in_flight
    if num_microbatches > in_flight:
        assert graphs < REGIONS_PER_CHUNK * chunks * 2 * num_microbatches


def test_unequal_chunks_keep_slots_of_their_own():
    """A light chunk's micro-batches would spread a heavy chunk over every slot of all: with
    weights the assignment keeps per-chunk slots when those reserve less."""
    order = interleaved_order(8, 2, 0, 2)
    equal, unequal = slot_runs(record(order, 2), chunk_of(2)), slot_runs(record(order, 2, [3, 1]), chunk_of(2))
    assert (len(equal), len(unequal)) == (5, 6)  # 5 micro-batches in flight; chunk 0 holds 4 at most, chunk 1 2
    assert all(len(slot_runs_) == 1 for slot_runs_ in unequal.values())  # one chunk per slot
    assert any(len(slot_runs_) == 2 for slot_runs_ in equal.values())


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_per_slot_pools_never_corrupt(name):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    slots = {}
    for s, cycle in cycles_of(events, chunks).items():
        plan = build_plan(cycle, regions, chunk_of=chunk_of(chunks))
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs=True, pool=Pool(first_block=1000 * s))
        slots[s] = (cycle, plan, block, temps)
    assert replay_iteration(events, regions, slots, saves_inputs=True) == []


def test_searched_slots_of_unequal_chunks_never_corrupt():
    """Four chunks of unequal weight: the searched assignment mixes chunks in slots in its
    own way; each slot's pool still never corrupts."""
    order = interleaved_order(16, 2, 0, 4)
    events = record(order, 4, weights=[5, 5, 5, 7])
    regions = chunk_regions(4)
    slots = {}
    for s, cycle in cycles_of(events, 4).items():
        plan = build_plan(cycle, regions, chunk_of=chunk_of(4))
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs=True, pool=Pool(first_block=1000 * s))
        slots[s] = (cycle, plan, block, temps)
    assert any(len({e.region // REGIONS_PER_CHUNK for e in cycle}) > 1 for cycle, *_ in slots.values())
    assert replay_iteration(events, regions, slots, saves_inputs=True) == []


def test_one_pool_shared_by_slots_is_caught():
    order = [(p, 0, mb) for p, mb in one_f_one_b_order(4, 1)]  # two micro-batches in flight
    events = record(order, 1)
    regions = chunk_regions(1)
    shared = Pool()
    slots = {}
    for s, cycle in cycles_of(events, 1).items():
        plan = build_plan(cycle, regions)
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs=True, pool=shared)
        slots[s] = (cycle, plan, block, temps)
    assert replay_iteration(events, regions, slots, saves_inputs=True) != []


def test_slot_cycles_reject_a_slot_whose_micro_batches_differ():
    events = [Event(FWD, 0, 0), Event(BWD, 0, 0), Event(FWD, 0, 0), Event(FWD, 1, 0), Event(BWD, 1, 0)]
    with pytest.raises(ValueError, match="different order in different micro-batches"):
        slot_cycles(events)
