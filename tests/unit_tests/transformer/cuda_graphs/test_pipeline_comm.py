"""Chunk boundaries under pipeline schedules against the hostile simulated pool (pure Python).

Every 1F1B and interleaved order of the slot tests (1, 2, 4, 8 micro-batches, 2-4
stages, every rank) is replayed with the communication a pipeline stage does at its
chunks' edges: the last graph's output is sent to the next stage (the send reads the
buffer until its wait, here the latest one allowed: right before the slot's next
micro-batch starts); the first graph's static input is where the receive
lands (posted once the slot's previous micro-batch has finished, no copy); the first
graph's dgrad is sent back (read by the send, no copy). The plan must never let a
later graph clobber what a send still reads or what a receive wrote, and each naive
release, or a receive posted too early, must be caught.
"""

import pytest

from megatron.core.pipeline_parallel.schedules import one_f_one_b_order
from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, CommRead, CommRecv, build_plan, slot_cycles
from tests.unit_tests.transformer.cuda_graphs.test_plan_simulation import (
    Pool,
    replay_iteration,
    simulate_capture,
    stack,
)
from tests.unit_tests.transformer.cuda_graphs.test_slots import (
    CHUNK_OF,
    ORDERS,
    REGIONS_PER_CHUNK,
    chunk_regions,
    record,
)


def boundary_comm(num_chunks, receives_first=True, sends_last=True):
    """(sends, receives) at every chunk's edges; the model's first chunk receives only on
    later pipeline ranks and its last chunk sends only on earlier ones."""
    sends, recvs = [], []
    for c in range(num_chunks):
        first, last = c * REGIONS_PER_CHUNK, (c + 1) * REGIONS_PER_CHUNK - 1
        if c < num_chunks - 1 or sends_last:
            sends.append(CommRead(("output", last, 0), until=None))
        if c > 0 or receives_first:
            recvs.append(("input", first, 0))
            sends.append(CommRead(("grad_input", first, 0), until=None))
    return sends, recvs


def captured(events, regions, comm_for, saves_inputs, runner_holds=True, edit=None):
    slots = {}
    for s, cycle in slot_cycles(events, CHUNK_OF).items():
        present = {e.region for e in cycle}
        comm = [c for c in comm_for if c.key[1] in present]
        plan = build_plan(cycle, regions, comm, CHUNK_OF)
        if edit is not None:
            edit(plan, cycle)
        block, temps = simulate_capture(cycle, regions, plan, saves_inputs, runner_holds, pool=Pool(1000 * s))
        slots[s] = (cycle, plan, block, temps)
    return slots


def case(name, middle_rank=True):
    order, chunks = ORDERS[name]
    events = record(order, chunks)
    sends, recvs = boundary_comm(chunks, receives_first=middle_rank, sends_last=middle_rank)
    return events, chunk_regions(chunks), sends, recvs


def plan_comm(sends, recvs):
    return sends + [CommRecv(k) for k in recvs]


@pytest.mark.parametrize("saves_inputs", [True, False], ids=["inputs saved", "nothing saved"])
@pytest.mark.parametrize("name", sorted(ORDERS))
def test_chunk_edges_never_corrupt(name, saves_inputs):
    events, regions, sends, recvs = case(name)
    slots = captured(events, regions, plan_comm(sends, recvs), saves_inputs)
    assert replay_iteration(events, regions, slots, saves_inputs, comm=sends, recv=recvs) == []
    for _, plan, _, _ in slots.values():
        for key in recvs:
            if key in plan.buffers:  # received into, kept; sent buffers are never copied
                assert plan.buffers[key].release_after is None and plan.buffers[key].dead_after is None
        for read in sends:
            if read.key in plan.buffers:
                assert not plan.buffers[read.key].copy_out and plan.buffers[read.key].release_after is None


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_first_and_last_stage_edges_never_corrupt(name):
    events, regions, sends, recvs = case(name, middle_rank=False)
    slots = captured(events, regions, plan_comm(sends, recvs), saves_inputs=True)
    assert replay_iteration(events, regions, slots, saves_inputs=True, comm=sends, recv=recvs) == []


