"""The hand-off / release plan, on recorded orders (pure Python)."""

import pytest

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


def stack_cycle(n):
    return [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]


def layer_stack(n, shared=True):
    """n whole-layer regions: hidden handed off layer to layer, rotary table shared."""
    regions = []
    for i in range(n):
        hidden = OWN if i == 0 else Source("handoff", i - 1, 0)
        inputs = [hidden] + ([Source("shared", index=0)] if shared else [])
        regions.append(RegionIO(f"layer{i}", inputs, [True] + ([False] if shared else []), [True]))
    return regions


def pos(cycle, phase, r):
    return cycle.index(Event(phase, r))


def test_handoff_forward_and_backward_alias():
    cycle = stack_cycle(3)
    plan = build_plan(cycle, layer_stack(3))
    # Forward: layer k+1 reads layer k's output buffer directly (no copy).
    assert plan.buffers[("input", 1, 0)].alias_of == ("output", 0, 0)
    assert plan.buffers[("input", 2, 0)].alias_of == ("output", 1, 0)
    # Backward: layer k's grad_output is layer k+1's dgrad buffer.
    assert plan.buffers[("grad_output", 0, 0)].alias_of == ("grad_input", 1, 0)
    assert plan.buffers[("grad_output", 1, 0)].alias_of == ("grad_input", 2, 0)
    # The first layer's input comes from eager code: a buffer of its own, copied into.
    assert plan.buffers[("input", 0, 0)].alias_of is None
    # Last layer's grad_output comes from eager code too.
    assert plan.buffers[("grad_output", 2, 0)].alias_of is None
    assert plan.owner(("grad_output", 0, 0)) == ("grad_input", 1, 0)


def test_handed_off_dgrad_released_after_its_reader():
    cycle = stack_cycle(3)
    plan = build_plan(cycle, layer_stack(3))
    # dgrad of layer 2 is read by layer 1's backward graph, then dead.
    assert plan.buffers[("grad_input", 2, 0)].release_after == pos(cycle, BWD, 1)
    assert plan.buffers[("grad_input", 1, 0)].release_after == pos(cycle, BWD, 0)
    # The first layer's dgrad escapes to eager code (embedding backward): replay hands out
    # a copy, so the buffer dies with its own backward graph.
    spec = plan.buffers[("grad_input", 0, 0)]
    assert spec.copy_out and spec.release_after == pos(cycle, BWD, 0)
    assert not any(b.copy_out for k, b in plan.buffers.items() if k != ("grad_input", 0, 0))


def test_output_escaping_to_eager_kept_until_producer_backward():
    cycle = stack_cycle(3)
    plan = build_plan(cycle, layer_stack(3))
    # The last layer's output escapes to the final norm and loss: eager code reads it
    # until the gradient reaches the layer, so it must survive every capture before B2.
    assert plan.buffers[("output", 2, 0)].release_after == pos(cycle, BWD, 2)
    for r in range(3):
        assert plan.buffers[("output", r, 0)].release_after == pos(cycle, BWD, r)
        assert plan.buffers[("output", r, 0)].release_after > pos(cycle, FWD, 2)


def test_saved_for_backward_input_dead_only_after_backward():
    cycle = stack_cycle(2)
    plan = build_plan(cycle, layer_stack(2))
    spec = plan.buffers[("input", 0, 0)]
    # Our reference may go after the forward capture (autograd owns saved tensors) ...
    assert spec.release_after == pos(cycle, FWD, 0)
    # ... but the memory is only dead after the backward that may read what was saved.
    assert spec.dead_after == pos(cycle, BWD, 0)


def test_multi_consumer_input_is_one_buffer():
    cycle = stack_cycle(4)
    plan = build_plan(cycle, layer_stack(4))
    group = ("shared", -1, 0)
    for r in range(4):
        assert plan.owner(("input", r, 1)) == group
    # Held until the last forward reader is captured, dead after the last backward.
    assert plan.buffers[group].readers == [pos(cycle, FWD, r) for r in range(4)]
    assert plan.buffers[group].release_after == pos(cycle, FWD, 3)
    assert plan.buffers[group].dead_after == pos(cycle, BWD, 0)


def test_output_read_by_two_regions_released_after_both():
    # Region 0's output feeds regions 1 and 2 (e.g. a residual read by two branches).
    cycle = stack_cycle(3)
    regions = [
        RegionIO("a", [OWN], [True], [True]),
        RegionIO("b", [Source("handoff", 0, 0)], [True], [True]),
        RegionIO("c", [Source("handoff", 0, 0)], [True], [True]),
    ]
    plan = build_plan(cycle, regions)
    spec = plan.buffers[("output", 0, 0)]
    assert spec.readers == [pos(cycle, FWD, 0), pos(cycle, FWD, 1), pos(cycle, FWD, 2)]
    assert spec.release_after == pos(cycle, BWD, 0)
    assert spec.dead_after >= pos(cycle, BWD, 1)


