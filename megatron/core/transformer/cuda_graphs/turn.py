"""The eager turn: the eager work between a micro-batch's last forward graph and its first
backward graph, allocated in the pool of the backward graphs.

With a partial scope, eager code runs after the last graphed region: the layers after it
and the loss head, then their backward, before the first backward graph. Eagerly, the loss
head's logits die just before the first backward's temporaries are born, and the two share
memory. With graphs the pool reserves those temporaries for good while the logits need the
eager cache on top of it: most of a partial scope's memory over eager. The turn routes the
eager work's allocations into the backward graphs' pool, whose memory holds nothing at that
time:

* Only with one micro-batch in flight and no pipeline schedule (every forward, then every
  backward), and not for MoE models (their eager layers keep statistics on logging
  iterations, which the check below could miss). The backward graphs get a pool of their
  own (``share_backward``); the forward pool keeps the saved activations, which live across
  the turn.
* Routing is per thread (the caching allocator's thread filter): the main thread from the
  last forward replay to the end of the model's forward; autograd's device thread from
  when the gradient of the model's output arrives to the first backward replay. The loss
  and what the schedule sums in between (logged values) are not routed, and the model's
  output is cloned out of the pool.
* Nothing born in the turn may outlive it, since the first backward graph writes over its
  memory. The recording iteration checks that with :class:`TurnWatch` and leaves the turn
  off, with a warning naming the ops, if anything does (a ``param.grad`` waiting for DDP's
  fold is the usual one: DDP folds on arrival while the turn is switched on). The first backward
  graph's static gradient inputs stay held: the turn's gradient is copied into them.
* Between backward graphs, eager backward work (the eager MLP of an ``attn`` scope) turns too
  (``MEGATRON_CG_EAGER_TURN=all``, the default; ``1`` opens the first turn only, ``0`` none), also
  where the first turn stays closed (a graphed loss head): from right after a
  backward graph, whose dgrads for eager code are copies in the eager cache, to the next
  backward graph. The recording checks the same (nothing made in between is alive at the next
  backward graph but the gradients handed to it), and two more things: a gradient handed to a
  backward graph is dead once its region's input gradients are made (else autograd keeps it for
  another use, which at replay would read it after the graph's temporaries overwrote it); and
  no released buffer of the backward pool holds data over the gap (``Plan.released_across``: a
  dgrad handed from one backward graph to the next). Each such turn is judged alone: one that fails
  stays closed, the others open. A gradient an eager turn hands to a graph that
  overlaps the graph's static input is copied into it through a clone.
* A forward's scratch blocks (``scratch.py``: working memory that dies inside its block, as the
  Mamba scan's slices) allocate in the backward pool too, where the turns open.
* The turn after a micro-batch's last backward graph (the embedding's backward, whose weight
  gradient lives until DDP folds it) ends with the backward pass, in autograd's final callback,
  instead of at a next backward graph; the recording judges it there too. Eagerly that gradient
  reuses the memory the backward freed; outside the pool it would sit on top of the pools.
* No turn where a collective could run inside one (tensor parallelism; gradient reduction
  overlapping the backward with DP > 1): it runs on NCCL's stream of its own. Not yet run on several GPUs.
* The pool's memory is shared only if the backward graphs' temporaries are cut from the memory
  the turn uses; captured first, they are not, and the turn's tensors (the logits) grow the pool
  beside them. So the watch also notes the order in which the turn
  allocated and freed (:attr:`TurnWatch.pattern`), and the capture allocates and frees the same
  sizes in the backward pool, on the training stream, just before the first backward graph
  (:func:`shape_pool`): the graphs' temporaries are then cut from the turn's segments, and each
  replayed turn finds them free again.
* A tensor that autograd keeps past the turn by design is made under :func:`outside_turn`, in the
  eager cache, unseen by the watch: the weight gradient of an output layer tied to the word
  embeddings without gradient-accumulation fusion, which waits for the embedding's part.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
import warnings
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _get_current_dispatch_mode_stack

from megatron.core.transformer.cuda_graphs.plan import BWD, FWD
from megatron.core.transformer.cuda_graphs.pool import (
    GraphPool,
    allocate_into_pool,
    begin_allocating_into,
    end_allocating_into,
)
from megatron.core.transformer.cuda_graphs.transients import made_storages

ENV_SWITCH = "MEGATRON_CG_EAGER_TURN"
"""``all`` (the default) opens the eager turns: the first, before the first backward graph, and those
between backward graphs; ``1`` the first only; ``0`` none. A turn routes eager allocations into graph
memory, where a wrong lifetime would corrupt silently: the recording checks each turn before it opens
it, and the GPU tests compare graphed runs with eager, bitwise, under each setting."""


def _switch() -> str:
    value = os.environ.get(ENV_SWITCH, "all")
    if value not in ("0", "1", "all"):
        raise ValueError(
            f"{ENV_SWITCH}={value!r}: use 0 (no eager turns), 1 (the first turn only) or all (every turn, the default)"
        )
    return value


def enabled() -> bool:
    return _switch() != "0"


def backward_turns_enabled() -> bool:
    """``all`` opens the turns between backward graphs too; ``1`` only the first turn (before the first
    backward graph)."""
    return _switch() == "all"


_here = threading.local()  # per thread: a weak reference to the router that routed it last, outside_turn's depth


@contextlib.contextmanager
def outside_turn():
    """Allocations made inside stay out of an eager turn: in the eager cache, not the backward
    pool, and unseen by the recording's watch. For a tensor autograd keeps past the turn by design
    (eagerly it lives in the eager cache too); a turn's memory is overwritten by the next backward
    graph. Does nothing outside a turn. The routing resumes on exit: the block runs on the routed
    thread, and only that thread closes its turn (before the next backward graph)."""
    router = getattr(_here, "router", lambda: None)()
    paused = router is not None and router.routing_here() and router.close()
    _here.outside = getattr(_here, "outside", 0) + 1
    try:
        yield
    finally:
        _here.outside -= 1
        if paused:
            router.open()


MIN_TURN_BYTES = 16 * 2**20
"""The turn opens when its eager work holds at least this much at once (in the recording
iteration): below it, what the forward and backward graphs lose by not sharing one pool
outweighs what the turn saves."""


class TurnWatch(TorchDispatchMode):
    """Notes the storages ops create during a turn; at its end, reports those still alive.

    Pushed for the whole recording iteration (autograd's threads run the backward under the
    modes active when it started); only ``tracking`` spans record anything.

    Args:
        device_type: Storages of this device type count (the pool's memory).
    """

    def __init__(self, device_type: str, between_backward: bool = False):
        super().__init__()
        self.device_type = device_type
        self.between_backward = between_backward  # watch the turns between backward graphs too
        self.tracking = False
        self.in_turn = False
        self.alive: dict[int, tuple[str, int]] = {}  # storage data_ptr -> (what made it, bytes)
        self.live_bytes = 0
        self.turn_peak = 0  # since the last forward graph
        self.peak_bytes = 0  # the largest turn (up to a backward graph), over the iteration
        self.turns = 0
        self.escaped: list[str] = []
        self.blind = False  # the turn's backward half ran on a thread this mode did not reach
        self.pattern: list[int] = []  # of the largest turn: see shape_pool
        self._steps: list[int] = []  # of the turn in progress
        self._index: dict[int, int] = {}  # storage data_ptr -> its allocation's number (live ones)
        self._made = 0  # allocations in the turn in progress
        # Turns between backward graphs (module docstring), named by the backward event they follow.
        self.segment = None  # the backward event the turn in progress follows; None for the first turn
        self.backward_clean: list = []  # backward events whose following turn ended with nothing alive
        self.backward_escaped: list[str] = []  # what kept a turn closed (for the warning)
        self.backward_off: set = set()  # backward events whose following turn must stay closed
        self._all_off = False  # a check that names no one turn failed: every turn stays closed
        self._handing = None  # the backward event whose turn handed the gradients to the last backward
        self._handed: dict[int, str] = {}  # gradients handed to the last backward, still alive
        self._handed_head = False  # ... handed by the first turn
        self._region_done = False  # the last backward's region reported its input gradients (checked them)
        self._expect = None  # the backward event whose region reports next

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.tracking and not getattr(_here, "outside", 0):
            self._note(func, (args, kwargs), out)
        return out

    def _note(self, func, inputs, out) -> None:
        for storage, t in made_storages(inputs, out, self.device_type):
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in self.alive:
                continue
            self.alive[ptr] = (f"{func} -> {tuple(t.shape)} {t.dtype}", nbytes)
            self._index[ptr] = self._made
            self._made += 1
            self._steps.append(nbytes)
            self.live_bytes += nbytes
            self.turn_peak = max(self.turn_peak, self.live_bytes)
            weakref.finalize(storage, self._died, ptr)

    def _died(self, ptr: int) -> None:
        entry = self.alive.pop(ptr, None)
        if entry is not None:
            self.live_bytes -= entry[1]
            self._steps.append(-1 - self._index.pop(ptr))

    def start(self, segment=None) -> None:
        """A forward graph ran (``segment`` None): the turn, if this was the micro-batch's last, starts
        here. Or a backward graph ran (``segment``, its event): the turn up to the next one starts."""
        self.alive.clear()
        self._steps, self._index, self._made = [], {}, 0
        self.live_bytes = self.turn_peak = 0
        self.in_turn = self.tracking = True
        self.segment = segment

    def pause(self) -> None:
        """The model's output is out: the loss is not part of the turn."""
        self.tracking = False

    def resume(self) -> None:
        """The gradient of the model's output has arrived (on the thread that runs the backward)."""
        self.tracking = self.in_turn
        if self.in_turn and self not in _get_current_dispatch_mode_stack():
            self.blind = True

    def finish(self, inputs: tuple, event=None) -> None:
        """The backward graph of ``event`` is next: whatever the turn made and is still alive (but
        the gradients handed to that graph, ``inputs``) escaped. The turn after it starts here."""
        handed = {t.untyped_storage().data_ptr(): t for t in inputs if isinstance(t, torch.Tensor)}
        if self.in_turn:
            escaped = [what for ptr, (what, _) in self.alive.items() if ptr not in handed]
            if self.blind:
                escaped.append("unseen: the backward ran on a thread without this watch")
            if self.segment is None:
                self.escaped += escaped
                self.turns += 1
                if self.turn_peak > self.peak_bytes:
                    self.peak_bytes, self.pattern = self.turn_peak, self._steps
            elif escaped:
                self.backward_escaped += escaped
                self.backward_off.add(self.segment)
            else:
                self.backward_clean.append(self.segment)
        if self._expect is not None and not self._region_done and self._handed:
            unchecked = f"gradients handed to region {self._expect.region}, never checked"
            if self._handed_head:
                self.escaped.append(unchecked)
            elif self._handing is not None:
                self.backward_escaped.append(unchecked)
                self.backward_off.add(self._handing)
        self._handed_head = self.in_turn and self.segment is None
        self._handing = self.segment if self.in_turn else None
        self._region_done, self._expect = False, event
        self._handed = {}
        for ptr, t in handed.items():
            self._handed[ptr] = f"the gradient {tuple(t.shape)} {t.dtype} handed to a backward graph"
            weakref.finalize(t.untyped_storage(), self._handed.pop, ptr, None)
        self.alive.clear()
        self.live_bytes = 0
        self.in_turn = self.tracking = self.blind = False
        if self.between_backward and event is not None:
            self.start(event)  # its region's own backward is in this turn too, conservatively
            self.resume()

    def region_done(self, event, input_grads: tuple) -> None:
        """The backward of ``event``'s region has made its input gradients. A gradient handed to it
        that is still alive and is none of them is kept by autograd for another use: at replay that
        use would read it after the graph's temporaries overwrote it."""
        if event != self._expect:  # complete only after a later backward: its inputs have eager readers
            self.backward_escaped.append(f"the input gradients of region {event.region} came late")
            self._all_off = True
            return
        kept = {t.untyped_storage().data_ptr() for t in input_grads if isinstance(t, torch.Tensor)}
        stuck = [what for ptr, what in self._handed.items() if ptr not in kept]
        if stuck and self._handed_head:
            self.escaped += stuck
        elif stuck:  # the turn that handed them stays closed; handed by no turn we watched: all do
            self.backward_escaped += stuck
            if self._handing is None:
                self._all_off = True
            else:
                self.backward_off.add(self._handing)
        self._handed = {}
        self._region_done = True

    def verdict(self) -> tuple[bool, str | None]:
        """``(open the turn, why not)`` after the recording iteration."""
        if self.escaped:
            listed = "; ".join(dict.fromkeys(self.escaped))
            return False, (
                "CUDA graphs: the eager work between the last forward graph and the first backward graph leaves "
                f"tensors alive past it ({listed}), so it keeps the eager cache: the graphed run needs about its "
                "size more memory than eager."
            )
        return self.turns > 0 and self.peak_bytes >= MIN_TURN_BYTES, None

    def backward_verdict(self) -> tuple[list, str | None]:
        """``(backward events after which a turn may open, why none may)`` after the recording
        iteration. Each turn is judged alone: one that leaves something alive past the
        next backward graph, or hands it a gradient autograd keeps for another use, stays closed."""
        clean = [] if self._all_off else [e for e in self.backward_clean if e not in self.backward_off]
        if clean or not self.backward_escaped:  # some open: no warning for the few that stay closed
            return clean, None
        listed = "; ".join(dict.fromkeys(self.backward_escaped))
        return clean, (
            f"CUDA graphs: the eager work between backward graphs leaves tensors alive past the next one "
            f"({listed}), so it keeps the eager cache."
        )


def shape_pool(pattern: list[int], pool: GraphPool, stream: torch.cuda.Stream) -> None:
    """Allocates and frees in ``pool``, on ``stream``, what a turn did (:attr:`TurnWatch.pattern`:
    ``n >= 0`` allocates n bytes, ``n < 0`` frees allocation number ``-1 - n``), then frees what
    is left. The caching allocator cuts the same segments as the turn will, and leaves them free
    for the backward graphs' temporaries; blocks serve only the stream they were made on, so
    ``stream`` must be the one the turn runs on."""
    held: dict[int, torch.Tensor] = {}
    made = 0
    with torch.cuda.stream(stream), allocate_into_pool(pool):
        for step in pattern:
            if step >= 0:
                held[made] = torch.empty(step, dtype=torch.uint8, device=stream.device)
                made += 1
            else:
                del held[-1 - step]
        held.clear()


def gap_holds_data(plan, position: int, in_pool: frozenset[int]) -> bool:
    """Whether a released buffer of the backward pool holds data over the gap after ``position``
    (``Plan.released_across``): a static gradient, or an output of a forward captured there
    (``in_pool``). Eager work allocating in that pool then could overwrite it."""
    held = plan.released_across(position, ("grad_input", "grad_output", "output"))
    return any(key[0] != "output" or key[1] in in_pool for key in held)


class TurnRouter:
    """Routes one thread's allocations into the backward pool during the turn of each micro-batch.

    Args:
        pool: The backward graphs' pool.
        last_forward: Cycle position of the micro-batch's last forward graph, after which the first
            turn opens (None: no first turn). Every turn closes before the next backward graph.
        after_backward: Cycle positions of backward graphs after which a turn opens, up to the next one.
    """

    def __init__(self, pool: GraphPool, last_forward: int | None, after_backward=frozenset()):
        self.pool = pool
        self.last_forward = last_forward
        self.after_backward = frozenset(after_backward)
        self._thread: int | None = None  # the thread whose allocations go to the pool

    def open(self) -> None:
        """This thread's allocations go to the pool from now on."""
        if self._thread is not None:
            raise RuntimeError("CUDA graphs: the eager turn is already routed for another thread")
        begin_allocating_into(self.pool)
        self._thread = threading.get_ident()
        _here.router = weakref.ref(self)

    def close(self) -> bool:
        """Stops the routing; returns whether there was one."""
        if self._thread is None:
            return False
        self._thread = None
        end_allocating_into(self.pool)
        return True

    def routing_here(self) -> bool:
        return self._thread == threading.get_ident()

    def routing(self) -> bool:
        """Whether some thread's allocations go to the pool now."""
        return self._thread is not None

    def count(self) -> int:
        """Turns per micro-batch: the first (if it opens) and those after backward graphs."""
        return (self.last_forward is not None) + len(self.after_backward)


@dataclasses.dataclass(frozen=True)
class TurnPlan:
    """The turns a capture opens (:meth:`TurnHooks._plan_turns`)."""

    first: tuple[int, int] | None
    """(last forward, first backward) cycle positions of the first turn, if it opens."""
    after_backward: frozenset[int]
    """Cycle positions of backward graphs after which a turn opens."""
    keep: frozenset = frozenset()
    """Owner keys of the first backward's static gradients, held: the first turn's gradient is copied in."""
    pattern: list[int] | None = None
    """The first turn's allocations, to shape the backward pool with (:func:`shape_pool`)."""
    first_region: int | None = None
    """The region whose backward capture the shaping precedes (the first backward's)."""
    shaped_bytes: int = 0
    """The first turn's peak: eager memory the shaping moves into the backward pool."""


class TurnHooks:
    """The eager turn's side of a graph session (a mixin of ``GraphSession``, whose state it uses)."""

    _watch: TurnWatch | None = None
    turn_plan: TurnPlan | None = None  # the turns the capture opened (the memory report reads it)
    _turn: TurnRouter | None = None
    _output_hook = None
    _region_hooks: tuple = ()  # the recording's hooks on regions' inputs, removed with the watch
    _pass_end_queued = False  # a callback for the end of the backward pass in progress is queued
    captures_next = False  # recording on CUDA, to capture after (not a CPU recording for tests)
    eager_turn_allowed = True
    """The trainer's say: False for pipelines (no turn there); for MoE models, whose eager layers
    record per-layer statistics on logging iterations only (the recording iteration's watch could
    miss them); and wherever a collective could run inside a turn, on NCCL's stream with the turn's
    routing in force: tensor parallelism, and gradient reduction overlapping the backward with
    DP > 1. Those stay off until a run on several GPUs checks them."""

    def watch_model_output(self, model: torch.nn.Module) -> None:
        """Marks where ``model``'s forward ends: the turn pauses there until its output's gradient arrives."""
        if enabled():
            self._output_hook = model.register_forward_hook(_OutputHook(self))

    def _watch_forward_done(self, backward, inputs=()) -> None:
        """Recording before a capture: a forward region ran on ``inputs`` (the watch is pushed on the
        first, and popped by the capture); the watch hears when their gradients are made, after the
        region's ``backward`` event."""
        if not self.captures_next:
            return
        if self._watch is None:
            self._watch = TurnWatch("cuda", backward_turns_enabled())
            self._region_hooks = []
            self._watch.__enter__()
        self._watch.start()
        inputs = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
        if inputs:
            # Removed when the watch ends: the hook's closure holds the inputs' autograd nodes, which
            # hold the hook, a cycle through C++ that Python's collector cannot break. It would keep
            # the autograd graph, the model and the session with its graph pools alive for good.
            self._region_hooks.append(
                torch.autograd.graph.register_multi_grad_hook(
                    inputs, functools.partial(self._region_backward_done, backward)
                )
            )

    def _watch_backward_next(self, grads: tuple, event=None) -> None:
        if self._watch is not None:
            self._watch.finish(grads, event)
            self._at_backward_pass_end(self._watch_backward_pass_end)

    def _watch_backward_pass_end(self) -> None:
        """The backward pass is over: the turn after its last backward graph ends here (the tail)."""
        if self._watch is not None:
            self._watch.finish(())

    def _at_backward_pass_end(self, fn) -> None:
        """Runs ``fn`` once when the backward pass in progress ends (autograd's final callbacks, queued
        from a backward graph's hook on autograd's thread)."""
        if self._pass_end_queued:
            return
        self._pass_end_queued = True

        def done():
            self._pass_end_queued = False
            fn()

        torch.autograd.Variable._execution_engine.queue_callback(done)

    def _region_backward_done(self, backward, grads) -> None:
        if self._watch is not None:
            self._watch.region_done(backward, tuple(grads))

    def _model_output(self, module, args, output):
        if not isinstance(output, torch.Tensor) or output.grad_fn is None:
            return None
        if self._watch is not None and self._watch.in_turn:
            self._watch.pause()
            output.grad_fn.register_prehook(lambda grads: self._watch.resume() if self._watch else None)
        elif self._turn is not None and self._turn.routing_here():
            self._turn.close()
            output.grad_fn.register_prehook(lambda grads: self._turn.open() if self._turn else None)
        else:
            return None
        return output.clone()  # out of the turn's memory: the loss and the schedule read it later

    def _end_watch(self) -> TurnWatch | None:
        """Pops the watch after the recording iteration and returns it."""
        watch, self._watch = self._watch, None
        for handle in self._region_hooks:
            handle.remove()
        self._region_hooks = ()
        if watch is not None:
            watch.__exit__(None, None, None)
        return watch

    def _turns_possible(self, watch: TurnWatch | None, cycles: dict, single_schedule: bool) -> bool:
        """One slot whose cycle runs every forward, then every backward (no forward inside the
        backward), without a pipeline schedule, watched while it recorded."""
        if watch is None or len(cycles) != 1 or not single_schedule or not self.eager_turn_allowed:
            return False
        ((_, cycle),) = cycles.items()
        phases = [e.phase for e in cycle]
        return FWD in phases and BWD in phases and FWD not in phases[phases.index(BWD) :]

    def _plan_turns(
        self, watch: TurnWatch | None, plans: dict, single_schedule: bool, next_to_backward: frozenset[int]
    ) -> TurnPlan | None:
        """The turns to open after the recording, or None. ``next_to_backward``: the forwards captured
        into the backward pool unless the first turn opens (whose work would overwrite their outputs)."""
        first = self._decide_turn(watch, self.cycles, single_schedule)
        in_pool = frozenset() if first is not None else next_to_backward
        after_backward = self._backward_turns(watch, plans, single_schedule, in_pool)
        if first is None:
            return TurnPlan(None, after_backward) if after_backward else None
        ((slot, cycle),) = self.cycles.items()
        region = self.regions[cycle[first[1]].region]
        keys = [("grad_output", region.index, j) for j in range(region.num_outputs)]
        keep = frozenset(plans[slot].owner(k) for k in keys if k in plans[slot].buffers)
        return TurnPlan(first, after_backward, keep, watch.pattern, region.index, watch.peak_bytes)

    def _decide_turn(self, watch: TurnWatch | None, cycles: dict, single_schedule: bool):
        """``(last forward, first backward)`` cycle positions when the turn opens, else None."""
        if not self._turns_possible(watch, cycles, single_schedule):
            return None
        ((_, cycle),) = cycles.items()
        last = [e.phase for e in cycle].index(BWD) - 1
        opens, why = watch.verdict()
        if why is not None:
            warnings.warn(why, stacklevel=5)  # the trainer's line
        return (last, last + 1) if opens else None

    def _turn_after_forward(self) -> None:
        """A forward graph just replayed (the session's cursor is past it)."""
        if self._turn is not None and self._positions[self.cursor - 1][1] == self._turn.last_forward:
            self._turn.open()

    def _turn_before_backward(self) -> bool:
        """A backward graph replays next (the session's cursor is past it): a turn before it ends,
        and so does the one after the pass's last backward graph, at the end of the pass. Returns
        whether a turn ended here (its gradients may then sit in the backward pool)."""
        if self._turn is None:
            return False
        self._at_backward_pass_end(self._turn.close)
        return self._turn.close()

    def _turn_after_backward(self) -> None:
        """A backward graph replayed and its dgrads for eager code were copied out of the pool."""
        if self._turn is not None and self._positions[self.cursor - 1][1] in self._turn.after_backward:
            self._turn.open()

    def _backward_turns(
        self, watch: TurnWatch | None, plans: dict, single_schedule: bool, in_pool: frozenset[int]
    ) -> frozenset[int]:
        """Cycle positions of the backward graphs after which a turn may open, whether or not the
        first turn does (a graphed loss head leaves none before the first backward graph): the
        recording saw the eager work up to the next backward graph leave nothing alive, and no
        released buffer of the backward pool holds data over that gap (``Plan.released_across``:
        static gradients, and the outputs of the forwards ``in_pool`` captures there)."""
        if not backward_turns_enabled() or not self._turns_possible(watch, self.cycles, single_schedule):
            return frozenset()
        events, why = watch.backward_verdict()
        if why is not None:
            warnings.warn(why, stacklevel=5)  # the trainer's line
        ((_, plan),) = plans.items()
        positions = {plan.position(e.phase, e.region) for e in events}
        return frozenset(p for p in positions if not gap_holds_data(plan, p, in_pool))

    def _close_turn(self) -> None:
        if self._turn is not None:
            self._turn.close()
        self._turn = None
        if self._output_hook is not None:
            self._output_hook.remove()
            self._output_hook = None
        try:
            self._end_watch()
        except RuntimeError:  # not on top of the mode stack any more (an error in the recording)
            pass


class _OutputHook:
    """The model's forward hook; a deep copy of the model gets none (the copy is not attached)."""

    def __init__(self, hooks: TurnHooks):
        self.hooks = hooks

    def __call__(self, module, args, output):
        return self.hooks._model_output(module, args, output)

    def __deepcopy__(self, memo):
        return _no_hook


def _no_hook(module, args, output):
    return None
