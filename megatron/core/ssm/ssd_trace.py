"""What the Mamba scan's backward allocates at its peak, traced on the meta device (shapes, no data).

The memory report and the budgets (``cuda_graphs/activations.py``) ask it for a captured scan's
working memory; the tests check it against what a real backward allocates.
"""

import functools
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.core.ssm import ssd, ssd_kernels


class _LiveBytes(TorchDispatchMode):
    """Counts the bytes of the storages that operations create, while they live, and their peak. An
    output on an input's storage (a view, an in-place result) creates none, even where that input
    was made before counting began."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage._cdata, storage.nbytes()
            if key in self._seen or key in inputs or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live -= size
        self._seen.discard(key)


def captured_backward_peak_bytes(
    batch: int, length: int, heads: int, head_dim: int, groups: int, state: int, chunk_size: int, dtype: torch.dtype
) -> int:
    """Peak bytes :class:`GroupSlicedScan`'s backward allocates while a CUDA graph captures it
    (slices of ``SLICE_BYTES``): its gradients and one slice's working memory.

    Found by running that backward on the meta device (shapes only, no data, no device)
    and counting what each operation creates while it lives: exact for this scan's
    operations, however they change. ``x``, ``B``, ``C`` in ``dtype``, ``dt``, ``A``, ``D``
    in float32, as the mixer passes them. Every Mamba layer of a model asks the same
    question, so each answer is traced once. Unless ``MEGATRON_SSD_KERNELS=torch`` the Triton
    kernels' backward is traced (its allocations; the launches are skipped on the meta device).
    """
    kernels = ssd_kernels.takes(dtype)
    return _traced_backward_peak(
        batch, length, heads, head_dim, groups, state, chunk_size, dtype, ssd.SLICE_BYTES, kernels
    )


@functools.lru_cache(maxsize=64)
def _traced_backward_peak(
    batch, length, heads, head_dim, groups, state, chunk_size, dtype, budget, kernels=False
) -> int:
    meta = dict(device="meta")
    f32 = dict(dtype=torch.float32, **meta)
    saved = (
        torch.empty(batch, length, heads, head_dim, dtype=dtype, **meta),
        torch.empty(batch, length, heads, **f32),
        torch.empty(heads, **f32),
        torch.empty(batch, length, groups, state, dtype=dtype, **meta),
        torch.empty(batch, length, groups, state, dtype=dtype, **meta),
        torch.empty(heads, **f32),
    )
    dy = torch.empty_like(saved[0])
    counter = _LiveBytes()
    with counter:
        ssd._sliced_backward(saved, (True,) * 6, dy, chunk_size, None, budget=budget, kernels=kernels)
    return counter.peak