def test_sub_layer_regions_with_eager_between():
    # attn-only scope: attn graphs with eager MLPs in between -> no hand-offs at all.
    n = 3
    cycle = stack_cycle(n)
    regions = [RegionIO(f"attn{i}", [OWN, Source("shared", index=0)], [True, False], [True]) for i in range(n)]
    plan = build_plan(cycle, regions)
    for r in range(n):
        assert plan.buffers[("input", r, 0)].alias_of is None
        assert plan.buffers[("grad_output", r, 0)].alias_of is None
        # dgrads go to the eager MLP below: copied out at replay, released after their graph.
        spec = plan.buffers[("grad_input", r, 0)]
        assert spec.copy_out and spec.release_after == plan.cycle.index(Event(BWD, r))


def test_region_without_backward_keeps_its_output():
    cycle = [Event(FWD, 0)]
    plan = build_plan(cycle, [RegionIO("frozen", [OWN], [False], [False])])
    assert plan.buffers[("output", 0, 0)].release_after is None
    assert ("grad_output", 0, 0) not in plan.buffers


def test_releases_never_precede_any_reader():
    cycle = stack_cycle(5)
    plan = build_plan(cycle, layer_stack(5))
    for key, spec in plan.buffers.items():
        if spec.alias_of is None and spec.release_after is not None:
            assert all(r <= spec.release_after for r in spec.readers), key
            for k2, s2 in plan.buffers.items():
                if s2.alias_of is not None and plan.owner(k2) == key:
                    assert all(r <= spec.release_after for r in s2.readers), (key, k2)


def test_slot_runs_over_micro_batches():
    one = stack_cycle(3)
    assert slot_runs(one * 4) == {0: [(0, one)]}
    assert slot_cycles(one) == {0: one}


def test_slot_runs_of_a_slot_serving_two_chunks_in_any_order():
    chunk0, chunk1 = stack_cycle(2), [Event(FWD, 2), Event(FWD, 3), Event(BWD, 3), Event(BWD, 2)]
    chunk_of = {0: 0, 1: 0, 2: 1, 3: 1}
    order = chunk1 + chunk0 + chunk0 + chunk1 + chunk0
    assert slot_runs(order, chunk_of) == {0: [(1, chunk1), (0, chunk0)]}
    assert slot_cycles(order, chunk_of) == {0: chunk1 + chunk0}
    # Without the chunks a forward after a run's backward is not a new run: the orders differ.
    with pytest.raises(ValueError, match="different order"):
        slot_runs(order)


def test_slot_runs_reject_changing_order_and_overlapping_micro_batches():
    one = stack_cycle(3)
    other = [Event(FWD, 0), Event(FWD, 2), Event(FWD, 1), Event(BWD, 1), Event(BWD, 2), Event(BWD, 0)]
    with pytest.raises(ValueError, match="different order"):
        slot_runs(one + other)
    with pytest.raises(ValueError, match="different order"):  # the last micro-batch never ran backward
        slot_runs(one + one[:3])
    with pytest.raises(ValueError, match="no graphed region"):
        slot_runs([])
    inside = [Event(FWD, 0), Event(FWD, 2), Event(BWD, 0)]  # chunk 1 starts while chunk 0's backward is due
    with pytest.raises(ValueError, match="B0 of model chunk 0 inside a micro-batch of chunk 1"):
        slot_runs(inside, {0: 0, 2: 1})


def test_handoff_from_later_region_rejected():
    cycle = stack_cycle(2)
    regions = [RegionIO("a", [Source("handoff", 1, 0)], [True], [True]), RegionIO("b", [OWN], [True], [True])]
    with pytest.raises(ValueError, match="runs later"):
        build_plan(cycle, regions)


def test_released_across_names_backward_buffers_that_hold_data_over_a_gap():
    """Eager code between two backward graphs may allocate in their pool only where no released
    buffer holds data: a dgrad handed from one backward graph to the next does, a dgrad
    copied out to eager code (regions separated by eager layers) does not."""
    cycle = stack_cycle(3)
    grads = ("grad_input", "grad_output")
    handed = build_plan(cycle, layer_stack(3))
    assert handed.released_across(pos(cycle, BWD, 2), grads) == [("grad_input", 2, 0)]
    assert handed.released_across(pos(cycle, BWD, 1), grads) == [("grad_input", 1, 0)]
    assert handed.released_across(pos(cycle, BWD, 0), grads) == []
    # Forward outputs saved for backward are live over the backward gaps too (another pool here).
    assert ("output", 0, 0) in handed.released_across(pos(cycle, BWD, 2), ["output"])
    separated = [RegionIO(f"attn{i}", [OWN], [True], [True]) for i in range(3)]
    plan = build_plan(cycle, separated)
    for r in range(3):
        assert plan.released_across(pos(cycle, BWD, r), grads) == []
