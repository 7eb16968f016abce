"""Allocator traces, read: what a pool or the eager cache holds at its peak, and each time it grew.

Pure functions over ``torch.cuda.memory._snapshot()`` output taken with history recording on
(segments with ``segment_pool_id``, ``address`` and ``total_size``; per device a trace of
``alloc``, ``free_requested``, ``segment_map`` / ``segment_alloc`` and their releases), so they run
on a saved snapshot and are tested on the CPU. ``tools/pool_peak.py`` runs the training that
records one and prints what these find.
"""

import collections
import os
import sys
from collections.abc import Sequence
from typing import Any, NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron.core.transformer.cuda_graphs.pool import _pool_id  # noqa: E402


def segment_pool(segment: dict) -> tuple[int, int]:
    """The id of the pool a snapshot segment belongs to (``(0, 0)``: the eager cache)."""
    return _pool_id(segment.get("segment_pool_id", (0, 0)))


def pool_segments(snapshot: dict, pool_ids, device: int) -> list[dict]:
    """The segments of ``device`` that belong to one of ``pool_ids``."""
    wanted = {_pool_id(p) for p in pool_ids}
    return [s for s in snapshot["segments"] if s.get("device", device) == device and segment_pool(s) in wanted]


def pool_ranges(snapshot: dict, pool_ids, device: int) -> list[tuple[int, int]]:
    """``(first, end)`` addresses of every segment of ``device`` that belongs to one of ``pool_ids``."""
    return [(s["address"], s["address"] + s["total_size"]) for s in pool_segments(snapshot, pool_ids, device)]


def pool_peak(snapshot: dict, pool_id, device: int) -> tuple[int, int, list[dict]]:
    """``(peak live bytes, trace index of the peak, blocks live then)`` of one pool.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` taken with history recording on.
        pool_id: The pool's id (``(int, int)``); its segments are found in the snapshot.
        device: Device index whose trace is replayed.
    """
    ranges = pool_ranges(snapshot, [pool_id], device)
    return _live_peak(snapshot["device_traces"][device], lambda addr: _within(ranges, addr))


def outside_peak(snapshot: dict, pool_ids, device: int) -> tuple[int, list[dict]]:
    """``(peak live bytes, blocks live then)`` of every allocation outside the given pools.

    Replays the whole trace of ``device``; allocations that fall in a segment of one of
    ``pool_ids`` are skipped (the pools' reserved bytes are counted separately). Blocks
    already live when recording began are not in the trace and not counted.
    """
    ranges = pool_ranges(snapshot, pool_ids, device)
    peak, _, peak_live = _live_peak(snapshot["device_traces"][device], lambda addr: not _within(ranges, addr))
    return peak, peak_live


def live_outside(snapshot: dict, pool_ids, device: int, since: int, at: int) -> list[tuple[int, dict]]:
    """``(trace index, alloc entry)`` of every block outside the given pools that was allocated at or
    after trace index ``since`` and is still live just before index ``at``: what a phase left behind
    (e.g. ``since`` the end of the model's build, ``at`` the start of the capture)."""
    ranges = pool_ranges(snapshot, pool_ids, device)
    live: dict[int, tuple[int, dict]] = {}
    for i, entry in enumerate(snapshot["device_traces"][device][:at]):
        addr = entry.get("addr")
        if entry["action"] == "alloc" and i >= since and not _within(ranges, addr):
            live[addr] = (i, entry)
        elif entry["action"] == "free_requested":
            live.pop(addr, None)
    return list(live.values())


def _within(ranges: list[tuple[int, int]], addr: int | None) -> bool:
    return addr is not None and any(lo <= addr < hi for lo, hi in ranges)


def _live_peak(trace: list[dict], counted) -> tuple[int, int, list[dict]]:
    """``(peak live bytes, trace index of the peak, blocks live then)`` of the allocations whose
    address ``counted(addr)`` accepts."""
    live: dict[int, dict] = {}
    current = peak = peak_at = 0
    peak_live: list[dict] = []
    for i, entry in enumerate(trace):
        addr = entry.get("addr")
        if entry["action"] == "alloc" and counted(addr):
            live[addr] = entry
            current += entry["size"]
            if current > peak:
                peak, peak_at, peak_live = current, i, list(live.values())
        elif entry["action"] == "free_requested" and addr in live:
            current -= live.pop(addr)["size"]
    return peak, peak_at, peak_live


def allocation_site(entry: dict, root: str = "/megatron/", depth: int = 3) -> str:
    """The innermost ``depth`` frames of ``entry`` whose file lies under ``root``."""
    frames = [f for f in entry.get("frames", []) if root in f["filename"]]
    return (
        " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in frames[:depth])
        or "(no frame here)"
    )


def by_site(blocks: Sequence[dict]) -> list[tuple[str, int, int]]:
    """``(site, bytes, count)`` per allocation site, largest first."""
    size, count = collections.Counter(), collections.Counter()
    for b in blocks:
        site = allocation_site(b)
        size[site] += b["size"]
        count[site] += 1
    return [(site, nbytes, count[site]) for site, nbytes in size.most_common()]


def last_mark(marks: list, index: int):
    """The last of ``marks`` (tuples, trace index first, in order) at or before trace ``index``; None if none."""
    during = [m for m in marks if m[0] <= index][-1:]
    return during[0] if during else None


