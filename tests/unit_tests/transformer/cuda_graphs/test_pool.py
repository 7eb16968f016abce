"""Tests for the shared graph pool (cuda_graphs/mempool.py).

CPU: snapshot accounting on synthetic segments, the log line, the no-CUDA
errors. GPU: allocation routing, release through weak references, per-pool
accounting, and the allocator behaviour the release plan relies on (a block
released by a weak reference is handed to the next capture in the same pool).
"""

import types

import pytest
import torch

from megatron.core.transformer.cuda_graphs import pool as mempool
from megatron.core.transformer.cuda_graphs.pool import (
    GraphPool,
    PoolStats,
    allocate_into_pool,
    device_memory_used,
    format_pool_summary,
    pool_stats_from_segments,
)
from megatron.core.transformer.cuda_graphs.weak import is_weak_ref, make_weak_ref

MiB = 1 << 20


# --------------------------------------------------------------------- CPU


def _segment(device, pool_id, blocks):
    return {
        "device": device,
        "segment_pool_id": pool_id,
        "total_size": sum(size for size, _ in blocks),
        "blocks": [{"size": size, "state": state} for size, state in blocks],
    }


def test_pool_stats_from_segments_filters_by_pool_and_device():
    ours, other = (0, 7), (0, 8)
    segments = [
        _segment(0, ours, [(4 * MiB, "active_allocated"), (16 * MiB, "inactive")]),
        _segment(0, ours, [(2 * MiB, "active_pending_free"), (1 * MiB, "inactive")]),
        _segment(0, other, [(64 * MiB, "active_allocated")]),  # another pool
        _segment(0, (0, 0), [(32 * MiB, "inactive")]),  # the global cache
        _segment(1, ours, [(128 * MiB, "active_allocated")]),  # another device
    ]
    stats = pool_stats_from_segments(segments, ours, device=0)
    assert stats == PoolStats(reserved_bytes=23 * MiB, live_bytes=6 * MiB, num_segments=2, largest_free_bytes=16 * MiB)
    # The handle may come as any two-int sequence (lists survive a JSON round trip).
    segments[0]["segment_pool_id"] = [0, 7]
    assert pool_stats_from_segments(segments, [0, 7], device=0) == stats
    assert pool_stats_from_segments(segments, (0, 9), device=0) == PoolStats(0, 0, 0, 0)


def test_pool_stats_from_segments_without_block_detail():
    seg = {"device": 0, "segment_pool_id": (0, 3), "total_size": 20 * MiB, "active_size": 5 * MiB}
    stats = pool_stats_from_segments([seg], (0, 3), device=0)
    assert stats == PoolStats(20 * MiB, 5 * MiB, 1, 0)


def test_format_pool_summary():
    line = format_pool_summary(16, int(123.45 * MiB), int(67.89 * MiB), strong_bytes=12 * MiB, capture_seconds=0.312)
    assert line == (
        "graph pool | graphs: 16 | reserved: 123.45 MB | live: 67.89 MB | strongly held: 12.00 MB | capture: 0.31 s"
    )


