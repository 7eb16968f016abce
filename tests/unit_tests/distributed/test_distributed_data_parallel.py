"""DDP: main_grad equals plain autograd, buckets, readiness, events, and 2-rank averaging.

Parity is bitwise: with DP = 1 main_grad is 0 + grad; with DP = 2 the reference is
(g0 + g1) * 0.5, and DDP computes g0 * 0.5 + g1 * 0.5, which is the same number
because scaling by a power of two is exact and a two-term sum is commutative.
"""

import contextlib
import copy
import gc
import weakref

import pytest
import torch

from megatron.core.distributed import distributed_data_parallel as ddp_module
from megatron.core.distributed import grad_fold
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, default_bucket_size
from megatron.core.parallel_state import ProcessGroups
from megatron.training.config import DDPConfig
from tests.unit_tests.dist_utils import cpu_process_groups, run_distributed


class _Net(torch.nn.Module):
    def __init__(self, with_unused: bool = False):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.norm = torch.nn.LayerNorm(16)
        self.fc2 = torch.nn.Linear(16, 5)
        self.unused = torch.nn.Linear(3, 3) if with_unused else None

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


def _loss(model, x):
    return model(x).square().mean()


def _make(overlap=False, bucket_size=None, with_unused=False, pg=None):
    torch.manual_seed(0)
    net = _Net(with_unused)
    ref = copy.deepcopy(net)
    config = DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size)
    ddp = DistributedDataParallel(net, config=config, pg=pg or ProcessGroups.single())
    return ddp, ref


def _assert_main_grads_equal(ddp, ref_grads):
    for (name, p), g in zip(ddp.module.named_parameters(), ref_grads):
        assert p.grad is None, name
        assert torch.equal(p.main_grad, g), name


class _FakeEvent:
    """Stands in for a torch.cuda.Event on the CPU: records when it is waited on."""

    def __init__(self, log):
        self.log = log

    def synchronize(self):
        self.log.append("wait")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("bucket_size", [None, 100])
def test_main_grad_matches_autograd_bitwise(overlap, bucket_size):
    ddp, ref = _make(overlap, bucket_size)
    x = torch.randn(7, 6)
    _loss(ddp, x).backward()
    ddp.finish_grad_sync()
    _loss(ref, x).backward()
    _assert_main_grads_equal(ddp, [p.grad for p in ref.parameters()])


@pytest.mark.parametrize("overlap", [False, True])
def test_gradient_accumulation_under_no_sync(overlap):
    ddp, ref = _make(overlap, bucket_size=100)
    xs = [torch.randn(4, 6) for _ in range(3)]
    for x in xs[:-1]:
        with ddp.no_sync():
            _loss(ddp, x).backward()
        assert not any(b.launched or b.ready for b in ddp.buckets)
    _loss(ddp, xs[-1]).backward()
    assert all(b.launched for b in ddp.buckets) == overlap
    ddp.finish_grad_sync()
    for x in xs:
        _loss(ref, x).backward()  # plain autograd accumulates into .grad
    _assert_main_grads_equal(ddp, [p.grad for p in ref.parameters()])


def test_grad_left_attached_to_main_grad_is_not_added_twice():
    ddp, ref = _make()
    for p in ddp.parameters():
        p.grad = p.main_grad  # as an optimizer might leave fp32 params
    x = torch.randn(3, 6)
    _loss(ddp, x).backward()
    ddp.finish_grad_sync()
    _loss(ref, x).backward()
    _assert_main_grads_equal(ddp, [p.grad for p in ref.parameters()])


def test_buffer_address_is_stable_across_iterations():
    ddp, _ = _make(overlap=True, bucket_size=100)
    ptr = ddp.grad_buffer.data.data_ptr()
    views = {n: p.main_grad.data_ptr() for n, p in ddp.module.named_parameters()}
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for _ in range(3):
        ddp.zero_grad_buffer()
        assert ddp.grad_buffer.data.abs().sum() == 0
        _loss(ddp, torch.randn(3, 6)).backward()
        ddp.finish_grad_sync()
        for p in ddp.parameters():
            p.grad = p.main_grad
        opt.step()
        for p in ddp.parameters():
            p.grad = None
    assert ddp.grad_buffer.data.data_ptr() == ptr
    assert {n: p.main_grad.data_ptr() for n, p in ddp.module.named_parameters()} == views


