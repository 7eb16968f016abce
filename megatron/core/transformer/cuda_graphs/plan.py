"""The hand-off plan: which static buffer feeds whom, and when our reference may go.

Pure Python, no torch: computed from the order the first (eager) iteration recorded,
unit-tested on the CPU.

Vocabulary. An *event* is one graph execution: forward or backward of region r in
micro-batch *slot* s (``F3@1``). A slot is a micro-batch in flight: the schedule gives
each micro-batch a free slot when its forward starts (``pipeline_parallel/slots.py``),
and the slot is free again once its backward has run, so a region needs one graph pair
per slot, never one per micro-batch. The recorded *iteration* is every event of one
global batch in execution order (1F1B and interleaved schedules mix slots). Restricted
to one slot it is a sequence of *runs*, one per micro-batch the slot served, e.g. ``F0
F1 .. Fn Bn .. B0`` for a stack of regions; every run of a model chunk is the same. A
slot's *cycle* is one run of each chunk it served, one after the other, and its graphs
are captured in cycle order into one pool of that slot; with one slot in flight (no
pipelining) that is the one shared pool of the run. A slot may serve the chunks' runs in
any order, as the schedule hands it out (``pipeline_parallel/slots.py``): at the end of
a run everything it allocated is dead except the buffers kept for good below, which
nothing reads once the slot's next run starts; so whichever run comes next may reuse its
memory, and the slot's pool reserves the largest run, not the sum. Slots need pools of
their own: a forward of slot 0 replays while slot 1's activations are live, yet slot 0
was captured before they existed, so in one pool its temporaries may sit where they now
live (the hostile pool test shows it). Backward graphs are the exception
(:func:`backward_runs_alone`): when every slot's backward events of a micro-batch run
back to back, with no other slot's graph in between (what the schedules do: one backward
step runs a chunk's whole backward), the backward graphs of all slots share one pool.
What they allocate is dead by the end of that run (temporaries, gradients handed along
the run, dgrads copied out to eager code) except what a send reads later
(:meth:`Plan.persistent`), which the backward graph copies into a buffer of its slot's
own pool. So slots pay for one set of backward temporaries, as eager does, not one each.
A forward that the order always follows at once by its own backward (the loss head of a
pipeline's last stage: :func:`forwards_next_to_backward`) joins that pool as well: what
it allocates is dead once its backward has run, and no other graph replays in between,
so its activations (the logits' gradient, the largest of a run) are reserved once, not
in every slot that serves its chunk.
Replay must walk the recorded iteration in order, every iteration. Each region owns four
kinds of static buffers per slot:

* ``input``       forward input i of region r (filled by a copy at replay), unless it is
                  handed off from a producer's output (same memory, no copy) or shared
                  by several regions (one buffer, one copy per cycle).
* ``output``      forward output j of region r (returned to the caller without a copy).
* ``grad_output`` gradient arriving for output j (filled by a copy at replay), unless it
                  is the dgrad a later region's backward graph already wrote there.
* ``grad_input``  dgrad for input i, written by the backward graph.

Release rule. The pool hands a freed block to whatever is captured *later*, and
replay runs in capture order, so a buffer may be released (our strong reference turned
into a non-owning view) right after the capture of its last reader in cycle order and
never earlier. Readers that autograd knows of need no help: a tensor saved for backward
is owned by the captured autograd graph until the backward capture frees it. The plan
keeps a strong reference for readers autograd cannot see:

* an output is read by eager code and by consumers until the producer's own backward
  has run (every differentiable use sends its gradient there first): keep it until the
  producer's backward capture (forever when the region has no backward graph);
* a dgrad handed to a producer is read by that producer's backward graph: keep it until
  that capture. A dgrad that escapes to eager code (the embedding's or an eager MLP's
  backward) is *copied out* right after its replay: eager autograd gets the copy and
  may keep it as long as it likes, and the buffer dies with its own backward graph;
* an own input / shared input is read by its consumers' forward graphs;
* an own grad_output is read by the region's backward graph only;
* a buffer a communication op reads (a pipeline send of an output or of a dgrad) is
  kept until the event before which the op is waited on (``CommRead``); a dgrad that is
  sent needs no copy. ``until=None`` keeps the buffer for good, yet the op must still be
  waited on before the slot's next micro-batch starts: a buffer kept for good may sit
  in a block that a buffer released earlier in the cycle used, and the next
  micro-batch (of any chunk) writes that one first (the hostile pool test shows it);
* the static input a pipeline receive writes into (``CommRecv``: the input of a chunk's
  first graph, received into without a copy) is kept for good. The receive is posted
  when the slot's previous micro-batch has finished its run and lands before the
  forward; a block released inside the cycle may by then hold a buffer that lives past
  the cycle (a frozen output, an output whose send is waited on late), which the
  receive would overwrite. Autograd holds that input until the first graph's backward
  anyway, so keeping it costs nothing in the cycle.
"""

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

