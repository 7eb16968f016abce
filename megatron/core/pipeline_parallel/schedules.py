"""Schedules: how the micro-batches of one global batch run forward and backward.

A schedule pulls micro-batches (``next_batch()``), runs the family's
``forward_step(batch, model) -> (loss, metrics)`` on each (Megatron's entry-point
contract: the loss is the micro-batch's mean loss, ``metrics`` extra values to log such
as aux losses), scales and back-propagates the loss, and tells the CUDA-graph session
which micro-batch slot each forward runs in. It returns the mean loss and metrics.

Slots. A micro-batch takes a slot when its forward starts and frees it when its
backward has run (``slots.py``), so graphs exist per micro-batch in flight, not per
micro-batch. Without pipelining that is slot 0 for every micro-batch.

Orders. :func:`one_f_one_b_order` and :func:`interleaved_order` give the sequence of
forward and backward steps of one pipeline rank, as plain data (tested on the CPU,
shared by the executors and the CUDA-graph slots). :func:`forward_backward_pipelining`
runs them over the pipeline group (1F1B with one model chunk per rank, interleaved 1F1B
with several); ``timetable.py`` decides which exchange carries each activation and
gradient. :func:`forward_backward_in_flight` runs a 1F1B order on one rank with several
micro-batches in flight (the shape a pipeline stage sees).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from megatron.core.models.gpt.loss import mask_kwargs
from megatron.core.pipeline_parallel.slots import SlotAllocator

ForwardStep = Callable[[dict, torch.nn.Module], tuple[torch.Tensor, dict[str, torch.Tensor]]]
NUM_TOKENS = "num_tokens"
"""The metric a ``forward_step`` reports its loss tokens under (evaluation and ``--calculate-per-token-loss``)."""
Step = tuple[str, int]  # ("F" | "B", micro-batch)
ChunkStep = tuple[str, int, int]  # ("F" | "B", model chunk, micro-batch)


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


def one_f_one_b_warmup(pp_size: int, pp_rank: int) -> int:
    """Megatron's warm-up forwards of 1F1B on ``pp_rank``: the stages after it."""
    return pp_size - pp_rank - 1


def interleaved_warmup(pp_size: int, pp_rank: int, num_chunks: int, microbatch_group_size: int | None = None) -> int:
    """Megatron's warm-up forwards of interleaved 1F1B (before clamping to the total)."""
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    return (pp_size - pp_rank - 1) * 2 + (num_chunks - 1) * group


def schedule_table(num_microbatches: int, num_chunks: int, microbatch_group_size: int) -> list[tuple[int, int]]:
    """``(chunk, micro-batch)`` of each forward, in order: groups of ``microbatch_group_size``
    micro-batches run through chunk 0, then chunk 1, ...; the last group may be shorter."""
    table = []
    for start in range(0, num_microbatches, microbatch_group_size):
        stop = min(start + microbatch_group_size, num_microbatches)
        table += [(c, m) for c in range(num_chunks) for m in range(start, stop)]
    return table


