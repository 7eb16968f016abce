"""The graph session: one per attached model; lifecycle record -> capture -> replay -> close.

``attach(model, ...)`` (``__init__.py``) resolves the scopes, wraps each selected region
in a :class:`GraphedRegion` and routes the layer method through the session by putting
a :class:`RoutedMethod` in the instance's ``__dict__`` (the class's method shows through
again after :meth:`GraphSession.close`). Model classes carry no capture code.

- Recording (iteration 1): regions run eagerly; the recorder keeps the order of events
  ``(phase, region, slot)`` and where every argument came from.
- ``end_of_iteration()`` after iteration 1 builds one plan per slot (its runs: one
  micro-batch of each model chunk it served, ``plan.slot_runs``) and captures
  (``capture.py``). Later iterations replay; each replay must be the event the recorded
  iteration has next (cheap check: an index and a tuple compare), and an iteration must
  replay all of it, no more. The schedule says its micro-batch count (and which
  schedule it is) before each iteration. A new count after capture (batch-size ramp-up)
  replays the one slot's cycle that many times without pipelining, and raises with
  several slots in flight; a new schedule raises. Anything else raises instead of
  silently reading freed memory.
- Pipeline receives (the hooks are in ``pipeline_hooks.py``): the schedule notes a
  received tensor while recording (``note_receive``); after capture ``receive_buffer(slot, chunk)`` is the static input
  of the slot's graph of that chunk that reads it, to receive into without a copy.
  Sends: ``note_send`` for a graphed output; ``note_receive(..., grad_sent=True)`` for
  the gradient of a received input that the schedule sends back from the graph's own
  buffer.
- Pools: one per slot; when the slots' backward runs never interleave (the
  schedules' backward steps), one more that every slot's backward graphs share
  (``plan.backward_runs_alone``).
- Eval and no-grad calls always run eagerly.
- Backward replays mark their parameters ready on the grad sinks (DDP buffers) with an
  event recorded after the replay.

Unusual here: deep-copying an attached model gives a copy whose region methods are the
class's own, bound to the copy (eager, its own weights), never a route into this
session; a second ``attach`` on the same model raises.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import time
import types
import warnings
import weakref
from collections.abc import Hashable, Iterator, Sequence
from typing import Protocol

import torch

from megatron.core.transformer.cuda_graphs import capture as capture_lib
from megatron.core.transformer.cuda_graphs import transients
from megatron.core.transformer.cuda_graphs.accounting import Accounting
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.feed import FeedHooks
from megatron.core.transformer.cuda_graphs.pipeline_hooks import PipelineHooks
from megatron.core.transformer.cuda_graphs.plan import (
    BWD,
    FWD,
    CommRead,
    CommRecv,
    Event,
    Plan,
    RegionIO,
    Run,
    backward_runs_alone,
    build_plan,
    forwards_next_to_backward,
    run_cycle,
    slot_runs,
)
from megatron.core.transformer.cuda_graphs.recorder import Recorder, recording_region
from megatron.core.transformer.cuda_graphs.region import GraphedRegion, arg_metadata
from megatron.core.transformer.cuda_graphs.replay import GraphReplay, RecordBackward
from megatron.core.transformer.cuda_graphs.scratch import ScratchHooks, own_scratch
from megatron.core.transformer.cuda_graphs.turn import TurnHooks, TurnRouter, enabled

NEXT_EVENT = "next event"
"""``note_send(..., until=NEXT_EVENT)``: the send is waited on before the producing slot's
next graph event (a schedule that waits on its sends in the same exchange)."""


class GraphState(enum.Enum):
    OFF = "off"  # graphs disabled (or no CUDA): every region runs eagerly
    RECORD = "record"  # the recording iteration
    CAPTURED = "captured"  # replaying
    CLOSED = "closed"  # detached: the modules are restored


class GradSink(Protocol):
    """Where backward graphs report finished weight gradients (DDP implements it)."""

    def manages(self, param: torch.nn.Parameter) -> bool: ...

    def mark_ready(self, params: Sequence[torch.nn.Parameter], event: torch.cuda.Event) -> None:
        """``params``' main_grads are complete once ``event`` has completed."""

    def add_event(self, params: Sequence[torch.nn.Parameter], event: torch.cuda.Event) -> None:
        """Wait on ``event`` before reading ``params``' buckets, without marking them ready."""


