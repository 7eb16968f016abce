"""Pipeline schedules simulated on one rank: orders, micro-batch slots, model chunks.

What a pipeline rank executes, without communication:

- :func:`rank_order`: the steps ``(phase, chunk, micro-batch)`` that pipeline rank
  ``pp_rank`` runs under 1F1B or interleaved 1F1B (the order helpers of
  ``schedules.py``, with Megatron's warm-up);
- :func:`slot_steps`: the CUDA-graph micro-batch slot of every step
  (``slots.assign_slots``, as the pipelined schedule hands them out);
- :func:`forward_backward_chunks`: runs a whole GPT model as ``num_chunks``
  consecutive model chunks in one process, in the interleaved order of one pipeline
  rank. Chunk c's output is "sent" to chunk c+1 (a detached tensor received as a new
  leaf, as a pipeline stage receives it) and the dgrad of that leaf is "sent" back; with
  CUDA graphs the receive lands in the static input of the chunk's first graph.
  Losses and gradients equal the unpipelined schedule's (the same kernels in the same
  per-parameter order), except for a weight shared by two chunks (tied embeddings:
  pipelines reduce its two gradients separately), so compare with untied weights.

Unusual here: the simulated order is only valid when each chunk's forward of a
micro-batch comes after the previous chunk's and its backward before the previous
chunk's backward (:func:`check_single_process`); every 1F1B and interleaved order is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.autograd.variable import Variable

from megatron.core.pipeline_parallel.schedules import (
    ChunkStep,
    ForwardStep,
    _in_slot,
    _mean,
    _results,
    _sum_into,
    _token_sum,
    interleaved_order,
    one_f_one_b_order,
)
from megatron.core.pipeline_parallel.slots import assign_slots
from megatron.core.transformer.recompute import run_layers

SCHEDULES = ("1f1b", "interleaved")


def rank_order(
    schedule: str, num_microbatches: int, pp_size: int, pp_rank: int, num_chunks: int = 1
) -> list[ChunkStep]:
    """The steps of ``pp_rank`` under ``schedule`` (``1f1b``: one chunk, warm-up
    ``pp_size - pp_rank - 1`` forwards; ``interleaved``: ``num_chunks`` chunks)."""
    if not 0 <= pp_rank < pp_size:
        raise ValueError(f"pipeline rank {pp_rank} is outside a pipeline of {pp_size} stages")
    if schedule == "1f1b":
        if num_chunks != 1:
            raise ValueError(f"1F1B runs one model chunk per rank, got {num_chunks}; use the interleaved schedule")
        return [(p, 0, mb) for p, mb in one_f_one_b_order(num_microbatches, pp_size - pp_rank - 1)]
    if schedule == "interleaved":
        return interleaved_order(num_microbatches, pp_size, pp_rank, num_chunks)
    raise ValueError(f"unknown schedule {schedule!r}; one of {', '.join(SCHEDULES)}")


@dataclasses.dataclass(frozen=True)
class SlotStep:
    """One step of a rank's order and the micro-batch slot its graphs run in."""

    phase: str  # "F" | "B"
    chunk: int
    microbatch: int
    slot: int


def slot_steps(order: Sequence[ChunkStep], weights: Sequence[float] | None = None) -> list[SlotStep]:
    """The slot of every step, as the pipelined schedule assigns them (``slots.assign_slots``;
    ``weights``: per chunk, e.g. its layers)."""
    slot_of = assign_slots(order, weights)
    return [SlotStep(phase, chunk, mb, slot_of[(chunk, mb)]) for phase, chunk, mb in order]


def max_in_flight(order: Sequence[ChunkStep], chunk: int | None = None) -> int:
    """Most micro-batches of ``chunk`` (None: of every chunk) forwarded and not yet
    backwarded at once."""
    live: set[tuple[int, int]] = set()
    most = 0
    for phase, c, mb in order:
        if chunk is None or c == chunk:
            if phase == "F":
                live.add((c, mb))
            else:
                live.discard((c, mb))
            most = max(most, len(live))
    return most


def check_single_process(order: Sequence[ChunkStep], num_chunks: int) -> None:
    """Raises ``ValueError`` unless chunk c+1 of one process can take chunk c's output.

    Every (chunk, micro-batch) runs forward once, then backward once; the forward of
    chunk c+1 follows chunk c's and its backward precedes chunk c's.
    """
    done: dict[tuple[str, int, int], int] = {}
    for i, (phase, c, mb) in enumerate(order):
        step = (phase, c, mb)
        if step in done:
            raise ValueError(f"step {step} runs twice")
        needs = [("F", c, mb)] if phase == "B" else []
        if phase == "F" and c > 0:
            needs.append(("F", c - 1, mb))
        if phase == "B" and c < num_chunks - 1:
            needs.append(("B", c + 1, mb))
        for need in needs:
            if need not in done:
                raise ValueError(f"step {step} (position {i}) runs before {need}, which it needs")
        done[step] = i
    missing = [(p, c, mb) for p, c, mb in done if p == "F" and ("B", c, mb) not in done]
    if missing:
        raise ValueError(f"forwards without a backward: {missing}")


