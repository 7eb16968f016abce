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


def test_slot_allocator_reuses_the_lowest_free_slot():
    slots = schedules.SlotAllocator()
    assert [slots.acquire(m) for m in range(3)] == [0, 1, 2]
    slots.release(1)
    assert slots.acquire(3) == 1 and slots.in_flight == 3
    with pytest.raises(ValueError, match="already in flight"):
        slots.acquire(3)
    chunk1 = schedules.SlotAllocator(chunk=1, num_chunks=2)  # ids never collide with chunk 0's
    assert [chunk1.acquire(m) for m in range(2)] == [1, 3] and chunk1.release(0) == 1


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