def capture_at(captures: list, index: int) -> str:
    """Which capture was running at trace ``index`` (``captures``: ``(start index, region, phase)``)."""
    during = last_mark(captures, index)
    return f"{during[2]} capture of {during[1]}" if during else "set-up"


def segments_at_peak(snapshot: dict, pool_id, device: int, blocks: Sequence[dict]) -> list[tuple[int, int, int]]:
    """``(reserved bytes, bytes of ``blocks`` inside it, stream)`` per segment of one pool."""
    rows = []
    for s in pool_segments(snapshot, [pool_id], device):
        lo, hi = s["address"], s["address"] + s["total_size"]
        live = sum(b["size"] for b in blocks if lo <= b["addr"] < hi)
        rows.append((s["total_size"], live, s.get("stream", 0)))
    return rows


class Growth(NamedTuple):
    """One time a pool's segment grew: ``mapped`` bytes at trace ``index``, to ``reserved`` bytes of that
    segment, for the next allocation in it (``request`` bytes at ``site``) while ``live`` bytes were
    allocated in it."""

    index: int
    mapped: int
    reserved: int
    live: int
    request: int
    site: str

    @property
    def fragmented(self) -> bool:
        """The segment's free bytes before the growth would have held the request, had they been one run."""
        return self.reserved - self.mapped - self.live >= self.request


def pool_growth(snapshot: dict, pool_id, device: int) -> list[Growth]:
    """Every growth of one pool's segments in the trace of ``device``, each segment on its own (small
    and large requests are served from different segments): expandable segments map pages
    (``segment_map``), others allocate whole segments (``segment_alloc``). Only the first kind can be
    judged ``fragmented``: a new whole segment starts empty, and the other segments' free runs are
    not weighed."""
    ranges = pool_ranges(snapshot, [pool_id], device)

    def segment(entry: dict) -> int | None:
        addr = entry.get("addr")
        return next((k for k, (lo, hi) in enumerate(ranges) if addr is not None and lo <= addr < hi), None)

    return _growths(snapshot["device_traces"][device], segment, segment)


SMALL_BLOCK = 2**20
"""The caching allocator serves requests up to this size from its small-block segments."""


def cache_growth(snapshot: dict, pool_ids, device: int) -> list[Growth]:
    """Every growth of the segments outside the given pools (the eager cache), per stream and block
    size (each pair has segments of its own), as :func:`pool_growth` lists a pool's. Their addresses
    need not lie in segments the snapshot still has (``empty_cache`` unmaps), so a growth belongs to
    the stream it happens on and to the small or large segments by the request that follows it; the
    trace should begin before the first allocation, or the segments' live bytes are short. A release is
    told apart by address, which is exact with expandable segments (each stream's small and large blocks
    map pages in an address range of their own) and a guess with whole segments."""
    ranges = pool_ranges(snapshot, pool_ids, device)

    def outside(entry: dict) -> bool:
        return entry.get("addr") is not None and not _within(ranges, entry["addr"])

    return _growths(
        snapshot["device_traces"][device],
        lambda e: e.get("stream", 0) if outside(e) else None,
        lambda e: (e.get("stream", 0), "small" if e["size"] <= SMALL_BLOCK else "large") if outside(e) else None,
    )


def _growths(trace: list[dict], growth_key, block_key) -> list[Growth]:
    """The growths of ``trace`` (see :class:`Growth`). ``growth_key(entry)``: where a growth happens
    (None: not counted); it is charged to the segment (``block_key``) of the next allocation with
    the same ``growth_key``, which it was made for. A release is charged to the segment whose
    growths spanned its address."""
    blocks: dict[int, tuple[Any, int]] = {}  # address -> (segment, bytes)
    live: collections.Counter = collections.Counter()
    reserved: collections.Counter = collections.Counter()
    spans: dict[Any, tuple[int, int]] = {}  # segment -> (lowest, end) address its growths mapped
    pending: dict[Any, list[tuple[int, dict]]] = {}  # growth key -> growths awaiting their request
    rows = []
    for i, entry in enumerate(trace):
        action = entry["action"]
        if action in ("segment_map", "segment_alloc"):
            key = growth_key(entry)
            if key is not None:
                pending.setdefault(key, []).append((i, entry))
        elif action in ("segment_unmap", "segment_free"):
            addr = entry["addr"]
            seg = next((s for s, (lo, hi) in spans.items() if lo <= addr < hi), None)
            if seg is not None:
                reserved[seg] -= entry["size"]
        elif action == "alloc" and (seg := block_key(entry)) is not None:
            for index, grown in pending.pop(growth_key(entry), []):
                reserved[seg] += grown["size"]
                lo, hi = spans.get(seg, (grown["addr"], grown["addr"]))
                spans[seg] = (min(lo, grown["addr"]), max(hi, grown["addr"] + grown["size"]))
                rows.append(
                    Growth(index, grown["size"], reserved[seg], live[seg], entry["size"], allocation_site(entry))
                )
            blocks[entry["addr"]] = (seg, entry["size"])
            live[seg] += entry["size"]
        elif action == "free_requested" and entry.get("addr") in blocks:
            seg, size = blocks.pop(entry["addr"])
            live[seg] -= size
    return sorted(rows)
