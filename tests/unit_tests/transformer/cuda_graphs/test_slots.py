"""Micro-batch slots under 1F1B and interleaved orders (pure Python, simulated pools).

A recorded iteration is built from a schedule's order over a stack of regions per
model chunk; each micro-batch takes the lowest free slot of its chunk. Checked: the
slot count is the micro-batches in flight (never the micro-batch count), each slot's
events are one cycle repeated, and replaying the whole iteration against the hostile
LIFO pool never corrupts with one pool per slot, while one pool shared by the slots
does (why slots get pools of their own).
"""

import pytest

from megatron.core.pipeline_parallel.schedules import SlotAllocator, interleaved_order, one_f_one_b_order
from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, OWN, Event, RegionIO, Source, build_plan, slot_cycles
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


def record(order, num_chunks):
    """The recorded iteration of an order of ``(phase, chunk, micro-batch)`` steps."""
    allocators = {c: SlotAllocator(c, num_chunks) for c in range(num_chunks)}
    slot_of, events = {}, []
    for phase, chunk, mb in order:
        allocator = allocators[chunk]
        first = chunk * REGIONS_PER_CHUNK
        if phase == "F":
            slot_of[(chunk, mb)] = slot = allocator.acquire(mb)
            events += [Event(FWD, first + i, slot) for i in range(REGIONS_PER_CHUNK)]
        else:
            slot = slot_of[(chunk, mb)]
            events += [Event(BWD, first + i, slot) for i in reversed(range(REGIONS_PER_CHUNK))]
            allocator.release(mb)
    return events


def max_in_flight(order, chunk):
    live, most = set(), 0
    for phase, c, mb in order:
        if c == chunk:
            (live.add if phase == "F" else live.discard)(mb)
            most = max(most, len(live))
    return most


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
    cycles = slot_cycles(events)
    num_microbatches = len({mb for _, _, mb in order})
    for chunk in range(chunks):
        mine = [c for c in cycles.values() if c[0].region // REGIONS_PER_CHUNK == chunk]
        # One graph pair per region per slot, as many slots as micro-batches in flight.
        assert len(mine) == max_in_flight(order, chunk)
        assert all({e.region // REGIONS_PER_CHUNK for e in c} == {chunk} for c in mine)  # one chunk per slot
    graphs = sum(len({e.region for e in cycle}) * 2 for cycle in cycles.values())
    assert graphs == sum(REGIONS_PER_CHUNK * 2 * max_in_flight(order, c) for c in range(chunks))
    if num_microbatches > max(max_in_flight(order, c) for c in range(chunks)):
        assert graphs < REGIONS_PER_CHUNK * chunks * 2 * num_microbatches


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_per_slot_pools_never_corrupt(name):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    slots = {}
    for s, cycle in slot_cycles(events).items():
        plan = build_plan(cycle, regions)
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs=True, pool=Pool(first_block=1000 * s))
        slots[s] = (cycle, plan, block, temps)
    assert replay_iteration(events, regions, slots, saves_inputs=True) == []


def test_one_pool_shared_by_slots_is_caught():
    order = [(p, 0, mb) for p, mb in one_f_one_b_order(4, 1)]  # two micro-batches in flight
    events = record(order, 1)
    regions = chunk_regions(1)
    shared = Pool()
    slots = {}
    for s, cycle in slot_cycles(events).items():
        plan = build_plan(cycle, regions)
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs=True, pool=shared)
        slots[s] = (cycle, plan, block, temps)
    assert replay_iteration(events, regions, slots, saves_inputs=True) != []


def test_slot_cycles_reject_a_slot_whose_micro_batches_differ():
    events = [Event(FWD, 0, 0), Event(BWD, 0, 0), Event(FWD, 0, 0), Event(FWD, 1, 0), Event(BWD, 1, 0)]
    with pytest.raises(ValueError, match="different order in different micro-batches"):
        slot_cycles(events)
