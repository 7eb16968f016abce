"""Scratch blocks (``cuda_graphs/scratch.py``) on the CPU: the recording's watch of each block, and
where they may move after the capture. Their capture into the backward pool runs on the GPU
(``test_hybrid_graphs_gpu.py``)."""

import pytest
import torch

from megatron.core.transformer.cuda_graphs import scratch
from megatron.core.transformer.cuda_graphs.scratch import ScratchHooks
from megatron.core.transformer.cuda_graphs.turn import TurnHooks
from tests.unit_tests.transformer.cuda_graphs.test_turn import CpuWatch


class ScratchSession(TurnHooks, ScratchHooks):
    """A session recording before a capture, as far as :func:`scratch.scratch` asks."""

    recording = True
    captures_next = True
    forwards_in_backward_pool = frozenset()


@pytest.fixture
def scratch_session(monkeypatch):
    monkeypatch.setattr(scratch, "TurnWatch", CpuWatch)
    session = ScratchSession()
    scratch.own_scratch(session)
    yield session
    scratch.disown_scratch(session)


def test_scratch_changes_nothing_without_a_session():
    x = torch.randn(8, 8)
    with scratch.scratch():
        y = (x * 2).sum()
    assert y.ndim == 0


def test_scratch_that_leaves_a_tensor_alive_stays_in_the_eager_cache(scratch_session):
    x = torch.randn(8, 8)
    with scratch.scratch():
        gone = x * 2  # dies inside: working memory
        kept = gone + 1  # alive after the block: not scratch
        del gone
    scratch_session._turn = object()  # the capture opened turns
    with pytest.warns(UserWarning, match="scratch block of the forward left tensors alive .*aten.add"):
        scratch_session._open_scratch()
    assert not scratch_session._scratch_open and kept.shape == x.shape


def test_scratch_opens_where_the_turns_do_and_no_forward_output_waits_in_the_pool(scratch_session):
    x = torch.randn(8, 8)
    out = torch.empty(8, 8)
    with scratch.scratch():
        out[:] = (x * 2).exp()  # the result goes into a tensor made before the block
    assert scratch_session._scratch_seen and scratch_session._scratch_escaped is None
    scratch_session._open_scratch()
    assert not scratch_session._scratch_open  # no turns: nowhere to route
    scratch_session._turn = object()
    scratch_session.forwards_in_backward_pool = frozenset({3})
    scratch_session._open_scratch()
    assert not scratch_session._scratch_open  # a forward graph's output waits in the backward pool
    scratch_session.forwards_in_backward_pool = frozenset()
    scratch_session._open_scratch()
    assert scratch_session._scratch_open


def test_the_mamba_scan_forward_scratch_leaves_nothing_alive(scratch_session, monkeypatch):
    """GroupSlicedScan's slices, each in a scratch block: the results land in the output made before."""
    from megatron.core.ssm import ssd
    from tests.unit_tests.ssm.test_ssd import inputs

    monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", 1)  # one group per slice: several blocks
    x, dt, A, B, C, D = (t.requires_grad_() for t in inputs(2, 37, 4, 8, 2, 16))
    y = ssd.ssd_chunked_scan(x, dt, A, B, C, 8, D=D)
    assert type(y.grad_fn).__name__ == "GroupSlicedScanBackward"
    assert scratch_session._scratch_seen and scratch_session._scratch_escaped is None


def test_forward_graphs_capture_their_scratch_into_the_backward_pool_with_one_slot(scratch_session, monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    assert not scratch_session._capture_scratch(True, 1)  # the recording saw no block
    x, out = torch.randn(8), torch.empty(8)
    with scratch.scratch():
        out[:] = x.exp()
    assert scratch_session._capture_scratch(True, 1) and scratch_session.scratch_captured
    assert not scratch_session._capture_scratch(True, 2)  # several slots: capture order is not replay order
    assert not scratch_session._capture_scratch(False, 1)  # no backward pool of its own
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "graph_capture_record_stream_reuse:True")
    assert not scratch_session._capture_scratch(True, 1)
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    with scratch.scratch():
        kept = x * 2  # alive after the block
    assert not scratch_session._capture_scratch(True, 1) and kept.shape == x.shape
