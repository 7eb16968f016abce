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

from megatron.core.transformer.cuda_graphs.buffers import BWD, FWD, OWN, Event, RegionIO, Source, build_plan

TEMPS = 2  # temporaries each graph allocates and frees inside its own capture


class Pool:
    def __init__(self):
        self.free, self.count = [], itertools.count()

    def alloc(self):
        return self.free.pop() if self.free else next(self.count)

    def release(self, block):
        self.free.append(block)


def simulate_capture(cycle, regions, plan, saves_inputs, runner_holds=True):
    """Block of every buffer (and of every temporary) after capture in cycle order.

    ``runner_holds=False`` models a capture that keeps no references of its own (only
    the plan's and autograd's), as upstream's weak-reference step did.
    """
    pool, block, holders = Pool(), {}, {}
    temps = {}

    def hold(key, who):
        holders.setdefault(key, set()).add(who)

    def drop(key, who):
        owners = holders.get(key)
        if owners is None or who not in owners:
            return
        owners.discard(who)
        if not owners:
            pool.release(block[key])

    def alloc(key):
        if key not in block:
            block[key] = pool.alloc()
            hold(key, "plan")

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
            temps[pos] = [pool.alloc() for _ in range(TEMPS)]
            for b in temps[pos]:
                pool.release(b)
            for j in range(len(io.output_requires_grad)):
                alloc(("output", e.region, j))
                if io.has_backward and runner_holds:
                    hold(("output", e.region, j), ("runner", e.region))
        else:
            for j, rg in enumerate(io.output_requires_grad):
                if rg:
                    alloc(plan.owner(("grad_output", e.region, j)))
            temps[pos] = [pool.alloc() for _ in range(TEMPS)]
            for b in temps[pos]:
                pool.release(b)
            for who in (("runner", e.region), ("autograd", e.region)):
                for key in list(holders):
                    drop(key, who)
            for i, rg in enumerate(io.input_requires_grad):
                if rg:
                    alloc(("grad_input", e.region, i))
        for key in plan.releases_at(pos):
            if key in block:
                drop(key, "plan")
    return block, temps


def replay(cycle, regions, plan, block, temps, saves_inputs, cycles=2):
    """Writes/reads block contents in replay order; returns the reads that saw wrong data."""
    content, bad = {}, []
    bpos = {e.region: p for p, e in enumerate(cycle) if e.phase == BWD}

    def write(key):
        content[block[key]] = key

    def read(key, when):
        owner = plan.owner(key)
        if content.get(block[owner]) != owner:
            bad.append((when, key, content.get(block[owner])))

    for _ in range(cycles):
        for pos, e in enumerate(cycle):
            io = regions[e.region]
            if e.phase == FWD:
                for i, src in enumerate(io.inputs):
                    key = plan.owner(("input", e.region, i))
                    if src.kind == "own" or (src.kind == "shared" and plan.buffers[key].readers[0] == pos):
                        write(key)  # the eager copy into the static input
                # A graph may write its temporaries before its last read of an input.
                for b in temps[pos]:
                    content[b] = ("temp", pos)
                for i in range(len(io.inputs)):
                    read(("input", e.region, i), f"F{e.region}")
                for j in range(len(io.output_requires_grad)):
                    write(("output", e.region, j))
            else:
                for j, rg in enumerate(io.output_requires_grad):
                    key = ("grad_output", e.region, j)
                    if rg and plan.buffers[key].alias_of is None:
                        write(key)  # the eager copy of the incoming gradient
                for b in temps[pos]:
                    content[b] = ("temp", pos)
                for j, rg in enumerate(io.output_requires_grad):
                    if rg:
                        read(("grad_output", e.region, j), f"B{e.region}")
                if saves_inputs:
                    for i in range(len(io.inputs)):
                        read(("input", e.region, i), f"B{e.region} (saved)")
                for i, rg in enumerate(io.input_requires_grad):
                    if rg:
                        write(("grad_input", e.region, i))
                        if plan.buffers[("grad_input", e.region, i)].copy_out:
                            read(("grad_input", e.region, i), f"copy-out after B{e.region}")
            # Eager code between graphs: every region output is read by eager consumers
            # (final norm, eager MLP, logging) until the producer's backward runs.
            for r, rio in enumerate(regions):
                f = cycle.index(Event(FWD, r))
                end = bpos.get(r, len(cycle))
                if f <= pos < end - 1 or (f <= pos and r not in bpos):
                    for j in range(len(rio.output_requires_grad)):
                        read(("output", r, j), f"eager after {cycle[pos]}")
        # Eager readers of escaping dgrads (embedding backward) run after the cycle; they
        # read the copy, unless the plan handed out the buffer itself.
        handed_off = {spec.alias_of for spec in plan.buffers.values()}
        for (kind, r, i), spec in plan.buffers.items():
            if kind == "grad_input" and (kind, r, i) not in handed_off and not spec.copy_out:
                read((kind, r, i), "eager after the cycle")
    return bad


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
