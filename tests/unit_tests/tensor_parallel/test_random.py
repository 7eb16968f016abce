"""The model-parallel RNG tracker on the CPU generator (the CUDA path swaps graph-safe states)."""

import pytest
import torch

from megatron.core.tensor_parallel import random as tp_random


def test_fork_draws_from_its_own_stream_and_restores_the_default():
    tp_random.model_parallel_manual_seed(5, tp_rank=0, device="cpu")
    tracker = tp_random.get_rng_tracker()
    with tracker.fork():
        inside = torch.rand(4)
    after = torch.rand(4)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(4))  # the default stream did not move
    torch.manual_seed(5 + 2718)
    assert torch.equal(inside, torch.rand(4))  # Megatron's seed offset for TP rank 0
    tp_random.model_parallel_manual_seed(5, tp_rank=0, device="cpu")
    with tracker.fork():
        pass
    with tp_random.get_rng_tracker().fork():
        torch.rand(4)
        again = torch.rand(4)
    torch.manual_seed(5 + 2718)
    torch.rand(4)
    assert torch.equal(again, torch.rand(4))  # a fork continues where the last one stopped


def test_tp_ranks_get_different_streams():
    draws = []
    for tp_rank in (0, 1):
        tp_random.model_parallel_manual_seed(5, tp_rank=tp_rank, device="cpu")
        with tp_random.fork_if(True):
            draws.append(torch.rand(8))
        draws.append(torch.rand(8))  # outside: the same on every TP rank
    assert not torch.equal(draws[0], draws[2])
    assert torch.equal(draws[1], draws[3])


def test_fork_if_false_is_a_no_op_and_states_round_trip():
    tp_random.model_parallel_manual_seed(9, device="cpu")
    tracker = tp_random.get_rng_tracker()
    torch.manual_seed(1)
    with tp_random.fork_if(False):
        a = torch.rand(3)
    torch.manual_seed(1)
    assert torch.equal(a, torch.rand(3))
    saved = tracker.get_states()
    with tracker.fork():
        x = torch.rand(3)
    tracker.set_states(saved)
    with tracker.fork():
        assert torch.equal(x, torch.rand(3))
    assert tracker.graph_safe_states() == []  # CPU states are byte tensors: nothing to register


def test_unseeded_tracker_and_reused_seed_raise():
    tracker = tp_random.RNGStatesTracker("cpu")
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 3)
    with pytest.raises(ValueError, match="already"):
        tracker.add("b", 3)


@pytest.mark.gpu
def test_cuda_states_are_graph_safe_and_registered():
    tp_random.model_parallel_manual_seed(5, tp_rank=1, device="cuda")
    tracker = tp_random.get_rng_tracker()
    assert tracker.graph_safe and len(tracker.graph_safe_states()) == 1
    graph = torch.cuda.CUDAGraph()
    tracker.register_with_graph(graph)
    x = torch.zeros(1024, device="cuda")
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        with tracker.fork():
            torch.nn.functional.dropout(x + 1, 0.5)  # warm-up
        with torch.cuda.graph(graph, stream=stream):
            with tracker.fork():
                y = torch.nn.functional.dropout(x + 1, 0.5)
    graph.replay()
    first = y.clone()
    graph.replay()
    assert not torch.equal(first, y)  # the tracked state advanced between replays
