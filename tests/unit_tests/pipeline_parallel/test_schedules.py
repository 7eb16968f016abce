"""Schedule orders, slots, and the forward_step seam through the trainer (CPU)."""

import functools

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.pipeline_parallel import schedules
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.conftest import TINY_GPT_FLAGS


def test_one_f_one_b_order():
    assert schedules.one_f_one_b_order(3, 0) == [("F", 0), ("B", 0), ("F", 1), ("B", 1), ("F", 2), ("B", 2)]
    assert schedules.one_f_one_b_order(4, 2) == [
        ("F", 0), ("F", 1), ("F", 2), ("B", 0), ("F", 3), ("B", 1), ("B", 2), ("B", 3),
    ]  # fmt: skip
    assert schedules.one_f_one_b_order(2, 5) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]


def test_interleaved_order_visits_chunks_in_groups_of_pp_size():
    order = schedules.interleaved_order(4, 2, 1, 2)
    forwards = [(c, m) for p, c, m in order if p == "F"]
    backwards = [(c, m) for p, c, m in order if p == "B"]
    assert forwards == [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)]
    assert backwards == [(1, 0), (1, 1), (0, 0), (0, 1), (1, 2), (1, 3), (0, 2), (0, 3)]
    # Every forward comes before its backward, and the warm-up is Megatron's.
    for p, c, m in order:
        if p == "B":
            assert order.index(("F", c, m)) < order.index(("B", c, m))
    warmup = next(i for i, (p, _, _) in enumerate(order) if p == "B") - 1
    assert warmup == (2 - 1 - 1) * 2 + (2 - 1) * 2
    with pytest.raises(ValueError, match="to be a multiple"):
        schedules.interleaved_order(3, 2, 0, 2)


TINY = TINY_GPT_FLAGS + " --global-batch-size 8"  # 4 micro-batches


def run(iters, schedule=None, forward_step=None):
    kwargs = {} if forward_step is None else {"forward_step": forward_step}
    trainer = build_trainer(f"{TINY} --train-iters {iters}".split(), **kwargs)
    if schedule is not None:
        trainer.schedule = schedule
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses = [trainer.train_step(it)[0].clone() for _ in range(iters)]
        grads = [p.main_grad.clone() for p in trainer.model.module.parameters()]
        return losses, grads
    finally:
        parallel_state.destroy(trainer.pg)


@pytest.mark.parametrize("in_flight", [2, 3])
def test_in_flight_schedule_equals_sequential(in_flight):
    base = run(3)
    other = run(3, schedule=functools.partial(schedules.forward_backward_in_flight, num_warmup=in_flight - 1))
    for a, b in zip(base[0], other[0], strict=True):
        assert torch.equal(a, b)
    for a, b in zip(base[1], other[1], strict=True):
        assert torch.equal(a, b)


def test_custom_forward_step_plugs_in_without_touching_the_trainer():
    seen = []

    def forward_step(batch, model):
        per_token = model(batch["tokens"], batch["position_ids"], batch["labels"])
        loss, _ = masked_mean_loss(per_token, batch["loss_mask"])
        aux = 0.0 * per_token.mean()  # an aux term joins the loss; its value is reported
        seen.append(batch["tokens"].shape)
        return loss + aux, {"aux": aux.detach()}

    base = run(2)
    custom = run(2, forward_step=forward_step)
    assert len(seen) == 2 * 4 and all(shape == (2, 16) for shape in seen)
    for a, b in zip(base[0], custom[0], strict=True):
        assert torch.equal(a, b)


def test_get_forward_backward_func_picks_the_pipelined_schedule():
    assert schedules.get_forward_backward_func(1) is schedules.forward_backward_no_pipelining
    assert schedules.get_forward_backward_func(2) is schedules.forward_backward_pipelining
    assert schedules.get_forward_backward_func(2, 2) is schedules.forward_backward_pipelining
    with pytest.raises(ValueError, match="--pipeline-model-parallel-size > 1"):
        schedules.get_forward_backward_func(1, 2)


# ---------------------------------------------------------------------- pipelined orders and timetable


def test_warmup_counts_are_megatrons():
    assert [schedules.one_f_one_b_warmup(4, r) for r in range(4)] == [3, 2, 1, 0]
    # (PP - rank - 1) * 2 + (chunks - 1) * group, group defaulting to PP.
    assert [schedules.interleaved_warmup(4, r, 2) for r in range(4)] == [10, 8, 6, 4]
    assert schedules.interleaved_warmup(2, 0, 3, microbatch_group_size=3) == 2 + 6
    for pp, chunks, m in [(2, 1, 4), (4, 1, 3), (2, 2, 4), (4, 2, 8), (2, 3, 6)]:
        for rank in range(pp):
            order = schedules.rank_order(m, pp, rank, chunks)
            first_backward = next(i for i, s in enumerate(order) if s[0] == "B")
            if chunks == 1:
                want = min(schedules.one_f_one_b_warmup(pp, rank), m)
            else:
                want = min(schedules.interleaved_warmup(pp, rank, chunks), m * chunks)
            # The warm-up forwards, then the first steady-state forward before the first backward.
            assert first_backward == want + (1 if want < m * chunks else 0), (pp, chunks, m, rank)


