"""Simulated pipeline ranks: orders, slots, and model chunks in one process (CPU)."""

import functools

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import build_gpt_model
from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.core.parallel_state import ProcessGroups
from megatron.core.pipeline_parallel import schedules, simulate
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import DDPConfig
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.conftest import TINY_GPT_FLAGS


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is several times faster on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def layouts():
    """Every (schedule, micro-batches, stages, rank, chunks) the graph tests cover."""
    for m in (1, 2, 4, 8):
        for stages in (2, 3, 4):
            for rank in range(stages):
                yield "1f1b", m, stages, rank, 1
    for m in (2, 4, 8):
        for stages in (2, 3, 4):
            if m % stages == 0:
                for rank in range(stages):
                    yield "interleaved", m, stages, rank, 2


LAYOUTS = list(layouts())


def layout_id(layout):
    schedule, m, stages, rank, chunks = layout
    return f"{schedule}-m{m}-pp{stages}-rank{rank}"


def test_rank_order_is_the_order_helpers_with_megatrons_warmup():
    assert simulate.rank_order("1f1b", 4, 4, 1) == [(p, 0, mb) for p, mb in schedules.one_f_one_b_order(4, 2)]
    assert simulate.rank_order("1f1b", 4, 4, 3) == [(p, 0, mb) for p, mb in schedules.one_f_one_b_order(4, 0)]
    assert simulate.rank_order("interleaved", 4, 2, 1, 2) == schedules.interleaved_order(4, 2, 1, 2)
    with pytest.raises(ValueError, match="one model chunk per rank"):
        simulate.rank_order("1f1b", 4, 2, 0, 2)
    with pytest.raises(ValueError, match="unknown schedule"):
        simulate.rank_order("zero-bubble", 4, 2, 0)
    with pytest.raises(ValueError, match="outside a pipeline of 2"):
        simulate.rank_order("1f1b", 4, 2, 2)


@pytest.mark.parametrize("layout", LAYOUTS, ids=layout_id)
def test_every_order_runs_in_one_process_and_slots_follow_in_flight(layout):
    schedule, m, stages, rank, chunks = layout
    order = simulate.rank_order(schedule, m, stages, rank, chunks)
    simulate.check_single_process(order, chunks)
    steps = simulate.slot_steps(order)
    assert [(s.phase, s.chunk, s.microbatch) for s in steps] == order
    # Equal chunks: as many slots as micro-batches of all chunks in flight at once.
    assert len({s.slot for s in steps}) == simulate.max_in_flight(order) <= m * chunks
    # A micro-batch keeps its slot from forward to backward.
    slot_of = {(s.chunk, s.microbatch): s.slot for s in steps if s.phase == "F"}
    assert all(s.slot == slot_of[(s.chunk, s.microbatch)] for s in steps)