FWD = "fwd"
BWD = "bwd"


@dataclasses.dataclass(frozen=True)
class Event:
    """One graph execution: a phase of a region in a micro-batch slot."""

    phase: str  # FWD or BWD
    region: int
    slot: int = 0

    def __str__(self) -> str:
        return f"{'F' if self.phase == FWD else 'B'}{self.region}" + (f"@{self.slot}" if self.slot else "")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where forward input i of a region comes from.

    kind: ``own`` (a fresh buffer, copied into), ``handoff`` (output ``index`` of region
    ``region``), or ``shared`` (group ``index``: one buffer for every region that reads
    the same tensor).
    """

    kind: str
    region: int = -1
    index: int = -1


OWN = Source("own")


@dataclasses.dataclass
class RegionIO:
    """What the recording pass learned about one region's tensor arguments."""

    name: str
    inputs: list[Source]
    input_requires_grad: list[bool]
    output_requires_grad: list[bool]

    @property
    def has_backward(self) -> bool:
        return any(self.output_requires_grad)


@dataclasses.dataclass(frozen=True)
class CommRead:
    """A communication op (e.g. a pipeline send) reads buffer ``key`` after it is written.

    ``until``: the (phase, region) before whose replay the op is waited on, or None when
    the wait comes only after the whole cycle. The buffer stays strong until then.
    """

    key: tuple[str, int, int]
    until: tuple[str, int] | None = None


@dataclasses.dataclass(frozen=True)
class CommRecv:
    """A pipeline receive writes forward input ``key`` (``("input", region, i)``, a buffer
    of its own) between the slot's cycles, before the region's forward replays."""

    key: tuple[str, int, int]


BufferKey = tuple[str, int, int]  # (kind, region, index)


@dataclasses.dataclass
class BufferSpec:
    """One static buffer and when our strong reference to it may be dropped.

    ``release_after`` is a position in the cycle (the buffer is released right after
    that event is captured), or ``None`` for never. ``alias_of`` names the buffer this
    one shares memory with; aliases have no lifetime of their own.
    """

    key: BufferKey
    alias_of: BufferKey | None = None
    release_after: int | None = None
    readers: list[int] = dataclasses.field(default_factory=list)
    dead_after: int | None = None
    """Position after which no graph reads the memory, counting reads of tensors that
    autograd saved (they happen in the backward of each forward reader). Debug mode
    poisons the buffer right after this event at replay. ``None``: never dead."""
    copy_out: bool = False
    """Replay hands eager code a copy made right after the producing graph, not the buffer."""


