"""transients.py on the CPU: which ops of a forward make only transients, and the capture's routing
of them (a stand-in detour records what it would route; the GPU tests run the real one)."""

import contextlib
import warnings

import pytest
import torch

from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs import transients
from megatron.core.transformer.cuda_graphs.capture import sample_tensor
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.transients import OpLog, TransientRouter
from tests.unit_tests.transformer.cuda_graphs.test_session_cpu import tiny_gpt

_kept = []  # a cache the forward below stores into: alive after it returns


def forward(x, w):
    h = x.exp()  # dies (x needs no gradient: nothing saves it)
    h2 = h + 1  # alive: the product below saves it for w's gradient
    t = torch.tanh(h2 * w)  # the product dies; tanh saves its own result for backward: alive
    total = t.sum()  # alive in the cache
    total.add_(1)  # in place: nothing new
    _kept.append(total)
    return t.view(-1) * 2  # view: nothing new; the product is the output: alive


def log_of(fn, *args):
    log = OpLog("cpu")
    with log:
        out = fn(*args)
    return log.records(), out


def test_op_log_marks_what_died_inside_the_forward():
    x, w = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    _kept.clear()
    records, out = log_of(forward, x, w)
    ops = ["exp", "add", "mul", "tanh", "detach", "sum", "add_", "view", "mul"]  # detach: autograd saving tanh's
    assert [op.split(".")[1] for op, _ in records] == ops
    assert [transient for _, transient in records] == [True, False, True, False, True, False, True, True, False]
    out.sum().backward()  # what autograd saved still works
    assert w.grad is not None


def route(log, fn, *args):
    routed = []

    class Spy(TransientRouter):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            before = self.routed
            out = super().__torch_dispatch__(func, types, args, kwargs)
            routed.append(self.routed > before)
            return out

    router = Spy(log, contextlib.nullcontext, device_type="cpu")
    with router:
        out = fn(*args)
    return router, routed, out


def test_the_router_detours_the_logged_transients_and_checks_them_dead():
    x, w = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    records, _ = log_of(forward, x, w)
    router, routed, out = route(records, forward, x, w)
    assert routed == [transient for _, transient in records]
    assert router.routed == sum(routed) and router.diverged_at is None
    router.check("layer 0")  # the outputs are alive, but none was routed


def test_the_router_stops_at_the_first_op_that_differs_from_the_log():
    x, w = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    records, _ = log_of(forward, x, w)
    changed = [records[0], ("aten.sub.Tensor", True)] + records[2:]
    router, routed, _ = route(changed, forward, x, w)
    assert router.diverged_at == 1
    assert routed == [True] + [False] * (len(records) - 1)


def test_a_routed_tensor_that_outlives_the_capture_is_an_error():
    x, w = torch.randn(4, 3), torch.randn(4, 3, requires_grad=True)
    records, _ = log_of(forward, x, w)
    wrong = [(op, True) for op, _ in records]  # as if the recording had seen the output die
    router, _, out = route(wrong, forward, x, w)
    with pytest.raises(
        RuntimeError, match=r"capturing layer 0's forward kept tensors alive.*aten\.mul\.Tensor -> \(12,\)"
    ):
        router.check("layer 0")
    assert "MEGATRON_CG_FORWARD_TRANSIENTS=0" in str(pytest.raises(RuntimeError, router.check, "x").value)
    del out, _kept[:]


def test_switch(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    monkeypatch.delenv("MEGATRON_CG_FORWARD_TRANSIENTS", raising=False)
    assert transients.enabled()
    monkeypatch.setenv("MEGATRON_CG_FORWARD_TRANSIENTS", "0")
    assert not transients.enabled()
    monkeypatch.setenv("MEGATRON_CG_FORWARD_TRANSIENTS", "1")
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "graph_capture_record_stream_reuse:True")
    assert not transients.enabled()  # no detour possible there


@pytest.mark.parametrize("scopes", [[], ["attn", "mlp"]], ids=["layer", "attn-mlp"])
def test_a_gpt_region_repeats_its_logged_ops_on_fresh_inputs(scopes):
    """As the capture does: each region of a real GPT (RoPE, whose tables a fresh input does not carry),
    logged on fresh sample inputs after a recording iteration, runs the same ops on other fresh inputs;
    the router follows the log to its end, routes the transients, and finds none of them alive."""
    model, _ = tiny_gpt(rope=True)
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(model, config, record_without_cuda=True)
    tokens = torch.randint(0, 64, (2, 16))
    masked_mean_loss(model(tokens, None, tokens), torch.ones(2, 16))[0].backward()
    for region in session.regions:
        log = transients.log_forward(region.fn, region.sample_args(sample_tensor), "cpu")
        assert any(transient for _, transient in log) and not all(transient for _, transient in log)
        router = TransientRouter(log, contextlib.nullcontext, device_type="cpu")
        args = region.sample_args(sample_tensor)
        with router:
            out = region.fn(*args)
        assert router.diverged_at is None and router.followed == len(log), region.name
        assert router.routed == sum(transient for _, transient in log), region.name
        router.check(region.name)
        del out


def test_the_log_counts_only_ops_on_the_device():
    x = torch.randn(3)
    log = transients.log_forward(lambda t: (t.exp(), torch.ones(2, device="meta")), (x,), "cpu")
    assert [op for op, _ in log] == ["aten.exp.default"]
    log = transients.log_forward(lambda t: torch.zeros(2) + t.sum(), (x,), "cpu")  # a factory on the device counts
    assert [op for op, _ in log] == ["aten.zeros.default", "aten.sum.default", "aten.add.Tensor"]
