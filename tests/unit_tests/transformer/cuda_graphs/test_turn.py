"""The eager turn's CPU parts: the watch of what the turn leaves alive, and when the turn opens.

Routing into the pool needs CUDA; the graphed runs that use it are compared with eager,
bitwise, by the GPU tests (test_graphs_gpu.py's eager turn cases under each setting of
MEGATRON_CG_EAGER_TURN, and every graphed GPU test under the default).
"""

import gc
import threading
import weakref

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.models.hybrid.hybrid_model import build_hybrid_model
from megatron.core.parallel_state import ProcessGroups
from megatron.core.ssm import ssd
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs import scratch, turn
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, Event
from megatron.core.transformer.cuda_graphs.turn import TurnHooks, TurnWatch
from megatron.training.config import DDPConfig
from tests.unit_tests.models.hybrid.test_hybrid_model import configs
from tests.unit_tests.transformer.cuda_graphs.test_session_cpu import tiny_gpt


def attach_recording(model, scope: str, fold: bool = True):
    """``(ddp, session)``: ``model`` behind DDP (gradients folded on arrival unless ``fold`` is False)
    and a graph session of ``scope`` on it that records on the CPU."""
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    if fold:
        ddp.fold_grads_on_arrival()
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scope)
    return ddp, cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)


def record_two_microbatches(ddp) -> None:
    """The recording iteration of a model behind ``ddp`` (vocabulary 64): two micro-batches of 2 x 16
    tokens, forward and backward, then DDP's gradient sync."""
    tokens = torch.randint(0, 64, (2, 16))
    for _ in range(2):
        loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 16))
        loss.backward()
    ddp.finish_grad_sync()


def test_watch_reports_what_outlives_the_turn():
    x = torch.randn(64, 64)
    with TurnWatch("cpu") as watch:
        watch.start()
        gone = x * 2  # born and dead inside the turn
        kept = gone.exp()  # still alive at the end: escapes
        kept.view(-1).add_(1)  # a view and an in-place op make no storage
        del gone
        watch.pause()
        loss = kept.sum()  # the loss: not part of the turn
        watch.resume()
        handed = torch.ones(64, 64)  # the gradient handed to the first backward graph
        watch.finish((handed,))
        after = x + 1  # outside a turn
    assert len(watch.escaped) == 1 and watch.escaped[0].startswith("aten.exp")
    assert watch.turns == 1 and watch.peak_bytes == 2 * 64 * 64 * 4  # two at once: gone and kept, then kept and handed
    assert not watch.alive and loss.ndim == 0 and after.shape == x.shape
    n = 64 * 64 * 4
    assert watch.pattern == [n, n, -1, n]  # made gone, made kept, freed gone (number 0), made handed
    opens, why = watch.verdict()
    assert not opens and "aten.exp" in why and "alive" in why


def test_watch_keeps_the_allocation_order_of_the_largest_turn():
    """What the capture replays into the backward pool (turn.shape_pool): allocation sizes and
    frees by allocation number, of the turn that held the most; a tensor of another turn that
    dies during this one is not part of it."""
    x = torch.randn(16, 16)
    with TurnWatch("cpu") as watch:
        watch.start()
        small = x + 1
        watch.finish(())
        watch.start()
        a = torch.cat([x, x])  # 2 KiB, number 0
        b = a * 2  # number 1
        del small, a  # small is the first turn's: no step
        c = torch.cat([b, b])  # 4 KiB, number 2
        del b
        watch.finish((c,))
        watch.start()
        d = x * 3
        del d
        watch.finish(())
    k = 16 * 16 * 4
    assert watch.turns == 3 and watch.peak_bytes == 2 * k + 4 * k
    assert watch.pattern == [2 * k, 2 * k, -1, 4 * k, -2]


def test_a_backward_on_a_thread_the_watch_does_not_reach_keeps_the_turn_off():
    with TurnWatch("cpu") as watch:
        watch.start()
        watch.pause()
        elsewhere = threading.Thread(target=watch.resume)  # no dispatch mode is active on that thread
        elsewhere.start()
        elsewhere.join()
        watch.finish(())
    assert watch.escaped == ["unseen: the backward ran on a thread without this watch"]


