"""The pipeline schedule's side of a graph session: receives, sends and what communication reads.

A mixin of :class:`~megatron.core.transformer.cuda_graphs.session.GraphSession` (the
session's state lives there). While recording, the schedule notes what it receives
(``note_receive``) and sends (``note_send``) and declares buffers communication reads
(``add_comm_read``); the plan keeps those buffers as long as communication needs them.
After capture, ``receive_buffer`` hands the schedule the static input a receive writes
into, without a copy.
"""

from __future__ import annotations

import weakref

import torch

from megatron.core.transformer.cuda_graphs.plan import CommRead


class PipelineHooks:
    """Pipeline communication hooks of the graph session (see the module docstring)."""

    def add_comm_read(self, slot: int, read: CommRead) -> None:
        """Declares that communication reads a buffer of ``slot`` (before capture)."""
        self.comm_reads.append((slot, read))

    def note_receive(self, slot: int, tensor: torch.Tensor, grad_sent: bool = False) -> None:
        """Recording: ``tensor`` was received from another pipeline stage for ``slot``.

        A graphed region that takes it as an input of its own gets a static input that
        later receives write into (``receive_buffer``). ``grad_sent``: the schedule sends
        the tensor's gradient back as the graph's dgrad buffer itself and waits on that
        send before the slot's next micro-batch starts, in every micro-batch of the slot;
        the buffer is then kept for good and not copied (otherwise the dgrad leaves the
        graph as a copy). A no-op outside recording.
        """
        if self.recording:
            self._receives[id(tensor)] = (weakref.ref(tensor), grad_sent)

    def note_send(self, tensor: torch.Tensor, until: tuple[str, int] | str | None = None) -> None:
        """Recording: ``tensor`` is sent to another pipeline stage and read until the
        send's wait. When it is a graphed region's output, that output buffer is kept
        strong in every slot until ``until`` (a ``(phase, region)`` of the same cycle
        before which the send is waited on; :data:`NEXT_EVENT`: before the slot's event
        after the producer's forward; None: for good, the send then being waited on
        before the slot's next micro-batch starts). A no-op outside recording."""
        if not self.recording:
            return
        key = self.recorder.producer_of(tensor)
        if key is not None:
            self.sent_outputs[key] = until

    def receive_buffer(self, slot: int, chunk: int = 0) -> torch.Tensor | None:
        """After capture: the static input to receive ``slot``'s next input (a micro-batch
        of model chunk ``chunk``) into, no copy.

        None before capture, and when no graph of the chunk in the slot reads a received
        tensor directly (the receiver allocates then, and the replay copies). Ask only
        when the slot's previous micro-batch has run its whole run (the receive lands in
        memory the slot's graphs use until then).

        Raises:
            RuntimeError: the slot is in the middle of a micro-batch.
        """
        if not self.captured:
            return None
        cycle = self.cycles.get(slot)
        if cycle is None:
            raise RuntimeError(f"CUDA graphs: no micro-batch slot {slot} was recorded (slots: {sorted(self.cycles)}).")
        at = self._slot_at.get(slot)
        if at is not None and at not in self._run_ends[slot]:
            event = cycle[at]
            raise RuntimeError(
                f"CUDA graphs: a pipeline receive for slot {slot} while its previous micro-batch is in the middle "
                f"of its run (last replayed: the {event.phase} graph of {self.regions[event.region].name}); "
                "receive the next micro-batch's input only after the slot's backward has run."
            )
        regions = {e.region for c, events in self.runs[slot] if c == chunk for e in events}
        for r, i in sorted(self.received_inputs):
            if r in regions:
                plan = self.plans[slot]
                return self.buffers[slot][plan.owner(("input", r, i))]
        return None
