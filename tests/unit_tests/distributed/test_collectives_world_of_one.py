"""Every collective the trainer issues, through a real process group of one rank.

At world size 1 the trainer makes no groups (``None`` is a group of one and the wrappers
skip the call), so NCCL's path of each collective is never taken by a one-GPU run. Here
each is called on a group holding the one rank, on gloo (CPU, the normal run) and on
NCCL (``gpu``): the TP mappings and their adjoints (all-reduce, all-gather along the first
and last dimension, reduce-scatter: TP and SP), the vocab-parallel cross entropy's
reductions (the Triton kernel's too where it runs), the EP all-to-alls (even and uneven
splits, the int64 count exchange), the DDP bucket all-reduce and the distributed
optimizer's reduce-scatter (with and without overlap: NCCL takes the communication
stream), the all-gather into one tensor (as the distributed optimizer's parameter gather
issues it), the embedding/pipeline warm-up all-reduce. With one rank
every one of them is the identity (a sum or mean over one term, a gather of one piece),
so the results must equal the inputs bitwise. Pipeline p2p has no peer in a world of one
(a rank cannot send to itself) and is covered by the multi-rank gloo tests only.
"""

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(6, 24)
        self.b = torch.nn.Linear(24, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def _grads(pg_of_group, overlap, distributed_optimizer):
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.training.config import DDPConfig

    torch.manual_seed(0)
    device = pg_of_group.device
    net = _Net().to(device)
    config = DDPConfig(
        overlap_grad_reduce=overlap, ddp_bucket_size=100, use_distributed_optimizer=distributed_optimizer
    )
    ddp = DistributedDataParallel(net, config=config, pg=pg_of_group)
    for _ in range(2):  # the second iteration reuses the buffers (and the communication stream)
        ddp.zero_grad_buffer()
        torch.manual_seed(1)
        ddp(torch.randn(4, 6, device=device)).square().sum().backward()
        ddp.finish_grad_sync()
    return [p.main_grad.detach().clone() for p in net.parameters()], len(ddp.grad_buffer.buckets)


def _check_all(rank, world, backend):
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.pipeline_parallel import p2p_communication
    from megatron.core.tensor_parallel import cross_entropy, mappings
    from megatron.core.transformer.moe import moe_utils

    assert world == 1
    device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    group = dist.new_group([0], backend=backend)
    assert dist.get_backend(group) == backend and dist.get_world_size(group) == 1
    dtypes = (torch.float32, torch.bfloat16) if backend == "nccl" else (torch.float32,)
    torch.manual_seed(0)
    for dtype in dtypes:
        x = torch.randn(8, 4, 6, device=device, dtype=dtype)
        # TP and SP mappings, forward and backward (the adjoint collective).
        assert torch.equal(mappings.all_reduce(x.clone(), group), x)
        assert torch.equal(mappings.all_gather_first_dim(x, group), x)
        assert torch.equal(mappings.reduce_scatter_first_dim(x, group), x)
        assert torch.equal(mappings.all_gather_last_dim(x, group), x)
        for fn in (mappings._ReduceFromRegion, mappings._CopyToRegion):
            leaf = x.clone().requires_grad_()
            out = fn.apply(leaf * 1, group)
            out.backward(torch.ones_like(out))
            assert torch.equal(out.detach(), x) and torch.equal(leaf.grad, torch.ones_like(x)), fn.__name__
        # EP: all-to-all with equal and uneven splits, all-gather / reduce-scatter, their backward.
        for splits in (None, [8]):
            leaf = x.clone().requires_grad_()
            out = moe_utils.all_to_all(leaf, splits, splits, group)
            out.backward(2 * torch.ones_like(out))
            assert torch.equal(out.detach(), x) and torch.equal(leaf.grad, 2 * torch.ones_like(x))
        assert torch.equal(moe_utils.all_gather(x, group), x)
        assert torch.equal(moe_utils.reduce_scatter(x, group), x)
        assert torch.equal(moe_utils.all_gather_uneven(x, [8], group), x)
        assert torch.equal(moe_utils.reduce_scatter_uneven(x, [8], group), x)
        # The vocab-parallel cross entropy's max and sum reductions against the one-process loss
        # (both fp32 math, in another order: 1e-5).
        logits = torch.randn(5, 32, device=device, dtype=dtype)
        target = torch.randint(0, 32, (5,), device=device)
        want = cross_entropy.vocab_parallel_cross_entropy(logits, target, None)
        got = cross_entropy._VocabParallelCrossEntropy.apply(logits, target, group, 0)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        from megatron.core.fusions import fused_cross_entropy

        if fused_cross_entropy.available(logits):
            fused = fused_cross_entropy.fused_vocab_parallel_cross_entropy(logits.clone(), target, group, 0)
            torch.testing.assert_close(fused, want, rtol=1e-5, atol=1e-5)
    # The dispatcher's per-expert count exchange (int64).
    counts = torch.tensor([3, 0, 5], device=device)
    recv = torch.empty_like(counts)
    dist.all_to_all_single(recv, counts, group=group)
    assert torch.equal(recv, counts)
    # DDP over a data-parallel group of one: bucket all-reduce, distributed-optimizer reduce-scatter.
    alone = ProcessGroups.single(device)
    dp = ProcessGroups(rank=0, world_size=1, device=device, dp=group)
    assert dp.dp is group and dp.dp_size == 1
    for overlap in (False, True):
        for distributed_optimizer in (False, True):
            want, buckets = _grads(alone, overlap, distributed_optimizer)
            got, buckets_dp = _grads(dp, overlap, distributed_optimizer)
            assert buckets == buckets_dp > 1
            for g, w in zip(got, want):
                assert torch.equal(g, w), (overlap, distributed_optimizer)
    # The pipeline warm-up and the embedding group's all-reduce.
    p2p_communication.warm_up_group(ProcessGroups(rank=0, world_size=1, device=device, pp=group))
    grad = torch.randn(7, device=device)
    copy = grad.clone()
    dist.all_reduce(copy, group=group)
    assert torch.equal(copy, grad)
    return True


def test_every_collective_through_a_gloo_group_of_one():
    assert run_distributed(_check_all, 1, "gloo", timeout=300) == [True]


@pytest.mark.gpu
def test_every_collective_through_an_nccl_group_of_one():
    assert run_distributed(_check_all, 1, "nccl", timeout=300) == [True]
