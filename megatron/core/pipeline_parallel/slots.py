"""CUDA-graph micro-batch slots: which slot each forward of a rank's order runs in.

A slot is a micro-batch in flight. Each slot has a graph pool that holds what one
micro-batch keeps for its backward, so a region needs one graph pair per slot it runs
in, and the pools together reserve what the slots hold at most. A micro-batch takes a
slot when its forward starts and frees it once its backward has run; a slot serves one
micro-batch at a time, of any model chunk (its pool then holds the largest chunk it
served, see ``cuda_graphs/plan.py``).

:func:`assign_slots` is a pure function of the order: the schedule that runs the order
and the plan of its exchanges (``graph_comm.py``) call it alike. With model chunks
(virtual pipeline stages) it compares ways to hand out slots by the pool memory they
reserve, ``sum over slots of the largest chunk weight a slot served``:

- ``per chunk``: each chunk its own slots (as many as its micro-batches in flight);
- ``lowest free``: the lowest free slot of all: as many slots as micro-batches of all
  chunks in flight at once, which is what eager execution holds at its peak, but a
  slot that served a heavy chunk once reserves it for good;
- ``cheapest`` (chunks of unequal weight only): a depth-first search over the free slot
  each forward takes, pruned by the best reservation found so far and cut off after
  :data:`SEARCH_NODES` steps (with equal weights ``lowest free`` is already the least).

Ties go to fewer ``(chunk, slot)`` pairs (fewer graphs to capture), then to ``per
chunk``. The trainer weighs a chunk by the analytic activation bytes of its graphed
regions (``report.chunk_activation_bytes``: the chunk with the loss head is heavier);
without weights every chunk weighs the same. Equal chunks on 2 stages with 2 chunks: 5
slots instead of 6 on rank 0, 3 instead of 4 on rank 1.
"""

from __future__ import annotations

import functools
from collections.abc import Hashable, Sequence

Key = tuple[int, int]  # (model chunk, micro-batch)
Step = tuple[str, int, int]  # ("F" | "B", model chunk, micro-batch)
SEARCH_NODES = 20_000
"""Search steps of the ``cheapest`` assignment (tens of milliseconds, once per order)."""
SEARCH_MAX_STEPS = 600
"""Longer orders skip the search (its depth is the order's length)."""


class SlotAllocator:
    """Lowest free slot per micro-batch in flight; a slot is free once its backward ran."""

    def __init__(self) -> None:
        self._busy: dict[Hashable, int] = {}

    def acquire(self, key: Hashable) -> int:
        if key in self._busy:
            raise ValueError(f"micro-batch {key} is already in flight")
        used = set(self._busy.values())
        index = next(i for i in range(len(used) + 1) if i not in used)
        self._busy[key] = index
        return index

    def release(self, key: Hashable) -> int:
        return self._busy.pop(key)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._busy

    @property
    def in_flight(self) -> int:
        return len(self._busy)


def assign_slots(order: Sequence[Step], weights: Sequence[float] | None = None) -> dict[Key, int]:
    """The slot of every ``(chunk, micro-batch)`` of ``order`` (module docstring).

    Args:
        order: The rank's steps ``(phase, chunk, micro-batch)``; every forward is followed,
            later, by its backward.
        weights: Per chunk, what a micro-batch of it keeps in its slot's pool (any unit,
            e.g. layers); default equal.

    Raises:
        ValueError: a micro-batch starts twice, or runs backward before forward.
    """
    chunks = 1 + max((c for _, c, _ in order), default=0)
    w = tuple(weights) if weights is not None else (1.0,) * chunks
    if len(w) < chunks:
        raise ValueError(f"slot weights for {len(w)} model chunks, the order runs {chunks}")
    return dict(_assign(tuple(order), w[:chunks]))


