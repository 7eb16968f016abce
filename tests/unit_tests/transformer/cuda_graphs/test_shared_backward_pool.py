"""One backward pool shared by every micro-batch slot (pure Python, hostile simulated pools).

The schedules run each micro-batch's backward of a chunk as one step, so no other
slot's graph replays inside it; every slot's backward graphs can then take their
temporaries and gradients from one pool, captured slot after slot, while each slot
keeps its own pool for forwards (activations live across other slots' events). Checked
against the LIFO pool of ``test_plan_simulation``, over every 1F1B and interleaved order
of the slot tests, with and without the chunk-edge communication: no read ever sees
another buffer's data, fewer blocks are used than with a backward pool per slot, and
each of the rules is needed: a sent dgrad left in the shared pool, or backward runs that
interleave, are caught. A forward the order always follows at once by its own backward
(the loss head of the last stage) joins the shared pool as well; any other forward there
is caught. What every forward makes and frees inside itself (its transients) may go there
too: nothing in that pool is live while a forward replays.
"""

import pytest

from megatron.core.transformer.cuda_graphs.plan import (
    BWD,
    FWD,
    Event,
    backward_runs_alone,
    build_plan,
    forwards_next_to_backward,
    in_backward_pool,
    slot_runs,
)
from tests.unit_tests.transformer.cuda_graphs.test_pipeline_comm import boundary_comm, plan_comm
from tests.unit_tests.transformer.cuda_graphs.test_plan_simulation import Pool, replay_iteration, simulate_capture
from tests.unit_tests.transformer.cuda_graphs.test_slots import (
    CHUNK_OF,
    ORDERS,
    REGIONS_PER_CHUNK,
    chunk_regions,
    cycles_of,
    record,
)

MULTI_SLOT = sorted(
    name for name, (order, chunks) in ORDERS.items() if len(cycles_of(record(order, chunks), chunks)) > 1
)


def capture(events, regions, comm, shared: bool, edit=None, forwards_there=(), transients_there=False):
    """Every slot captured in turn; backward graphs into one pool when ``shared``, and so
    are the forwards of ``forwards_there`` and, with ``transients_there``, every forward's
    temporaries."""
    backward = Pool(first_block=100_000) if shared else None
    slots = {}
    for s, cycle in cycles_of(events, 8).items():
        present = {e.region for e in cycle}
        plan = build_plan(cycle, regions, [c for c in comm if c.key[1] in present], CHUNK_OF)
        if edit is not None:
            edit(plan)
        block, temps = simulate_capture(
            cycle,
            regions,
            plan,
            saves_inputs=True,
            pool=Pool(first_block=1000 * s),
            backward_pool=backward,
            forwards_there=forwards_there,
            transients_there=transients_there,
        )
        slots[s] = (cycle, plan, block, temps)
    return slots


def blocks_used(slots) -> int:
    return len({b for _, _, block, temps in slots.values() for b in [*block.values(), *sum(temps.values(), [])]})


def test_the_schedules_run_each_backward_alone():
    assert MULTI_SLOT, "the slot tests lost their multi-slot orders"
    for name in MULTI_SLOT:
        order, chunks = ORDERS[name]
        events = record(order, chunks)
        assert backward_runs_alone(events, slot_runs(events, CHUNK_OF)), name


def test_one_slot_or_interleaved_backwards_do_not_share():
    order, chunks = ORDERS["1f1b m4 pp2 rank0"]
    events = record(order, chunks)
    assert not backward_runs_alone(events, slot_runs([e for e in events if e.slot == 0]))
    interleaved = [Event(FWD, 0, 0), Event(FWD, 1, 0), Event(FWD, 0, 1), Event(FWD, 1, 1)]
    interleaved += [Event(BWD, 1, 0), Event(BWD, 1, 1), Event(BWD, 0, 0), Event(BWD, 0, 1)]
    assert not backward_runs_alone(interleaved, slot_runs(interleaved))
    forward_after_backward = [Event(FWD, 0, 0), Event(BWD, 0, 0), Event(FWD, 1, 0)]
    forward_after_backward += [Event(FWD, 0, 1), Event(BWD, 0, 1), Event(FWD, 1, 1)]
    assert not backward_runs_alone(forward_after_backward, slot_runs(forward_after_backward))


@pytest.mark.parametrize("edges", [False, True], ids=["no communication", "chunk edges sent and received"])
@pytest.mark.parametrize("name", MULTI_SLOT)
def test_shared_backward_pool_never_corrupts_and_saves_blocks(name, edges):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    sends, recvs = boundary_comm(chunks) if edges else ([], [])
    comm = plan_comm(sends, recvs)
    shared = capture(events, regions, comm, shared=True)
    assert replay_iteration(events, regions, shared, True, comm=sends, recv=recvs) == []
    assert blocks_used(shared) < blocks_used(capture(events, regions, comm, shared=False))


