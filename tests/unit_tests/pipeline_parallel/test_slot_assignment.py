"""Micro-batch slots of a rank's order (``pipeline_parallel/slots.py``, pure Python)."""

import pytest

from megatron.core.pipeline_parallel.schedules import interleaved_order, one_f_one_b_order
from megatron.core.pipeline_parallel.simulate import max_in_flight
from megatron.core.pipeline_parallel.slots import SlotAllocator, assign_slots, reserved


def test_slot_allocator_reuses_the_lowest_free_slot():
    slots = SlotAllocator()
    assert [slots.acquire(m) for m in range(3)] == [0, 1, 2]
    assert slots.release(1) == 1 and 1 not in slots
    assert slots.acquire(3) == 1 and slots.in_flight == 3 and 3 in slots
    with pytest.raises(ValueError, match="already in flight"):
        slots.acquire(3)


def test_one_chunk_takes_the_lowest_free_slot():
    order = [(p, 0, mb) for p, mb in one_f_one_b_order(8, 3)]
    slot_of = assign_slots(order)
    assert [slot_of[(0, mb)] for mb in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


@pytest.mark.parametrize("pp, chunks", [(2, 2), (2, 4), (4, 2), (4, 3)])
@pytest.mark.parametrize("m", [4, 8, 16])
def test_equal_chunks_share_slots_down_to_what_is_in_flight(pp, chunks, m):
    for rank in range(pp):
        if m % pp:
            continue
        order = interleaved_order(m, pp, rank, chunks)
        slot_of = assign_slots(order)
        per_chunk = sum(max_in_flight(order, c) for c in range(chunks))
        assert len(set(slot_of.values())) == max_in_flight(order) <= per_chunk
        live: dict[int, tuple[int, int]] = {}
        for phase, c, mb in order:  # a slot serves one micro-batch at a time
            if phase == "F":
                assert slot_of[(c, mb)] not in live
                live[slot_of[(c, mb)]] = (c, mb)
            else:
                assert live.pop(slot_of[(c, mb)]) == (c, mb)


def test_two_stages_two_chunks_save_a_slot_per_rank():
    # Rank 0 of 2 holds 5 micro-batches at once (chunk 0 up to 4, chunk 1 up to 2): 5 slots, not 6.
    assert [len(set(assign_slots(interleaved_order(8, 2, r, 2)).values())) for r in (0, 1)] == [5, 3]


def test_weights_choose_the_assignment_that_reserves_less():
    order = interleaved_order(8, 2, 0, 2)
    shared, heavy_first = assign_slots(order), assign_slots(order, [3, 1])
    assert reserved(shared, [1, 1]) == 5
    # Shared slots would let chunk 0 (3 layers) reach all 5 slots: 15; its own 4 slots and
    # chunk 1's 2 reserve 4 * 3 + 2 * 1 = 14.
    assert reserved(shared, [3, 1]) == 15 and reserved(heavy_first, [3, 1]) == 14
    assert not {s for (c, _), s in heavy_first.items() if c == 0} & {s for (c, _), s in heavy_first.items() if c == 1}


def test_bad_orders_are_refused():
    with pytest.raises(ValueError, match="starts twice"):
        assign_slots([("F", 0, 0), ("B", 0, 0), ("F", 0, 0)])
    with pytest.raises(ValueError, match="backward before its forward"):
        assign_slots([("B", 0, 0)])
    with pytest.raises(ValueError, match="slot weights for 1 model chunks, the order runs 2"):
        assign_slots([("F", 0, 0), ("F", 1, 0)], [1])


def test_unequal_chunks_search_for_a_cheaper_assignment():
    """Four chunks, the last with the loss head (weights 5, 5, 5, 7): neither per-chunk slots
    (64) nor the lowest free slot (63) is the least; the search finds one reserving 58,
    deterministically, with one micro-batch per slot at a time."""
    from megatron.core.pipeline_parallel import slots as slots_lib

    order = interleaved_order(16, 2, 0, 4)
    weights = [5, 5, 5, 7]
    slot_of = assign_slots(order, weights)
    assert reserved(slots_lib._per_chunk(order, 4), weights) == 64
    assert reserved(slots_lib._lowest_free(order), weights) == 63
    assert reserved(slot_of, weights) == 58 and assign_slots(list(order), weights) == slot_of
    live: dict[int, tuple[int, int]] = {}
    for phase, c, mb in order:
        if phase == "F":
            assert slot_of[(c, mb)] not in live
            live[slot_of[(c, mb)]] = (c, mb)
        else:
            assert live.pop(slot_of[(c, mb)]) == (c, mb)
    # A long order skips the search (its depth is the order's length): the best of the other two.
    long = interleaved_order(160, 2, 0, 4)
    assert len(long) > slots_lib.SEARCH_MAX_STEPS
    assert reserved(assign_slots(long, weights), weights) == min(
        reserved(slots_lib._per_chunk(long, 4), weights), reserved(slots_lib._lowest_free(long), weights)
    )