def test_orders_a_single_process_cannot_run_are_rejected():
    with pytest.raises(ValueError, match="runs before"):
        simulate.check_single_process([("F", 1, 0), ("F", 0, 0), ("B", 1, 0), ("B", 0, 0)], 2)
    with pytest.raises(ValueError, match="runs before"):
        simulate.check_single_process([("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)], 2)
    with pytest.raises(ValueError, match="without a backward"):
        simulate.check_single_process([("F", 0, 0)], 1)
    with pytest.raises(ValueError, match="runs twice"):
        simulate.check_single_process([("F", 0, 0), ("F", 0, 0)], 1)


def test_chunk_boundaries_and_edge_layers():
    assert simulate.chunk_boundaries(4, 2) == [0, 2, 4]
    assert simulate.chunk_boundaries(5, 2) == [0, 3, 5]
    assert simulate.chunk_boundaries(3, 3) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="cannot split 2 layers into 3"):
        simulate.chunk_boundaries(2, 3)

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.decoder = torch.nn.Module()
            self.decoder.layers = torch.nn.ModuleList(torch.nn.Identity() for _ in range(5))

    chunks = simulate.GPTChunks(Block(), 2)
    assert chunks.first_and_last_layers() == [(0, 2), (3, 4)]
    assert simulate.GPTChunks(Block(), 2, boundaries=[0, 1, 5]).first_and_last_layers() == [(0, 0), (1, 4)]
    with pytest.raises(ValueError, match="every chunk needs a layer"):
        simulate.GPTChunks(Block(), 2, boundaries=[0, 0, 5])
    with pytest.raises(ValueError, match="do not split 5 layers"):
        simulate.GPTChunks(Block(), 2, boundaries=[0, 2, 4])


TINY = TINY_GPT_FLAGS + " --num-layers 4 --global-batch-size 8 --untie-embeddings-and-output-weights"  # 4 mbs


def run(iters, schedule=None, flags=TINY):
    trainer = build_trainer(f"{flags} --train-iters {iters}".split())
    if schedule is not None:
        trainer.schedule = schedule
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses = [trainer.train_step(it)[0].clone() for _ in range(iters)]
        grads = [p.main_grad.clone() for p in trainer.model.module.parameters()]
        return losses, grads, trainer
    finally:
        parallel_state.destroy(trainer.pg)


def test_model_chunks_through_the_trainer_equal_sequential():
    """The trainer's schedule seam: two chunks in rank 0's interleaved order, 2 iterations."""
    base = run(2)
    schedule = functools.partial(simulate.forward_backward_chunks, num_chunks=2, pp_size=2, pp_rank=0)
    other = run(2, schedule=schedule)
    for a, b in zip(base[0], other[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(base[1], other[1], strict=True):
        assert torch.equal(a, b)


def tiny_ddp():
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        untie_embeddings_and_output_weights=True,
    ).finalize()
    torch.manual_seed(0)
    return DistributedDataParallel(build_gpt_model(cfg, 32), config=DDPConfig(), pg=ProcessGroups.single())


def one_iteration(schedule, batches, **kwargs):
    ddp = tiny_ddp()
    loss, _ = schedule(
        forward_step=gpt_forward_step,
        next_batch=iter(batches).__next__,
        model=ddp,
        num_microbatches=len(batches),
        no_sync=ddp.no_sync,
        **kwargs,
    )
    ddp.finish_grad_sync()
    return loss, [p.main_grad.clone() for p in ddp.module.parameters()], ddp


@pytest.mark.parametrize(
    "chunks,pp_size,pp_rank,deallocate",
    [(2, 2, 1, False), (2, 4, 3, False), (4, 2, 1, False), (1, 4, 0, False), (2, 2, 0, True), (4, 2, 1, True)],
    ids=lambda v: str(v),
)
def test_model_chunks_in_one_process_equal_sequential(chunks, pp_size, pp_rank, deallocate):
    torch.manual_seed(1)
    batches = []
    for _ in range(4):
        tokens = torch.randint(0, 32, (2, 8))
        batches.append({"tokens": tokens, "position_ids": None, "labels": tokens, "loss_mask": torch.ones(2, 8)})
    want = one_iteration(schedules.forward_backward_no_pipelining, batches)
    kwargs = dict(num_chunks=chunks, pp_size=pp_size, pp_rank=pp_rank)
    got = one_iteration(simulate.forward_backward_chunks, batches, deallocate_pipeline_outputs=deallocate, **kwargs)
    assert torch.equal(want[0], got[0])
    for a, b in zip(want[1], got[1], strict=True):
        assert torch.equal(a, b)
    # Evaluation through the same schedule (forward only) gives the same loss.
    with torch.no_grad():
        common = dict(forward_step=gpt_forward_step, model=got[2], num_microbatches=4, forward_only=True)
        ref, _ = schedules.forward_backward_no_pipelining(next_batch=iter(batches).__next__, **common)
        loss, _ = simulate.forward_backward_chunks(next_batch=iter(batches).__next__, **common, **kwargs)
    assert torch.equal(ref, loss)


def test_deallocated_output_keeps_its_graph_and_views_are_refused():
    x = torch.randn(4, 3, requires_grad=True)
    out = x * 2
    simulate.deallocate_output(out)
    assert out.numel() == 1
    simulate.backward_output(out, torch.ones(4, 3))
    assert torch.equal(x.grad, torch.full((4, 3), 2.0))
    with pytest.raises(RuntimeError, match="is a view"):
        simulate.deallocate_output((x * 2)[1:])


def test_a_receive_into_a_graph_buffer_leaves_it_without_autograd_history():
    """The simulated receive into a captured graph's static input is a plain write: had it been
    an autograd copy, the session's buffer would hold the sending chunk's graph nodes, which
    hold the session (a leak of the session, the model and its pools; seen on the GPU)."""

    class Session:
        def __init__(self):
            self.buffer = torch.zeros(3)

        def receive_buffer(self, slot, chunk):
            return self.buffer

    session = Session()
    sent = torch.arange(3.0, requires_grad=True) * 2
    received = simulate._receive(session, 0, 1, sent)
    assert session.buffer.grad_fn is None and not session.buffer.requires_grad
    assert torch.equal(session.buffer, sent.detach())
    assert received.is_leaf and received.requires_grad
    assert received.untyped_storage().data_ptr() == session.buffer.untyped_storage().data_ptr()