def test_watch_sees_a_waiting_param_grad_unless_ddp_folds_on_arrival():
    """The backward half of a turn: a gradient that waits in param.grad for DDP's fold after the
    backward outlives the turn; folded on arrival, nothing does."""

    def turn_of(fold: bool):
        torch.manual_seed(0)
        ddp = DistributedDataParallel(
            torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.LayerNorm(32)),
            config=DDPConfig(),
            pg=ProcessGroups.single(),
        )
        if fold:
            ddp.fold_grads_on_arrival()
        x = torch.randn(8, 32)
        with TurnWatch("cpu") as watch:
            watch.start()
            made = ddp(x)
            watch.pause()  # as the session's hook on the model output: pause, clone it out
            made.grad_fn.register_prehook(lambda grads: watch.resume())
            out = made.clone()
            del made
            loss = out.square().mean()
            loss.backward()
            watch.finish(())
        ddp.finish_grad_sync()
        return watch, [p.main_grad.clone() for p in ddp.module.parameters()]

    waiting, folded_after = turn_of(False)
    assert waiting.escaped and not waiting.verdict()[0]
    clean, folded_on_arrival = turn_of(True)
    assert clean.escaped == [] and clean.turns == 1
    for a, b in zip(folded_after, folded_on_arrival):
        assert torch.equal(a, b)


def test_turns_between_backward_graphs_are_clean_only_when_checked_and_nothing_outlives_them():
    """After a backward graph (``finish`` with its event) the next turn starts. It opens when nothing
    made in it outlives it and the gradients it hands the next graph are dead once that region's
    input gradients are made (``region_done``, which must come): a gradient autograd keeps for
    another use would be overwritten by the graph's temporaries at replay."""
    b1, b0 = Event(BWD, 1), Event(BWD, 0)
    x = torch.randn(16, 16)
    with TurnWatch("cpu", between_backward=True) as watch:
        handed = x * 2
        watch.finish((handed,), b1)
        dgrad = handed + 1  # the region's own backward, in the turn after it
        del handed
        watch.region_done(b1, (dgrad,))
        tmp = dgrad * 3  # the eager work up to the next graph
        nxt = tmp + 1
        del tmp, dgrad
        watch.finish((nxt,), b0)
    assert watch.backward_clean == [b1] and watch.backward_escaped == []
    assert watch.backward_verdict() == ([b1], None)

    with TurnWatch("cpu", between_backward=True) as watch:
        handed = x * 2
        watch.finish((handed,), b1)
        watch.region_done(b1, (x + 1,))  # handed is still alive: autograd keeps it for another use
        watch.finish((), b0)
    assert "handed to a backward graph" in watch.backward_escaped[0]
    events, why = watch.backward_verdict()  # handed by no watched turn: every turn stays closed
    assert events == [] and "between backward graphs" in why

    with TurnWatch("cpu", between_backward=True) as watch:
        watch.finish((x * 2,), b1)
        kept = x * 3  # outlives the turn
        watch.region_done(b1, ())
        watch.finish((), b0)
    assert watch.backward_clean == [] and watch.backward_escaped[0].startswith("aten.mul")
    assert kept.shape == x.shape

    # Each turn is judged alone: one that leaves a tensor alive, or hands a gradient autograd keeps,
    # stays closed; the others open.
    b2 = Event(BWD, 2)
    for fault in ("alive", "kept"):
        with TurnWatch("cpu", between_backward=True) as watch:
            watch.finish((x * 2,), b2)
            watch.region_done(b2, ())
            handed = x * 5  # the turn after b2: clean unless the gradient it hands b1 is kept
            watch.finish((handed,), b1)
            watch.region_done(b1, () if fault == "kept" else (handed,))
            kept = x * 3 if fault == "alive" else None  # made in the turn after b1, outlives it
            del handed
            watch.finish((), b0)
        events, why = watch.backward_verdict()
        assert watch.backward_off == {b2 if fault == "kept" else b1}, fault
        assert events == ([b1] if fault == "kept" else [b2]) and why is None, fault
        del kept

    with TurnWatch("cpu", between_backward=True) as watch:
        watch.finish((x * 2,), b1)
        watch.finish((), b0)  # no region_done: what it was handed was never checked
        watch.region_done(b1, ())  # and one that comes after the next backward graph is too late
    assert watch.backward_escaped == ["the input gradients of region 1 came late"]
    assert watch.backward_verdict()[0] == []

    with TurnWatch("cpu", between_backward=True) as watch:
        watch.finish((x * 2,), b2)
        handed = x * 5
        watch.finish((handed,), b1)  # b1's region never reports while what the turn after b2 handed lives
        watch.finish((), b0)
    assert watch.backward_off == {b2} and watch.backward_verdict()[0] == [b1]
    assert "never checked" in watch.backward_escaped[0]
    del handed