def naive_release_after_producer(plan, cycle):
    for spec in plan.buffers.values():
        if spec.alias_of is None and spec.key[0] in ("output", "grad_input"):
            phase = FWD if spec.key[0] == "output" else BWD
            spec.release_after = next(i for i, e in enumerate(cycle) if e.phase == phase and e.region == spec.key[1])


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_naive_release_of_sent_outputs_is_caught(name):
    events, regions, sends, recvs = case(name)
    slots = captured(events, regions, plan_comm(sends, recvs), False, False, edit=naive_release_after_producer)
    assert replay_iteration(events, regions, slots, False, comm=sends, recv=recvs) != []


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_send_the_plan_does_not_know_is_caught(name):
    """The plan is told of the receives only: a sent output is released after its
    producer's backward, and the send, waited on later, reads a clobbered block."""
    events, regions, sends, recvs = case(name)
    slots = captured(events, regions, [CommRecv(k) for k in recvs], saves_inputs=True)
    assert replay_iteration(events, regions, slots, True, comm=sends, recv=recvs) != []


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_receive_posted_before_the_slot_finished_is_caught(name):
    """The receive for the slot's next micro-batch lands while its previous micro-batch's
    first backward still reads the saved input (what ``receive_buffer`` refuses)."""
    events, regions, sends, recvs = case(name)
    slots = captured(events, regions, plan_comm(sends, recvs), saves_inputs=True)
    assert replay_iteration(events, regions, slots, True, comm=sends, recv=recvs, recv_early=True) != []


@pytest.mark.parametrize("saves_inputs", [True, False], ids=["inputs saved", "nothing saved"])
@pytest.mark.parametrize("m", [2, 4, 8])
def test_receive_into_a_released_input_is_caught(m, saves_inputs):
    """A plan that releases the received input as it would a copied one: once its last
    holder lets go (the first backward), the sent dgrad takes its block, and the next
    micro-batch's receive lands on the dgrad before the send is waited on."""
    order = [(p, 0, mb) for p, mb in one_f_one_b_order(m, 1)]
    events = record(order, 1)
    _, regions = stack(REGIONS_PER_CHUNK, shared=False)  # no RoPE table to take the block first
    sends, recvs = boundary_comm(1)

    def release_after_forward(plan, cycle):
        plan.buffers[("input", 0, 0)].release_after = plan.position(FWD, 0)

    kept = captured(events, regions, plan_comm(sends, recvs), saves_inputs)
    assert replay_iteration(events, regions, kept, saves_inputs, comm=sends, recv=recvs) == []
    naive = captured(events, regions, plan_comm(sends, recvs), saves_inputs, edit=release_after_forward)
    assert replay_iteration(events, regions, naive, saves_inputs, comm=sends, recv=recvs) != []


def test_receive_into_a_handed_off_input_is_rejected():
    events, regions, _, _ = case("1f1b m2 pp2 rank0")
    cycle = slot_cycles(events)[0]
    with pytest.raises(ValueError, match="not a forward input of its own"):
        build_plan(cycle, regions, [CommRecv(("input", 1, 0))])  # region 1 reads region 0's output


@pytest.mark.parametrize("name", sorted(ORDERS))
def test_send_waited_on_after_the_slot_moved_on_is_caught(name):
    """A buffer kept for good may sit in a block that a buffer released earlier in the
    cycle also uses (here: the RoPE table's, copied in by the next micro-batch's first
    forward); a send must be waited on before the slot's next micro-batch starts."""
    events, regions, sends, recvs = case(name)
    slots = captured(events, regions, plan_comm(sends, recvs), saves_inputs=True)
    assert replay_iteration(events, regions, slots, True, comm=sends, recv=recvs, late_wait=True) != []