def interleaved_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    num_chunks: int,
    *,
    microbatch_group_size: int | None = None,
) -> list[ChunkStep]:
    """Interleaved 1F1B on ``pp_rank``: ``num_chunks`` model chunks (virtual stages) per rank.

    Forwards visit chunk 0 for ``microbatch_group_size`` micro-batches (default
    ``pp_size``, Megatron's ``--microbatch-group-size-per-virtual-pipeline-stage``), then
    chunk 1, ...; backwards run the chunks in reverse. The warm-up is ``(pp_size - pp_rank
    - 1) * 2 + (num_chunks - 1) * group`` forwards, as Megatron's. As Megatron, the group
    must lie in ``[pp_size, num_microbatches]`` and the last group must be empty or at
    least ``pp_size`` long.
    """
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    if group < pp_size or group > num_microbatches:
        raise ValueError(
            f"the interleaved schedule needs --microbatch-group-size-per-virtual-pipeline-stage ({group}, default "
            f"--pipeline-model-parallel-size) between --pipeline-model-parallel-size ({pp_size}) and the number of "
            f"micro-batches ({num_microbatches}); change --global-batch-size or --micro-batch-size."
        )
    if 0 < num_microbatches % group < pp_size:
        raise ValueError(
            f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a multiple "
            f"of --microbatch-group-size-per-virtual-pipeline-stage ({group}, default "
            f"--pipeline-model-parallel-size) or to leave a remainder of at least "
            f"--pipeline-model-parallel-size ({pp_size}); change --global-batch-size or --micro-batch-size."
        )
    table = schedule_table(num_microbatches, num_chunks, group)
    total = len(table)

    def forward(k: int) -> ChunkStep:
        return ("F", *table[k])

    def backward(k: int) -> ChunkStep:
        c, m = table[k]
        return ("B", num_chunks - 1 - c, m)

    warmup = min(interleaved_warmup(pp_size, pp_rank, num_chunks, group), total)
    order = [forward(k) for k in range(warmup)]
    for k in range(warmup, total):
        order += [forward(k), backward(k - warmup)]
    order += [backward(k) for k in range(total - warmup, total)]
    return order


def rank_order(
    num_microbatches: int,
    pp_size: int,
    pp_rank: int,
    num_chunks: int = 1,
    *,
    microbatch_group_size: int | None = None,
    forward_only: bool = False,
) -> list[ChunkStep]:
    """The steps of ``pp_rank``: 1F1B for one chunk, interleaved 1F1B for several; forwards only
    for evaluation (in the same forward order)."""
    if num_chunks == 1:
        if forward_only:
            return [("F", 0, m) for m in range(num_microbatches)]
        warmup = one_f_one_b_warmup(pp_size, pp_rank)
        return [(p, 0, m) for p, m in one_f_one_b_order(num_microbatches, warmup)]
    order = interleaved_order(
        num_microbatches, pp_size, pp_rank, num_chunks, microbatch_group_size=microbatch_group_size
    )
    return [step for step in order if step[0] == "F"] if forward_only else order


def _sum_into(total: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], per_token_loss: bool) -> None:
    for name, value in metrics.items():
        if name == NUM_TOKENS and not per_token_loss:
            continue  # only the per-token loss needs the count: no add per micro-batch otherwise
        value = value.detach()
        total[name] = value if name not in total else total[name] + value