class FakeSession(TurnHooks):
    pass


CYCLE = [Event(FWD, 0), Event(FWD, 1), Event(BWD, 1), Event(BWD, 0)]


def watch_with(peak_bytes: int, escaped=(), turns: int = 1) -> TurnWatch:
    watch = TurnWatch("cpu")
    watch.peak_bytes, watch.escaped, watch.turns = peak_bytes, list(escaped), turns
    return watch


def test_turn_opens_after_the_last_forward_when_clean_and_large_enough():
    big = turn.MIN_TURN_BYTES
    assert FakeSession()._decide_turn(watch_with(big), {0: CYCLE}, True) == (1, 2)
    assert FakeSession()._decide_turn(watch_with(big - 1), {0: CYCLE}, True) is None  # the head is graphed
    assert FakeSession()._decide_turn(watch_with(big, turns=0), {0: CYCLE}, True) is None
    assert FakeSession()._decide_turn(None, {0: CYCLE}, True) is None
    assert FakeSession()._decide_turn(watch_with(big), {0: CYCLE, 1: CYCLE}, True) is None  # two slots
    assert FakeSession()._decide_turn(watch_with(big), {0: CYCLE}, False) is None  # a pipeline schedule
    inside = CYCLE[:3] + [Event(FWD, 0)] + CYCLE[3:]  # a forward again during the backward
    assert FakeSession()._decide_turn(watch_with(big), {0: inside}, True) is None
    assert FakeSession()._decide_turn(watch_with(big), {0: CYCLE[:2]}, True) is None  # no backward
    moe = FakeSession()
    moe.eager_turn_allowed = False  # the trainer's say for MoE models
    assert moe._decide_turn(watch_with(big), {0: CYCLE}, True) is None
    with pytest.warns(UserWarning, match="tensors alive past it"):
        assert FakeSession()._decide_turn(watch_with(big, ["aten.mm -> (4, 4)"]), {0: CYCLE}, True) is None


def test_every_turn_is_on_by_default_and_the_switch_names_its_values(monkeypatch):
    """The switch is an environment variable: every turn by default, ``1`` the first only, ``0``
    none (no hook on the model); anything else is an error naming the variable and its values."""
    monkeypatch.delenv(turn.ENV_SWITCH, raising=False)
    assert turn.enabled() and turn.backward_turns_enabled()
    monkeypatch.setenv(turn.ENV_SWITCH, "1")
    assert turn.enabled() and not turn.backward_turns_enabled()
    monkeypatch.setenv(turn.ENV_SWITCH, "0")
    assert not turn.enabled() and not turn.backward_turns_enabled()
    model = torch.nn.Linear(4, 4)
    FakeSession().watch_model_output(model)
    assert not model._forward_hooks
    monkeypatch.setenv(turn.ENV_SWITCH, "on")
    with pytest.raises(ValueError, match="MEGATRON_CG_EAGER_TURN='on': use 0 .*, 1 .* or all"):
        turn.enabled()


