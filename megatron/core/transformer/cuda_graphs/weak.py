"""Non-owning tensor views: how a captured graph's static buffer is released.

A CUDA graph bakes raw device addresses into its kernels. Once capture is over,
the graph needs the *address* of a static buffer, not the Python tensor that
owns it. Swapping that tensor for a non-owning view at the same address lets
the caching allocator return the block to the graph pool (so a later capture
can reuse it) while the graph, and anyone holding the view, still sees the
same pointer. That is the whole memory saving of partial CUDA graphs, and also
the whole danger: after release, the view points at memory somebody else may
own. Deciding *when* a release is safe is the hand-off plan's job
(``buffers.py``); this file only builds the view.

What is unusual here:

* The view is built from a pointer and a byte count with the private
  ``torch._C._construct_storage_from_data_pointer`` (present in torch 2.x), so
  it works for every dtype, float8 and unsigned types included, and keeps
  strides, storage offset and the conj/neg view bits. Helpers that go through
  a dtype table (Transformer Engine's) miss dtypes and drop strides.
* If the private API is missing or raises, :func:`make_weak_ref` falls back to
  returning the tensor itself (a strong reference) and warns once per process:
  correct, just no memory saved.
* Only CUDA tensors are weak-referenced by default. CUDA memory lives in the
  caching allocator: a freed block stays mapped inside its pool until the pool
  hands it out again, which is exactly what the release plan reasons about.
  CPU memory goes back to the system allocator at once, so a weak view of a
  CPU tensor dangles immediately (reads garbage, may segfault). More broadly:
  never weak-ref memory the graph pool does not own: once its owner frees it, the
  memory can go anywhere. ``allow_cpu=True`` exists for tests that keep the owner alive
  and check layout fidelity on machines without a GPU.
"""

from __future__ import annotations

import warnings

import torch

__all__ = ["make_weak_ref", "is_weak_ref", "poison_"]

# Marker attribute set on every tensor make_weak_ref returns as a weak view.
# A per-object attribute (rather than a global WeakSet) keeps no global state;
# note that further views taken from a weak tensor are not marked.
_WEAK_MARKER = "_mcore_cuda_graph_weak_ref"

# One warning per process when the private constructor is unusable.
_fallback_warned = False


def _construct_storage(data_ptr: int, device: torch.device, nbytes: int):
    """Builds an untyped storage over ``nbytes`` at ``data_ptr`` that frees nothing.

    Kept as a module-level function so tests can replace it to exercise the
    fallback path.
    """
    ctor = getattr(torch._C, "_construct_storage_from_data_pointer", None)
    if ctor is None:
        raise RuntimeError("torch._C._construct_storage_from_data_pointer is not available")
    return ctor(data_ptr, device, nbytes)


def _warn_fallback(reason: str) -> None:
    global _fallback_warned
    if _fallback_warned:
        return
    _fallback_warned = True
    warnings.warn(
        "CUDA graphs: cannot build non-owning tensor views in this torch build "
        f"({reason}); static graph buffers stay strongly referenced, so graph "
        "memory will not be released (results stay correct, memory use is higher).",
        RuntimeWarning,
        stacklevel=3,
    )


def make_weak_ref(t: torch.Tensor, allow_cpu: bool = False) -> torch.Tensor:
    """Returns a tensor viewing ``t``'s memory without owning it.

    The result has the same data pointer, dtype, shape, strides, storage
    offset, device and conj/neg bits as ``t``. Dropping ``t`` and every other
    owner frees the block in the caching allocator while the result keeps
    pointing at the address. The result is a plain ``torch.Tensor`` (tensor
    subclasses such as ``Parameter`` are not preserved), carries no autograd
    history and has ``requires_grad=False``.

    Args:
        t: The tensor to view. Must use the strided layout.
        allow_cpu: Also build weak views of CPU tensors. Only safe while an
            owner stays alive: CPU memory is returned to the system the moment
            its last owner dies. Meant for layout tests on machines without a
            GPU.

    Returns:
        A non-owning view (``is_weak_ref(result)`` is True), or ``t`` itself,
        a strong reference, when ``t`` is not on CUDA (and not allowed CPU), is
        not strided, or the private storage constructor is unusable (the last
        case warns once per process).

    Raises:
        TypeError: ``t`` is not a tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"make_weak_ref expects a torch.Tensor, got {type(t).__name__}")
    if is_weak_ref(t):
        return t
    if t.device.type != "cuda" and not (allow_cpu and t.device.type == "cpu"):
        # Refuse: outside the CUDA caching allocator a freed block is not
        # parked anywhere we can reason about.
        return t
    if t.layout != torch.strided:
        return t

    storage = t.untyped_storage()
    try:
        # The view's storage starts at the ORIGINAL storage's base address and
        # spans all of it, so storage_offset (in elements of t.dtype) and the
        # strides mean exactly what they meant for t.
        weak_storage = _construct_storage(storage.data_ptr(), t.device, storage.nbytes())
        weak = torch.empty(0, dtype=t.dtype, device=t.device)
        weak.set_(weak_storage, t.storage_offset(), t.size(), t.stride())
    except Exception as exc:  # noqa: BLE001 - any failure means "no weak views here"
        _warn_fallback(f"{type(exc).__name__}: {exc}")
        return t
    assert weak.data_ptr() == t.data_ptr(), "weak view must alias the original address"

    # set_ produced a tensor without the lazy conj/neg bits; re-apply them as
    # views so the values read through the weak tensor match t's.
    if t.is_conj():
        weak = weak.conj()
    if t.is_neg():
        weak = weak._neg_view()
    setattr(weak, _WEAK_MARKER, True)
    return weak


def is_weak_ref(t: object) -> bool:
    """Whether ``t`` is a tensor returned by :func:`make_weak_ref` as a weak view."""
    return isinstance(t, torch.Tensor) and getattr(t, _WEAK_MARKER, False) is True


def _poison_value(dtype: torch.dtype) -> object | None:
    """The fill value for ``dtype``, or None if only a byte pattern will do."""
    if dtype == torch.bool:
        return True
    if dtype.is_floating_point or dtype.is_complex:
        return float("nan")
    try:
        return torch.iinfo(dtype).max
    except TypeError:
        return None


def poison_(t: torch.Tensor) -> torch.Tensor:
    """Overwrites ``t``'s elements in place with a recognisable pattern.

    Used by a debug mode that poisons a static buffer at release time, so that
    a reader the release plan missed sees garbage instead of plausible stale
    values. Patterns: NaN for floating and complex dtypes (float8 included),
    the maximum value for integer dtypes, True for bool, and all-ones bytes for
    bit-packed types without a NaN (e.g. float4, bits8). Only the elements the
    tensor views are written, strides respected.

    Args:
        t: The tensor to poison (may be a weak view).

    Returns:
        ``t``.

    Raises:
        TypeError: The dtype has no pattern (e.g. quantized dtypes).
    """
    value = _poison_value(t.dtype)
    if value is not None:
        try:
            return t.fill_(value)
        except (RuntimeError, NotImplementedError):
            pass  # no fill kernel for this dtype on this device: try bytes
    if t.element_size() == 1:
        try:
            t.view(torch.uint8).fill_(0xFF)
            return t
        except (RuntimeError, NotImplementedError):
            pass
    raise TypeError(f"poison_: no poison pattern for dtype {t.dtype}")