def test_buckets_split_as_configured():
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)])
    module.frozen = torch.nn.Parameter(torch.zeros(5), requires_grad=False)
    ddp = DistributedDataParallel(module, config=DDPConfig(ddp_bucket_size=50), pg=ProcessGroups.single())
    sizes = [[p.numel() for p in b.params] for b in ddp.buckets]
    assert sizes == [[40, 30], [20, 10]]  # backward order; a bucket closes once it reaches 50
    assert not hasattr(module.frozen, "main_grad")
    # Views are disjoint, inside their bucket, aligned, and the buffer is one allocation.
    buf = ddp.grad_buffer
    seen = torch.zeros(buf.numel, dtype=torch.int32)
    for bucket in ddp.buckets:
        for p in bucket.params:
            start, end = buf.param_range(p)
            assert start % 64 == 0
            assert bucket.offset <= start and end <= bucket.offset + bucket.numel
            assert p.main_grad.shape == p.shape and p.main_grad.dtype == torch.float32
            seen[start:end] += 1
    assert seen.max() == 1 and seen.sum() == 100
    # One default bucket holds everything.
    module2 = torch.nn.Linear(4, 4)
    ddp2 = DistributedDataParallel(module2, config=DDPConfig(), pg=ProcessGroups.single())
    assert len(ddp2.buckets) == 1 and len(ddp2.buckets[0].params) == 2
    assert default_bucket_size(1) == 40_000_000 and default_bucket_size(64) == 64_000_000


def test_bad_bucket_size_names_the_flag():
    with pytest.raises(ValueError, match="--ddp-bucket-size"):
        DistributedDataParallel(torch.nn.Linear(2, 2), config=DDPConfig(ddp_bucket_size=0), pg=ProcessGroups.single())
    for config, match in (
        (DDPConfig(ddp_num_buckets=0), "--ddp-num-buckets must be >= 1"),
        (DDPConfig(ddp_num_buckets=2, ddp_bucket_size=10), "--ddp-num-buckets and --ddp-bucket-size"),
    ):
        with pytest.raises(ValueError, match=match):
            DistributedDataParallel(torch.nn.Linear(2, 2), config=config, pg=ProcessGroups.single())


def test_num_buckets_sets_the_size_from_the_parameter_count():
    """Megatron's --ddp-num-buckets N: buckets of (trainable parameters) // N elements (here 100 // 2)."""
    module = torch.nn.Module()
    module.ps = torch.nn.ParameterList([torch.nn.Parameter(torch.zeros(n)) for n in (10, 20, 30, 40)])
    module.frozen = torch.nn.Parameter(torch.zeros(50), requires_grad=False)  # not counted
    ddp = DistributedDataParallel(module, config=DDPConfig(ddp_num_buckets=2), pg=ProcessGroups.single())
    assert [[p.numel() for p in b.params] for b in ddp.buckets] == [[40, 30], [20, 10]]


def test_unused_params_are_reduced_at_finish():
    ddp, ref = _make(overlap=True, bucket_size=1, with_unused=True)  # one param per bucket
    x = torch.randn(5, 6)
    _loss(ddp, x).backward()
    # The unused params come last in forward order, so they sit in the first buckets:
    # in-order launching holds every bucket back until finish.
    assert not any(b.launched for b in ddp.buckets)
    ddp.finish_grad_sync()
    assert all(b.launched for b in ddp.buckets)
    _loss(ref, x).backward()
    for (name, p), r in zip(ddp.module.named_parameters(), ref.parameters()):
        expected = torch.zeros_like(p) if r.grad is None else r.grad
        assert torch.equal(p.main_grad, expected), name