def _token_sum(loss: torch.Tensor, metrics: dict[str, torch.Tensor]) -> torch.Tensor:
    """The micro-batch's loss summed over its tokens (evaluation and --calculate-per-token-loss)."""
    if NUM_TOKENS not in metrics:
        raise ValueError(
            f"forward_step must report the loss tokens as metrics[{NUM_TOKENS!r}]: evaluation and "
            "--calculate-per-token-loss weigh each micro-batch by its loss tokens."
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
def _in_slot(graphs, slot: int, chunk: int = 0) -> Iterator[None]:
    if graphs is None:
        yield
    else:
        with graphs.micro_batch(slot, chunk):
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


def default_stage_forward(batch: dict, model: torch.nn.Module) -> torch.Tensor:
    """A pipeline stage before the last: the model on the batch's tokens and positions (the
    received activation, set on the model, replaces the embedding after the first stage)."""
    return model(batch["tokens"], batch.get("position_ids"), **mask_kwargs(batch))


def deallocate_output(output: torch.Tensor) -> None:
    """Frees a sent stage output's storage; its ``grad_fn`` stays for the backward
    (Megatron's ``deallocate_pipeline_outputs``; :func:`custom_backward` runs it). A view
    keeps its storage (its base would keep it alive anyway), and so does a leaf: the received
    tensor a chunk of no layers passes on, which may be a receive buffer."""
    if output._base is not None or output.grad_fn is None:
        return
    output.data = torch.empty((1,), device=output.device, dtype=output.dtype)


def custom_backward(output: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from ``output`` with ``grad_output`` without autograd's shape check (the
    output's storage may have been freed by :func:`deallocate_output`)."""
    if grad_output is None:
        assert output.numel() == 1, "only a scalar output runs backward without a gradient"
        grad_output = torch.ones_like(output, memory_format=torch.preserve_format)
    torch.autograd.Variable._execution_engine.run_backward(
        tensors=(output,),
        grad_tensors=(grad_output,),
        keep_graph=False,
        create_graph=False,
        inputs=(),
        allow_unreachable=True,
        accumulate_grad=True,
    )


def _unwrap(module: torch.nn.Module) -> torch.nn.Module:
    return getattr(module, "module", module)


def model_chunks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model chunks of this pipeline rank: a DDP-wrapped ``ModuleList`` holds one per
    virtual stage; anything else is one chunk."""
    inner = _unwrap(model)
    return list(inner) if isinstance(inner, torch.nn.ModuleList) else [model]


def forward_backward_pipelining(
    *,
    forward_step: ForwardStep,
    next_batch: Callable[[], dict],
    model: torch.nn.Module,
    num_microbatches: int,
    pg,
    tensor_shape: tuple[int, ...],
    dtype: torch.dtype,
    forward_only: bool = False,
    scale_loss: Callable[[torch.Tensor], torch.Tensor] | None = None,
    no_sync: Callable[[], contextlib.AbstractContextManager] | None = None,
    graphs=None,
    per_token_loss: bool = False,
    microbatch_group_size: int | None = None,
    stage_forward: Callable[[dict, torch.nn.Module], torch.Tensor] = default_stage_forward,
    deallocate_pipeline_outputs: bool = True,
    slot_weights: Sequence[float] | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """1F1B (one chunk per rank) or interleaved 1F1B (several) over the pipeline group.

    Every rank pulls every micro-batch (the stages read tokens for the sequence length,
    the last one labels and mask). The loss, ``forward_step`` and the loss scaling run
    on the last stage exactly as in :func:`forward_backward_no_pipelining`; the mean
    loss (or the token sums with ``per_token_loss``) is then broadcast from the last
    stage, so every rank returns the same loss. Other metrics stay on the last stage.
    Gradients reduce only in the rank's last backward (``no_sync`` around the others).

    With a CUDA-graph session (``graphs``) the schedule tells it the slot of every
    forward, its order (``pipeline_schedule_key``) and, while recording, what crosses
    stages: a sent graphed output (waited in its tick's exchange), a received input and
    whether its dgrad may be sent from the graph's buffer. After capture a receive lands
    in the static input of its slot's first graph when that slot is free by then
    (``graph_comm.py``), else in a fresh tensor that the replay copies.

    Args:
        pg: ``ProcessGroups`` (``pp`` group and neighbours).
        tensor_shape: Shape of the activations stages exchange (``p2p_communication.tensor_shape``).
        dtype: Their dtype.
        microbatch_group_size: ``--microbatch-group-size-per-virtual-pipeline-stage``.
        stage_forward: ``(batch, model) -> hidden states`` on stages before the last.
        deallocate_pipeline_outputs: Free a stage output's storage once it is sent.
        slot_weights: Per model chunk, what a micro-batch keeps in its CUDA-graph slot
            (``slots.assign_slots``; default: the chunk's layers).
        Others: as :func:`forward_backward_no_pipelining`.
    """
    from megatron.core.pipeline_parallel.graph_comm import plan_graph_comm
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator
    from megatron.core.pipeline_parallel.timetable import build_timetable
    from megatron.core.transformer.cuda_graphs.regions import graphable_layers
    from megatron.core.transformer.cuda_graphs.session import NEXT_EVENT

    chunks = model_chunks(model)
    for chunk in chunks:
        if not callable(getattr(_unwrap(chunk), "set_input_tensor", None)):
            raise ValueError(
                f"{type(_unwrap(chunk)).__name__} has no set_input_tensor(tensor): a model chunk of a pipelined "
                "run starts from the activation the schedule receives (Megatron's contract); build the model "
                "from pre_process/post_process stages (GPTModel, HybridModel) or use "
                "--pipeline-model-parallel-size 1."
            )
    num_chunks, pp, rank = len(chunks), pg.pp_size, pg.pp_rank
    last_stage = pp * num_chunks - 1
    orders = [
        rank_order(
            num_microbatches, pp, r, num_chunks, microbatch_group_size=microbatch_group_size, forward_only=forward_only
        )
        for r in range(pp)
    ]
    ticks = build_timetable(orders, num_chunks)[rank]
    comm = P2PCommunicator(pg, tuple(tensor_shape), dtype, pg.device)
    graph_comm = None  # slots and exchange decisions for the graph session (graph_comm.py)
    if graphs is not None and not forward_only:
        key = pipeline_schedule_key(pp, rank, num_chunks, microbatch_group_size)
        graphs.expect_microbatches(num_microbatches, schedule=key)
        if slot_weights is None:
            slot_weights = [len(graphable_layers(_unwrap(chunk))) for chunk in chunks]
        graph_comm = plan_graph_comm(orders[rank], ticks, slot_weights)
    last_backward = max((i for i, s in enumerate(orders[rank]) if s[0] == "B"), default=-1)
    batches: dict[int, dict] = {}
    inputs: dict[tuple[int, int], torch.Tensor] = {}  # received activations, by (chunk, mb)
    outputs: dict[tuple[int, int], torch.Tensor] = {}  # this stage's outputs (or scaled losses)
    grads: dict[tuple[int, int], torch.Tensor] = {}  # received output gradients
    losses: dict[int, torch.Tensor] = {}
    metric_sum: dict[str, torch.Tensor] = {}
    done = 0

    def forward(chunk: int, mb: int) -> torch.Tensor | None:
        stage = chunk * pp + rank
        if chunk == 0:
            batches[mb] = next_batch()
        batch = batches[mb] if chunk < num_chunks - 1 else batches.pop(mb)
        module = chunks[chunk]
        _unwrap(module).set_input_tensor(inputs.get((chunk, mb)) if stage > 0 else None)
        slot = graph_comm.slot_of[(chunk, mb)] if graph_comm is not None else 0
        with _in_slot(graphs, slot, chunk):
            if stage == last_stage:
                loss, metrics = forward_step(batch, module)
            else:
                output = stage_forward(batch, module)
        if forward_only:
            inputs.pop((chunk, mb), None)
        if stage != last_stage:
            if not forward_only:
                outputs[(chunk, mb)] = output
            if graph_comm is not None:  # recording: a graphed output is read until this tick's wait
                graphs.note_send(output, until=NEXT_EVENT)
            return output
        if per_token_loss:
            loss = _token_sum(loss, metrics)
        if not forward_only:
            scaled = loss if per_token_loss else _mean(loss, num_microbatches)
            outputs[(chunk, mb)] = scale_loss(scaled) if scale_loss is not None else scaled
        losses[mb] = loss.detach()
        _sum_into(metric_sum, metrics, per_token_loss)
        return None

    def backward(chunk: int, mb: int, last: bool) -> torch.Tensor | None:
        stage = chunk * pp + rank
        output, grad = outputs.pop((chunk, mb)), grads.pop((chunk, mb), None)
        received = inputs.pop((chunk, mb), None)
        if output is received:  # a chunk of no layers passed its input on: its gradient goes back as is
            return grad
        sync = no_sync() if (no_sync is not None and not last) else contextlib.nullcontext()
        with sync:
            custom_backward(output, grad)
        return received.grad if stage > 0 else None

    for tick in ticks:
        send_next = send_prev = None
        sent_output = None
        for phase, chunk, mb in tick.steps:
            if phase == "F":
                send_next = forward(chunk, mb)
                sent_output = send_next
            else:
                send_prev = backward(chunk, mb, last=done == last_backward)
            done += 1
        if send_next is None and send_prev is None and tick.recv_prev is None and tick.recv_next is None:
            continue
        got_prev, got_next = comm.communicate(
            send_next=send_next,
            recv_prev=tick.recv_prev is not None,
            send_prev=send_prev,
            recv_next=tick.recv_next is not None,
            recv_prev_into=_receive_target(graphs, graph_comm, tick.recv_prev),
        )
        if got_prev is not None:
            inputs[tick.recv_prev] = got_prev
            if graph_comm is not None:  # recording: the first graph's input, its dgrad sent back
                slot = graph_comm.slot_of[tick.recv_prev]
                graphs.note_receive(slot, got_prev, grad_sent=graph_comm.grad_sent_in_place[slot])
        if got_next is not None:
            grads[tick.recv_next] = got_next
        if sent_output is not None and deallocate_pipeline_outputs and not forward_only:
            deallocate_output(sent_output)
    assert not outputs and not grads and not batches, "the pipeline schedule left work undone"

    return _broadcast_results(losses, metric_sum, num_microbatches, per_token_loss, pg)


def pipeline_schedule_key(
    pp_size: int, pp_rank: int, num_chunks: int, microbatch_group_size: int | None = None
) -> tuple:
    """What fixes a pipeline rank's order besides the micro-batch count: the session
    compares it at every iteration (``expect_microbatches``)."""
    if num_chunks == 1:
        return ("1f1b", pp_size, pp_rank, 1, None)
    group = pp_size if microbatch_group_size is None else microbatch_group_size
    return ("interleaved", pp_size, pp_rank, num_chunks, group)


def _receive_target(graphs, graph_comm, key: tuple[int, int] | None) -> torch.Tensor | None:
    """Where the activation for ``key`` (chunk, micro-batch) is received: the static input
    of its slot's first graph when the slot has finished its previous micro-batch by this
    exchange (``graph_comm.py`` says when that is), else None: a fresh tensor, which the
    forward replay copies in (also before capture, and when no graph reads the input)."""
    if key is None or graph_comm is None or not graph_comm.receive_in_place[key]:
        return None
    slot = graph_comm.slot_of[key]
    if not graphs.captured or slot not in graphs.cycles:  # no graph of this chunk's slot was recorded
        return None
    return graphs.receive_buffer(slot, key[0])


def _broadcast_results(losses, metric_sum, n: int, per_token_loss: bool, pg):
    """The last stage's results on every pipeline rank (one broadcast over the PP group)."""
    if pg.is_pipeline_last_stage:
        loss_sum = None
        for mb in range(n):
            loss_sum = losses[mb] if loss_sum is None else loss_sum + losses[mb]
        loss, metrics = _results(loss_sum, metric_sum, n, per_token_loss)
    else:
        loss, metrics = None, {}
    values = torch.zeros(2, dtype=torch.float64, device=pg.device)  # fp64: the fp32 loss and counts exactly
    if loss is not None:
        values[0] = loss.double()
        if per_token_loss:
            values[1] = metrics[NUM_TOKENS].double()
    torch.distributed.broadcast(values, src=pg.pp_last_rank, group=pg.pp)
    if loss is None:
        loss = values[0].float()
        if per_token_loss:
            metrics = {NUM_TOKENS: values[1].long()}
    return loss, metrics


def get_forward_backward_func(pp_size: int = 1, num_chunks: int = 1) -> Callable[..., Any]:
    """The schedule for a pipeline layout (Megatron's name): no pipelining at PP = 1, else
    :func:`forward_backward_pipelining` (1F1B, interleaved with several chunks)."""
    if pp_size == 1:
        if num_chunks > 1:
            raise ValueError("virtual pipeline stages need --pipeline-model-parallel-size > 1.")
        return forward_backward_no_pipelining
    return forward_backward_pipelining
