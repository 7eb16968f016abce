"""The recording iteration: the order graph events ran in, and where arguments came from.

Iteration 1 runs eagerly. Every graphed region's forward and backward is appended to
``order`` as an ``Event(phase, region, slot)``, and each tensor argument of a region's
first call is classified by identity: the output of a region that ran earlier in the
same slot (a hand-off: the consumer's static input becomes the producer's output
buffer), a tensor several regions read (one shared buffer, e.g. the RoPE table), or a
tensor of its own (copied into a static input at replay). An output of another slot's
region is a tensor of its own here: slots have separate pools.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch

from megatron.core.transformer.cuda_graphs.plan import OWN, Event, Source

_here = threading.local()


@contextlib.contextmanager
def recording_region():
    """This thread runs a graphed region's forward eagerly, in the recording iteration, to capture it next."""
    _here.depth = getattr(_here, "depth", 0) + 1
    try:
        yield
    finally:
        _here.depth -= 1


def in_recorded_region() -> bool:
    """Whether this thread runs a graphed region's forward in the recording iteration. Code that
    chooses how much working memory to use (the Mamba scan's slices) makes the capture's choice
    there: the recording is an eager iteration whose peak counts as the run's too."""
    return getattr(_here, "depth", 0) > 0


class Recorder:
    """Collects the recorded order and argument sources (identity-based, weakly held)."""

    def __init__(self) -> None:
        self.order: list[Event] = []
        self._outputs: dict[int, tuple[weakref.ref, int, int, int]] = {}
        self._inputs: dict[int, tuple[weakref.ref, int, int, int | None]] = {}
        self._shared_groups = 0
        self._sources: dict[int, list[Source]] = {}  # region -> sources, rewritten for shared groups

    def event(self, event: Event) -> None:
        self.order.append(event)

    def note_output(self, t: torch.Tensor, region: int, slot: int, index: int) -> None:
        self._outputs[id(t)] = (weakref.ref(t), region, slot, index)

    def producer_of(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(region, output index) when ``t`` is a graphed region's output, else None."""
        hit = self._outputs.get(id(t))
        return (hit[1], hit[3]) if hit is not None and hit[0]() is t else None

    def sources(self, region: int, args: tuple, slot: int) -> list[Source]:
        """Classifies every argument of ``region``'s first call (kept and returned)."""
        found = [
            self._source_of(a, region, slot, i) if isinstance(a, torch.Tensor) else OWN for i, a in enumerate(args)
        ]
        self._sources[region] = found
        return found

    def _source_of(self, t: torch.Tensor, region: int, slot: int, arg: int) -> Source:
        hit = self._outputs.get(id(t))
        if hit is not None and hit[0]() is t and hit[2] == slot:
            return Source("handoff", hit[1], hit[3])
        seen = self._inputs.get(id(t))
        if seen is not None and seen[0]() is t:
            ref, first_region, first_arg, group = seen
            if group is None:
                group = self._shared_groups
                self._shared_groups += 1
                # The first reader learns only now that the tensor is shared.
                self._sources[first_region][first_arg] = Source("shared", index=group)
                self._inputs[id(t)] = (ref, first_region, first_arg, group)
            return Source("shared", index=group)
        self._inputs[id(t)] = (weakref.ref(t), region, arg, None)
        return OWN

    def clear_identities(self) -> None:
        """Drops the identity maps (capture needs only the order and the sources)."""
        self._outputs.clear()
        self._inputs.clear()
