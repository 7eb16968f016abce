"""fp32 gradients for the optimizer from bf16/fp16 ``main_grad`` buffers.

With ``--grad-reduce-in-bf16`` (or ``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``)
DDP's ``main_grad`` views are bf16/fp16. The optimizer's fp32 main params take fp32
gradients, and unscaling, the gradient norm, clipping and the non-finite checks all
run on those fp32 gradients, as in Megatron (which gives each main param
``main_grad.float()`` as its gradient every step).

Unusual here: a flat gradient buffer is converted by one copy per step, and every
parameter's fp32 gradient is a view into that copy at its ``main_grad``'s offset, so
the norm can still be one reduction over the flat copy. The copies live for one step:
between steps only the bf16/fp16 buffer holds gradients.
"""

from collections.abc import Sequence

import torch


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


class Fp32GradCopies:
    """Per-step fp32 copies of low-precision ``main_grad`` tensors.

    Args:
        grads: The ``main_grad`` of each parameter the optimizer steps, in its order.
        buffers: Flat buffers that hold those gradients (the DDP buffer, or the
            distributed optimizer's shards of it); may be empty. A low-precision
            gradient inside one of them becomes a view into the buffer's fp32 copy;
            one outside them is copied alone.
    """

    def __init__(self, grads: Sequence[torch.Tensor], buffers: Sequence[torch.Tensor]):
        self.grads = list(grads)
        self.buffers = list(buffers)
        spans = [_span(b) for b in self.buffers]
        # Per gradient: None (fp32 already: used as it is), or (buffer index, element offset),
        # or (-1, 0) (its own copy).
        self._where: list[tuple[int, int] | None] = []
        for g in self.grads:
            if g.dtype == torch.float32:
                self._where.append(None)
                continue
            lo, hi = _span(g)
            found = (-1, 0)
            for i, (b_lo, b_hi) in enumerate(spans):
                if self.buffers[i].dtype == g.dtype and b_lo <= lo and hi <= b_hi:
                    found = (i, (lo - b_lo) // g.element_size())
                    break
            self._where.append(found)
        # Every low-precision buffer is copied, also one no gradient lies in (a distributed
        # optimizer shard of padding only): the norm reads it too.
        self._used = [i for i, b in enumerate(self.buffers) if b.dtype != torch.float32]
        self._table: dict[int, torch.Tensor] = {}

    def make(self) -> list[torch.Tensor]:
        """This step's fp32 gradients, in ``grads`` order (fp32 ``main_grad`` tensors themselves)."""
        flats = {i: self.buffers[i].float() for i in self._used}
        table = {id(self.buffers[i]): flat for i, flat in flats.items()}
        out = []
        for g, where in zip(self.grads, self._where):
            if where is None:
                fp32 = g
            elif where[0] < 0:
                fp32 = g.float()
            else:
                start = where[1]
                fp32 = flats[where[0]][start : start + g.numel()].view(g.shape)
            table[id(g)] = fp32
            out.append(fp32)
        self._table = table
        return out

    def of(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The fp32 tensors of this step for ``tensors`` (gradients or buffers given at
        construction; fp32 ones pass through). Call after ``make``."""
        return [t if t.dtype == torch.float32 else self._table[id(t)] for t in tensors]

    def check_known(self, tensors: Sequence[torch.Tensor]) -> None:
        """Raises unless every low-precision tensor in ``tensors`` is one of the gradients or buffers."""
        known = {id(t) for t in self.grads} | {id(b) for b in self.buffers}
        if any(t.dtype != torch.float32 and id(t) not in known for t in tensors):
            raise ValueError(
                "the gradient-norm tensors must be the parameters' main_grad views or the grad buffers "
                "(the norm is taken over their fp32 copies)."
            )

    def clear(self) -> None:
        """Drops this step's copies."""
        self._table = {}
