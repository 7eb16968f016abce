"""Data iterators leave torch's RNG stream alone and keep no batches (CPU)."""

import gc
import itertools
import weakref

import torch

from megatron.training.data import repeat
from tests.unit_tests.training.test_checkpointing import losses, run


def test_resume_with_workers_is_bitwise_and_independent_of_num_workers(tmp_path):
    # Hidden dropout is on (FLAGS): any draw from the global generator shifts the losses.
    full = run("--train-iters", 4, "--num-workers", 0)
    part = run("--train-iters", 4, "--num-workers", 2, "--exit-interval", 2, "--save", tmp_path / "c")
    resumed = run("--train-iters", 4, "--num-workers", 2, "--load", tmp_path / "c")
    assert losses(part) + losses(resumed) == losses(full)


def test_starting_an_iteration_draws_nothing_from_the_global_generator():
    from megatron.training.data import _own_generator

    loader = _own_generator(torch.utils.data.DataLoader(list(range(4)), batch_size=2), seed=3)
    torch.manual_seed(0)
    expected = torch.rand(2)
    torch.manual_seed(0)
    batches = list(itertools.islice(repeat(loader), 5))  # three passes start
    assert torch.equal(torch.rand(2), expected)
    assert [b.tolist() for b in batches] == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]]


class _Batch:
    pass


def test_repeat_keeps_no_batch_alive():
    made = []

    class Source:
        def __iter__(self):
            for _ in range(3):
                batch = _Batch()
                made.append(weakref.ref(batch))
                yield batch

    it = repeat(Source())
    for _ in range(7):
        next(it)
    gc.collect()
    assert sum(r() is not None for r in made) <= 1  # at most the one the generator holds now
    cached = itertools.cycle(Source())
    made.clear()
    for _ in range(7):
        next(cached)
    gc.collect()
    assert sum(r() is not None for r in made) == 3  # what itertools.cycle did: every batch, forever
