"""The loader-building part of the trainer's data setup."""

import gc
import weakref

import torch

from megatron.training.data import repeat


def test_validation_batches_are_not_kept():
    """The validation iterator repeats its loader without holding the batches it yielded."""

    class Fresh:
        def __init__(self):
            self.passes = 0

        def __iter__(self):
            self.passes += 1
            return iter([torch.full((2,), i) for i in range(3)])

    source = Fresh()
    it = repeat(source)
    first = next(it)
    seen = weakref.ref(first)
    assert [next(it).tolist() for _ in range(5)] == [[1, 1], [2, 2], [0, 0], [1, 1], [2, 2]]
    assert source.passes == 2
    del first
    gc.collect()
    assert seen() is None, "a yielded batch is still referenced by the iterator"
    assert list(repeat([])) == []