@pytest.mark.parametrize(
    "env, possible",
    [
        ({}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}, True),
        ({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True, graph_capture_record_stream_reuse:True"}, False),
        ({"PYTORCH_ALLOC_CONF": "graph_capture_record_stream_reuse:true"}, False),
        ({"PYTORCH_CUDA_ALLOC_CONF": "graph_capture_record_stream_reuse:False"}, True),
    ],
)
def test_capture_detour_is_off_where_ending_a_routing_expects_the_capture_over(env, possible, monkeypatch):
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert mempool.capture_detour_possible() is possible


def test_graph_pool_without_cuda_raises(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        GraphPool()
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        device_memory_used()


def test_missing_private_api_names_the_call(monkeypatch):
    monkeypatch.delattr(torch._C, "_cuda_releasePool", raising=False)
    with pytest.raises(RuntimeError, match="_cuda_releasePool"):
        mempool._private_api("_cuda_releasePool")


def test_a_nested_capture_detour_into_the_same_pool_changes_no_routing(monkeypatch):
    """A scratch block's op that transients.py routes too: the inner detour finds the thread in the
    backward pool already and leaves the allocator's routing alone; into another pool it raises."""
    calls = []
    monkeypatch.setattr(mempool, "_private_api", lambda name: lambda *args: calls.append((name, args[1])))
    capturing, backward, other = (types.SimpleNamespace(device=0, handle=h) for h in ("fwd", "bwd", "x"))
    with mempool.capture_detour(capturing, backward):
        outer = list(calls)
        with mempool.capture_detour(capturing, backward):
            assert calls == outer
        with pytest.raises(RuntimeError, match="another pool"), mempool.capture_detour(capturing, other):
            pass
        assert calls == outer
    assert [c[0] for c in outer] == ["_cuda_endAllocateToPool", "_cuda_beginAllocateCurrentThreadToPool"]
    assert calls[len(outer) :] == [
        ("_cuda_endAllocateToPool", "bwd"),
        ("_cuda_releasePool", "bwd"),
        ("_cuda_beginAllocateCurrentThreadToPool", "fwd"),
        ("_cuda_releasePool", "fwd"),
    ]
    with mempool.capture_detour(capturing, other):  # the thread is free again
        pass


# --------------------------------------------------------------------- GPU
# Sizes are multiples of 512 bytes and >= 1 MiB, so each tensor is one block of
# exactly its own size in the allocator's large-block pool.


@pytest.fixture
def pool():
    p = GraphPool()
    yield p
    p.close()


@pytest.mark.gpu
def test_fresh_pool_is_empty_and_handle_is_two_ints(pool):
    handle = pool.handle
    assert isinstance(handle, tuple) and len(handle) == 2
    assert all(isinstance(x, int) for x in handle)
    assert pool.device == torch.cuda.current_device()
    assert pool.stats() == PoolStats(0, 0, 0, 0)


@pytest.mark.gpu
def test_allocate_into_pool_then_capture(pool):
    # Allocating before the first capture must not leave the pool unreferenced
    # (a capture into an unreferenced pool trips an allocator assertion).
    with allocate_into_pool(pool):
        static_in = torch.full((MiB,), 1.5, device="cuda")  # 4 MiB
    assert pool.stats().live_bytes == static_in.nbytes

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool.handle):
        static_out = static_in * 2
    static_in.fill_(3.0)
    graph.replay()
    torch.cuda.synchronize()
    assert bool((static_out == 6.0).all())
    assert pool.stats().live_bytes == static_in.nbytes + static_out.nbytes


@pytest.mark.gpu
def test_weak_ref_release_frees_block_inside_pool(pool):
    with allocate_into_pool(pool):
        buf = torch.ones(MiB, device="cuda")  # 4 MiB
    ptr = buf.data_ptr()
    held = pool.stats()
    assert held.live_bytes == 4 * MiB
    assert held.reserved_bytes >= held.live_bytes
    # One segment, the rest of it one free block.
    assert held.num_segments == 1
    assert held.largest_free_bytes == held.reserved_bytes - held.live_bytes

    allocated = torch.cuda.memory_allocated()
    weak = make_weak_ref(buf)
    del buf
    released = pool.stats()
    assert released.live_bytes == 0
    assert released.reserved_bytes == held.reserved_bytes  # memory stays in the pool
    assert released.largest_free_bytes == held.reserved_bytes
    assert torch.cuda.memory_allocated() == allocated - 4 * MiB
    assert is_weak_ref(weak) and weak.data_ptr() == ptr

    torch.cuda.empty_cache()
    assert pool.stats().reserved_bytes == held.reserved_bytes


@pytest.mark.gpu
def test_stats_count_only_our_pool(pool):
    other = GraphPool()
    before = pool.stats()
    outside = torch.empty(16 * MiB, dtype=torch.uint8, device="cuda")
    with allocate_into_pool(other):
        theirs = torch.empty(8 * MiB, dtype=torch.uint8, device="cuda")
    assert pool.stats() == before  # neither allocation is ours
    with allocate_into_pool(pool):
        ours = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    # Allocations after the context go back to the global cache.
    after_ctx = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
    assert pool.stats().live_bytes == before.live_bytes + 4 * MiB
    assert other.stats().live_bytes == 8 * MiB
    assert all(t.numel() > 0 for t in (outside, theirs, ours, after_ctx))
    other.close()


@pytest.mark.gpu
def test_released_block_is_reused_by_next_capture(pool):
    """The hazard behind every release decision (research notes, section 6).

    Graph 1's output is weak-referenced; graph 2, captured next into the same
    pool on the same stream, gets the very same block. Replaying 1 then 2
    overwrites what graph 1 produced. Releasing is only safe when nothing
    reads the buffer after a later graph may have claimed it: the plan in
    buffers.py must guarantee that. The strong-reference control shows the
    aliasing comes from the release alone.
    """
    n = MiB  # 4 MiB fp32
    x = torch.ones(n, device="cuda")  # eager input, outside the pool
    stream = torch.cuda.Stream()

    def capture(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool.handle, stream=stream):
            out = fn()
        return graph, out

    # Control: graph 1's output held strongly -> graph 2 gets another block.
    g1, out1 = capture(lambda: x + 2.0)
    g2, out2 = capture(lambda: x + 4.0)
    assert out2.data_ptr() != out1.data_ptr()
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    assert bool((out1 == 3.0).all()) and bool((out2 == 5.0).all())
    del g1, g2, out1, out2

    # Release graph 1's output, then capture graph 2: the block is reused.
    g1, out1 = capture(lambda: x + 2.0)
    ptr1 = out1.data_ptr()
    live_before = pool.stats().live_bytes
    weak1 = make_weak_ref(out1)
    del out1
    assert pool.stats().live_bytes == live_before - 4 * MiB
    g2, out2 = capture(lambda: x + 4.0)
    assert out2.data_ptr() == ptr1
    g1.replay()
    torch.cuda.synchronize()
    assert bool((weak1 == 3.0).all())  # correct while nothing else ran
    g2.replay()
    torch.cuda.synchronize()
    assert bool((weak1 == 5.0).all())  # graph 2 overwrote graph 1's output


@pytest.mark.gpu
def test_close_is_idempotent_and_blocks_further_use():
    p = GraphPool()
    with allocate_into_pool(p):
        buf = torch.full((MiB,), 2.0, device="cuda")
    p.close()
    p.close()
    assert p.closed
    with pytest.raises(RuntimeError, match="closed"):
        _ = p.handle
    with pytest.raises(RuntimeError, match="closed"):
        with allocate_into_pool(p):
            pass
    # Tensors already in the pool stay valid until they die.
    assert bool((buf == 2.0).all())
    del buf
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_device_memory_used():
    _, total = torch.cuda.mem_get_info()
    used = device_memory_used(empty_cache=True)
    assert isinstance(used, int) and 0 < used <= total
    assert 0 < device_memory_used() <= total
