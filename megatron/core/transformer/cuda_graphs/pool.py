"""The shared CUDA graph memory pool: ownership, allocation into it, accounting.

All training graphs of a run are captured, in execution order, into one
private pool of the CUDA caching allocator, so graph k+1 can reuse memory that
graph k no longer needs. :class:`GraphPool` owns that pool, routes allocations
of static buffers into it (:func:`allocate_into_pool`) and reports how much
memory it holds (:meth:`GraphPool.stats`).

What is unusual here:

* **The pool is reference counted by the allocator, and we hold a reference.**
  ``torch.cuda.graph_pool_handle()`` only mints an id. The allocator creates
  the pool on first use and counts users: each capture and each open
  allocation context adds one, each graph's destruction and each context exit
  removes one. A pool whose count drops to 0 is torn down lazily, and a later
  capture into it trips an internal assertion (seen on torch 2.11: "use_count
  > 0 INTERNAL ASSERT FAILED" from ``torch.cuda.graph``). Allocating static buffers into
  the pool *before* the first capture would do exactly that, so
  :class:`GraphPool` takes one reference of its own at construction (through
  the same private calls ``torch.cuda.use_mem_pool`` uses) and drops it in
  :meth:`GraphPool.close`.
* **Accounting comes from the allocator snapshot**, filtered by the segments'
  ``segment_pool_id``. ``memory_allocated``/``memory_reserved`` do not split by
  pool and do not see what weak references released (a weak view keeps the
  block mapped while ``memory_allocated`` no longer counts it). A snapshot walks every segment of the device: call
  :meth:`GraphPool.stats` after capture and at log/checkpoint points, never in
  the per-step hot path and never during a capture.
* **Blocks remember their stream.** The caching allocator hands a freed block
  only to allocations on the stream it was allocated on. A buffer allocated
  on the default stream and released later is recycled by later captures only
  if they allocate on that same stream; allocate static buffers under
  ``torch.cuda.stream(capture_stream)`` when their memory should be reused by
  later captures.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import warnings
from collections.abc import Iterator

import torch

__all__ = [
    "PoolStats",
    "GraphPool",
    "allocate_into_pool",
    "begin_allocating_into",
    "end_allocating_into",
    "capture_detour",
    "capture_detour_possible",
    "device_memory_used",
    "pool_stats_from_segments",
    "format_pool_summary",
]

_MB = 1024 * 1024  # Megatron's memory lines say "MB" and divide by 2**20.

# Snapshot block states that still hold memory. "active_pending_free" blocks
# are freed by Python but wait on stream events before the allocator reuses
# them, so they are not yet available to the pool.
_LIVE_STATES = ("active_allocated", "active_pending_free")


@dataclasses.dataclass(frozen=True)
class PoolStats:
    """Memory held by one graph pool on one device, from an allocator snapshot."""

    reserved_bytes: int
    """Bytes of all segments (cudaMalloc'd regions) that belong to the pool."""

    live_bytes: int
    """Bytes of blocks in those segments that are allocated or pending free."""

    num_segments: int
    """Number of segments of the pool."""

    largest_free_bytes: int
    """Largest free block inside the pool (what a new allocation can get without
    growing the pool)."""


def _private_api(name: str):
    fn = getattr(torch._C, name, None)
    if fn is None:
        raise RuntimeError(
            f"CUDA graphs: this torch build lacks torch._C.{name}, needed to route "
            "allocations into the graph pool; use a supported torch (see requirements.txt) or "
            "--cuda-graph-impl none."
        )
    return fn


def _device_index(device: None | int | str | torch.device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"expected a CUDA device, got {device}")
    return device.index if device.index is not None else torch.cuda.current_device()


def _snapshot_segments() -> list[dict]:
    """All segments of the caching allocator, every device and pool."""
    try:
        # torch >= 2.8 can skip serialising trace entries.
        return torch.cuda.memory_snapshot(include_traces=False)
    except TypeError:
        return torch.cuda.memory_snapshot()


def _pool_id(handle) -> tuple[int, int]:
    return tuple(int(x) for x in handle)


def pool_stats_from_segments(segments: list[dict], pool_id, device: int) -> PoolStats:
    """Sums the segments of one pool on one device from an allocator snapshot.

    Pure function over ``torch.cuda.memory_snapshot()`` output (a list of
    segment dicts with ``device``, ``segment_pool_id`` (a tuple of two ints),
    ``total_size`` and ``blocks``, each block with ``size`` and ``state``), so
    tools can also run it on a saved snapshot.

    Args:
        segments: Snapshot segments.
        pool_id: The pool's handle, e.g. ``GraphPool.handle``.
        device: CUDA device index to count.
    """
    pool_id = _pool_id(pool_id)
    reserved = live = count = largest_free = 0
    for seg in segments:
        if seg.get("device") != device:
            continue
        if _pool_id(seg.get("segment_pool_id", (0, 0))) != pool_id:
            continue
        count += 1
        reserved += int(seg["total_size"])
        blocks = seg.get("blocks")
        if blocks is None:  # segment totals only: no free-block detail
            live += int(seg.get("active_size", seg.get("allocated_size", 0)))
            continue
        for block in blocks:
            size = int(block["size"])
            if block["state"] in _LIVE_STATES:
                live += size
            else:
                largest_free = max(largest_free, size)
    return PoolStats(
        reserved_bytes=reserved,
        live_bytes=live,
        num_segments=count,
        largest_free_bytes=largest_free,
    )


def format_pool_summary(
    num_graphs: int, reserved_bytes: int, live_bytes: int, strong_bytes: int, capture_seconds: float
) -> str:
    """The graph pools' log line in Megatron's ``|``-separated style (MB = 2**20 bytes).

    Example: ``graph pool | graphs: 16 | reserved: 123.45 MB | live: 67.89 MB
    | strongly held: 12.00 MB | capture: 0.31 s``.
    """
    return (
        f"graph pool | graphs: {num_graphs} "
        f"| reserved: {reserved_bytes / _MB:.2f} MB "
        f"| live: {live_bytes / _MB:.2f} MB "
        f"| strongly held: {strong_bytes / _MB:.2f} MB "
        f"| capture: {capture_seconds:.2f} s"
    )


class GraphPool:
    """One CUDA graph memory pool shared by all training graphs of a run.

    Pass :attr:`handle` as ``pool=`` to ``torch.cuda.graph`` for every capture
    and use :func:`allocate_into_pool` for static input buffers. Counting graphs
    and bytes held is the session's job; the pool reports what the allocator holds.

    Args:
        device: CUDA device of the pool; default: the current device.

    Raises:
        RuntimeError: CUDA is not available.
    """

    def __init__(self, device: None | int | str | torch.device = None):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "GraphPool needs a CUDA device, and none is available. CUDA graphs "
                "are GPU-only: run with --cuda-graph-impl none on CPU."
            )
        torch.cuda.init()  # the allocator's per-device state must exist
        self._device = _device_index(device)
        self._handle: tuple[int, int] = _pool_id(torch.cuda.graph_pool_handle())
        self._closed = False
        self._holds_reference = False
        # Create the pool now and keep it alive for our lifetime (module
        # docstring): begin/end without a matching release adds one user.
        begin = _private_api("_cuda_beginAllocateCurrentThreadToPool")
        end = _private_api("_cuda_endAllocateToPool")
        begin(self._device, self._handle)
        end(self._device, self._handle)
        self._holds_reference = True

    # ----------------------------------------------------------------- identity

    @property
    def handle(self) -> tuple[int, int]:
        """The pool id, a tuple of two ints, for ``torch.cuda.graph(pool=...)``."""
        self._check_open()
        return self._handle

    @property
    def device(self) -> int:
        """Index of the CUDA device the pool lives on."""
        return self._device

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` dropped our reference to the pool."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(
                "GraphPool is closed: its pool reference was dropped, so nothing may be "
                "captured or allocated into it any more."
            )

    def close(self) -> None:
        """Drops our reference to the pool. Idempotent.

        Graphs captured into the pool keep their own references; once they and
        all tensors in the pool are gone, ``torch.cuda.empty_cache()`` returns
        the pool's memory to the driver. After ``close`` the pool must not be
        used for new captures or allocations.
        """
        if self._closed:
            return
        self._closed = True
        if self._holds_reference:
            self._holds_reference = False
            _private_api("_cuda_releasePool")(self._device, self._handle)

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to do
            pass

    # --------------------------------------------------------------- accounting

    def stats(self, device: None | int | str | torch.device = None) -> PoolStats:
        """Reserved and live bytes of this pool, from an allocator snapshot.

        Expensive (walks every segment of the allocator) and illegal during a
        capture: call it after capture and at logging points, not per step.

        Args:
            device: Device to inspect; default: the pool's device.
        """
        index = self._device if device is None else _device_index(device)
        return pool_stats_from_segments(_snapshot_segments(), self._handle, index)

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"GraphPool(device={self._device}, handle={self._handle}, {state})"


@contextlib.contextmanager
def allocate_into_pool(pool: GraphPool) -> Iterator[None]:
    """Routes this thread's CUDA allocations on the pool's device into ``pool``.

    Static graph input buffers are allocated here so they live in the graph
    pool and may be weak-referenced later. Other threads (e.g. autograd's
    device threads) are not affected. Must not be nested for the same pool,
    and must not be used while a capture into the same pool is in progress:
    the allocator rejects a second concurrent user of one pool.

    Note: blocks are tied to the stream they were allocated on (module
    docstring); enter ``torch.cuda.stream(capture_stream)`` first if released
    buffers should be reusable by later captures.

    Args:
        pool: The pool to allocate into.

    Raises:
        RuntimeError: The pool is closed, or this torch lacks the private
            routing calls.
    """
    begin_allocating_into(pool)
    try:
        yield
    finally:
        end_allocating_into(pool)


def begin_allocating_into(pool: GraphPool) -> None:
    """From now on this thread's CUDA allocations on the pool's device go to ``pool``, until
    :func:`end_allocating_into` (called on any thread: it ends the routing into ``pool``).
    :func:`allocate_into_pool` is the scoped form; the two calls are for routing that starts
    and ends in different places. Adds a user to the pool; ending removes it, and
    GraphPool's own reference keeps the count above zero in between."""
    _private_api("_cuda_beginAllocateCurrentThreadToPool")(pool.device, pool.handle)  # handle raises if closed


def end_allocating_into(pool: GraphPool) -> None:
    """Ends :func:`begin_allocating_into`'s routing into ``pool`` and removes its user."""
    _private_api("_cuda_endAllocateToPool")(pool.device, pool.handle)
    _private_api("_cuda_releasePool")(pool.device, pool.handle)


@contextlib.contextmanager
def capture_detour(capturing: GraphPool, pool: GraphPool) -> Iterator[None]:
    """Inside a capture into ``capturing``, on the capturing thread: this thread's allocations go
    to ``pool`` instead, until the block ends.

    The allocator serves the first routing that matches, and the capture's comes first, so the
    capture's routing is taken off for the block and put back after it. Put back, it matches
    this thread rather than the capture's streams: the same allocations while a forward captures
    (one thread), so use this only there, and only where :func:`capture_detour_possible`. The
    pool counts one user more for the routing put back, which the capture's end does not remove:
    released here. Nested (a scratch block's op that ``transients`` routes too), it does nothing:
    the thread already allocates in ``pool``."""
    if getattr(_detour, "pool", None) is not None:
        if _detour.pool is not pool:
            raise RuntimeError("CUDA graphs: a capture detour into another pool is in progress on this thread")
        yield
        return
    device = capturing.device
    _private_api("_cuda_endAllocateToPool")(device, capturing.handle)
    _detour.pool = pool
    try:
        with allocate_into_pool(pool):
            yield
    finally:
        _detour.pool = None
        begin_allocating_into(capturing)
        _private_api("_cuda_releasePool")(device, capturing.handle)


_detour = threading.local()  # per thread: the pool of the capture_detour in progress


def capture_detour_possible() -> bool:
    """Whether :func:`capture_detour` may run: not with the allocator's
    ``graph_capture_record_stream_reuse`` on, whose end of a pool's routing expects the capture
    to be over (an internal assertion)."""
    conf = ",".join(os.environ.get(name, "") for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    return "graph_capture_record_stream_reuse:true" not in conf.replace(" ", "").lower()


def device_memory_used(empty_cache: bool = False, device: None | int | str | torch.device = None) -> int:
    """Bytes in use on the device as the driver sees them (total - free).

    Unlike allocator counters this includes NCCL buffers, library workspaces
    and instantiated graphs. Without ``empty_cache`` the reading also counts
    blocks the caching allocator keeps cached; deltas are only meaningful with
    ``empty_cache=True`` before *both* readings. That synchronises the device
    and flushes the cache: not for hot paths, never during a capture.

    Args:
        empty_cache: Synchronise and release cached blocks first.
        device: Device to read; default: the current device.

    Raises:
        RuntimeError: CUDA is not available.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("device_memory_used needs a CUDA device, and none is available.")
    index = _device_index(device)
    if empty_cache:
        torch.cuda.synchronize(index)
        torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(index)
    return int(total - free)


def use_expandable_segments() -> bool:
    """Turns on the caching allocator's expandable segments unless the user chose.

    Respects ``PYTORCH_CUDA_ALLOC_CONF`` when it mentions ``expandable_segments``.
    Returns whether expandable segments are now requested. Safe to call before or
    after CUDA initialisation (it only affects segments created afterwards).
    """
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" in conf:
        return "expandable_segments:true" in conf.replace(" ", "").lower()
    setter = getattr(torch.cuda.memory, "_set_allocator_settings", None)
    if setter is None:
        return False
    try:
        with warnings.catch_warnings():
            # torch 2.11 marks this spelling deprecated in favour of a private
            # accelerator-generic one; the setting itself is the same.
            warnings.simplefilter("ignore", FutureWarning)
            setter("expandable_segments:True")
    except RuntimeError as err:  # e.g. a platform without virtual memory management
        warnings.warn(
            f"expandable segments are not available here ({err}); the graph pool may fragment more.", stacklevel=2
        )
        return False
    return True
