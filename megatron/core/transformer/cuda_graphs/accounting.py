"""What a graph session holds and has done, for logs, metrics and tools: its graphs, its pools'
reserved and live bytes (allocator snapshots), the static buffers it still holds strongly, and the
pools' log line."""

from __future__ import annotations

from typing import Any

from megatron.core.transformer.cuda_graphs.plan import BWD, FWD
from megatron.core.transformer.cuda_graphs.pool import format_pool_summary
from megatron.core.transformer.cuda_graphs.weak import is_weak_ref


class Accounting:
    """The report side of a graph session (a mixin of ``GraphSession``, whose state it reads:
    ``regions``, ``buffers``, ``pools``, ``backward_pool``, ``capture_seconds``, the turn, scratch
    and feed switches)."""

    def strong_bytes(self) -> int:
        """Bytes of static buffers we still hold strongly (each storage counted once)."""
        seen = {}
        held = [t for b in self.buffers.values() for t in b.values()]
        held += [g for r in self.regions for s in r.slots.values() for g in s.shared_grads]
        for t in held:
            if t is not None and not is_weak_ref(t):
                seen[t.data_ptr()] = t.untyped_storage().nbytes()
        return sum(seen.values())

    def num_graphs(self) -> int:
        return sum(r.num_graphs() for r in self.regions)

    def all_pools(self) -> list:
        """Every pool of the session: one per slot, then the shared backward pool if any."""
        return list(self.pools.values()) + ([self.backward_pool] if self.backward_pool is not None else [])

    def pool_stats(self) -> tuple[int, int]:
        """(reserved, live) bytes of every pool of the session (allocator snapshots)."""
        reserved = live = 0
        for pool in self.all_pools():
            s = pool.stats()
            reserved += s.reserved_bytes
            live += s.live_bytes
        return reserved, live

    def stats(self) -> dict[str, Any]:
        """Plain-typed accounting for logs, metrics and tools (takes allocator snapshots)."""
        if not self.pools:
            return {"graphs": 0}
        reserved, live = self.pool_stats()
        return {
            "graphs": self.num_graphs(),
            "slots": len(self.pools),
            "backward_pool_shared": self.backward_pool is not None,
            "eager_turn": self._turn is not None,
            "forward_scratch_in_backward_pool": self._scratch_open,
            "captured_scratch_in_backward_pool": self.scratch_captured,
            "embedding_in_backward_pool": self.feed_open,
            "pool_reserved_bytes": int(reserved),
            "pool_live_bytes": int(live),
            "strong_bytes": int(self.strong_bytes()),
            "capture_seconds": float(self.capture_seconds),
            "regions": [
                {
                    "name": r.name,
                    "slot": slot,
                    "pool_reserved_after_fwd": g.pool_reserved_after.get(FWD),
                    "pool_reserved_after_bwd": g.pool_reserved_after.get(BWD),
                    "pool_live_after_fwd": g.pool_live_after.get(FWD),
                    "pool_live_after_bwd": g.pool_live_after.get(BWD),
                }
                for r in self.regions
                for slot, g in sorted(r.slots.items())
            ],
        }

    def summary_line(self, stage: tuple[int, int] | None = None) -> str:
        """The pools' log line in Megatron's ``|``-separated style.

        ``stage``: ``(pipeline rank, pipeline size)``; with more than one stage the line
        names the stage (each stage captures, and logs, its own graphs).
        """
        reserved, live = self.pool_stats()
        line = format_pool_summary(self.num_graphs(), reserved, live, self.strong_bytes(), self.capture_seconds)
        if stage is not None and stage[1] > 1:
            line = line.replace("graph pool |", f"graph pool | pipeline rank: {stage[0]} of {stage[1]} |", 1)
        scratch = " | forward scratch in the backward pool" if self._scratch_open or self.scratch_captured else ""
        if self.feed_open:
            scratch += " | embedding in the backward pool"
        if self._turn is not None:
            return f"{line} | eager turns in the backward pool: {self._turn.count()}{scratch}"
        shared = " (backward pool shared)" if self.backward_pool is not None else ""
        return line + scratch if len(self.pools) <= 1 else f"{line} | slots: {len(self.pools)}{shared}"
