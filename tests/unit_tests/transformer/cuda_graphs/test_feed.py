"""The feed (``cuda_graphs/feed.py``) on the CPU: the recording's watch of the embedding, and when the
capture lets it allocate in the backward pool. The graphed runs with it open are the GPU tests'
(``test_graphs_gpu.py``, ``test_hybrid_graphs_gpu.py``: whole layers)."""

import types

import pytest
import torch

from megatron.core.models.hybrid.hybrid_model import build_hybrid_model
from megatron.core.transformer.cuda_graphs import feed, scratch, turn
from megatron.core.transformer.cuda_graphs.feed import FeedHooks, FeedWatch
from tests.unit_tests.models.hybrid.test_hybrid_model import configs
from tests.unit_tests.transformer.cuda_graphs.test_session_cpu import tiny_gpt
from tests.unit_tests.transformer.cuda_graphs.test_turn import CpuWatch, attach_recording, record_two_microbatches


def cpu_feed_watch(device_type: str) -> FeedWatch:
    """The session's watch counts CUDA storages; on the CPU, the CPU's."""
    return FeedWatch("cpu")


def gpt():
    return tiny_gpt(layers=2)[0]


def hybrid():
    cfg, mc = configs("M*M-M*M-", position_embedding_type="none", normalization="RMSNorm")
    torch.manual_seed(0)
    return build_hybrid_model(cfg, mc, 64, device="cpu")


def recorded_watch(scope, monkeypatch, build=gpt, embedding_dropout=0.0):
    """The feed's watch after a recording iteration of two micro-batches on the CPU, driven by the
    session, of the model ``build`` makes."""
    monkeypatch.setenv(turn.ENV_SWITCH, "all")
    monkeypatch.setattr(turn.TurnHooks, "captures_next", True)
    monkeypatch.setattr(turn, "TurnWatch", CpuWatch)
    monkeypatch.setattr(feed, "FeedWatch", cpu_feed_watch)
    model = build()
    model.embedding.embedding_dropout = embedding_dropout
    ddp, session = attach_recording(model, scope)
    scratch.own_scratch(session)  # as a session on CUDA does
    try:
        record_two_microbatches(ddp)
        session._end_watch()  # the capture's order: the turns' watch, then the feed's
        return session._end_feed_watch()
    finally:
        session.close()
        scratch.disown_scratch(session)


@pytest.mark.parametrize(
    "build,scope",
    [(gpt, ["attn"]), (gpt, []), (hybrid, []), (hybrid, ["mamba"]), (hybrid, ["mamba", "attn", "mlp"])],
    ids=["gpt-attn", "gpt-layer", "hybrid-layer", "hybrid-mamba", "hybrid-mamba-attn-mlp"],
)
def test_the_embedding_feeds_the_first_graph_and_nothing_else(build, scope, monkeypatch):
    """The embedding (GPT: word and position tables; hybrid: the word table; no dropout) is read by
    the first graphed region only and is dead when the backward begins, micro-batch after micro-batch."""
    watch = recorded_watch(scope, monkeypatch, build)
    assert watch.seen and watch.escaped == []
    assert watch.fed == {}


def test_an_eager_layer_before_the_first_graph_keeps_the_embedding_for_its_backward(monkeypatch):
    """With ``mlp`` the first layer's attention runs eagerly, and its norm saves the embedding's
    output for the backward: the feed stays in the eager cache."""
    watch = recorded_watch(["mlp"], monkeypatch)
    assert watch.escaped and all("alive when the backward began" in e for e in watch.escaped)


def test_embedding_dropout_keeps_its_mask_for_the_backward(monkeypatch):
    """The dropout mask is made in the feed and autograd keeps it: the feed stays in the eager cache."""
    watch = recorded_watch([], monkeypatch, embedding_dropout=0.1)
    assert watch.escaped and all("alive when the backward began" in e for e in watch.escaped)


class WatchedSession(FeedHooks):
    """A session recording before a capture, as far as :func:`feed.feed` asks."""

    recording = True
    captures_next = True
    captured = False
    _turn = None