def test_sent_dgrad_left_in_the_shared_pool_is_caught():
    """A chunk's first dgrad is sent, and the send may be waited on as late as before the
    slot's next micro-batch; left in the shared pool, another slot's backward graphs
    overwrite it first wherever one runs in between: in every interleaved order here and
    in 1F1B orders with enough micro-batches."""
    caught = set()
    for name in MULTI_SLOT:
        order, chunks = ORDERS[name]
        events = record(order, chunks)
        regions = chunk_regions(chunks)
        sends, recvs = boundary_comm(chunks)

        def forget_persistence(plan):
            plan.persistent = list  # no dgrad copied into the slot's pool

        slots = capture(events, regions, plan_comm(sends, recvs), shared=True, edit=forget_persistence)
        if replay_iteration(events, regions, slots, True, comm=sends, recv=recvs):
            caught.add(name)
    assert {n for n in MULTI_SLOT if n.startswith("interleaved")} <= caught
    assert "1f1b m8 pp3 rank0" in caught


def test_interleaved_backward_runs_in_a_shared_pool_are_caught():
    """Why the rule exists: two slots whose backward graphs alternate would overwrite
    each other's gradients in one pool."""
    regions = chunk_regions(1)
    n = len(regions)
    order = [Event(FWD, r, s) for s in (0, 1) for r in range(n)]
    order += [Event(BWD, r, s) for r in reversed(range(n)) for s in (0, 1)]
    slots = capture(order, regions, [], shared=True)
    assert replay_iteration(order, regions, slots, True) != []
    assert replay_iteration(order, regions, capture(order, regions, [], shared=False), True) == []


def head_orders():
    """(name, head region) of every multi-slot order whose last chunk's forward of each
    micro-batch is followed at once by its backward: the last region of that chunk."""
    for name in MULTI_SLOT:
        order, chunks = ORDERS[name]
        last = chunks - 1
        if all(
            i + 1 < len(order) and order[i + 1] == ("B", last, mb)
            for i, (phase, c, mb) in enumerate(order)
            if phase == "F" and c == last
        ):
            yield name, (last + 1) * REGIONS_PER_CHUNK - 1


HEADS = dict(head_orders())


def test_forwards_next_to_backward_are_the_last_stages_loss_head():
    # The last rank of an interleaved schedule (1F1B's last rank runs one slot: no sharing).
    last_ranks = {
        n for n in MULTI_SLOT if n.startswith("interleaved") and n.endswith(f"rank{int(n.split()[2][2:]) - 1}")
    }
    assert set(HEADS) == last_ranks, HEADS
    for name in MULTI_SLOT:
        order, chunks = ORDERS[name]
        events = record(order, chunks)
        expected = {HEADS[name]} if name in HEADS else set()
        assert forwards_next_to_backward(events) == expected, name
        assert forwards_next_to_backward(events, excluded=expected) == set(), name


@pytest.mark.parametrize("name", sorted(HEADS))
def test_loss_head_forward_in_the_shared_pool_never_corrupts_and_saves_blocks(name):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    sends, recvs = boundary_comm(chunks, sends_last=False)  # the last stage sends no output
    comm = plan_comm(sends, recvs)
    head = forwards_next_to_backward(events, excluded={c.key[1] for c in comm})
    assert head == {HEADS[name]}
    joined = capture(events, regions, comm, shared=True, forwards_there=head)
    assert replay_iteration(events, regions, joined, True, comm=sends, recv=recvs) == []


def test_other_forwards_in_the_shared_pool_are_caught():
    """Why only such forwards: the first chunk's last forward is followed by other
    steps; in the shared pool, other slots' backward graphs overwrite what it keeps."""
    caught = set()
    for name in MULTI_SLOT:
        order, chunks = ORDERS[name]
        events = record(order, chunks)
        regions = chunk_regions(chunks)
        slots = capture(events, regions, [], shared=True, forwards_there={REGIONS_PER_CHUNK - 1})
        if replay_iteration(events, regions, slots, True):
            caught.add(name)
    assert caught == set(MULTI_SLOT), set(MULTI_SLOT) - caught


def test_which_graphs_the_backward_pool_holds():
    """Every backward, and the forwards of the regions found next to their backward; the
    capture and the memory report read it from the same place."""
    assert in_backward_pool(Event(BWD, 3, 0), ())
    assert not in_backward_pool(Event(FWD, 3, 0), {2})
    assert in_backward_pool(Event(FWD, 2, 1), {2})


@pytest.mark.parametrize("edges", [False, True], ids=["no communication", "chunk edges sent and received"])
@pytest.mark.parametrize("name", MULTI_SLOT)
def test_forward_transients_in_the_shared_pool_never_corrupt_and_save_blocks(name, edges):
    """transients.py's claim, against the hostile pool: every forward writes its temporaries into
    the shared backward pool, with the loss head's forward there too where the order allows it."""
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    regions = chunk_regions(chunks)
    sends, recvs = boundary_comm(chunks, sends_last=name not in HEADS) if edges else ([], [])
    comm = plan_comm(sends, recvs)
    head = forwards_next_to_backward(events, excluded={c.key[1] for c in comm})
    plain = capture(events, regions, comm, shared=True, forwards_there=head)
    moved = capture(events, regions, comm, shared=True, forwards_there=head, transients_there=True)
    assert replay_iteration(events, regions, moved, True, comm=sends, recv=recvs) == []
    assert blocks_used(moved) < blocks_used(plain)
