"""The trainer fetches the next step's first micro-batch during the optimizer step."""

import torch

from megatron.core import parallel_state
from megatron.training.training import build_trainer

TINY = (
    "--num-layers 1 --hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 64 "
    "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --train-iters 3"
).split()


class Recording:
    def __init__(self, n):
        torch.manual_seed(0)
        self.batches = [
            {"tokens": t, "labels": t, "loss_mask": torch.ones(2, 16), "position_ids": torch.arange(16).repeat(2, 1)}
            for t in torch.randint(0, 64, (n, 2, 16))
        ]
        self.taken = 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.taken == len(self.batches):
            raise StopIteration
        self.taken += 1
        return self.batches[self.taken - 1]


def test_prefetch_keeps_order_and_stops_cleanly():
    trainer = build_trainer(TINY)
    try:
        it = Recording(4)  # two steps of two micro-batches, nothing left after
        losses = []
        for step in range(2):
            losses.append(trainer.train_step(it)[0])
            assert it.taken == min(2 * step + 3, 4)  # one micro-batch ahead, none past the end
        assert trainer._prefetched is None
        # Same batches in the same order as fetching on demand.
        ref = build_trainer(TINY)
        ref._prefetch = lambda data_iterator: None
        it2 = Recording(4)
        for step in range(2):
            assert torch.equal(ref.train_step(it2)[0], losses[step])
        parallel_state.destroy(ref.pg)
        # Another iterator (validation between steps) neither gets nor drops the prefetched batch.
        it3, it4 = Recording(4), Recording(4)
        trainer.train_step(it3)
        assert trainer._prefetched[0] is it3
        batch = trainer._next_batch(it4)
        assert torch.equal(batch["tokens"], it4.batches[0]["tokens"]) and trainer._prefetched[0] is it3
        assert torch.equal(trainer._next_batch(it3)["tokens"], it3.batches[2]["tokens"])
    finally:
        parallel_state.destroy(trainer.pg)
