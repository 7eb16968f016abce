"""When each pipeline rank runs its steps and exchanges tensors: a lock-step timetable.

Each rank's *order* of forward and backward steps is Megatron's (``schedules.rank_order``).
This module decides only which exchange carries each tensor, by simulating every rank
in lock-step ticks (pure Python, the same result on every rank):
- in tick ``t`` a rank runs the next steps of its order whose inputs it holds, at most
  one forward and one backward;
- then every rank makes one batched exchange: it sends what its tick-``t`` steps
  produced and receives what its neighbours' tick-``t`` steps produced for it.
So a rank's ``t``-th exchange is matched, operation for operation, by its neighbours'
``t``-th exchanges: no exchange can wait on one its peer makes later (no deadlock, on
NCCL's blocking groups as on gloo), and no shape or count is ever exchanged. A tick in
which a rank neither computes nor exchanges costs it nothing.

Virtual stage ``v = chunk * PP + rank``; stage ``v`` feeds ``v + 1`` (forward) and
``v - 1`` (backward). The last stage's backward needs only its own forward.
"""

from __future__ import annotations

import dataclasses

ChunkStep = tuple[str, int, int]  # ("F" | "B", chunk, micro-batch)


@dataclasses.dataclass
class Tick:
    """One rank's part of one tick.

    Attributes:
        steps: The steps it runs, in its order.
        recv_prev: ``(chunk, micro-batch)`` of the forward whose input arrives from the
            previous rank in this tick's exchange, or None.
        recv_next: ``(chunk, micro-batch)`` of the backward whose output gradient arrives
            from the next rank, or None.
    """

    steps: list[ChunkStep]
    recv_prev: tuple[int, int] | None = None
    recv_next: tuple[int, int] | None = None

    @property
    def empty(self) -> bool:
        return not self.steps and self.recv_prev is None and self.recv_next is None


def build_timetable(orders: list[list[ChunkStep]], num_chunks: int) -> list[list[Tick]]:
    """``timetable[rank][t]``: what ``rank`` does in tick ``t`` (every rank gets the same tick count).

    Args:
        orders: Each pipeline rank's steps, rank 0 first.
        num_chunks: Model chunks per rank.

    Raises:
        ValueError: the orders cannot run (a step waits on one that never comes).
    """
    pp = len(orders)
    last_stage = pp * num_chunks - 1
    done: dict[tuple[str, int, int], int] = {}  # (phase, virtual stage, micro-batch) -> tick
    position = [0] * pp
    timetable: list[list[Tick]] = [[] for _ in range(pp)]
    tick = 0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        ran: list[list[ChunkStep]] = [[] for _ in range(pp)]
        for rank in range(pp):
            kinds: set[str] = set()
            while position[rank] < len(orders[rank]):
                phase, chunk, mb = orders[rank][position[rank]]
                stage = chunk * pp + rank
                if phase in kinds:
                    break
                if phase == "F":
                    ready = stage == 0 or done.get(("F", stage - 1, mb), tick) < tick
                else:
                    ready = ("F", stage, mb) in done and (
                        stage == last_stage or done.get(("B", stage + 1, mb), tick) < tick
                    )
                if not ready:
                    break
                kinds.add(phase)
                done[(phase, stage, mb)] = tick
                ran[rank].append((phase, chunk, mb))
                position[rank] += 1
        if not any(ran):
            stuck = {r: orders[r][position[r]] for r in range(pp) if position[r] < len(orders[r])}
            raise ValueError(f"the pipeline orders cannot run: every rank waits (next steps {stuck})")
        for rank in range(pp):
            timetable[rank].append(Tick(ran[rank]))
        for rank in range(pp):  # what arrives in this tick's exchange
            for phase, chunk, mb in ran[rank]:
                stage = chunk * pp + rank
                if phase == "F" and stage < last_stage:
                    target = timetable[(rank + 1) % pp][tick]
                    assert target.recv_prev is None
                    target.recv_prev = ((stage + 1) // pp, mb)
                if phase == "B" and stage > 0:
                    target = timetable[(rank - 1) % pp][tick]
                    assert target.recv_next is None
                    target.recv_next = ((stage - 1) // pp, mb)
        tick += 1
    return timetable