class RoutedMethod:
    """A region method routed through a session; stored on the layer instance."""

    def __init__(self, session: GraphSession, region: GraphedRegion, func):
        self.session = session
        self.region = region
        self.func = func  # the class's function (unbound)

    def __call__(self, *args, **kwargs):
        return self.session.dispatch(self.region, args, kwargs)

    def __deepcopy__(self, memo):
        copy = memo.get(id(self.region.module))
        if copy is None:
            raise RuntimeError(
                f"cannot copy the routed region {self.region.name} on its own; copy the whole model, "
                "or close the graph session first."
            )
        return types.MethodType(self.func, copy)  # the copy runs its own weights, eagerly


class GraphSession(PipelineHooks, TurnHooks, ScratchHooks, FeedHooks, Accounting):
    """Owns the regions, the pools, the recorded order, the replay cursor and teardown.

    Args:
        config: The ``--cuda-graph-*`` settings.
        grad_sinks: Where finished weight gradients are reported (DDP buffers).
    """

    def __init__(self, config: CudaGraphConfig, *, grad_sinks: Sequence[GradSink] = ()):
        self.config = config
        self.grad_sinks = list(grad_sinks)
        self.regions: list[GraphedRegion] = []
        self.state = GraphState.OFF
        if config.enabled:
            if torch.cuda.is_available():
                self.state = GraphState.RECORD
                self.captures_next = enabled()  # the eager turn's watch runs while recording
                if self.captures_next:
                    own_scratch(self)
            else:
                warnings.warn(
                    f"--cuda-graph-impl {config.cuda_graph_impl}: CUDA is not available, so CUDA graphs are off and "
                    "the run is eager.",
                    stacklevel=3,
                )
        self.recorder = Recorder()
        self.order: list[Event] = []  # the recorded iteration, replayed in this order
        self.cycles: dict[int, list[Event]] = {}  # slot -> its runs one after the other
        self.runs: dict[int, list[Run]] = {}  # slot -> (chunk, events of one micro-batch) per chunk served
        self.plans: dict[int, Plan] = {}
        self.comm_reads: list[tuple[int, CommRead]] = []  # (slot, read)
        self.comms: dict[int, list[CommRead | CommRecv]] = {}  # slot -> what communication reads and writes
        self.pools: dict = {}  # slot -> GraphPool
        self.backward_pool = None  # the GraphPool every slot's backward graphs share, if they do
        self.forwards_in_backward_pool: frozenset[int] = frozenset()  # regions whose forwards join it
        self.buffers: dict[int, dict] = {}
        self.cursor = 0
        self.slot = 0
        self.chunk = 0
        self._chunk_of: dict[int, int] = {}  # region -> the model chunk it ran in (recording)
        self.capture_seconds = 0.0
        self.recorded_microbatches: int | None = None
        self.recorded_schedule: Hashable | None = None
        self.received_inputs: set[tuple[int, int]] = set()  # (region, arg) a pipeline receive fills
        self.sent_outputs: dict[tuple[int, int], tuple[str, int] | str | None] = {}  # (region, output) -> wait
        self.sent_grads: set[tuple[int, int, int]] = set()  # (slot, region, arg): a received input's dgrad sent
        self._receives: dict[int, tuple[weakref.ref, bool]] = {}  # recording: id -> (received tensor, grad sent)
        self._slot_at: dict[int, int] = {}  # slot -> cycle position of its last replayed event
        self._run_ends: dict[int, set[int]] = {}  # slot -> cycle positions that end a run
        self._anchor: torch.Tensor | None = None
        self._positions: list[tuple[int, int]] = []  # per order index: (slot, cycle position)
        self._poison: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._debug_checked: dict[int, int] = {}
        self._ready: dict[tuple[int, int], list[tuple[GradSink, list, list]]] = {}

    # ------------------------------------------------------------------ state
    @property
    def active(self) -> bool:
        """Recording or replaying (regions go through the session)."""
        return self.state in (GraphState.RECORD, GraphState.CAPTURED)

    @property
    def captured(self) -> bool:
        return self.state is GraphState.CAPTURED

    @property
    def recording(self) -> bool:
        return self.state is GraphState.RECORD

    def chunk_of(self, region: int) -> int:
        """The model chunk region ``region`` ran in while recording (0 without chunks)."""
        return self._chunk_of.get(region, 0)

    def start_recording(self) -> None:
        """Records even without CUDA, to inspect the order and plan (CPU tests)."""
        self.state = GraphState.RECORD

    def route(self, module: torch.nn.Module, method: str, name: str, shared_params=()) -> GraphedRegion:
        """Routes ``module.<method>`` through the session (``attach`` calls this)."""
        if isinstance(module.__dict__.get(method), RoutedMethod):
            raise RuntimeError(
                f"{name} is already routed through a CUDA graph session; attach once per model "
                "(close() the old session first)."
            )
        func = getattr(type(module), method)
        region = GraphedRegion(
            module, method, types.MethodType(func, module), name, len(self.regions), shared_params=shared_params
        )
        self.regions.append(region)
        module.__dict__[method] = RoutedMethod(self, region, func)
        return region

    def close(self) -> None:
        """Restores every module, frees the graphs, the buffers and the pools. Idempotent."""
        for region in self.regions:
            routed = region.module.__dict__.get(region.method_name)
            if isinstance(routed, RoutedMethod) and routed.session is self:
                del region.module.__dict__[region.method_name]
            region.slots.clear()
        self._close_turn()
        self._close_feed()
        self._close_scratch()
        self.buffers.clear()
        self._poison.clear()
        self._ready.clear()
        for pool in self.all_pools():
            pool.close()
        self.pools.clear()
        self.backward_pool = None
        self._anchor = None
        self.state = GraphState.CLOSED

    def __deepcopy__(self, memo):
        raise RuntimeError("a CUDA graph session cannot be copied; copy the model and attach a new session.")

    # ------------------------------------------------------------------ schedule hooks
    @contextlib.contextmanager
    def micro_batch(self, slot: int, chunk: int = 0) -> Iterator[None]:
        """Forwards inside run in micro-batch ``slot``, in model chunk ``chunk`` (the
        schedule says which; a slot serves one micro-batch at a time, of any chunk)."""
        previous = self.slot, self.chunk
        self.slot, self.chunk = slot, chunk
        try:
            yield
        finally:
            self.slot, self.chunk = previous

    def expect_microbatches(self, n: int, schedule: Hashable | None = None) -> None:
        """Called by the schedule before each training iteration with its micro-batch count.

        ``schedule``: what else fixes the order of graph events and communication waits
        (e.g. ``("interleaved", pp_size, pp_rank, num_chunks)``); compared like the count.
        """
        if self.state is GraphState.RECORD:
            self.recorded_microbatches = n
            self.recorded_schedule = schedule
        elif self.state is GraphState.CAPTURED and schedule != self.recorded_schedule:
            raise ValueError(
                f"CUDA graphs were captured under the schedule {self.recorded_schedule!r}, this iteration runs "
                f"{schedule!r}. The replay order is the recorded schedule's; keep the pipeline layout and schedule "
                "fixed while graphs are on, or run with --cuda-graph-impl none."
            )
        elif self.state is GraphState.CAPTURED and n != self.recorded_microbatches:
            self._rekey_microbatches(n)

    def _rekey_microbatches(self, n: int) -> None:
        """A new micro-batch count after capture (a batch-size ramp or step schedule).

        With one slot and no pipeline schedule every micro-batch replays the same cycle of
        graphs in slot 0, so ``n`` micro-batches replay that cycle ``n`` times: the graphs,
        their plan and buffers stay. With several slots in flight, or under a pipeline
        schedule (whose receives, sends and slot assignment are planned for the recorded
        count), the order depends on the count, which the recorded iteration does not give;
        that raises.
        """
        if self.cursor != 0:
            raise RuntimeError(
                f"CUDA graphs: the micro-batch count changed to {n} in the middle of an iteration "
                f"({self.cursor} of {len(self.order)} graph events replayed)."
            )
        if len(self.cycles) != 1 or self.recorded_schedule is not None:
            raise ValueError(
                f"CUDA graphs were captured for {self.recorded_microbatches} micro-batches per iteration in "
                f"{len(self.cycles)} slot(s) under the schedule {self.recorded_schedule!r}, this iteration has {n}; a "
                "pipelined replay order depends on the count. Keep the global batch size fixed (no --rampup-batch-size or "
                "--step-batch-size-schedule) with a pipelined schedule while graphs are on, or run with "
                "--cuda-graph-impl none."
            )
        ((slot, cycle),) = self.cycles.items()
        assert self.order == cycle * self.recorded_microbatches, "one slot's order is its cycle repeated"
        self.order = cycle * n
        self._positions = [(slot, i) for _ in range(n) for i in range(len(cycle))]
        self.recorded_microbatches = n

    # ------------------------------------------------------------------ dispatch
    def dispatch(self, region: GraphedRegion, args, kwargs):
        if (
            not self.active
            or not region.module.training
            or not torch.is_grad_enabled()
            or (self.state is GraphState.CAPTURED and torch.cuda.is_current_stream_capturing())
        ):
            return region.fn(*args, **kwargs)
        args = region.bind(args, kwargs)
        slot = self.slot
        if self.state is GraphState.RECORD:
            return self._record(region, slot, args)
        region.check_args(args)
        outs = GraphReplay.apply(self, region, slot, self._anchor, *args)
        if (
            self.config.cuda_graph_debug
            and self._debug_checked.get(region.index, 0) < self.config.cuda_graph_debug_replays
        ):
            self._debug_compare(region, args, outs)
        return region.join_outputs(outs)

    def _record(self, region: GraphedRegion, slot: int, args: tuple):
        """Eager forward that also records metadata, sources and the backward order."""
        args = self._feed_region_forward(args)
        if region.arg_meta is None:
            region.arg_meta = arg_metadata(args)
            region.sources = self.recorder.sources(region.index, args, slot)
            for i, a in enumerate(args):
                hit = self._receives.get(id(a))
                if hit is not None and hit[0]() is a and region.sources[i].kind == "own":
                    self.received_inputs.add((region.index, i))
        else:
            region.check_args(args)
        for i, a in enumerate(args):  # per slot: the schedule sends this input's dgrad uncopied
            hit = self._receives.get(id(a)) if (region.index, i) in self.received_inputs else None
            if hit is not None and hit[0]() is a and hit[1] and region.input_requires_grad[i]:
                self.sent_grads.add((slot, region.index, i))
        chunk = self._chunk_of.setdefault(region.index, self.chunk)
        if chunk != self.chunk:
            raise ValueError(
                f"{region.name} ran in model chunk {self.chunk} after running in chunk {chunk}; a region belongs to "
                "one model chunk"
            )
        with recording_region():
            outs = region.note_call(args, region.fn(*args))
        self.recorder.event(Event(FWD, region.index, slot))
        self._watch_forward_done(Event(BWD, region.index, slot), args if region.has_backward else ())
        if region.has_backward:
            idx = [j for j, rg in enumerate(region.output_requires_grad) if rg]
            wrapped = RecordBackward.apply(
                functools.partial(self._recorded_backward, Event(BWD, region.index, slot)), *[outs[j] for j in idx]
            )
            outs = list(outs)
            for j, w in zip(idx, wrapped):
                outs[j] = w
        for j, o in enumerate(outs):
            self.recorder.note_output(o, region.index, slot, j)
        return region.join_outputs(outs)

    def _recorded_backward(self, event: Event, grads: tuple = ()) -> None:
        """Notes a backward of the recording iteration (``grads``: its incoming gradients), and hands the memory
        eager freed up to here back to the device: else, under an interleaved order, blocks freed by one micro-batch
        (the logits) stay cached in pieces other sizes cannot reuse, and the pools captured next start above eager's
        peak. One device sync per region, in this one iteration."""
        self._watch_backward_next(grads, event)
        self._feed_backward_begins()
        self.recorder.event(event)
        torch.cuda.empty_cache()  # a no-op until CUDA is initialised (CPU recording)

    # ------------------------------------------------------------------ replay (GraphReplay calls these)
    def replay_forward(self, region: GraphedRegion, slot: int, args) -> tuple[torch.Tensor, ...]:
        self._advance(Event(FWD, region.index, slot), region)
        outs = region.replay_forward(slot, args)
        self._after_replay()
        self._turn_after_forward()
        return outs

    def replay_backward(self, region: GraphedRegion, slot: int, grads) -> tuple[torch.Tensor | None, ...]:
        self._advance(Event(BWD, region.index, slot), region)
        dgrads = region.replay_backward(slot, grads, after_turn=self._turn_before_backward())
        self._after_replay()
        event = region.slots[slot].wgrad_event
        for sink, ready, waiting in self._ready.get((region.index, slot), ()):
            if ready:
                sink.mark_ready(ready, event)
            if waiting:
                sink.add_event(waiting, event)
        self._turn_after_backward()
        return dgrads

    def _advance(self, event: Event, region: GraphedRegion) -> None:
        if self.cursor == len(self.order):
            raise RuntimeError(
                f"CUDA graph replay past the recorded iteration: all {len(self.order)} recorded graph events have "
                f"replayed, then came the {event.phase} graph of {region.name} in slot {event.slot}. More "
                "micro-batches than recorded, or a schedule other than the recorded one; call end_of_iteration() "
                "after every training iteration."
            )
        expected = self.order[self.cursor]
        if event != expected:
            want = self.regions[expected.region]
            raise RuntimeError(
                f"CUDA graph replay out of capture order: expected the {expected.phase} graph of {want.name} "
                f"in slot {expected.slot} (event {self.cursor} of {len(self.order)} in the recorded iteration), "
                f"got the {event.phase} graph of {region.name} in slot {event.slot}. Graphs are only correct "
                "when replayed in the order the recording iteration ran; the schedule or the data flow changed."
            )
        slot, position = self._positions[self.cursor]
        self._slot_at[slot] = position
        self.cursor += 1

    def _after_replay(self) -> None:
        """Debug mode: poison the buffers that died with the event that just replayed."""
        if self._poison:
            for t in self._poison.get(self._positions[self.cursor - 1], ()):
                t.fill_(float("nan"))

    def end_of_iteration(self) -> None:
        """Called after every training iteration: captures after the first."""
        if self.state is GraphState.RECORD and self.recorder.order:
            self.capture()
        elif self.state is GraphState.CAPTURED:
            if self._turn is not None:
                self._turn.close()  # normally closed by the first backward replay, or the backward pass's end
            self._pass_end_queued = False  # a backward pass that raised never ran its final callbacks
            if self.cursor not in (0, len(self.order)):
                raise RuntimeError(
                    f"CUDA graphs: the iteration ended after {self.cursor} of the {len(self.order)} recorded graph "
                    "events; a forward without its backward, or a schedule other than the recorded one, breaks "
                    "buffer reuse."
                )
            self.cursor = 0

    # ------------------------------------------------------------------ plan and capture
    def make_plans(self) -> dict[int, Plan]:
        """Each slot's cycle and hand-off plan, from what the recording iteration saw."""
        self.order = list(self.recorder.order)
        self.runs = slot_runs(self.order, self._chunk_of)
        self.cycles = {slot: run_cycle(runs) for slot, runs in self.runs.items()}
        self._run_ends = {}
        for slot, runs in self.runs.items():
            ends, end = set(), -1
            for _, events in runs:
                end += len(events)
                ends.add(end)
            self._run_ends[slot] = ends
        ios = [RegionIO(r.name, list(r.sources), r.input_requires_grad, r.output_requires_grad) for r in self.regions]
        self.plans = {}
        for slot, cycle in self.cycles.items():
            regions = {e.region for e in cycle}
            comm: list[CommRead | CommRecv] = [read for s, read in self.comm_reads if s == slot]
            comm += [CommRecv(("input", r, i)) for r, i in sorted(self.received_inputs) if r in regions]
            comm += [
                CommRead(("output", r, j), _next_event(cycle, r) if until == NEXT_EVENT else until)
                for (r, j), until in self.sent_outputs.items()
                if r in regions
            ]
            comm += [CommRead(("grad_input", r, i)) for s, r, i in sorted(self.sent_grads) if s == slot]
            self.plans[slot] = build_plan(cycle, ios, comm, self._chunk_of)
            self.comms[slot] = comm
        positions = {slot: {(e.phase, e.region): i for i, e in enumerate(c)} for slot, c in self.cycles.items()}
        self._positions = [(e.slot, positions[e.slot][(e.phase, e.region)]) for e in self.order]
        return self.plans

    def capture(self) -> None:
        start = time.perf_counter()
        watch = self._end_watch()
        feed_watch = self._end_feed_watch()  # pushed before the turns' watch
        plans = self.make_plans()
        self.recorder.clear_identities()
        share = backward_runs_alone(self.order, self.runs) and not any(
            read.until is not None and read.until[0] == FWD and read.key[0] == "grad_input"
            for _, read in self.comm_reads
        )
        communicating = {c.key[1] for comm in self.comms.values() for c in comm}
        next_to_backward = frozenset(forwards_next_to_backward(self.order, communicating))
        turns = self._plan_turns(watch, plans, self.recorded_schedule is None and not communicating, next_to_backward)
        self.turn_plan = turns
        if turns is not None:  # turns allocate in a backward pool of its own
            share = True
            if turns.first is not None:  # the first turn's work would overwrite those forwards' outputs
                next_to_backward = frozenset()
        self.forwards_in_backward_pool = next_to_backward if share else frozenset()
        self.pools, self.backward_pool, self.buffers = capture_lib.capture_all(
            self.regions,
            self.cycles,
            plans,
            self.config.cuda_graph_warmup_steps,
            share_backward=share,
            forwards_in_backward_pool=self.forwards_in_backward_pool,
            keep=turns.keep if turns is not None else frozenset(),
            turn_pattern=turns.pattern if turns is not None else None,
            scratch_to_backward=self._capture_scratch(share, len(self.cycles)),
            forward_transients=transients.enabled(),
        )
        if turns is not None:
            self._turn = TurnRouter(self.backward_pool, turns.first[0] if turns.first else None, turns.after_backward)
        self._open_scratch()
        first_forward = next((e.region for e in self.order if e.phase == FWD), None)
        self._open_feed(
            feed_watch,
            first_turn=turns is not None and turns.first is not None,
            first_forward_in_backward_pool=first_forward in self.forwards_in_backward_pool,
        )
        if self.config.cuda_graph_debug:
            for slot, plan in plans.items():
                for position, tensors in capture_lib.poison_plan(plan, self.buffers[slot]).items():
                    self._poison[(slot, position)] = tensors
        self._ready = self._sink_lists()
        self._anchor = torch.zeros((), device=torch.cuda.current_device(), requires_grad=True)
        self.state = GraphState.CAPTURED
        self.cursor = 0
        self._receives.clear()
        self._slot_at.clear()
        self.capture_seconds = time.perf_counter() - start

    def _sink_lists(self) -> dict[tuple[int, int], list[tuple[GradSink, list, list]]]:
        """Per (region, slot): for each sink, the params its replay completes and those it
        only writes part of (fused shared weights: eager autograd completes them)."""
        lists = {}
        for region in self.regions:
            per_sink = []
            for sink in self.grad_sinks:
                ready = [p for p in region.params if sink.manages(p)]
                waiting = [p for p in region.fused_shared_params if sink.manages(p)]
                if ready or waiting:
                    per_sink.append((sink, ready, waiting))
            for slot in region.slots:
                lists[(region.index, slot)] = per_sink
        return lists

    # ------------------------------------------------------------------ debug
    def _debug_compare(self, region: GraphedRegion, args, outs) -> None:
        self._debug_checked[region.index] = self._debug_checked.get(region.index, 0) + 1
        with torch.no_grad():
            ref = region.split_outputs(region.fn(*args))
        for j, (got, want) in enumerate(zip(outs, ref)):
            if not torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2, equal_nan=False):
                diff = (got.float() - want.float()).abs().max().item()
                raise RuntimeError(
                    f"--cuda-graph-debug: replay of {region.name} output {j} differs from an eager run "
                    f"(max abs diff {diff:.3e}); a static buffer was overwritten before it was read."
                )


def _next_event(cycle: Sequence[Event], region: int) -> tuple[str, int] | None:
    """``(phase, region)`` of the event after ``region``'s forward in ``cycle`` (None: none)."""
    at = next(i for i, e in enumerate(cycle) if e.phase == FWD and e.region == region)
    return (cycle[at + 1].phase, cycle[at + 1].region) if at + 1 < len(cycle) else None