def test_a_copied_model_carries_no_turn_hook(monkeypatch):
    import copy

    monkeypatch.setenv(turn.ENV_SWITCH, "1")
    model = torch.nn.Linear(4, 4)
    session = FakeSession()
    session.watch_model_output(model)
    twin = copy.deepcopy(model)
    assert twin(torch.ones(1, 4)).shape == (1, 4)  # the copy's hook is a no-op: no session is reached
    assert len(model._forward_hooks) == 1
    session._close_turn()
    assert not model._forward_hooks


@pytest.mark.parametrize("fusion", [True, False], ids=["fused-wgrad", "unfused-wgrad"])
@pytest.mark.parametrize("fold", [True, False], ids=["folded-on-arrival", "folded-after"])
@pytest.mark.parametrize("scope", [["attn"], ["mlp"], []], ids=["attn", "mlp", "layer"])
def test_recording_watches_the_turn_of_a_real_session(scope, fold, fusion, monkeypatch):
    """A tiny GPT recorded on the CPU, the watch driven by the session itself (as before a capture):
    with `attn` the loss head is eager and its logits make the turn; with `mlp` or whole layers the
    head is graphed and the turn holds the loss only. A waiting param.grad (no fold on arrival)
    escapes. Without gradient-accumulation fusion the tied output weight's gradient waits in autograd
    for the embedding's part, made outside the turn (turn.outside_turn): the same turns open."""
    monkeypatch.setenv(turn.ENV_SWITCH, "all")
    monkeypatch.setattr(turn.TurnHooks, "captures_next", True)
    monkeypatch.setattr(turn, "TurnWatch", CpuWatch)
    model, _ = tiny_gpt(layers=2, gradient_accumulation_fusion=fusion)
    ddp, session = attach_recording(model, scope, fold)
    try:
        record_two_microbatches(ddp)  # two turns
        watch = session._end_watch()
    finally:
        session.close()
    assert watch.turns == 2
    head_eager = scope == ["attn"]
    logits = 2 * 16 * 64 * 4  # the head's fp32 logits, the largest tensor of the turn
    assert (watch.peak_bytes >= logits) == head_eager
    if fold or not head_eager:  # with the head graphed, its weights' gradients arrive in the graphs
        assert watch.escaped == []
        cycles = {0: session.make_plans() and session.cycles[0]}
        monkeypatch.setattr(turn, "MIN_TURN_BYTES", logits)
        assert (session._decide_turn(watch, cycles, True) is not None) == head_eager
    else:
        assert watch.escaped and not watch.verdict()[0]
    # Between backward graphs: with `attn`, layer 1's attention backward is followed by layer 0's
    # eager MLP backward, a turn; with `mlp`, layer 1's MLP backward by its eager attention backward
    # (with no first turn: the head is graphed), but not the head's backward, whose dgrad waits in
    # the backward pool for layer 1's MLP graph; with whole layers one graph hands its dgrad to the next.
    # After the last backward graph (layer 0's), the rest of the backward pass turns (the tail): the
    # embedding's backward, and with `mlp` layer 0's eager attention backward before it.
    plan = session.make_plans()[0]
    positions = session._backward_turns(watch, {0: plan}, True, frozenset())
    tail = plan.position(BWD, session.regions[0].index)
    assert tail == max(plan.position(BWD, r.index) for r in session.regions)
    if not fold:  # the eager weights' gradients (the embedding's at least) wait in param.grad
        assert watch.backward_escaped and positions == frozenset()
    elif scope == []:
        assert positions == {tail}
    else:
        turns_after = session.regions[1].index  # layer 1's attn or mlp
        assert watch.backward_escaped == [] and positions == {plan.position(BWD, turns_after), tail}
        if scope == ["mlp"]:
            head = plan.position(BWD, session.regions[2].index)
            assert head not in positions and plan.released_across(head, ("grad_input", "grad_output"))
    turns = session._plan_turns(watch, {0: plan}, True, frozenset())  # what the capture opens
    if fold and head_eager:  # the first turn, its gradient copied into the first backward's held inputs
        assert turns.first is not None and turns.keep and turns.pattern == watch.pattern
        assert (turns.first_region, turns.shaped_bytes) == (session.regions[1].index, watch.peak_bytes)
    elif positions:
        assert turns.first is None and turns.keep == frozenset() and turns.pattern is None
    else:
        assert turns is None
    if turns is not None:
        assert turns.after_backward == positions