@pytest.fixture
def session(monkeypatch):
    monkeypatch.setattr(feed, "FeedWatch", cpu_feed_watch)
    session = WatchedSession()
    scratch.own_scratch(session)
    yield session
    session._close_feed()
    scratch.disown_scratch(session)


def embedding():
    return torch.nn.Embedding(64, 8).train()


def test_a_read_after_the_first_graph_is_seen(session):
    table = embedding()
    with feed.feed(table):
        x = table(torch.arange(4)) * 2
    (copy,) = session._feed_region_forward((x,))
    assert copy is not x and torch.equal(copy, x)
    y = copy + x  # eager code reads the feed's output after the first graph: its memory may be overwritten
    session._feed_backward_begins()
    del x
    watch = session._end_feed_watch()
    assert any("read by aten.add" in e for e in watch.escaped) and y.shape == (4, 8)


def test_a_second_feed_after_the_first_graph_is_seen(session):
    table = embedding()
    with feed.feed(table):
        x = table(torch.arange(4))
    session._feed_region_forward((x,))
    del x
    with feed.feed(table):
        table(torch.arange(4))
    assert any("after the first forward graph" in e for e in session._end_feed_watch().escaped)


def test_eval_and_no_grad_forwards_are_not_watched(session):
    table = embedding()
    with torch.no_grad(), feed.feed(table):
        table(torch.arange(4))
    with feed.feed(table.eval()):
        table(torch.arange(4))
    assert session._feed_watch is None


def test_the_feed_changes_nothing_without_a_session():
    table = embedding()
    with feed.feed(table):
        assert table(torch.arange(4)).shape == (4, 8)


class CapturedSession(FeedHooks):
    """A session at the end of its capture, as far as ``_open_feed`` reads it."""

    eager_turn_allowed = True
    backward_pool = object()
    pools = {0: object()}
    recorded_schedule = None
    config = types.SimpleNamespace(cuda_graph_debug=False)


CLOSES = {
    "turns off": ("eager_turn_allowed", False),
    "no backward pool of its own": ("backward_pool", None),
    "two slots": ("pools", {0: object(), 1: object()}),
    "a pipeline schedule": ("recorded_schedule", "1f1b"),
    "debug mode": ("config", types.SimpleNamespace(cuda_graph_debug=True)),
}


def clean_watch() -> FeedWatch:
    watch = FeedWatch("cpu")
    watch.seen = True
    return watch


@pytest.mark.parametrize("what", [None, *CLOSES], ids=["opens", *CLOSES])
def test_the_feed_opens_only_where_the_backward_pool_is_idle_at_the_forward(what, monkeypatch):
    monkeypatch.setenv(turn.ENV_SWITCH, "all")
    session = CapturedSession()
    if what is not None:
        setattr(session, *CLOSES[what])
    session._open_feed(clean_watch(), first_turn=False, first_forward_in_backward_pool=False)
    assert session.feed_open == (what is None)


def test_the_feed_stays_closed_beside_a_first_turn_a_first_forward_in_the_pool_or_turns_switched_off(monkeypatch):
    session = CapturedSession()
    session._open_feed(clean_watch(), first_turn=True, first_forward_in_backward_pool=False)
    assert not session.feed_open
    session._open_feed(clean_watch(), first_turn=False, first_forward_in_backward_pool=True)
    assert not session.feed_open
    monkeypatch.setenv(turn.ENV_SWITCH, "0")
    session._open_feed(clean_watch(), first_turn=False, first_forward_in_backward_pool=False)
    assert not session.feed_open
    session._open_feed(None, first_turn=False, first_forward_in_backward_pool=False)  # no feed recorded
    assert not session.feed_open


def test_a_feed_that_escaped_stays_closed_without_a_word(recwarn):
    """Nothing for the user to change: the feed is an optimisation, and the pools' line says when it is on."""
    watch = clean_watch()
    watch.escaped.append("aten.native_dropout -> (4, 8) torch.float32, alive when the backward began")
    session = CapturedSession()
    session._open_feed(watch, first_turn=False, first_forward_in_backward_pool=False)
    assert not session.feed_open and len(recwarn) == 0
