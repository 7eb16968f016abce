"""One contiguous gradient buffer, split into buckets that are reduced as units.

Every trainable parameter gets ``param.main_grad``: a view into a single flat buffer
allocated once. Its address never changes for the whole run, which is what lets a
captured CUDA graph add weight gradients straight into it. Parameters are laid out in
backward order (the reverse of ``module.parameters()``), so the first bucket fills
first during backward and its all-reduce can start while backward continues.

Unusual here: a bucket also remembers CUDA events handed in by graph replays that
wrote its ``main_grad`` views on another stream; whoever reads, scales or reduces the
bucket first makes the current stream wait on them (``wait_events``).

For the distributed optimizer (``shard_count`` = DP > 1 ranks sharing the work) each
bucket is padded to a multiple of ``shard_count`` elements, so it splits into equal
contiguous shards, one per DP rank (reduce-scatter the gradients, all-gather the
parameters), and the parameters themselves move into a second flat buffer
(``param_data``) with the same layout, so a bucket's parameters are one tensor too.
"""

from collections.abc import Sequence

import torch

# Parameter starts are rounded up to this many elements (256 bytes in fp32, 128 in bf16), so every
# main_grad view is aligned for vectorised kernels. The gaps stay zero.
_ALIGN_ELEMENTS = 64


def _round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


class Bucket:
    """A contiguous slice of the grad buffer, reduced by one collective.

    Attributes:
        index: Position in the buffer (and in launch order).
        params: Parameters whose ``main_grad`` lies in this bucket, in buffer order.
        data: 1-D view of the buffer covering all of them (alignment gaps included).
        offset: Index of ``data[0]`` in the whole buffer.
        ready: ``id``s of the parameters whose gradient is complete for the current sync.
        handle: The in-flight async collective, if launched and not yet waited on.
        launched: True once the bucket's reduction was started this sync
            (with DP = 1 this means only that its events were waited on).
    """

    def __init__(self, index: int, params: list[torch.nn.Parameter], data: torch.Tensor, offset: int):
        self.index = index
        self.params = params
        self.data = data
        self.offset = offset
        self.ready: set = set()
        self.handle = None
        self.launched = False
        self.param_data: torch.Tensor | None = None  # the same slice of the parameter buffer
        self.param_handle = None  # in-flight all-gather of the parameters
        # id(event) -> event; an event object re-recorded every replay is stored once.
        self._events: dict[int, object] = {}

    @property
    def numel(self) -> int:
        return self.data.numel()

    def shard_range(self, rank: int, count: int) -> tuple[int, int]:
        """``(start, end)`` of shard ``rank`` of ``count`` in buffer coordinates."""
        assert self.numel % count == 0, (self.numel, count)
        size = self.numel // count
        return self.offset + rank * size, self.offset + (rank + 1) * size

    def is_ready(self) -> bool:
        return len(self.ready) == len(self.params)

    def add_event(self, event) -> None:
        self._events[id(event)] = event

    def wait_events(self) -> None:
        """Orders later work on this bucket after every event handed in (no host sync on CUDA)."""
        if not self._events:
            return
        if self.data.is_cuda:
            stream = torch.cuda.current_stream(self.data.device)
            for event in self._events.values():
                stream.wait_event(event)
        else:
            # A CPU buffer is read by the host, so the host itself has to wait.
            for event in self._events.values():
                event.synchronize()
        self._events.clear()

    def reset(self) -> None:
        """Forgets readiness and launch state (the buffer contents are zeroed elsewhere)."""
        assert self.handle is None, "reset a bucket whose reduction is still in flight"
        self.ready.clear()
        self.launched = False


