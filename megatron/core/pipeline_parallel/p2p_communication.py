"""Activation and gradient exchange between adjacent pipeline stages.

Every exchange is one ``torch.distributed.batch_isend_irecv`` over the pipeline group,
waited before it returns: up to four operations, activations to the next stage and from
the previous one, gradients to the previous stage and from the next one. The shapes are
known from the layout (``[s / TP with sequence parallelism, micro batch, hidden]``), so
no shape is exchanged. The pipeline is a ring, as in Megatron: the last rank's "next" is
rank 0, which is how an interleaved schedule passes a model chunk's output to the next
chunk on the first rank.

Unusual here: the operations of one batch are always posted in the same order,
activations before gradients on both sides, and carry a tag per kind (gloo honours
tags; NCCL matches by order). With two pipeline ranks the previous and the next rank
are the same process, so one batch may carry an activation and a gradient each way;
the fixed order keeps the i-th send of one rank matched with the i-th receive of its
peer whichever backend matches them.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

_ACTIVATION_TAG = 1
_GRADIENT_TAG = 2


@dataclasses.dataclass
class P2PCommunicator:
    """Sends and receives one pipeline rank's tensors.

    Args:
        pg: ``ProcessGroups`` (``pp`` group, neighbour ranks).
        tensor_shape: ``(seq, micro batch, hidden)`` of every exchanged tensor.
        dtype: Their dtype (the model's activation dtype).
        device: Where received tensors live.
    """

    pg: object
    tensor_shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    def _empty(self) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device)

    def communicate(
        self,
        *,
        send_next: torch.Tensor | None = None,
        recv_prev: bool = False,
        send_prev: torch.Tensor | None = None,
        recv_next: bool = False,
        recv_prev_into: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """One batched exchange; returns ``(from previous, from next)`` (None where not asked).

        A received activation comes back with ``requires_grad`` set: it is the input
        of this stage's forward, whose gradient is sent back later. ``recv_prev_into``:
        receive the activation into this tensor (a CUDA graph's static input) and return
        a leaf alias of it, leaving the tensor itself as it was.
        """
        pg = self.pg
        ops: list[dist.P2POp] = []
        got_prev = None
        if recv_prev:
            got_prev = self._empty() if recv_prev_into is None else self._checked(recv_prev_into)
        got_next = self._empty() if recv_next else None
        group = pg.pp
        # Activations first, then gradients, sends before receives: the same order on
        # both ends of every pair (module docstring).
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, _contiguous(send_next), pg.pp_next_rank, group, _ACTIVATION_TAG))
        if got_prev is not None:
            ops.append(dist.P2POp(dist.irecv, got_prev, pg.pp_prev_rank, group, _ACTIVATION_TAG))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, _contiguous(send_prev), pg.pp_prev_rank, group, _GRADIENT_TAG))
        if got_next is not None:
            ops.append(dist.P2POp(dist.irecv, got_next, pg.pp_next_rank, group, _GRADIENT_TAG))
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        if got_prev is not None:
            got_prev = got_prev if recv_prev_into is None else got_prev.detach()
            got_prev.requires_grad_(True)
        return got_prev, got_next

    def _checked(self, into: torch.Tensor) -> torch.Tensor:
        if tuple(into.shape) != self.tensor_shape or into.dtype != self.dtype or not into.is_contiguous():
            raise RuntimeError(
                f"a pipeline receive into a {tuple(into.shape)} {into.dtype} tensor, but stages exchange "
                f"contiguous {self.tensor_shape} {self.dtype} activations"
            )
        return into

    # Megatron's names, for the schedules.
    def recv_forward(self) -> torch.Tensor:
        return self.communicate(recv_prev=True)[0]

    def send_forward(self, output: torch.Tensor) -> None:
        self.communicate(send_next=output)

    def recv_backward(self) -> torch.Tensor:
        return self.communicate(recv_next=True)[1]

    def send_backward(self, input_grad: torch.Tensor) -> None:
        self.communicate(send_prev=input_grad)

    def send_forward_recv_backward(self, output: torch.Tensor) -> torch.Tensor:
        return self.communicate(send_next=output, recv_next=True)[1]

    def send_backward_recv_forward(self, input_grad: torch.Tensor) -> torch.Tensor:
        return self.communicate(send_prev=input_grad, recv_prev=True)[0]

    def send_forward_recv_forward(self, output: torch.Tensor | None, recv_prev: bool) -> torch.Tensor | None:
        return self.communicate(send_next=output, recv_prev=recv_prev)[0]

    def send_backward_recv_backward(self, input_grad: torch.Tensor | None, recv_next: bool) -> torch.Tensor | None:
        return self.communicate(send_prev=input_grad, recv_next=recv_next)[1]

    def send_forward_backward_recv_forward_backward(
        self, output: torch.Tensor | None, input_grad: torch.Tensor | None, recv_prev: bool, recv_next: bool
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return self.communicate(send_next=output, recv_prev=recv_prev, send_prev=input_grad, recv_next=recv_next)


def warm_up_group(pg) -> None:
    """One collective over the whole pipeline group before its first exchange: with NCCL, a
    group's first call must involve all its ranks, which a p2p batch between two does not."""
    if pg.pp is not None:
        dist.all_reduce(torch.zeros(1, device=pg.device), group=pg.pp)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach() if tensor.is_contiguous() else tensor.detach().contiguous()


def tensor_shape(*, seq_length: int, micro_batch_size: int, hidden_size: int, pg) -> tuple[int, int, int]:
    """The ``[s, b, h]`` shape stages exchange (``s / TP`` rows with sequence parallelism)."""
    seq = seq_length
    if getattr(pg, "sequence_parallel", False):
        if seq % pg.tp_size:
            raise ValueError(
                f"--seq-length ({seq_length}) must be divisible by --tensor-model-parallel-size ({pg.tp_size}) "
                "with --sequence-parallel."
            )
        seq //= pg.tp_size
    return (seq, micro_batch_size, hidden_size)
