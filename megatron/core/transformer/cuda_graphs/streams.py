"""The side stream that graphed runs train and capture on, made without torch's stream pool.

Graphs cannot be captured on the default stream, so a graphed run needs one other
stream. ``torch.cuda.Stream()`` takes it from torch's stream pool, and the first such
call on a device creates the whole pool (32 streams per priority level), which costs
tens of MiB of device memory outside the caching allocator, with or without any kernel
on the new stream. Eager runs never pay it, so it would show up in full as graph
overhead.

:func:`side_stream` creates a single stream through the CUDA driver
(``cuStreamCreate`` on the context torch made current) and wraps it in
``torch.cuda.ExternalStream``. There is one per device for the life of the process,
like the pool's streams: it is never destroyed, so no allocator block can outlive a
stream whose handle the driver later hands out again. Where the driver library
cannot be loaded or the call fails, it falls back to ``torch.cuda.Stream()``.
"""

import contextlib
import ctypes
import warnings
from collections.abc import Iterator

import torch

_CU_STREAM_NON_BLOCKING = 0x1  # like the pool's streams: no implicit sync with stream 0

_streams: dict[int, torch.cuda.Stream] = {}


def _driver_stream(device: int) -> int:
    """A new non-blocking stream on ``device``'s primary context, as a raw handle."""
    lib = ctypes.CDLL("libcuda.so.1")  # the driver torch has loaded already (Linux)
    handle = ctypes.c_void_p()
    with torch.cuda.device(device):
        torch.cuda.synchronize()  # makes the device's primary context current on this thread
        rc = lib.cuStreamCreate(ctypes.byref(handle), ctypes.c_uint(_CU_STREAM_NON_BLOCKING))
    if rc != 0 or not handle.value:
        raise OSError(f"cuStreamCreate returned CUDA error {rc}")
    return handle.value


def side_stream(device=None) -> torch.cuda.Stream:
    """This process's side stream for ``device`` (default: the current device)."""
    index = None if device is None else torch.device(device).index
    index = torch.cuda.current_device() if index is None else index
    stream = _streams.get(index)
    if stream is None:
        try:
            stream = torch.cuda.ExternalStream(_driver_stream(index), device=index)
        except (OSError, AttributeError) as err:
            warnings.warn(
                f"could not create a CUDA stream through the driver ({err}); using torch's stream "
                "pool, which costs more device memory",
                stacklevel=2,
            )
            stream = torch.cuda.Stream(device=index)
        _streams[index] = stream
    return stream


@contextlib.contextmanager
def running_on(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """Runs the block on ``stream``, ordered after the caller's stream and before what the caller
    runs next (None: on the caller's stream)."""
    if stream is None:
        yield
        return
    caller = torch.cuda.current_stream(stream.device)
    stream.wait_stream(caller)
    with torch.cuda.stream(stream):
        yield
    caller.wait_stream(stream)


def warm_blas(stream: torch.cuda.Stream, dtype: torch.dtype) -> None:
    """Makes cuBLAS's workspaces for ``stream`` now, before any activation: one per cuBLAS handle,
    and the forward and autograd's backward thread each have one. Made later, in the first
    iteration, they land among its activations, and once those go back to the driver each holds
    the pages it touches (expandable segments map 20 MiB at a time): tens of MiB reserved for nothing."""
    with running_on(stream):
        x = torch.ones(2, 8, 16, device=stream.device, dtype=dtype, requires_grad=True)
        w = torch.ones(16, 16, device=stream.device, dtype=dtype, requires_grad=True)
        b = torch.ones(16, device=stream.device, dtype=dtype, requires_grad=True)
        out = torch.nn.functional.linear(x, w, b) + torch.nn.functional.linear(x, w)  # with and without bias
        out.sum().backward()
