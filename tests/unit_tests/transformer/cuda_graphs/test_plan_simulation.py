"""Adversarial check of the release plan against a simulated shared pool (pure Python).

A toy allocator replays what capture does: every static buffer, graph output and
graph temporary is a block of one size (so any freed block fits any later request),
and a freed block is handed to the very next allocation (LIFO: the most aggressive
reuse an allocator could do). Strong references are held exactly as the capture code
holds them: the plan's reference until ``release_after``; autograd's saved tensors
until the region's backward capture; the runner's forward outputs and capture
arguments until the same point. Then the cycle is replayed twice, writing and reading
block contents, with eager readers placed as late as the plan's rules allow. Any read
that finds another buffer's data in its block is the silent corruption upstream
shipped; the plan must never produce one, and a naive plan (release right after the
producing event) must.
"""

import itertools

import pytest

from megatron.core.transformer.cuda_graphs.plan import (
    BWD,
    FWD,
    OWN,
    CommRead,
    Event,
    RegionIO,
    Source,
    build_plan,
    forwards_next_to_backward,
)
from megatron.core.transformer.cuda_graphs.turn import gap_holds_data

TEMPS = 2  # temporaries each graph allocates and frees inside its own capture


class Pool:
    def __init__(self, first_block=0):
        self.free, self.count = [], itertools.count(first_block)

    def alloc(self):
        return self.free.pop() if self.free else next(self.count)

    def release(self, block):
        self.free.append(block)


def simulate_capture(
    cycle,
    regions,
    plan,
    saves_inputs,
    runner_holds=True,
    pool=None,
    backward_pool=None,
    forwards_there=(),
    transients_there=False,
):
    """Block of every buffer (and of every temporary) after capture in cycle order.

    ``runner_holds=False`` models a capture that keeps no references of its own (only
    the plan's and autograd's), as upstream's weak-reference step did. ``pool``: capture
    into this pool (shared with other cycles) instead of a new one. ``backward_pool``:
    backward events allocate there (a pool the slots share), except the dgrads the plan
    keeps for good (``Plan.persistent``), which the graph copies into ``pool``; so do the
    forwards of the regions in ``forwards_there`` (their inputs stay in ``pool``).
    ``transients_there``: every forward's temporaries allocate in ``backward_pool``
    (``cuda_graphs/transients.py``).
    """
    pool = Pool() if pool is None else pool
    bpool = pool if backward_pool is None else backward_pool
    persistent = set(plan.persistent()) if backward_pool is not None else set()
    block, holders, home = {}, {}, {}
    temps = {}

    def hold(key, who):
        holders.setdefault(key, set()).add(who)

    def drop(key, who):
        owners = holders.get(key)
        if owners is None or who not in owners:
            return
        owners.discard(who)
        if not owners:
            home[key].release(block[key])

    def alloc(key, into=pool):
        if key not in block:
            block[key] = into.alloc()
            home[key] = into
            hold(key, "plan")

    def scratch(into):
        blocks = [into.alloc() for _ in range(TEMPS)]
        for b in blocks:
            into.release(b)
        return blocks

    for pos, e in enumerate(cycle):
        io = regions[e.region]
        if e.phase == FWD:
            for i in range(len(io.inputs)):
                key = plan.owner(("input", e.region, i))
                alloc(key)
                if io.has_backward:
                    if runner_holds:
                        hold(key, ("runner", e.region))  # capture args kept for the backward capture
                    if saves_inputs:
                        hold(key, ("autograd", e.region))
            into = bpool if e.region in forwards_there else pool
            temps[pos] = scratch(bpool if transients_there else into)
            for j in range(len(io.output_requires_grad)):
                alloc(("output", e.region, j), into)
                if io.has_backward and runner_holds:
                    hold(("output", e.region, j), ("runner", e.region))
        else:
            for j, rg in enumerate(io.output_requires_grad):
                if rg:
                    alloc(plan.owner(("grad_output", e.region, j)), bpool)
            persist = [("grad_input", e.region, i) for i, rg in enumerate(io.input_requires_grad) if rg]
            persist = [k for k in persist if k in persistent]
            for key in persist:  # the copy's destination, allocated before the capture
                alloc(key, pool)
            temps[pos] = scratch(bpool)
            for who in (("runner", e.region), ("autograd", e.region)):
                for key in list(holders):
                    drop(key, who)
            for i, rg in enumerate(io.input_requires_grad):
                if rg:
                    if ("grad_input", e.region, i) in persist:
                        temps[pos] += scratch(bpool)[:1]  # the dgrad before its copy: dead after the graph
                    alloc(("grad_input", e.region, i), bpool)
        for key in plan.releases_at(pos):
            if key in block:
                drop(key, "plan")
    return block, temps