def schedule_key(schedule: str, pp_size: int, pp_rank: int, num_chunks: int) -> tuple:
    """What fixes a rank's order besides the micro-batch count (``expect_microbatches``)."""
    return (schedule, pp_size, pp_rank, num_chunks)


# ---------------------------------------------------------------------- GPT chunks


def chunk_boundaries(num_layers: int, num_chunks: int) -> list[int]:
    """Layer boundaries ``[0, .., num_layers]`` of ``num_chunks`` near-equal chunks."""
    if not 1 <= num_chunks <= num_layers:
        raise ValueError(f"cannot split {num_layers} layers into {num_chunks} model chunks")
    base, extra = divmod(num_layers, num_chunks)
    bounds = [0]
    for c in range(num_chunks):
        bounds.append(bounds[-1] + base + (c < extra))
    return bounds


class GPTChunks:
    """A whole GPT model run as consecutive chunks of its layers (one process).

    Chunk 0 also runs the embedding; the last chunk runs the loss head (through
    ``forward_step``, see :meth:`last`). The layers are the model's own, so CUDA-graph
    regions attached to the model route as usual.
    """

    def __init__(self, model: torch.nn.Module, num_chunks: int, boundaries: Sequence[int] | None = None):
        gpt = model.module if hasattr(model, "module") else model
        self.gpt = gpt
        self.layers = gpt.decoder.layers
        self.num_chunks = num_chunks
        self.bounds = list(boundaries) if boundaries is not None else chunk_boundaries(len(self.layers), num_chunks)
        if len(self.bounds) != num_chunks + 1 or self.bounds[0] != 0 or self.bounds[-1] != len(self.layers):
            raise ValueError(f"chunk boundaries {self.bounds} do not split {len(self.layers)} layers in {num_chunks}")
        if any(a >= b for a, b in zip(self.bounds, self.bounds[1:])):
            raise ValueError(f"chunk boundaries {self.bounds}: every chunk needs a layer")

    def first_and_last_layers(self) -> list[tuple[int, int]]:
        """(first, last) layer index of every chunk: the layers at chunk edges."""
        return [(a, b - 1) for a, b in zip(self.bounds, self.bounds[1:])]

    def _rotary(self, hidden: torch.Tensor):
        rope = self.gpt.rotary_pos_emb
        return None if rope is None else rope(hidden.shape[0], hidden.device)  # [s, b, h]: s first

    def layers_of(self, chunk: int, hidden: torch.Tensor) -> torch.Tensor:
        layers = self.layers[self.bounds[chunk] : self.bounds[chunk + 1]]
        return run_layers(layers, hidden, self._rotary(hidden), self.gpt.config)

    def forward(self, chunk: int, batch: dict, hidden: torch.Tensor | None) -> torch.Tensor:
        """Chunk ``chunk`` (not the last) on ``hidden`` (chunk 0: on the batch's tokens)."""
        if chunk == 0:
            hidden = self.gpt.embedding(batch["tokens"], batch.get("position_ids"))
        return self.layers_of(chunk, hidden)

    def last(self, hidden: torch.Tensor | None) -> Callable[..., torch.Tensor]:
        """The last chunk as ``model(tokens, position_ids, labels)`` for ``forward_step``:
        its layers on ``hidden`` (the received tensor), then the loss head."""

        def run(input_ids, position_ids=None, labels=None):
            h = hidden
            if self.num_chunks == 1:
                h = self.gpt.embedding(input_ids, position_ids)
            h = self.layers_of(self.num_chunks - 1, h)
            return self.gpt._postprocess(h, labels)

        return run


def deallocate_output(out: torch.Tensor) -> None:
    """Frees a sent output's storage; its autograd graph stays (Megatron's rule: never a view)."""
    if out._base is not None:
        raise RuntimeError("a pipeline output to deallocate is a view of another tensor; freeing it frees nothing")
    out.data = torch.empty((1,), device=out.device, dtype=out.dtype)


