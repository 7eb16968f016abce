"""What the pipelined schedule tells the CUDA-graph session about its exchanges (pure Python).

A pipeline rank's slots are a pure function of its order (``slots.assign_slots``; a
slot serves one micro-batch at a time, of any chunk), and the lock-step timetable fixes
the tick of every step and every exchange; so before an iteration starts we know, for
every receive and send, which micro-batch slot it serves and what that slot's graphs do
around it:

- **Receive into the static input.** After capture, the input a chunk receives can land
  straight in the static input of the chunk's first graph (``session.receive_buffer``)
  when the slot the micro-batch will run in has finished its previous micro-batch's
  backward (of whichever chunk) by the tick whose exchange posts the receive (steps run
  before the exchange of their tick). Otherwise the static input still belongs to that
  previous micro-batch: the receive lands in a fresh tensor and the forward replay
  copies it in. Which case happens when is a property of the timetable: on the last
  stage of 1F1B every receive is in place (one slot, freed in the tick of the forward
  before), and so is every receive of the interleaved schedule on 2 and 4 stages with 2
  chunks (up to 8 micro-batches, ``test_pipeline_graphs.py``); on a middle stage of 1F1B
  over 3 or more stages, a receive that arrives while the slot's previous micro-batch
  still waits for its gradient copies (e.g. 3 of 8 on rank 1 of 4 with 8 micro-batches).
- **Dgrad sent from the graph's buffer.** The gradient of a received input is sent in
  the exchange of the backward's tick, waited there. The first graph's dgrad buffer may
  share memory with the temporaries of the slot's forward graphs (captured earlier in
  the cycle), so it may be sent without a copy only when the slot's next forward comes
  in a later tick than the backward, for every micro-batch of the slot (on the last
  stage of 1F1B and in the interleaved layouts above it does). Otherwise the replay
  hands the dgrad over as a copy, as for any dgrad that escapes to eager code.
- **Graphed outputs sent.** Sends are waited in the exchange of the forward's tick,
  before the slot's next graph event: ``session.NEXT_EVENT``, no decision needed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from megatron.core.pipeline_parallel.schedules import ChunkStep
from megatron.core.pipeline_parallel.slots import Key, assign_slots
from megatron.core.pipeline_parallel.timetable import Tick


@dataclasses.dataclass(frozen=True)
class GraphCommPlan:
    """Slots and exchange decisions of one pipeline rank for one iteration.

    Attributes:
        slot_of: The slot every ``(chunk, micro-batch)`` forward runs in.
        previous: The ``(chunk, micro-batch)`` that held the same slot before, per
            ``(chunk, micro-batch)`` (absent for a slot's first micro-batch of the iteration).
        receive_in_place: Per received ``(chunk, micro-batch)``: whether the receive may
            land in the static input of the slot's first graph.
        grad_sent_in_place: Per slot: whether the dgrad of its received input may be sent
            from the graph's own buffer (no copy).
    """

    slot_of: dict[Key, int]
    previous: dict[Key, Key]
    receive_in_place: dict[Key, bool]
    grad_sent_in_place: dict[int, bool]


def plan_graph_comm(
    order: Sequence[ChunkStep], ticks: Sequence[Tick], weights: Sequence[float] | None = None
) -> GraphCommPlan:
    """The decisions for a rank with steps ``order`` and timetable row ``ticks`` (module docstring).

    ``weights``: per model chunk, what a micro-batch keeps in its slot (``assign_slots``).

    Raises:
        ValueError: ``ticks`` do not run ``order``.
    """
    tick_of: dict[ChunkStep, int] = {}
    for t, tick in enumerate(ticks):
        for step in tick.steps:
            tick_of[step] = t
    if [s for tick in ticks for s in tick.steps] != list(order):
        raise ValueError("the timetable does not run this rank's order")
    slot_of = assign_slots(order, weights)
    previous: dict[Key, Key] = {}
    last_in_slot: dict[int, Key] = {}  # slot -> its latest (chunk, micro-batch)
    for phase, chunk, mb in order:
        if phase == "F":
            slot = slot_of[(chunk, mb)]
            if slot in last_in_slot:
                previous[(chunk, mb)] = last_in_slot[slot]
            last_in_slot[slot] = (chunk, mb)

    def freed_by(key: Key, tick: int) -> bool:
        """The slot of ``key`` has run its previous micro-batch's backward by the end of
        ``tick``'s steps (a slot's first micro-batch: the previous iteration ran it)."""
        prev = previous.get(key)
        return prev is None or tick_of[("B", *prev)] <= tick

    receive_in_place = {
        tick.recv_prev: freed_by(tick.recv_prev, t) for t, tick in enumerate(ticks) if tick.recv_prev is not None
    }
    grad_sent_in_place = {slot: True for slot in set(slot_of.values())}
    for key, prev in previous.items():
        if tick_of[("F", *key)] <= tick_of[("B", *prev)]:
            grad_sent_in_place[slot_of[key]] = False
    return GraphCommPlan(slot_of, previous, receive_in_place, grad_sent_in_place)