@pytest.mark.parametrize("scope", [["attn"], ["mlp"], []], ids=["attn", "mlp", "layer"])
def test_a_dropped_session_and_its_model_are_freed_after_the_recording(scope, monkeypatch):
    """The recording hooks each region's inputs to hear when their gradients are made. Autograd keeps
    such a hook where Python's collector cannot see it, and the hook holds the inputs' autograd
    nodes: a cycle that kept the session, the model and (on a GPU) every graph pool alive after the
    trainer was dropped. The watch's end removes the hooks."""
    monkeypatch.setattr(turn.TurnHooks, "captures_next", True)
    monkeypatch.setattr(turn, "TurnWatch", CpuWatch)
    model, _ = tiny_gpt(layers=2)
    ddp, session = attach_recording(model, scope)
    record_two_microbatches(ddp)
    assert session._region_hooks, "the recording hooked the regions' inputs"
    session._end_watch()  # as the capture does first; no close(): a dropped trainer never calls it
    assert session._region_hooks == ()
    refs = weakref.ref(session), weakref.ref(model)
    del session, model, ddp
    gc.collect()
    assert [r() for r in refs] == [None, None]


class CpuWatch(TurnWatch):
    """The session's watch counts CUDA storages; on the CPU, the CPU's."""

    def __init__(self, device_type: str, between_backward: bool = False):
        super().__init__("cpu", between_backward)


def test_a_gradient_overlapping_a_static_input_is_seen():
    """A turn's gradient may sit partly in a released static gradient input's block: the replay then
    copies it through a clone (region._overlaps), not in place over itself."""
    from megatron.core.transformer.cuda_graphs.region import _overlaps

    block = torch.zeros(64)
    static = block[:32]  # views share their base's storage: compared by storage
    assert _overlaps(block[16:48], static) and _overlaps(static, block)
    assert not _overlaps(torch.zeros(32), static)


def test_outside_turn_pauses_this_threads_routing_and_the_watch(monkeypatch):
    """What autograd keeps past a turn by design is made under outside_turn: the routing of this
    thread into the pool pauses and resumes, and the recording's watch does not count it."""
    calls = []
    monkeypatch.setattr(turn, "begin_allocating_into", lambda pool: calls.append("begin"))
    monkeypatch.setattr(turn, "end_allocating_into", lambda pool: calls.append("end"))
    router = turn.TurnRouter(pool=object(), last_forward=0)
    with turn.outside_turn():  # no router yet: nothing to pause
        pass
    router.open()
    with turn.outside_turn():
        assert not router.routing_here()
        with turn.outside_turn():  # nested: the outer one resumes
            pass
    assert router.routing_here() and calls == ["begin", "end", "begin"]
    with pytest.raises(ValueError, match="inside"), turn.outside_turn():  # an error: routing resumes all the same
        raise ValueError("inside")
    assert router.routing_here() and calls == ["begin", "end", "begin", "end", "begin"]
    elsewhere = threading.Thread(target=lambda: turn.outside_turn().__enter__())  # routes no thread's allocations
    elsewhere.start()
    elsewhere.join()
    assert router.routing_here() and len(calls) == 5
    router.close()
    with turn.outside_turn():  # closed: nothing to pause
        pass
    assert calls == ["begin", "end", "begin", "end", "begin", "end"]

    x = torch.randn(16, 16)
    with TurnWatch("cpu") as watch:
        watch.start()
        with turn.outside_turn():
            kept = x * 2  # kept past the turn on purpose
        gone = x + 1
        del gone
        watch.finish(())
    assert watch.escaped == [] and watch.peak_bytes == 16 * 16 * 4 and kept.shape == x.shape


class CountingRouter:
    """A turn router that counts its closes (routing needs CUDA)."""

    def __init__(self):
        self.closes = 0

    def close(self) -> bool:
        self.closes += 1
        return self.closes == 1  # only the first close finds a turn open