def replay(cycle, regions, plan, block, temps, saves_inputs, cycles=2, comm=(), turns=None):
    """Writes/reads block contents in replay order; returns the reads that saw wrong data.

    ``comm``: buffers a communication op reads (instead of eager code) until it is waited
    on, right before the event ``until`` names.
    """
    return replay_iteration(
        list(cycle), regions, {0: (cycle, plan, block, temps)}, saves_inputs, cycles, comm, turns=turns
    )


def replay_iteration(
    order, regions, slots, saves_inputs, iterations=2, comm=(), recv=(), recv_early=False, late_wait=False, turns=None
):
    """``replay`` over a recorded iteration that mixes micro-batch slots.

    ``slots[s] = (cycle, plan, block, temps)`` of slot s; a cycle may hold runs of several
    model chunks (:func:`run_bounds`), which the order serves in any sequence. After every
    event, eager code reads every live output of every slot (a micro-batch in flight
    keeps its outputs). Block contents are labelled with the micro-batch (the slot's run
    count), so a write meant for the next micro-batch is caught as well.

    ``comm``: a send reads its buffer right before the event ``until`` names; with
    ``until`` None at the latest moment allowed, right before the slot's next
    micro-batch starts (and at the end); with ``late_wait`` later than allowed, right
    before the producer writes the buffer again.
    ``recv``: input keys a pipeline receive writes instead of the copy at the forward;
    posted (for the slot's next run) right after the slot's previous micro-batch finished
    its run, or with ``recv_early`` right before that run's last event (a schedule that
    receives early).
    ``turns``: ``(positions, blocks)``: eager code after each of those cycle positions
    allocates in a pool and writes every one of ``blocks`` (its free blocks after capture),
    as the eager turns between backward graphs may.
    """
    sent_late = {c.key for c in comm if c.until is None}
    sent = {c.key for c in comm}
    bounds = {s: run_bounds(cycle) for s, (cycle, *_) in slots.items()}
    # Per event that ends a run: the regions of the slot's next run (the order repeats).
    next_run: dict[int, set[int]] = {}
    for i, e in enumerate(order):
        pos = slots[e.slot][1].position(e.phase, e.region)
        if pos in bounds[e.slot][1]:
            nxt = next(
                order[(i + k) % len(order)]
                for k in range(1, len(order) + 1)
                if order[(i + k) % len(order)].slot == e.slot
            )
            next_run[i] = run_regions(slots[e.slot][0], slots[e.slot][1].position(nxt.phase, nxt.region))
    content, bad = {}, []
    at = {s: None for s in slots}  # slot -> cycle position of its last replayed event
    gen = {s: 0 for s in slots}  # slot -> micro-batches it has started
    sent_gen = {}  # (slot, key) -> micro-batch whose data a late-waited send reads

    def write(s, key, g=None):
        content[slots[s][2][key]] = (s, key, gen[s] if g is None else g)

    def read(s, key, when, g=None):
        _, plan, block, _ = slots[s]
        owner = plan.owner(key)
        want = (s, owner, gen[s] if g is None else g)
        if content.get(block[owner]) != want:
            bad.append((when, s, key, content.get(block[owner])))

    def post_receives(s, g, regions_next=None):
        plan = slots[s][1]
        for key in recv:
            if key in plan.buffers and (regions_next is None or key[1] in regions_next):
                write(s, plan.owner(key), g)

    def producer(key):
        return (FWD if key[0] == "output" else BWD, key[1])

    for s in slots:
        post_receives(s, 1)  # each slot's first micro-batch
    for _ in range(iterations):
        for index, e in enumerate(order):
            s = e.slot
            cycle, plan, block, temps = slots[s]
            starts, ends = bounds[s]
            pos = plan.position(e.phase, e.region)
            io = regions[e.region]
            for c in comm:
                if c.until == (e.phase, e.region):
                    read(s, c.key, f"send waited on before {e}")
                elif c.until is None and (s, c.key) in sent_gen:
                    due = producer(c.key) == (e.phase, e.region) if late_wait else pos in starts
                    if due:
                        g = sent_gen.pop((s, c.key))
                        read(s, c.key, f"send of micro-batch {g} waited on before {e}", g)
            if recv_early and pos in ends:
                post_receives(s, gen[s] + 1, next_run[index])
            if pos in starts:
                gen[s] += 1
            if e.phase == FWD:
                for i, src in enumerate(io.inputs):
                    key = plan.owner(("input", e.region, i))
                    if key in recv:
                        continue  # the receive wrote it
                    if src.kind == "own" or (src.kind == "shared" and plan.buffers[key].readers[0] == pos):
                        write(s, key)  # the eager copy into the static input
                # A graph may write its temporaries before its last read of an input.
                for b in temps[pos]:
                    content[b] = ("temp", s, pos)
                for i in range(len(io.inputs)):
                    read(s, ("input", e.region, i), f"{e}")
                for j in range(len(io.output_requires_grad)):
                    write(s, ("output", e.region, j))
            else:
                for j, rg in enumerate(io.output_requires_grad):
                    key = ("grad_output", e.region, j)
                    if rg and plan.buffers[key].alias_of is None:
                        write(s, key)  # the eager copy of the incoming gradient
                for b in temps[pos]:
                    content[b] = ("temp", s, pos)
                for j, rg in enumerate(io.output_requires_grad):
                    if rg:
                        read(s, ("grad_output", e.region, j), f"{e}")
                if saves_inputs:
                    for i in range(len(io.inputs)):
                        read(s, ("input", e.region, i), f"{e} (saved)")
                for i, rg in enumerate(io.input_requires_grad):
                    if rg:
                        write(s, ("grad_input", e.region, i))
                        if plan.buffers[("grad_input", e.region, i)].copy_out:
                            read(s, ("grad_input", e.region, i), f"copy-out after {e}")
            for key in sent_late:
                if producer(key) == (e.phase, e.region):
                    sent_gen[s, key] = gen[s]
            at[s] = pos
            if turns is not None and pos in turns[0]:
                for b in turns[1]:
                    content[b] = ("turn", s, pos)
            # Eager code between graphs: every region output is read by eager consumers
            # (final norm, eager MLP, logging) until the producer's backward runs.
            for t, p in at.items():
                if p is None:
                    continue
                t_plan = slots[t][1]
                current = run_regions(slots[t][0], p)
                for r, rio in enumerate(regions):
                    if r not in current:
                        continue
                    f = t_plan.position(FWD, r)
                    has_b = any(ev.region == r and ev.phase == BWD for ev in slots[t][0])
                    end = t_plan.position(BWD, r) if has_b else len(slots[t][0])
                    if f <= p < end or (f <= p and not has_b):
                        for j in range(len(rio.output_requires_grad)):
                            read(t, ("output", r, j), f"eager after {e}")
            if pos in ends:
                # Eager readers of escaping dgrads (embedding backward) run after the run;
                # they read the copy, unless the plan handed out the buffer itself.
                handed_off = {spec.alias_of for spec in plan.buffers.values()}
                mine = run_regions(cycle, pos)
                for (kind, r, i), spec in plan.buffers.items():
                    if (
                        kind == "grad_input"
                        and r in mine
                        and (kind, r, i) not in handed_off | sent
                        and not spec.copy_out
                    ):
                        read(s, (kind, r, i), "eager after the run")
                if not recv_early:
                    post_receives(s, gen[s] + 1, next_run[index])
    for (s, key), g in sent_gen.items():
        read(s, key, "send waited on at the end", g)
    return bad