def test_register_grad_ready_by_hand_and_events_on_cpu():
    """The graph-replay path: main_grad written directly, then marked ready (with events)."""
    for overlap in (False, True):
        ddp, _ = _make(overlap=overlap, bucket_size=100)
        log = []
        params = list(ddp.grad_buffer.params)  # backward order
        first = ddp.buckets[0]
        for p in first.params:
            p.main_grad.fill_(1.0)
            ddp.register_grad_ready(p)  # event=None
        assert first.launched == overlap
        other = [p for p in params if all(p is not q for q in first.params)]
        for p in other:
            ddp.register_grad_ready(p, _FakeEvent(log))
        # With overlap the later buckets launched (events waited) as they became ready.
        assert log == (["wait"] * len(other) if overlap else [])
        ddp.finish_grad_sync()
        assert log == ["wait"] * len(other)  # every event waited exactly once
        assert all(torch.equal(p.main_grad, torch.ones_like(p)) for p in first.params)


def test_register_grads_ready_in_bulk_adds_one_event_per_bucket():
    """One backward replay marks all of its parameters at once: every bucket they touch
    gets the replay's event once, and buckets launch as they complete."""
    for overlap in (False, True):
        ddp, _ = _make(overlap=overlap, bucket_size=100)
        assert len(ddp.buckets) >= 2
        log = []
        event = _FakeEvent(log)
        params = list(ddp.grad_buffer.params)
        ddp.register_grads_ready(params[:-1], event)  # the last bucket stays incomplete
        last = ddp.buckets[-1]
        assert all(b.is_ready() for b in ddp.buckets[:-1]) and not last.is_ready()
        assert [b.launched for b in ddp.buckets[:-1]] == [overlap] * (len(ddp.buckets) - 1)
        ddp.register_grad_ready(params[-1])
        ddp.finish_grad_sync()
        touched = {ddp.grad_buffer.bucket_of_id[id(p)].index for p in params[:-1]}
        assert log == ["wait"] * len(touched)  # once per bucket, not once per parameter
    with pytest.raises(RuntimeError, match="does not manage"):
        ddp.register_grads_ready([torch.nn.Parameter(torch.zeros(1))])


def test_events_are_waited_even_inside_no_sync_and_by_zero_grad():
    ddp, _ = _make(overlap=True, bucket_size=100)
    log = []
    p = ddp.grad_buffer.params[0]
    with ddp.no_sync():
        ddp.register_grad_ready(p, _FakeEvent(log))
    assert log == [] and not ddp.buckets[0].ready
    ddp.finish_grad_sync()
    assert log == ["wait"]
    with ddp.no_sync():
        ddp.register_grad_ready(p, _FakeEvent(log))
    ddp.zero_grad_buffer()  # never zero under a writer still in flight
    assert log == ["wait", "wait"]


def test_event_without_readiness_for_a_partly_written_tied_weight():
    ddp, _ = _make(overlap=True)
    log = []
    bucket = ddp.buckets[0]
    p = bucket.params[0]
    ddp.add_grad_event(p, _FakeEvent(log))  # a graph wrote part of p's gradient
    assert id(p) not in bucket.ready and not bucket.launched and log == []
    for q in bucket.params:
        ddp.register_grad_ready(q)  # eager autograd completes it later
    assert bucket.launched and log == ["wait"]


def test_gradient_after_launch_raises():
    ddp, _ = _make(overlap=True, bucket_size=100)
    _loss(ddp, torch.randn(2, 6)).backward()
    with pytest.raises(RuntimeError, match="no_sync"):
        _loss(ddp, torch.randn(2, 6)).backward()
    ddp.finish_grad_sync()
    ddp.zero_grad_buffer()
    _loss(ddp, torch.randn(2, 6)).backward()  # fine again after zeroing


def test_state_dict_has_no_wrapper_prefix():
    ddp, ref = _make()
    assert list(ddp.state_dict()) == list(ref.state_dict())
    ddp.load_state_dict(ref.state_dict())


@pytest.mark.parametrize("overlap", [False, True])
def test_a_dropped_ddp_frees_its_model(overlap):
    """DDP's hooks on the parameters (with overlap) live where Python's cycle collector cannot see
    them; one holding DDP strongly kept DDP, the model and the gradient buffer alive for good."""
    ddp, _ = _make(overlap, bucket_size=100)
    _loss(ddp, torch.randn(4, 6)).backward()
    ddp.finish_grad_sync()
    refs = weakref.ref(ddp), weakref.ref(ddp.module), weakref.ref(ddp.grad_buffer)
    del ddp
    gc.collect()
    assert [r() for r in refs] == [None, None, None]


