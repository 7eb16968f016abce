"""tools/alloc_trace.py: a pool's high-water mark and growths, and the eager cache's, from synthetic allocator
traces (CPU)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import alloc_trace  # noqa: E402

MEG = "/repo/megatron/core/"


def _alloc(addr, size, where):
    return {
        "action": "alloc",
        "addr": addr,
        "size": size,
        "frames": [
            {"filename": "/torch/x.py", "line": 1, "name": "f"},
            {"filename": MEG + where[0], "line": where[1], "name": where[2]},
        ],
    }


def _free(addr, size):
    return {"action": "free_requested", "addr": addr, "size": size}


def test_peak_counts_only_our_pool_and_groups_by_site():
    snapshot = {
        "segments": [
            {"device": 0, "address": 1000, "total_size": 1000, "segment_pool_id": (7, 1)},  # ours
            {"device": 0, "address": 5000, "total_size": 1000, "segment_pool_id": (0, 0)},  # regular cache
        ],
        "device_traces": [
            [
                _alloc(1000, 100, ("a.py", 3, "fwd")),
                _alloc(5000, 900, ("b.py", 9, "eager")),  # not in the pool: ignored
                _alloc(1100, 200, ("a.py", 3, "fwd")),
                _alloc(1300, 50, ("c.py", 5, "bwd")),  # peak: 350 live
                _free(1100, 200),
                _alloc(1100, 120, ("c.py", 5, "bwd")),  # 270: below the peak
                _free(1000, 100),
            ]
        ],
    }
    peak, at, blocks = alloc_trace.pool_peak(snapshot, (7, 1), 0)
    assert (peak, at) == (350, 3)
    assert sorted(b["addr"] for b in blocks) == [1000, 1100, 1300]
    sites = alloc_trace.by_site(blocks)
    assert sites == [("a.py:3:fwd", 300, 2), ("c.py:5:bwd", 50, 1)]
    assert alloc_trace.allocation_site({"frames": []}) == "(no frame here)"


def test_outside_peak_skips_every_listed_pool():
    snapshot = {
        "segments": [
            {"device": 0, "address": 1000, "total_size": 1000, "segment_pool_id": (7, 1)},
            {"device": 0, "address": 3000, "total_size": 1000, "segment_pool_id": (7, 2)},
            {"device": 0, "address": 5000, "total_size": 1000, "segment_pool_id": (0, 0)},
        ],
        "device_traces": [
            [
                _alloc(1000, 500, ("a.py", 3, "fwd")),  # pool 1: skipped
                _alloc(5000, 100, ("b.py", 9, "eager")),
                _alloc(3000, 700, ("a.py", 3, "fwd")),  # pool 2: skipped
                _alloc(5100, 200, ("b.py", 9, "eager")),  # peak: 300
                _free(5000, 100),
                _alloc(5300, 150, ("c.py", 1, "head")),  # 350: new peak
                _free(5100, 200),
            ]
        ],
    }
    peak, blocks = alloc_trace.outside_peak(snapshot, [(7, 1), (7, 2)], 0)
    assert peak == 350
    assert sorted(b["addr"] for b in blocks) == [5100, 5300]
    assert alloc_trace.outside_peak(snapshot, [], 0)[0] == 1550  # no pools: everything counts


def test_growth_the_free_bytes_would_have_held_is_flagged():
    """Pages mapped while the segment's free bytes exceeded the request are fragmentation; pages mapped
    because the free bytes were too few are not. Each segment counts its own (a small request is not
    served from a large segment); other pools' maps are not this pool's growth."""
    mib = 2**20
    snapshot = {
        "segments": [
            {"device": 0, "address": 0, "total_size": 60 * mib, "segment_pool_id": (7, 1)},
            {"device": 0, "address": 500 * mib, "total_size": 2 * mib, "segment_pool_id": (7, 1)},  # small
            {"device": 0, "address": 1000 * mib, "total_size": 20 * mib, "segment_pool_id": (0, 0)},
        ],
        "device_traces": [
            [
                {"action": "segment_map", "addr": 0, "size": 20 * mib},
                _alloc(0, 8 * mib, ("a.py", 1, "fwd")),
                _alloc(8 * mib, 8 * mib, ("a.py", 2, "fwd")),
                {"action": "segment_map", "addr": 1000 * mib, "size": 20 * mib},  # the regular cache
                _alloc(1000 * mib, 20 * mib, ("b.py", 1, "eager")),
                _free(0, 8 * mib),  # free: 8 at the start, 4 at the end; live 8
                {"action": "segment_map", "addr": 20 * mib, "size": 20 * mib},
                _alloc(16 * mib, 10 * mib, ("c.py", 3, "bwd")),  # 12 free would have held 10: fragmented
                {"action": "segment_map", "addr": 40 * mib, "size": 20 * mib},
                _alloc(26 * mib, 30 * mib, ("c.py", 4, "bwd")),  # 22 free, 30 wanted: needed
                {"action": "segment_map", "addr": 500 * mib, "size": 2 * mib},
                _alloc(500 * mib, 512, ("d.py", 5, "small")),  # the large segment's 4 free do not count
            ]
        ],
    }
    rows = alloc_trace.pool_growth(snapshot, (7, 1), 0)
    assert [(g.index, g.reserved // mib, g.live // mib, g.request // mib) for g in rows] == [
        (0, 20, 0, 8),
        (6, 40, 8, 10),
        (8, 60, 18, 30),
        (10, 2, 0, 0),
    ]
    assert [g.fragmented for g in rows] == [False, True, False, False]
    assert rows[1].site == "c.py:3:bwd"


def test_capture_at_names_the_capture_running_at_a_trace_index():
    captures = [(3, "layers.0", "forward"), (7, "layers.0", "backward")]
    assert alloc_trace.capture_at(captures, 2) == "set-up"
    assert alloc_trace.capture_at(captures, 3) == "forward capture of layers.0"
    assert alloc_trace.capture_at(captures, 9) == "backward capture of layers.0"


def test_cache_growth_is_per_stream_and_block_size_and_skips_our_pools():
    """The eager cache's growths: each stream's large and small segments count their own reserve and
    live bytes, a page release lowers the reserve of the segment that mapped it, and our pools' maps
    and blocks are not the cache's."""
    mib = 2**20

    def on(stream, entry):
        return {**entry, "stream": stream}

    snapshot = {
        "segments": [{"device": 0, "address": 900 * mib, "total_size": 20 * mib, "segment_pool_id": (7, 1)}],
        "device_traces": [
            [
                on(1, {"action": "segment_map", "addr": 0, "size": 20 * mib}),
                on(1, _alloc(0, 12 * mib, ("a.py", 1, "weights"))),
                on(2, {"action": "segment_map", "addr": 400 * mib, "size": 20 * mib}),  # another stream
                on(2, _alloc(400 * mib, 4 * mib, ("b.py", 1, "step"))),
                on(2, {"action": "segment_map", "addr": 900 * mib, "size": 20 * mib}),  # our pool: not counted
                on(2, _alloc(900 * mib, 16 * mib, ("c.py", 1, "graph"))),
                on(1, {"action": "segment_map", "addr": 200 * mib, "size": 2 * mib}),
                on(1, _alloc(200 * mib, 512, ("a.py", 2, "small"))),  # stream 1's small blocks
                on(1, _free(0, 12 * mib)),
                on(1, {"action": "segment_unmap", "addr": 0, "size": 20 * mib}),  # empty_cache
                on(1, {"action": "segment_map", "addr": 0, "size": 20 * mib}),
                on(1, _alloc(0, 8 * mib, ("a.py", 3, "again"))),  # 0 free after the release: needed
                on(2, {"action": "segment_map", "addr": 420 * mib, "size": 20 * mib}),
                on(2, _alloc(404 * mib, 10 * mib, ("b.py", 2, "step"))),  # 16 free would have held 10
            ]
        ],
    }
    rows = alloc_trace.cache_growth(snapshot, [(7, 1)], 0)
    assert [(g.index, g.reserved // mib, g.live // mib, g.request // mib, g.fragmented) for g in rows] == [
        (0, 20, 0, 12, False),
        (2, 20, 0, 4, False),
        (6, 2, 0, 0, False),
        (10, 20, 0, 8, False),
        (12, 40, 4, 10, True),
    ]
    assert rows[-1].site == "b.py:2:step"
    # Without our pool listed, its growth is the cache's.
    assert len(alloc_trace.cache_growth(snapshot, [], 0)) == 6


def test_last_mark_is_the_latest_at_or_before_an_index():
    marks = [(0, "build"), (5, "iteration 1"), (9, "capture")]
    assert alloc_trace.last_mark(marks, 4) == (0, "build")
    assert alloc_trace.last_mark(marks, 9) == (9, "capture")
    assert alloc_trace.last_mark([(3, "x")], 2) is None


def test_pool_segments_pick_one_device_and_pools_and_count_the_blocks_inside():
    snapshot = {
        "segments": [
            {"device": 0, "address": 1000, "total_size": 500, "segment_pool_id": (7, 1), "stream": 3},
            {"device": 0, "address": 2000, "total_size": 500, "segment_pool_id": (0, 0), "stream": 3},
            {"device": 1, "address": 3000, "total_size": 500, "segment_pool_id": (7, 1), "stream": 3},
            {"device": 0, "address": 4000, "total_size": 300, "segment_pool_id": (7, 1), "stream": 3},
        ]
    }
    assert [s["address"] for s in alloc_trace.pool_segments(snapshot, [(7, 1)], 0)] == [1000, 4000]
    assert alloc_trace.pool_ranges(snapshot, [(7, 1)], 0) == [(1000, 1500), (4000, 4300)]
    assert alloc_trace.segment_pool(snapshot["segments"][1]) == (0, 0)
    assert alloc_trace.segment_pool({}) == (0, 0)
    blocks = [{"addr": 1100, "size": 40}, {"addr": 2100, "size": 99}, {"addr": 4000, "size": 60}]
    assert alloc_trace.segments_at_peak(snapshot, (7, 1), 0, blocks) == [(500, 40, 3), (300, 60, 3)]


def test_live_outside_lists_what_a_phase_left_behind():
    snapshot = {
        "segments": [{"device": 0, "address": 1000, "total_size": 1000, "segment_pool_id": (7, 1)}],
        "device_traces": [
            [
                _alloc(5000, 100, ("build.py", 1, "init")),  # 0: before `since`
                _alloc(5100, 200, ("step.py", 2, "act")),  # 1: freed before `at`
                _alloc(5300, 32, ("step.py", 3, "keep")),  # 2: left behind
                _alloc(1000, 64, ("a.py", 3, "fwd")),  # 3: in our pool
                _free(5100, 200),
                _alloc(5400, 8, ("step.py", 4, "late")),  # 5: at `at`, not yet
            ]
        ],
    }
    rows = alloc_trace.live_outside(snapshot, [(7, 1)], 0, since=1, at=5)
    assert [(i, e["addr"]) for i, e in rows] == [(2, 5300)]
    assert [i for i, _ in alloc_trace.live_outside(snapshot, [], 0, since=0, at=6)] == [0, 2, 3, 5]