def run_bounds(cycle) -> tuple[set[int], set[int]]:
    """(first, last) positions of the runs in a slot's cycle: a run is a micro-batch of one
    model chunk, its forwards then its backwards, so a forward after a backward starts one."""
    starts = {0} | {i for i in range(1, len(cycle)) if cycle[i].phase == FWD and cycle[i - 1].phase == BWD}
    return starts, {i - 1 for i in starts if i} | {len(cycle) - 1}


def run_regions(cycle, pos) -> set[int]:
    """The regions of the run that holds position ``pos`` of ``cycle``."""
    starts, ends = run_bounds(cycle)
    first, last = max(i for i in starts if i <= pos), min(i for i in ends if i >= pos)
    return {e.region for e in cycle[first : last + 1]}


def stack(n, shared=True, handoff=True):
    regions = []
    for i in range(n):
        hidden = Source("handoff", i - 1, 0) if handoff and i else OWN
        inputs = [hidden] + ([Source("shared", index=0)] if shared else [])
        regions.append(RegionIO(f"r{i}", inputs, [True] + [False] * shared, [True]))
    cycle = [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]
    return cycle, regions


CASES = {
    "layers with hand-offs": stack(6),
    "sub-layer regions with eager between": stack(6, handoff=False),
    "no shared input": stack(4, shared=False),
    "frozen regions (no backward)": (
        [Event(FWD, 0), Event(FWD, 1), Event(FWD, 2)],
        [RegionIO(f"f{i}", [OWN], [False], [False]) for i in range(3)],
    ),
}