def test_schedule_table_follows_megatrons_example():
    # Megatron's PP 2, 5 micro-batches, 2 chunks, groups of 3.
    table = schedules.schedule_table(5, 2, 3)
    assert [m for _, m in table] == [0, 1, 2, 0, 1, 2, 3, 4, 3, 4]
    assert [c for c, _ in table] == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    order = schedules.interleaved_order(5, 2, 0, 2, microbatch_group_size=3)
    assert [(c, m) for p, c, m in order if p == "F"] == table
    with pytest.raises(ValueError, match="remainder of at least"):
        schedules.interleaved_order(4, 2, 0, 2, microbatch_group_size=3)
    with pytest.raises(ValueError, match="between --pipeline-model-parallel-size"):
        schedules.interleaved_order(4, 2, 0, 2, microbatch_group_size=5)


@pytest.mark.parametrize("pp, chunks, m", [(2, 1, 1), (2, 1, 4), (3, 1, 5), (4, 1, 2), (2, 2, 2), (2, 2, 6),
                                           (4, 2, 4), (4, 2, 8), (3, 3, 3), (2, 2, 4)])  # fmt: skip
def test_timetable_keeps_each_order_and_pairs_every_exchange(pp, chunks, m):
    from megatron.core.pipeline_parallel.timetable import build_timetable

    orders = [schedules.rank_order(m, pp, r, chunks) for r in range(pp)]
    table = build_timetable(orders, chunks)
    assert len({len(t) for t in table}) == 1  # every rank has the same number of exchanges
    last = pp * chunks - 1
    for rank in range(pp):
        assert [s for tick in table[rank] for s in tick.steps] == orders[rank]
    for t in range(len(table[0])):
        for rank in range(pp):
            sent_fwd = [(c, mb) for p, c, mb in table[rank][t].steps if p == "F" and c * pp + rank < last]
            sent_bwd = [(c, mb) for p, c, mb in table[rank][t].steps if p == "B" and c * pp + rank > 0]
            nxt, prv = table[(rank + 1) % pp][t], table[(rank - 1) % pp][t]
            # What this rank sends in exchange t is what its neighbours receive in exchange t.
            assert [((c * pp + rank + 1) // pp, mb) for c, mb in sent_fwd] == ([nxt.recv_prev] if nxt.recv_prev else [])
            assert [((c * pp + rank - 1) // pp, mb) for c, mb in sent_bwd] == ([prv.recv_next] if prv.recv_next else [])
    if chunks == 1:  # 1F1B's memory bound: warm-up + 1 micro-batches in flight per rank
        for rank in range(pp):
            live = peak = 0
            for p, _, _ in orders[rank]:
                live += 1 if p == "F" else -1
                peak = max(peak, live)
            assert peak <= schedules.one_f_one_b_warmup(pp, rank) + 1


def test_timetable_refuses_orders_that_cannot_run():
    from megatron.core.pipeline_parallel.timetable import build_timetable

    orders = [[("F", 0, 0), ("B", 0, 0)], [("B", 0, 0), ("F", 0, 0)]]  # the last stage's B before its F
    with pytest.raises(ValueError, match="cannot run"):
        build_timetable(orders, 1)


def test_custom_backward_runs_on_a_freed_output():
    w = torch.nn.Parameter(torch.randn(3, 3))
    x = torch.randn(2, 3)
    out = torch.tanh(x @ w)
    grad = torch.randn_like(out)
    want = torch.autograd.grad(torch.tanh(x @ w), w, grad)[0]
    schedules.deallocate_output(out)
    assert out.numel() == 1 and out.grad_fn is not None
    schedules.custom_backward(out, grad)
    assert torch.allclose(w.grad, want)


def test_pipelined_schedule_needs_models_that_take_the_received_activation():
    from megatron.core.parallel_state import ProcessGroups

    pg = ProcessGroups(rank=0, world_size=2, device=torch.device("cpu"), ranks={"pp": [0, 1]})
    with pytest.raises(ValueError, match="has no set_input_tensor"):
        schedules.forward_backward_pipelining(
            forward_step=None, next_batch=None, model=torch.nn.Linear(2, 2), num_microbatches=2, pg=pg,
            tensor_shape=(4, 1, 2), dtype=torch.float32,
        )  # fmt: skip