@functools.lru_cache(maxsize=64)  # the schedule asks every iteration, for the same order
def _assign(order: tuple[Step, ...], w: tuple[float, ...]) -> tuple[tuple[Key, int], ...]:
    candidates = [_per_chunk(order, len(w)), _lowest_free(order)]
    best = min(candidates, key=lambda slot_of: (reserved(slot_of, w), len(_pairs(slot_of))))
    if len(set(w)) > 1 and len(order) <= SEARCH_MAX_STEPS:
        best = _cheapest(order, w, reserved(best, w)) or best  # None: nothing below the bound
    return tuple(best.items())


def reserved(slot_of: dict[Key, int], weights: Sequence[float]) -> float:
    """Pool memory an assignment reserves: per slot, the heaviest chunk it served."""
    most: dict[int, float] = {}
    for (chunk, _), slot in slot_of.items():
        most[slot] = max(most.get(slot, 0.0), weights[chunk])
    return sum(most.values())


def _pairs(slot_of: dict[Key, int]) -> set[tuple[int, int]]:
    return {(chunk, slot) for (chunk, _), slot in slot_of.items()}


def _lowest_free(order: Sequence[Step]) -> dict[Key, int]:
    """Runs ``order`` with one :class:`SlotAllocator`: the lowest free slot of all."""
    slots = SlotAllocator()
    slot_of: dict[Key, int] = {}
    for phase, chunk, mb in order:
        key = (chunk, mb)
        if phase == "F":
            if key in slot_of:
                raise ValueError(f"micro-batch {mb} of chunk {chunk} starts twice")
            slot_of[key] = slots.acquire(key)
        elif key not in slots:
            raise ValueError(f"micro-batch {mb} of chunk {chunk} runs backward before its forward")
        else:
            slots.release(key)
    return slot_of


def _cheapest(order: Sequence[Step], w: Sequence[float], bound: float) -> dict[Key, int] | None:
    """The assignment reserving least below ``bound`` that the search finds, or None.

    Each forward tries one free slot per distinct reservation among the free ones (slots
    of equal reservation are interchangeable from here on), the heaviest that already
    fits first, then a new slot.
    """
    steps = list(order)
    caps: list[float] = []  # slot -> heaviest chunk weight it served so far
    busy: dict[Key, int] = {}
    slot_of: dict[Key, int] = {}
    best: list = [bound, None]
    nodes = [0]

    def walk(i: int, cost: float) -> None:
        nodes[0] += 1
        if cost >= best[0] or nodes[0] > SEARCH_NODES:
            return
        if i == len(steps):
            best[0], best[1] = cost, dict(slot_of)
            return
        phase, chunk, mb = steps[i]
        key = (chunk, mb)
        if phase == "B":
            slot = busy.pop(key)
            walk(i + 1, cost)
            busy[key] = slot
            return
        used = set(busy.values())
        options, seen = [], set()
        for slot in sorted(
            (s for s in range(len(caps)) if s not in used), key=lambda s: (caps[s] < w[chunk], -caps[s], s)
        ):
            if caps[slot] not in seen:
                seen.add(caps[slot])
                options.append(slot)
        options.append(len(caps))
        for slot in options:
            new = slot == len(caps)
            before = 0.0 if new else caps[slot]
            if new:
                caps.append(w[chunk])
            else:
                caps[slot] = max(before, w[chunk])
            busy[key] = slot_of[key] = slot
            walk(i + 1, cost + caps[slot] - before)
            del busy[key], slot_of[key]
            if new:
                caps.pop()
            else:
                caps[slot] = before

    walk(0, 0.0)
    return best[1]


def _per_chunk(order: Sequence[Step], chunks: int) -> dict[Key, int]:
    """Each chunk its own slots: the lowest free slot among those it served."""
    own = {c: _lowest_free([s for s in order if s[1] == c]) for c in range(chunks)}
    slot_of: dict[Key, int] = {}
    base = 0
    for c in range(chunks):
        for key, slot in own[c].items():
            slot_of[key] = base + slot
        base += 1 + max(own[c].values(), default=-1)
    return slot_of