@dataclasses.dataclass
class Plan:
    cycle: list[Event]
    buffers: dict[BufferKey, BufferSpec]

    def releases_at(self, position: int) -> list[BufferKey]:
        """Buffers whose strong reference is dropped right after capturing ``position``."""
        return [k for k, b in self.buffers.items() if b.alias_of is None and b.release_after == position]

    def owner(self, key: BufferKey) -> BufferKey:
        """The buffer that owns the memory behind ``key`` (itself unless aliased)."""
        return _root(self.buffers, key)

    def position(self, phase: str, region: int) -> int:
        """Position of ``phase`` of ``region`` in the cycle."""
        return next(i for i, e in enumerate(self.cycle) if e.phase == phase and e.region == region)

    def released_across(self, position: int, kinds: Iterable[str]) -> list[BufferKey]:
        """Released buffers of ``kinds`` whose memory holds data over the gap right after
        ``position``: written by then, read by a graph after it. The allocator sees their
        blocks as free, so eager code allocating in their pool there would overwrite them.
        A buffer is written by its region's event of its phase (a grad_output by the copy
        just before its backward, an input by the copy just before its forward)."""
        kinds = set(kinds)
        phase = {"output": FWD, "input": FWD, "grad_output": BWD, "grad_input": BWD}
        found = []
        for key, spec in self.buffers.items():
            if key[0] not in kinds or spec.alias_of is not None or spec.release_after is None:
                continue
            written = self.position(phase[key[0]], key[1]) if key[0] in phase else min(spec.readers)
            if written <= position < spec.dead_after:
                found.append(key)
        return found

    def persistent(self) -> list[BufferKey]:
        """Dgrads read after the cycle's backward run has ended: kept for good (a send
        waited on before the slot's next micro-batch). With a shared backward pool they
        must live in the slot's pool."""
        return [
            k
            for k, b in self.buffers.items()
            if k[0] == "grad_input" and b.alias_of is None and b.release_after is None
        ]


Run = tuple[int, list[Event]]  # (model chunk, the events of one micro-batch)


def slot_runs(order: Sequence[Event], chunk_of: Mapping[int, int] | None = None) -> dict[int, list[Run]]:
    """Each slot's runs in a recorded iteration: per model chunk the slot served, the
    events of one of its micro-batches (a *run*), chunks in the order the slot first served them.

    A slot serves one micro-batch at a time, so its events split into runs: a new run
    starts with a forward of another chunk (``chunk_of``: region -> chunk, default 0) or
    of a region the current run already ran. Every run of a chunk must be the same.

    Raises:
        ValueError: no events; runs of one chunk differ; a backward of another chunk
            inside a run.
    """
    if not order:
        raise ValueError("no graphed region ran during the recording iteration")
    chunk_of = chunk_of or {}
    runs: dict[int, list[tuple[int, list[Event]]]] = {}
    seen: dict[int, set[int]] = {}  # slot -> forwards of its current run
    for e in order:
        chunk = chunk_of.get(e.region, 0)
        current = runs[e.slot][-1] if e.slot in runs else None
        if current is None or (e.phase == FWD and (chunk != current[0] or e.region in seen[e.slot])):
            current = (chunk, [])
            runs.setdefault(e.slot, []).append(current)
            seen[e.slot] = set()
        elif chunk != current[0]:
            raise ValueError(
                f"slot {e.slot} ran {e} of model chunk {chunk} inside a micro-batch of chunk {current[0]}; a slot "
                "serves one micro-batch at a time"
            )
        if e.phase == FWD:
            seen[e.slot].add(e.region)
        current[1].append(e)
    result: dict[int, list[Run]] = {}
    for slot, slot_runs_ in sorted(runs.items()):
        first: dict[int, list[Event]] = {}
        for chunk, events in slot_runs_:
            want = first.setdefault(chunk, events)
            if events != want:
                raise ValueError(
                    "graphed regions ran in a different order in different micro-batches of the recording "
                    f"iteration (slot {slot}, first micro-batch: {' '.join(map(str, want))}; later: "
                    f"{' '.join(map(str, events))}); partial graphs need the same order every micro-batch"
                )
        result[slot] = list(first.items())
    return result


def run_cycle(runs: Sequence[Run]) -> list[Event]:
    """A slot's cycle: its runs (:func:`slot_runs`) one after the other."""
    return [e for _, events in runs for e in events]


def slot_cycles(order: Sequence[Event], chunk_of: Mapping[int, int] | None = None) -> dict[int, list[Event]]:
    """Each slot's cycle (:func:`run_cycle` of its runs)."""
    return {slot: run_cycle(runs) for slot, runs in slot_runs(order, chunk_of).items()}


