"""DDP's expert-gradient buffer: layout, readiness and the expert-DP reduction rule.

Expert parameters (``is_expert``) get their ``main_grad`` in a buffer of their own,
reduced over ``pg.expt_dp`` and scaled by 1 / DP. On two gloo ranks: with EP = 1 (a bare
DP group, so expert-DP = DP) the expert gradients are averaged like the dense ones; with
EP = 2 (expert-DP = 1: each rank holds other experts) they are only halved, never mixed
between ranks. Bitwise: a two-term sum of halves is exact.
"""

import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, is_expert_param
from megatron.core.parallel_state import ProcessGroups
from megatron.training.config import DDPConfig
from tests.unit_tests.dist_utils import cpu_process_groups, run_distributed


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(6, 8)
        self.expert = torch.nn.Linear(8, 8)
        self.head = torch.nn.Linear(8, 3)
        for p in self.expert.parameters():
            p.is_expert = True
            p.allreduce = False

    def forward(self, x):
        return self.head(torch.tanh(self.expert(torch.tanh(self.dense(x)))))


def _make(pg, overlap=False, bucket_size=None, distopt=False):
    torch.manual_seed(0)
    net = _Net()
    config = DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=bucket_size, use_distributed_optimizer=distopt)
    return DistributedDataParallel(net, config=config, pg=pg), net


def test_expert_params_live_in_their_own_buffer():
    ddp, net = _make(ProcessGroups.single(), bucket_size=40)
    dense = [p for p in net.parameters() if not is_expert_param(p)]
    expert = list(net.expert.parameters())
    assert {id(p) for p in ddp.grad_buffer.params} == {id(p) for p in dense}
    assert {id(p) for p in ddp.expert_grad_buffer.params} == {id(p) for p in expert}
    assert ddp.grad_buffers == [ddp.grad_buffer, ddp.expert_grad_buffer]
    assert len(ddp.buckets) == len(ddp.grad_buffer.buckets) + len(ddp.expert_grad_buffer.buckets)
    assert all(ddp.manages(p) for p in net.parameters())
    buf = ddp.expert_grad_buffer.data
    for p in expert:
        assert buf.data_ptr() <= p.main_grad.data_ptr() < buf.data_ptr() + buf.numel() * 4
    ddp(torch.randn(4, 6)).square().sum().backward()
    ddp.finish_grad_sync()
    before = [p.main_grad.clone() for p in net.parameters()]
    ddp.scale_grads(0.5)
    for p, b in zip(net.parameters(), before):
        assert torch.equal(p.main_grad, b * 0.5)
    ddp.zero_grad_buffer()
    assert all(b.data.abs().sum() == 0 for b in ddp.grad_buffers)


def test_without_experts_there_is_no_expert_buffer():
    ddp = DistributedDataParallel(torch.nn.Linear(3, 3), config=DDPConfig(), pg=ProcessGroups.single())
    assert ddp.expert_grad_buffer is None and ddp.grad_buffers == [ddp.grad_buffer]


def _ep2_groups(rank, world):
    """EP = 2 over both ranks: DP = 2, expert-DP = 1."""
    import torch.distributed as dist

    # One distributed-optimizer instance: its groups (intra_dp, intra_expt_dp) default to DP and expert-DP.
    ranks = {name: [rank] for name in ProcessGroups.GROUP_NAMES if not name.startswith("intra_")}
    ranks.update(dp=[0, 1], ep=[0, 1])
    return ProcessGroups(
        rank=rank, world_size=world, device=torch.device("cpu"), dp=dist.group.WORLD, ep=dist.group.WORLD, ranks=ranks
    )


def _check(rank, world, layout, overlap, distopt):
    pg = cpu_process_groups() if layout == "ep1" else _ep2_groups(rank, world)
    assert pg.expt_dp_size == (2 if layout == "ep1" else 1)
    ddp, net = _make(pg, overlap=overlap, bucket_size=50, distopt=distopt)
    grads = []
    for r in range(world):  # every rank's plain gradients, for the reference
        model = _make(ProcessGroups.single())[1]
        with torch.no_grad():  # the same weights on every rank, as after broadcast_params
            for a, b in zip(model.parameters(), net.parameters()):
                a.copy_(b)
        torch.manual_seed(10 + r)
        model(torch.randn(4, 6)).square().sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.manual_seed(10 + rank)
    ddp(torch.randn(4, 6)).square().sum().backward()
    ddp.finish_grad_sync()
    for k, p in enumerate(net.parameters()):
        if is_expert_param(p) and layout == "ep2":
            want = grads[rank][k] * 0.5  # this rank's experts alone, over DP = 2
        else:
            want = grads[0][k] * 0.5 + grads[1][k] * 0.5
        got = p.main_grad
        if distopt:  # only this rank's shard of each bucket is reduced
            buffer = ddp.expert_grad_buffer if is_expert_param(p) else ddp.grad_buffer
            size, shard = (pg.expt_dp_size, pg.expt_dp_rank) if is_expert_param(p) else (pg.dp_size, pg.dp_rank)
            start, end = buffer.param_range(p)
            bucket = buffer.bucket_of_id[id(p)]
            lo, hi = bucket.shard_range(shard, size)
            a, b = max(start, lo), min(end, hi)
            got, want = got.reshape(-1)[a - start : b - start], want.reshape(-1)[a - start : b - start]
        assert torch.equal(got, want), (layout, overlap, distopt, k)
    return True


def _all(rank, world):
    for layout in ("ep1", "ep2"):
        for overlap in (False, True):
            for distopt in (False, True):
                _check(rank, world, layout, overlap, distopt)
    return True


def test_expert_grads_reduced_over_expert_dp_and_scaled_by_dp():
    assert run_distributed(_all, 2) == [True, True]