def test_the_turn_after_the_last_backward_graph_closes_when_the_backward_pass_ends():
    """Each backward graph closes the turn before it, and queues one close for the end of the pass
    (autograd's final callbacks): the turn after the last backward graph ends there."""
    session = FakeSession()
    session._turn = CountingRouter()
    seen = []

    class Graph(torch.autograd.Function):  # stands for a backward graph's replay
        @staticmethod
        def forward(ctx, x):
            return x * 2

        @staticmethod
        def backward(ctx, grad):
            seen.append(session._turn_before_backward())
            return grad * 2

    x = torch.ones(3, requires_grad=True)
    Graph.apply(Graph.apply(x)).sum().backward()  # two backward graphs in one pass
    assert seen == [True, False] and session._turn.closes == 3  # before each, then at the end
    assert not session._pass_end_queued
    Graph.apply(x).sum().backward()  # the next pass queues its own
    assert session._turn.closes == 5 and not session._pass_end_queued


@pytest.mark.parametrize("scope", [["mamba"], ["attn"]], ids=["mamba", "attn"])
def test_the_recording_slices_a_scan_as_its_graph_will(scope, monkeypatch):
    """Recorded on the CPU: the Mamba layers' scans take the captured slice budget where they are graph
    regions (the recording's peak counts as the graphed run's), the eager one where they stay eager."""
    budgets = []
    real = ssd._group_slices
    monkeypatch.setattr(ssd, "_group_slices", lambda x, B, q, budget: budgets.append(budget) or real(x, B, q, budget))
    cfg, mc = configs("M*M-", position_embedding_type="none", normalization="RMSNorm")
    torch.manual_seed(0)
    model = build_hybrid_model(cfg, mc, 64, device="cpu")
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scope)
    session = cuda_graphs.attach(model, config, record_without_cuda=True)
    try:
        tokens = torch.randint(0, 64, (2, 16))
        loss, _ = masked_mean_loss(model(tokens, None, tokens), torch.ones(2, 16))
        loss.backward()
    finally:
        session.close()
    budget = ssd.SLICE_BYTES if scope == ["mamba"] else ssd.EAGER_SLICE_BYTES
    assert budgets == [budget] * 4  # two layers' forwards, then backwards


@pytest.mark.parametrize("scope", [["attn"], ["mlp"]], ids=["attn", "mlp"])
def test_a_hybrid_recording_opens_its_turns_and_its_scratch(scope, monkeypatch):
    """M*M-M*M- recorded on the CPU, the watch driven by the session (as before a capture), two
    micro-batches: the Mamba scan's forward slices are scratch blocks that leave nothing alive; the
    first turn (from the last forward graph: the last Mamba layer, the eager half, the head), the
    turns between backward graphs and the tail after the last one open."""
    monkeypatch.setenv(turn.ENV_SWITCH, "all")
    monkeypatch.setattr(turn.TurnHooks, "captures_next", True)
    monkeypatch.setattr(turn, "TurnWatch", CpuWatch)
    monkeypatch.setattr(turn, "MIN_TURN_BYTES", 1)
    monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", 1)  # a slice per group: two scratch blocks a layer
    cfg, mc = configs("M*M-M*M-", position_embedding_type="none", normalization="RMSNorm")
    torch.manual_seed(0)
    model = build_hybrid_model(cfg, mc, 64, device="cpu")
    ddp, session = attach_recording(model, scope)
    scratch.own_scratch(session)
    try:
        record_two_microbatches(ddp)
        watch = session._end_watch()
        assert session._scratch_seen and session._scratch_escaped is None
        assert watch.escaped == [] and watch.backward_escaped == []
        plans = session.make_plans()
        turns = session._plan_turns(watch, plans, True, frozenset())
        assert turns is not None and turns.first is not None  # the head stays eager beside eager Mamba layers
        ((_, plan),) = plans.items()
        last = max(plan.position(BWD, r.index) for r in session.regions)
        assert turns.after_backward == {last - 1, last}  # after the second layer's graph, and the tail
    finally:
        scratch.disown_scratch(session)
        session.close()