def backward_runs_alone(order: Sequence[Event], runs: dict[int, list[Run]]) -> bool:
    """Whether the slots' backward graphs may share one pool (module docstring).

    True when there are several slots, every run (:func:`slot_runs`) is all its
    forwards then all its backwards, and in ``order`` no other slot's event falls
    between the first and the last backward of a run.
    """
    if len(runs) < 2:
        return False
    backwards: dict[int, int] = {}  # region -> backward events of its run
    for slot_runs_ in runs.values():
        for _, events in slot_runs_:
            phases = [e.phase for e in events]
            if BWD not in phases or FWD in phases[phases.index(BWD) :]:
                return False
            for e in events:
                backwards[e.region] = phases.count(BWD)
    open_run: int | None = None  # the slot whose backward run has started and not ended
    remaining = 0
    for e in order:
        if open_run is not None and e.slot != open_run:
            return False
        if e.phase == BWD:
            if open_run is None:
                open_run, remaining = e.slot, backwards[e.region]
            remaining -= 1
            if remaining == 0:
                open_run = None
    return open_run is None


def forwards_next_to_backward(order: Sequence[Event], excluded: Iterable[int] = ()) -> set[int]:
    """Regions whose every forward in ``order`` is followed at once by their own backward
    in the same slot; with a shared backward pool their forward graphs join it (module
    docstring). ``excluded``: regions a communication op reads or writes a buffer of."""
    found = {e.region for e in order if e.phase == FWD} - set(excluded)
    for i, e in enumerate(order):
        if e.phase == FWD and (i + 1 == len(order) or order[i + 1] != Event(BWD, e.region, e.slot)):
            found.discard(e.region)
    return found


def in_backward_pool(event: Event, forwards_in_backward_pool: Iterable[int]) -> bool:
    """Whether ``event``'s graph is captured where backwards go: a backward, or the forward
    of a region :func:`forwards_next_to_backward` found."""
    return event.phase != FWD or event.region in forwards_in_backward_pool