def backward_output(out: torch.Tensor, grad: torch.Tensor) -> None:
    """Back-propagates ``grad`` from ``out``, whose storage may have been deallocated (the
    engine directly: ``torch.autograd.backward`` would compare the shapes)."""
    Variable._execution_engine.run_backward(
        tensors=(out,),
        grad_tensors=(grad,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _send(graphs, out: torch.Tensor) -> None:
    """What a pipeline send tells the graphs: the output is read until the send's wait, which comes
    before the slot's next graph event (``NEXT_EVENT``, as the pipelined schedule's exchange does):
    here the next chunk's forward of the same micro-batch reads it, and that forward comes before the
    backward of this chunk, the slot's next event."""
    if graphs is not None:
        from megatron.core.transformer.cuda_graphs.session import NEXT_EVENT

        graphs.note_send(out, until=NEXT_EVENT)


def _receive(graphs, slot: int, chunk: int, sent: torch.Tensor) -> torch.Tensor:
    """What a pipeline receive of ``sent`` gives ``chunk`` (a new leaf that needs a grad)."""
    buffer = graphs.receive_buffer(slot, chunk) if graphs is not None else None
    if buffer is not None:
        # The receive, straight into the first graph's static input. Not an autograd op, as a real
        # receive is not: a copy from ``sent`` would give the session's buffer a history (chunk
        # c - 1's graph nodes, which hold the session), a cycle through C++ that keeps the session,
        # the model and its pools alive after the trainer is gone.
        buffer.copy_(sent.detach())
        return buffer.detach().requires_grad_(True)
    received = sent.detach().clone().requires_grad_(True)
    if graphs is not None:
        graphs.note_receive(slot, received)
    return received


def forward_backward_chunks(
    *,
    forward_step: ForwardStep,
    next_batch: Callable[[], dict],
    model: torch.nn.Module,
    num_microbatches: int,
    num_chunks: int = 2,
    pp_size: int = 2,
    pp_rank: int = 0,
    boundaries: Sequence[int] | None = None,
    forward_only: bool = False,
    deallocate_pipeline_outputs: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    graphs=None,
    per_token_loss: bool = False,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The interleaved order of ``pp_rank`` (1F1B with one chunk) over model chunks in one
    process; returns the mean loss and metrics like ``forward_backward_no_pipelining``.

    Args:
        forward_step, next_batch, model, num_microbatches, scale_loss, no_sync, graphs,
            per_token_loss: as ``schedules.forward_backward_no_pipelining``.
        num_chunks: Model chunks (virtual stages) of the simulated rank.
        pp_size, pp_rank: The pipeline whose rank's order is simulated.
        boundaries: Layer boundaries of the chunks (default: near-equal chunks).
        forward_only: Evaluation: every chunk's forward per micro-batch, no backward.
        deallocate_pipeline_outputs: Free a chunk's output storage once it is sent, as
            Megatron's ``--deallocate-pipeline-outputs`` does (backward then runs the
            autograd engine on the emptied output with the received gradient).
    """
    chunks = GPTChunks(model, num_chunks, boundaries)
    last_chunk = num_chunks - 1
    if forward_only:
        order = [("F", c, mb) for mb in range(num_microbatches) for c in range(num_chunks)]
        steps = [SlotStep(p, c, mb, 0) for p, c, mb in order]
        graphs = None  # eval runs eagerly anyway
    else:
        schedule = "1f1b" if num_chunks == 1 else "interleaved"
        order = rank_order(schedule, num_microbatches, pp_size, pp_rank, num_chunks)
        check_single_process(order, num_chunks)
        steps = slot_steps(order, [hi - lo for lo, hi in zip(chunks.bounds, chunks.bounds[1:])])
        if graphs is not None:
            graphs.expect_microbatches(num_microbatches, schedule=schedule_key(schedule, pp_size, pp_rank, num_chunks))
    batches: dict[int, dict] = {}
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> output to back-propagate
    received: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> the leaf chunk c took
    dgrads: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, mb) -> gradient sent to chunk - 1
    pending: dict[int, torch.Tensor] = {}
    losses: dict[int, torch.Tensor] = {}
    metric_sum: dict[str, torch.Tensor] = {}
    for index, step in enumerate(steps):
        c, mb = step.chunk, step.microbatch
        if step.phase == "F":
            if c == 0:
                batches[mb] = next_batch()
            hidden = None
            if c > 0:
                sent = outputs.pop((c - 1, mb)) if forward_only else outputs[(c - 1, mb)]
                hidden = received[(c, mb)] = _receive(graphs, step.slot, c, sent)
                if deallocate_pipeline_outputs and not forward_only:
                    deallocate_output(sent)
            with _in_slot(graphs, step.slot, c):
                if c < last_chunk:
                    outputs[(c, mb)] = out = chunks.forward(c, batches[mb], hidden)
                    _send(graphs, out)
                    continue
                loss, metrics = forward_step(batches.pop(mb), chunks.last(hidden))
            if per_token_loss:
                loss = _token_sum(loss, metrics)
            if not forward_only:
                scaled = loss if per_token_loss else _mean(loss, num_microbatches)
                pending[mb] = scale_loss(scaled) if scale_loss is not None else scaled
            losses[mb] = loss.detach()
            _sum_into(metric_sum, metrics, per_token_loss)
            if forward_only:
                received.clear()
            continue
        last_step = index == len(steps) - 1
        sync = no_sync() if (no_sync is not None and not last_step) else contextlib.nullcontext()
        with sync:
            if c == last_chunk:
                pending.pop(mb).backward()
            else:
                backward_output(outputs.pop((c, mb)), dgrads.pop((c + 1, mb)))
            if c > 0:
                leaf = received.pop((c, mb))
                dgrads[(c, mb)] = leaf.grad  # the dgrad "sent" to the previous chunk
                leaf.grad = None
    loss_sum = None
    for mb in range(num_microbatches):
        loss_sum = losses[mb] if loss_sum is None else loss_sum + losses[mb]
    return _results(loss_sum, metric_sum, num_microbatches, per_token_loss)