@pytest.mark.parametrize("runner_holds", [True, False], ids=["with runner holds", "plan alone"])
@pytest.mark.parametrize("saves_inputs", [True, False], ids=["inputs saved", "nothing saved"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_plan_never_lets_a_later_graph_clobber_a_live_buffer(case, saves_inputs, runner_holds):
    cycle, regions = CASES[case]
    plan = build_plan(cycle, regions)
    block, temps = simulate_capture(cycle, regions, plan, saves_inputs, runner_holds)
    assert replay(cycle, regions, plan, block, temps, saves_inputs) == []
    # The plan is not just "keep everything": memory is actually shared.
    used = set(block.values()) | {b for bs in temps.values() for b in bs}
    assert len(used) < len(block) + sum(len(bs) for bs in temps.values())


def test_escaping_dgrad_released_without_copy_out_is_caught():
    cycle, regions = CASES["sub-layer regions with eager between"]
    plan = build_plan(cycle, regions)
    for spec in plan.buffers.values():
        spec.copy_out = False  # hand eager code the buffer itself, yet release it as if copied
    block, temps = simulate_capture(cycle, regions, plan, saves_inputs=False, runner_holds=False)
    assert replay(cycle, regions, plan, block, temps, saves_inputs=False) != []


@pytest.mark.parametrize(
    "case", ["layers with hand-offs", "sub-layer regions with eager between", "frozen regions (no backward)"]
)
def test_naive_release_after_producer_is_caught(case):
    cycle, regions = CASES[case]
    plan = build_plan(cycle, regions)
    for spec in plan.buffers.values():  # the naive scheme: drop each buffer right after it is produced
        if spec.alias_of is None and spec.key[0] in ("output", "grad_input"):
            phase = FWD if spec.key[0] == "output" else BWD
            spec.release_after = cycle.index(Event(phase, spec.key[1]))
    block, temps = simulate_capture(cycle, regions, plan, saves_inputs=False, runner_holds=False)
    assert replay(cycle, regions, plan, block, temps, saves_inputs=False) != []


def comm_case():
    """Sub-layer regions; the first region's dgrad goes to a pipeline send, waited on
    only before the last backward of the cycle (the send reads the buffer itself)."""
    cycle, regions = stack(4, handoff=False)
    return cycle, regions, [CommRead(("grad_input", 2, 0), until=(BWD, 0))]


def test_send_still_reading_keeps_its_buffer():
    cycle, regions, comm = comm_case()
    plan = build_plan(cycle, regions, comm)
    spec = plan.buffers[("grad_input", 2, 0)]
    assert not spec.copy_out and spec.release_after == plan.position(BWD, 0) - 1
    block, temps = simulate_capture(cycle, regions, plan, saves_inputs=False, runner_holds=False)
    assert replay(cycle, regions, plan, block, temps, saves_inputs=False, comm=comm) == []


def test_send_ignored_by_the_plan_is_caught():
    cycle, regions, comm = comm_case()
    plan = build_plan(cycle, regions)  # the plan does not know of the send ...
    plan.buffers[("grad_input", 2, 0)].copy_out = False  # ... which reads the buffer itself
    block, temps = simulate_capture(cycle, regions, plan, saves_inputs=False, runner_holds=False)
    assert replay(cycle, regions, plan, block, temps, saves_inputs=False, comm=comm) != []


@pytest.mark.parametrize("head", [False, True], ids=["", "last forward in the backward pool"])
@pytest.mark.parametrize("case", ["layers with hand-offs", "sub-layer regions with eager between"])
def test_eager_turns_between_backward_graphs_write_only_dead_blocks(case, head):
    """The eager turns between backward graphs allocate in the backward pool and may get any block
    free after capture: with a turn after each backward position ``turn.gap_holds_data`` leaves,
    no read sees a turn's data; with one after every backward graph, a dgrad handed from one
    backward graph to the next is overwritten. ``head``: the last region's forward, followed at
    once by its backward (a graphed loss head), is captured into the backward pool too, as when
    no first turn opens."""
    cycle, regions = CASES[case]
    plan = build_plan(cycle, regions)
    bpool = Pool(first_block=1000)
    there = frozenset(forwards_next_to_backward(cycle)) if head else frozenset()
    assert len(there) == head
    block, temps = simulate_capture(cycle, regions, plan, True, pool=Pool(), backward_pool=bpool, forwards_there=there)
    free = list(bpool.free)
    gaps = [p for p, e in enumerate(cycle) if e.phase == BWD][:-1]
    safe = {p for p in gaps if not gap_holds_data(plan, p, there)}
    assert replay(cycle, regions, plan, block, temps, True, turns=(safe, free)) == []
    if case == "layers with hand-offs":
        assert safe == set()
        assert replay(cycle, regions, plan, block, temps, True, turns=(set(gaps), free)) != []
    else:
        assert safe == set(gaps) and free  # every gap turns, over real free blocks