def _two_rank_parity(rank, world_size):
    pg = cpu_process_groups()
    for overlap in (False, True):
        for bucket_size in (None, 100):
            ddp, ref = _make(overlap, bucket_size, pg=pg)
            ddp.broadcast_params()
            torch.manual_seed(100)
            # Each rank's micro-batches; every rank builds all of them for the reference.
            data = [[torch.randn(4, 6) for _ in range(2)] for _ in range(world_size)]
            with ddp.no_sync():
                _loss(ddp, data[rank][0]).backward()
            _loss(ddp, data[rank][1]).backward()
            if overlap:
                assert all(b.handle is not None for b in ddp.buckets)  # launched during backward
            ddp.finish_grad_sync()
            per_rank = []
            for r in range(world_size):
                model = copy.deepcopy(ref)
                for x in data[r]:
                    _loss(model, x).backward()
                per_rank.append([p.grad for p in model.parameters()])
            expected = [(g0 + g1) * 0.5 for g0, g1 in zip(*per_rank)]
            _assert_main_grads_equal(ddp, expected)
            assert not torch.equal(per_rank[0][0], per_rank[1][0])  # the ranks really differ
    return ddp.grad_buffer.data.sum().item()


def test_two_ranks_average_gradients():
    sums = run_distributed(_two_rank_parity, 2)
    assert sums[0] == sums[1]