def build_plan(
    cycle: Sequence[Event],
    regions: Sequence[RegionIO],
    comm: Sequence[CommRead | CommRecv] = (),
    chunk_of: Mapping[int, int] | None = None,
) -> Plan:
    """Computes aliasing and release points for every static buffer of one slot's cycle.

    Args:
        cycle: One slot's cycle (one run per model chunk it serves), in execution order.
        regions: What recording learned of each region (index = ``Event.region``).
        comm: Buffers that communication reads, and until when; inputs that receives write.
        chunk_of: Region -> model chunk (default 0). A tensor that regions of several
            chunks read (a cached RoPE table) gets one shared buffer per chunk: the slot
            may run any chunk's micro-batch next, and each run fills its own.
    """
    chunk_of = chunk_of or {}
    cycle = list(cycle)
    if len({e.slot for e in cycle}) > 1:
        raise ValueError(f"a cycle holds the events of one slot, got {' '.join(map(str, cycle))}")
    pos: dict[tuple[str, int], int] = {}
    for i, e in enumerate(cycle):
        if (e.phase, e.region) in pos:
            raise ValueError(f"event {e} appears twice in one cycle")
        pos[(e.phase, e.region)] = i
    # The regions of this slot's runs (one run per model chunk it serves).
    present = sorted({e.region for e in cycle})
    for r in present:
        if (FWD, r) not in pos:
            raise ValueError(f"region {regions[r].name} ran backward but never forward in the recorded cycle")
    planned = [(r, regions[r]) for r in present]

    def fpos(r: int) -> int:
        return pos[(FWD, r)]

    def bpos(r: int) -> int | None:
        return pos.get((BWD, r))

    buffers: dict[BufferKey, BufferSpec] = {}
    # Forward readers of every output and shared group.
    output_readers: dict[tuple[int, int], list[int]] = {}
    shared_readers: dict[int, list[int]] = {}
    group_of: dict[tuple[int, int], int] = {}  # (chunk, recorded shared group) -> group of this plan

    def group(r: int, src: Source) -> int:
        return group_of.setdefault((chunk_of.get(r, 0), src.index), len(group_of))

    for r, io in planned:
        for i, src in enumerate(io.inputs):
            if src.kind == "handoff":
                if (FWD, src.region) not in pos or fpos(src.region) >= fpos(r):
                    raise ValueError(f"region {io.name} input {i} is handed off from a region that runs later")
                output_readers.setdefault((src.region, src.index), []).append(fpos(r))
            elif src.kind == "shared":
                shared_readers.setdefault(group(r, src), []).append(fpos(r))

    for r, io in planned:
        b = bpos(r)
        for j in range(len(io.output_requires_grad)):
            readers = [fpos(r)] + output_readers.get((r, j), [])
            # Eager readers of an output finish before the producer's backward; without
            # a backward graph nothing bounds them, so the buffer is kept.
            release = b if b is not None else None
            buffers[("output", r, j)] = BufferSpec(("output", r, j), release_after=release, readers=readers)
        for i, src in enumerate(io.inputs):
            key = ("input", r, i)
            if src.kind == "handoff":
                buffers[key] = BufferSpec(key, alias_of=("output", src.region, src.index), readers=[fpos(r)])
            elif src.kind == "shared":
                shared = ("shared", -1, group(r, src))
                if shared not in buffers:
                    readers = sorted(shared_readers[group(r, src)])
                    buffers[shared] = BufferSpec(shared, release_after=readers[-1], readers=readers)
                buffers[key] = BufferSpec(key, alias_of=shared, readers=[fpos(r)])
            else:
                buffers[key] = BufferSpec(key, release_after=fpos(r), readers=[fpos(r)])
        if b is None:
            continue
        for j, rg in enumerate(io.output_requires_grad):
            if rg:
                buffers.setdefault(
                    ("grad_output", r, j), BufferSpec(("grad_output", r, j), release_after=b, readers=[b])
                )
        for i, rg in enumerate(io.input_requires_grad):
            if not rg:
                continue
            src = io.inputs[i]
            key = ("grad_input", r, i)
            if src.kind == "handoff" and bpos(src.region) is not None and bpos(src.region) > b:
                p = bpos(src.region)
                buffers[key] = BufferSpec(key, release_after=p, readers=[p])
                # The producer's grad_output is this dgrad: no copy at replay.
                buffers[("grad_output", src.region, src.index)] = BufferSpec(
                    ("grad_output", src.region, src.index), alias_of=key, readers=[p]
                )
            else:
                buffers[key] = BufferSpec(key, release_after=b, readers=[b], copy_out=True)
    for recv in [c for c in comm if isinstance(c, CommRecv)]:
        spec = buffers.get(recv.key)
        kind, r, i = recv.key
        if kind != "input" or spec is None or spec.alias_of is not None or regions[r].inputs[i].kind != "own":
            raise ValueError(
                f"a pipeline receive writes {recv.key}, which is not a forward input of its own in this cycle"
            )
        spec.release_after = None
    for read in [c for c in comm if isinstance(c, CommRead)]:
        spec = buffers.get(read.key)
        if spec is None or spec.alias_of is not None:
            raise ValueError(f"communication reads {read.key}, which is not a buffer of its own in this cycle")
        if read.until is None:
            spec.release_after = None
        else:
            if read.until not in pos:
                raise ValueError(f"communication on {read.key} is waited on before {read.until}, which never runs")
            wait = pos[read.until] - 1  # the last event that may replay while the op reads
            spec.readers.append(wait)
            if spec.release_after is not None:
                spec.release_after = max(spec.release_after, wait)
        spec.copy_out = False  # the op reads the buffer itself
    # When is the memory dead for good? A forward reader may have saved the tensor for
    # its backward, so its backward counts as a reader too.
    region_of_fwd = {pos[(FWD, r)]: r for r in present}
    for key, spec in buffers.items():
        if spec.alias_of is not None or spec.release_after is None:
            continue
        readers = [spec.release_after]
        for k2, s2 in buffers.items():
            if k2 == key or (s2.alias_of is not None and _root(buffers, k2) == key):
                for p in s2.readers:
                    readers.append(p)
                    r = region_of_fwd.get(p)
                    if r is not None and bpos(r) is not None:
                        readers.append(bpos(r))
        spec.dead_after = max(readers)
    return Plan(cycle=cycle, buffers=buffers)


def _root(buffers: dict[BufferKey, BufferSpec], key: BufferKey) -> BufferKey:
    while buffers[key].alias_of is not None:
        key = buffers[key].alias_of
    return key
