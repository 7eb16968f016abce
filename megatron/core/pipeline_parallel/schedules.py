"""Schedules: how the micro-batches of one global batch run forward and backward.

A schedule pulls micro-batches (``next_batch()``), runs the family's
``forward_step(batch, model) -> (loss, metrics)`` on each (Megatron's entry-point
contract: the loss is the micro-batch's mean loss, ``metrics`` extra values to log such
as aux losses), scales and back-propagates the loss, and tells the CUDA-graph session
which micro-batch slot each forward runs in. It returns the mean loss and metrics.

Slots. A micro-batch takes the lowest slot free when its forward starts and frees it
when its backward has run (:class:`SlotAllocator`), so graphs exist per micro-batch in
flight, not per micro-batch. Without pipelining that is slot 0 for every micro-batch.

Orders. :func:`one_f_one_b_order` and :func:`interleaved_order` give the sequence of
forward and backward steps of one pipeline rank, as plain data (tested on the CPU,
shared by the executors). The pipelined executors with communication come with
pipeline parallelism; :func:`forward_backward_in_flight` runs a 1F1B order on one rank
with several micro-batches in flight (the shape a pipeline stage sees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch

ForwardStep = Callable[[dict, torch.nn.Module], tuple[torch.Tensor, dict[str, torch.Tensor]]]
NUM_TOKENS = "num_tokens"
"""The metric a ``forward_step`` reports its loss tokens under (``--calculate-per-token-loss``)."""
Step = tuple[str, int]  # ("F" | "B", micro-batch)
ChunkStep = tuple[str, int, int]  # ("F" | "B", model chunk, micro-batch)


class SlotAllocator:
    """Lowest free slot per micro-batch in flight; a slot is free once its backward ran.

    One allocator per model chunk: chunk ``c`` of ``num_chunks`` hands out the slot ids
    ``c, c + num_chunks, ...``, so a slot never holds two chunks' regions (its events
    must be one cycle repeated).
    """

    def __init__(self, chunk: int = 0, num_chunks: int = 1) -> None:
        self._busy: dict[Any, int] = {}
        self._chunk, self._num_chunks = chunk, num_chunks

    def acquire(self, key: Any) -> int:
        if key in self._busy:
            raise ValueError(f"micro-batch {key} is already in flight")
        used = set(self._busy.values())
        index = next(i for i in range(len(used) + 1) if i not in used)
        self._busy[key] = index
        return index * self._num_chunks + self._chunk

    def release(self, key: Any) -> int:
        return self._busy.pop(key) * self._num_chunks + self._chunk

    @property
    def in_flight(self) -> int:
        return len(self._busy)


def one_f_one_b_order(num_microbatches: int, num_warmup: int) -> list[Step]:
    """1F1B: ``num_warmup`` forwards, then one forward one backward, then the backwards left."""
    if num_microbatches < 1:
        raise ValueError(f"a schedule needs at least one micro-batch, got {num_microbatches}")
    warmup = min(num_warmup, num_microbatches)
    order: list[Step] = [("F", m) for m in range(warmup)]
    for m in range(warmup, num_microbatches):
        order += [("F", m), ("B", m - warmup)]
    order += [("B", m) for m in range(num_microbatches - warmup, num_microbatches)]
    return order


def interleaved_order(num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int) -> list[ChunkStep]:
    """Interleaved 1F1B on ``pp_rank``: ``num_chunks`` model chunks (virtual stages) per rank.

    Forwards visit chunk 0 for ``pp_size`` micro-batches, then chunk 1, ...; backwards
    run the chunks in reverse. The warm-up is ``(pp_size - pp_rank - 1) * 2 + (num_chunks
    - 1) * pp_size`` forwards, as Megatron's. The micro-batch count must be a multiple of
    ``pp_size``.
    """
    if num_microbatches % pp_size:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a multiple "
            f"of --pipeline-model-parallel-size ({pp_size}); change --global-batch-size or --micro-batch-size."
        )
    total = num_microbatches * num_chunks
    group = pp_size * num_chunks

    def forward(k: int) -> ChunkStep:
        return ("F", (k % group) // pp_size, (k // group) * pp_size + k % pp_size)

    def backward(k: int) -> ChunkStep:
        return ("B", num_chunks - 1 - (k % group) // pp_size, (k // group) * pp_size + k % pp_size)

    warmup = min((pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * pp_size, total)
    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [forward(k), backward(k - warmup)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def _sum_into(total: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], per_token_loss: bool) -> None:
    for name, value in metrics.items():
        if name == NUM_TOKENS and not per_token_loss:
            continue  # only the per-token loss needs the count: no add per micro-batch otherwise
        value = value.detach()
        total[name] = value if name not in total else total[name] + value


def _token_sum(loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    """--calculate-per-token-loss: the micro-batch's loss summed over its tokens."""
    if NUM_TOKENS not in metrics:
        raise ValueError(
            f"--calculate-per-token-loss needs forward_step to report the loss tokens as metrics[{NUM_TOKENS!r}]."
        )
    return loss * metrics[NUM_TOKENS]