@pytest.mark.gpu
def test_cuda_event_from_side_stream_is_waited():
    """A 'graph replay' writes main_grad on a side stream after a long kernel; finish must wait."""
    torch.manual_seed(0)
    net = _Net().cuda()
    ddp = DistributedDataParallel(net, config=DDPConfig(overlap_grad_reduce=True), pg=ProcessGroups.single())
    side = torch.cuda.Stream()
    event = torch.cuda.Event()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        for p in ddp.grad_buffer.params:
            p.main_grad.fill_(3.0)
        event.record()
    for p in ddp.grad_buffer.params:
        ddp.register_grad_ready(p, event)
    ddp.finish_grad_sync()
    snapshot = ddp.grad_buffer.data.clone()  # on the current stream, after the wait
    torch.cuda.synchronize()
    for p in ddp.grad_buffer.params:
        start, end = ddp.grad_buffer.param_range(p)
        assert torch.all(snapshot[start:end] == 3.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("fusion", [True, False])
def test_tied_gpt_with_fused_wgrads_overlap_equals_no_overlap(fusion, dtype):
    """Fused wgrads mark weights ready through our hook; the tied embedding weight gets
    its output-layer part fused and its lookup part through autograd, and must not be
    declared ready (and its bucket launched) before the second part has arrived. Folding
    each gradient as it arrives (fold_grads_on_arrival, for the CUDA graphs' eager turn)
    gives the same bits as folding after each backward."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model
    from megatron.core.models.gpt.loss import masked_mean_loss
    from megatron.core.transformer.transformer_config import TransformerConfig

    def run(mode):
        config = TransformerConfig(
            num_layers=2,
            hidden_size=32,
            num_attention_heads=4,
            seq_length=16,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            gradient_accumulation_fusion=fusion,
        ).finalize()
        torch.manual_seed(0)
        model = build_gpt_model(config, 64).to(dtype)
        ddp = DistributedDataParallel(
            model,
            config=DDPConfig(overlap_grad_reduce=mode == "overlap", ddp_bucket_size=3000),
            pg=ProcessGroups.single(),
        )
        if mode == "on arrival":
            ddp.fold_grads_on_arrival()
        tokens = torch.randint(0, 64, (2, 2, 16))
        for mb in range(2):
            ctx = ddp.no_sync() if mb == 0 else contextlib.nullcontext()
            with ctx:
                masked_mean_loss(ddp(tokens[mb], None, tokens[mb]), torch.ones(2, 16))[0].backward()
        ddp.finish_grad_sync()
        assert all(p.grad is None for p in model.parameters())
        return [p.main_grad.clone() for p in model.parameters()]

    after = run("after backward")
    for mode in ("overlap", "on arrival"):
        for a, b in zip(after, run(mode)):
            assert torch.equal(a, b), mode


@pytest.mark.parametrize("scratch_max_numel", [1 << 16, 20])
def test_bf16_grads_fold_into_fp32_main_grad_like_a_mixed_add(monkeypatch, scratch_max_numel):
    # The fold upcasts small bf16 grads into scratch tensors and adds fp32 to fp32, and
    # adds larger ones directly (20: fc1's and fc2's weights take that path); the
    # reference is the per-tensor mixed-dtype add, over 3 micro-batches.
    monkeypatch.setattr(grad_fold, "_FOLD_SCRATCH_MAX_NUMEL", scratch_max_numel)
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    ref = copy.deepcopy(net)
    ddp = DistributedDataParallel(net, config=DDPConfig(), pg=ProcessGroups.single())
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    xs = [torch.randn(4, 6, dtype=torch.bfloat16) for _ in range(3)]
    for i, x in enumerate(xs):
        with ddp.no_sync() if i < len(xs) - 1 else contextlib.nullcontext():
            _loss(ddp, x).backward()
        _loss(ref, x).backward()
        for e, p in zip(expected, ref.parameters()):
            e.add_(p.grad)
            p.grad = None
    ddp.finish_grad_sync()
    _assert_main_grads_equal(ddp, expected)
    assert all(p.main_grad.dtype == torch.float32 for p in ddp.parameters())


def test_fold_follows_a_change_in_which_params_have_grads():
    # The fold keeps its lists for the parameters it saw last; a backward that reaches
    # other parameters (here: fc1 alone, then the whole net) must still fold them all.
    torch.manual_seed(0)
    net = _Net().to(torch.bfloat16)
    ref = copy.deepcopy(net)
    ddp = DistributedDataParallel(net, config=DDPConfig(), pg=ProcessGroups.single())
    expected = [torch.zeros_like(p, dtype=torch.float32) for p in ref.parameters()]
    x = torch.randn(4, 6, dtype=torch.bfloat16)
    for loss_of in (lambda m: m.fc1(x).sum(), lambda m: _loss(m, x), lambda m: m.fc1(x).sum()):
        with ddp.no_sync():
            loss_of(ddp.module).backward()
        loss_of(ref).backward()
        for e, p in zip(expected, ref.parameters()):
            if p.grad is not None:
                e.add_(p.grad)
            p.grad = None
    ddp.finish_grad_sync()
    _assert_main_grads_equal(ddp, expected)


def _average_in_collective(rank, world_size):
    pg = cpu_process_groups()
    grads = {}
    for avg in (False, True):
        torch.manual_seed(0)
        net = _Net()
        ddp = DistributedDataParallel(net, config=DDPConfig(ddp_average_in_collective=avg), pg=pg)
        assert not ddp._syncs[0].use_avg_op  # gloo has no ReduceOp.AVG: pre-scale and SUM
        ddp.broadcast_params()
        torch.manual_seed(100 + rank)
        _loss(ddp, torch.randn(4, 6)).backward()
        ddp.finish_grad_sync()
        grads[avg] = ddp.grad_buffer.data.clone()
    # Where the backend has AVG (NCCL), the flag picks it; without the flag, the pre-scaled SUM.
    real = ddp_module.dist.get_backend
    try:
        ddp_module.dist.get_backend = lambda group=None: "nccl"
        ops = [
            DistributedDataParallel(_Net(), config=DDPConfig(ddp_average_in_collective=avg), pg=pg)._syncs[0].use_avg_op
            for avg in (False, True)
        ]
    finally:
        ddp_module.dist.get_backend = real
    return grads[False], grads[True], ops


def test_ddp_average_in_collective():
    results = run_distributed(_average_in_collective, 2)
    for scaled_sum, averaged, ops in results:
        torch.testing.assert_close(averaged, scaled_sum, rtol=1e-6, atol=0)
        assert ops == [False, True]
    assert torch.equal(results[0][1], results[1][1])  # every rank holds the same average