class GradBuffer:
    """The flat gradient buffer of a set of parameters, and its buckets.

    Args:
        params: Parameters in buffer order (backward order). Each gets ``main_grad``.
        bucket_size: Elements per bucket. A bucket is closed after the parameter that
            makes it reach this size, so a bucket can exceed it by less than one
            parameter, and a parameter never spans two buckets.
        device: Where the buffer lives (the parameters' device).
        dtype: Buffer dtype: fp32, or the parameters' bf16/fp16 (gradients then
            accumulate and are reduced in it).
        shard_count: Pad every bucket to a multiple of this many elements (the DP size
            of the distributed optimizer; 1 leaves the layout unpadded).
        param_buffer: Also move the parameters into one flat buffer of their dtype, laid
            out like the gradients (``param_data``; the distributed optimizer gathers into it).
    """

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        bucket_size: int,
        device: torch.device,
        dtype: torch.dtype = torch.float32,
        shard_count: int = 1,
        param_buffer: bool = False,
    ):
        assert bucket_size >= 1, bucket_size
        self.params = list(params)
        self.dtype = dtype
        self.device = torch.device(device)

        # Pass 1: offsets and bucket boundaries, in plain integers.
        starts: list[int] = []
        bucket_ranges: list[tuple] = []  # (first param index, end param index, start elem, end elem)
        offset = 0
        first_param, bucket_start = 0, 0
        for i, param in enumerate(self.params):
            start = _round_up(offset, _ALIGN_ELEMENTS)
            starts.append(start)
            offset = start + param.numel()
            if offset - bucket_start >= bucket_size:
                end = self._bucket_end(bucket_start, offset, shard_count)
                bucket_ranges.append((first_param, i + 1, bucket_start, end))
                first_param, bucket_start = i + 1, _round_up(end, _ALIGN_ELEMENTS)
                offset = end
        if first_param < len(self.params):
            end = self._bucket_end(bucket_start, offset, shard_count)
            bucket_ranges.append((first_param, len(self.params), bucket_start, end))
            offset = end
        self.numel = _round_up(offset, _ALIGN_ELEMENTS)

        # Pass 2: the one allocation, then views into it.
        self.data = torch.zeros(self.numel, dtype=dtype, device=self.device)
        for param, start in zip(self.params, starts):
            param.main_grad = self.data[start : start + param.numel()].view(param.shape)
        self.buckets: list[Bucket] = []
        self.bucket_of_id: dict[int, Bucket] = {}  # id(param) -> its bucket
        for index, (p0, p1, e0, e1) in enumerate(bucket_ranges):
            bucket = Bucket(index, self.params[p0:p1], self.data[e0:e1], e0)
            self.buckets.append(bucket)
            for param in bucket.params:
                self.bucket_of_id[id(param)] = bucket
        self.param_data: torch.Tensor | None = None
        if param_buffer:
            self._move_params_into_buffer(starts)

    @staticmethod
    def _bucket_end(start: int, end: int, shard_count: int) -> int:
        if shard_count == 1:
            return end  # unpadded: the layout of plain DDP
        return start + _round_up(end - start, shard_count * _ALIGN_ELEMENTS)

    @torch.no_grad()
    def _move_params_into_buffer(self, starts: list[int]) -> None:
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(
                f"--use-distributed-optimizer needs every trainable parameter in one dtype, found {sorted(map(str, dtypes))}."
            )
        dtype = dtypes.pop() if dtypes else self.dtype
        self.param_data = torch.zeros(self.numel, dtype=dtype, device=self.device)
        for param, start in zip(self.params, starts):
            view = self.param_data[start : start + param.numel()].view(param.shape)
            view.copy_(param.data)
            param.data = view  # same Parameter object, storage now in the buffer
        for bucket in self.buckets:
            bucket.param_data = self.param_data[bucket.offset : bucket.offset + bucket.numel]

    def zero_(self) -> None:
        """Zeroes the whole buffer in place (same storage, same address)."""
        self.data.zero_()

    def param_range(self, param: torch.nn.Parameter) -> tuple:
        """``(start, end)`` element indices of ``param.main_grad`` in ``data``."""
        start = param.main_grad.data_ptr() - self.data.data_ptr()
        start //= self.data.element_size()
        return start, start + param.numel()

    def __repr__(self) -> str:
        sizes = [b.numel for b in self.buckets]
        return f"GradBuffer(numel={self.numel}, dtype={self.dtype}, buckets={sizes})"