def _results(loss_sum, metric_sum, n: int, per_token_loss: bool):
    """Means over the micro-batches, or the sums with --calculate-per-token-loss (the
    trainer divides by the global token count)."""
    if per_token_loss:
        return loss_sum, metric_sum
    return _mean(loss_sum, n), {k: _mean(v, n) for k, v in metric_sum.items()}


def _mean(total: torch.Tensor, n: int) -> torch.Tensor:
    return total / n if n > 1 else total  # x / 1 is x: one launch fewer


@contextlib.contextmanager
def _in_slot(graphs, slot: int) -> Iterator[None]:
    if graphs is None:
        yield
    else:
        with graphs.micro_batch(slot):
            yield


def forward_backward_no_pipelining(
    *,
    forward_step: ForwardStep,
    next_batch: Callable[[], dict],
    model: torch.nn.Module,
    num_microbatches: int,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    graphs=None,
    per_token_loss: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every micro-batch forward then backward, in order; returns the mean loss and metrics.

    Args:
        forward_step: ``(batch, model) -> (loss, metrics)``.
        next_batch: Returns the next micro-batch.
        model: The (DDP-wrapped) model.
        num_microbatches: Micro-batches in this global batch.
        forward_only: Evaluation: no backward (the caller disables grad).
        scale_loss: Applied to ``loss / num_microbatches`` before backward (fp16 loss scale).
        no_sync: Context in which gradients accumulate without reduction (DDP's
            ``no_sync``); every micro-batch but the last runs in it.
        graphs: The CUDA-graph session, told the slot (always 0 here).
        per_token_loss: Back-propagate each micro-batch's token-summed loss, undivided,
            and return sums (``--calculate-per-token-loss``).
    """
    if graphs is not None and not forward_only:
        graphs.expect_microbatches(num_microbatches)
    loss_sum = None
    metric_sum: dict[str, torch.Tensor] = {}
    for mb in range(num_microbatches):
        batch = next_batch()
        last = mb == num_microbatches - 1
        sync = no_sync() if (no_sync is not None and not last and not forward_only) else contextlib.nullcontext()
        with sync:
            with _in_slot(graphs, 0):
                loss, metrics = forward_step(batch, model)
            if per_token_loss:
                loss = _token_sum(loss, metrics)
            if not forward_only:
                scaled = loss if per_token_loss else _mean(loss, num_microbatches)
                if scale_loss is not None:
                    scaled = scale_loss(scaled)
                scaled.backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        _sum_into(metric_sum, metrics, per_token_loss)
    return _results(loss_sum, metric_sum, num_microbatches, per_token_loss)


def forward_backward_in_flight(
    *,
    forward_step: ForwardStep,
    next_batch: Callable[[], dict],
    model: torch.nn.Module,
    num_microbatches: int,
    num_warmup: int,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    graphs=None,
    per_token_loss: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A 1F1B order on one rank: ``num_warmup + 1`` micro-batches in flight at most.

    Backwards still run in micro-batch order, so gradients accumulate in the same order
    as :func:`forward_backward_no_pipelining` and losses and gradients are equal to it.
    """
    if graphs is not None:
        graphs.expect_microbatches(num_microbatches)
    slots = SlotAllocator()
    pending: dict[int, torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    metric_sum: dict[str, torch.Tensor] = {}
    for phase, mb in one_f_one_b_order(num_microbatches, num_warmup):
        if phase == "F":
            batch = next_batch()
            with _in_slot(graphs, slots.acquire(mb)):
                loss, metrics = forward_step(batch, model)
            if per_token_loss:
                loss = _token_sum(loss, metrics)
            scaled = loss if per_token_loss else _mean(loss, num_microbatches)
            pending[mb] = scale_loss(scaled) if scale_loss is not None else scaled
            losses[mb] = loss.detach()
            _sum_into(metric_sum, metrics, per_token_loss)
            continue
        last = mb == num_microbatches - 1
        sync = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with sync:
            pending.pop(mb).backward()
        slots.release(mb)
    loss_sum = None
    for mb in range(num_microbatches):
        loss_sum = losses[mb] if loss_sum is None else loss_sum + losses[mb]
    return _results(loss_sum, metric_sum, num_microbatches, per_token_loss)


def get_forward_backward_func(pp_size: int = 1, num_chunks: int = 1) -> Callable[..., Any]:
    """The schedule for a pipeline layout (Megatron's name)."""
    if pp_size > 1 or num_chunks > 1:
        raise ValueError(
            "--pipeline-model-parallel-size > 1 needs the pipelined schedules, which are not available yet; "
            "use --pipeline-model-parallel-size 1."
        )
    return forward_backward_no_pipelining
