"""DDP with several distributed-optimizer instances (``--num-distributed-optimizer-instances``).

DP = 4 ranks in N = 2 instances of two consecutive ranks: each bucket is reduce-scattered
within the instance and the reduced shard all-reduced across the instances, so a
rank's shard holds the mean gradient over all four ranks, and the rank at the same
place in the other instance holds the same shard, bitwise. Expert parameters do the
same over their expert-DP ranks (with EP = 2: expert-DP = 2, one rank per instance,
so only the all-reduce across instances remains), scaled by 1 / DP.

The reference is float64 (each rank's plain autograd gradients, recomputed on every
rank from the same seeds); fp32 sums of four terms in another order agree within
1e-6 relative.

The groups are listed by hand here (not taken from ``parallel_state``), so the
collectives are checked against the layout, not against themselves.
"""

import pytest
import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel, is_expert_param
from megatron.core.parallel_state import ProcessGroups
from megatron.training.config import DDPConfig
from tests.unit_tests.dist_utils import run_distributed

RTOL = 1e-6


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.dense = torch.nn.Linear(6, 24)
        self.expert = torch.nn.Linear(24, 24)
        self.head = torch.nn.Linear(24, 3)
        for p in self.expert.parameters():
            p.is_expert = True

    def forward(self, x):
        return self.head(torch.tanh(self.expert(torch.tanh(self.dense(x)))))


# World 4, N = 2. EP = 2 (TP = ETP = 1): expert rank = ep + 2 * edp.
_LAYOUTS = {
    (4, 1): dict(
        dp=[[0, 1, 2, 3]],
        expt_dp=[[0, 1, 2, 3]],
        intra_dp=[[0, 1], [2, 3]],
        intra_expt_dp=[[0, 1], [2, 3]],
        inter_dp=[[0, 2], [1, 3]],
    ),
    (4, 2): dict(
        dp=[[0, 1, 2, 3]],
        ep=[[0, 1], [2, 3]],
        expt_dp=[[0, 2], [1, 3]],
        intra_dp=[[0, 1], [2, 3]],
        intra_expt_dp=[[0], [1], [2], [3]],
        inter_dp=[[0, 2], [1, 3]],
    ),
    (2, 1): dict(
        dp=[[0, 1]],
        expt_dp=[[0, 1]],
        intra_dp=[[0], [1]],
        intra_expt_dp=[[0], [1]],
        inter_dp=[[0, 1]],
    ),
}


def _process_groups(rank, world, ep, backend, device):
    handles, ranks = {}, {}
    for name, groups in _LAYOUTS[(world, ep)].items():
        for members in groups:  # every rank creates every group, in the same order
            handle = dist.new_group(members, backend=backend) if len(members) > 1 else None
            if rank in members:
                handles[name], ranks[name] = handle, members
    dp = handles.pop("dp")
    return ProcessGroups(rank=rank, world_size=world, device=device, dp=dp, ranks=ranks, **handles)


def _reference(net, world, pg):
    """Per parameter (float64): the mean over DP of every rank's gradient; expert
    parameters summed over this rank's expert-DP ranks only, scaled by 1 / DP."""
    grads = []
    for r in range(world):
        model = _Net().double()
        with torch.no_grad():
            for a, b in zip(model.parameters(), net.parameters()):
                a.copy_(b.detach().cpu())
        torch.manual_seed(10 + r)
        model(torch.randn(4, 6).double()).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    out = []
    for k, p in enumerate(net.parameters()):
        peers = pg.ranks["expt_dp"] if is_expert_param(p) else pg.ranks["dp"]
        out.append(sum(grads[r][k] for r in peers) / world)
    return out


def _check(rank, world, ep, backend, overlap):
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    pg = _process_groups(rank, world, ep, backend, device)
    torch.manual_seed(0)
    net = _Net().to(device)
    config = DDPConfig(overlap_grad_reduce=overlap, ddp_bucket_size=200, use_distributed_optimizer=True)
    ddp = DistributedDataParallel(net, config=config, pg=pg)
    assert len(ddp.grad_buffer.buckets) > 1  # several buckets, launched one by one
    want = _reference(net, world, pg)
    shards = []
    for _ in range(2):  # the second iteration reuses the buffers (and the communication stream)
        ddp.zero_grad_buffer()
        torch.manual_seed(10 + rank)
        ddp(torch.randn(4, 6).to(device)).square().sum().backward()
        ddp.finish_grad_sync()
        shards = []
        for k, p in enumerate(net.parameters()):
            expert = is_expert_param(p)
            buffer = ddp.expert_grad_buffer if expert else ddp.grad_buffer
            size, place = (
                (pg.intra_expt_dp_size, pg.intra_expt_dp_rank) if expert else (pg.intra_dp_size, pg.intra_dp_rank)
            )
            start, end = buffer.param_range(p)
            lo, hi = buffer.bucket_of_id[id(p)].shard_range(place, size)
            a, b = max(start, lo), min(end, hi)
            got = p.main_grad.reshape(-1)[a - start : b - start].cpu()
            torch.testing.assert_close(got.double(), want[k].reshape(-1)[a - start : b - start], rtol=RTOL, atol=1e-7)
            shards.append((k, a - start, got))
    return pg.inter_dp_rank, pg.intra_dp_rank, shards


def _all(rank, world, backend):
    out = {}
    for ep in (1, 2) if world == 4 else (1,):
        for overlap in (False, True):
            out[(ep, overlap)] = _check(rank, world, ep, backend, overlap)
    return out


def _assert_instances_agree(results):
    for key in results[0]:
        places = {}
        for r in results:
            _instance, place, shards = r[key]
            places.setdefault(place, []).append(shards)
        for copies in places.values():  # the same place in every instance: the same shard, bitwise
            assert len(copies) == 2
            for (k, a, got), (k2, a2, other) in zip(*copies, strict=True):
                assert (k, a) == (k2, a2) and torch.equal(got, other), key


def test_four_ranks_in_two_instances_reduce_within_then_across():
    _assert_instances_agree(run_distributed(_all, 4, "gloo", timeout=300))


@pytest.mark.gpu
@pytest.mark.parametrize("world", [2, 4])
def test_nccl_instances_on_a_communication_stream(world):
    """On CUDA with --overlap-grad-reduce, the two reductions run on DDP's communication stream."""
    if not torch.cuda.is_available() or torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA devices")
    _assert_instances_agree(run_distributed(_all, world, "nccl", timeout=300))


def test_instances_need_the_distributed_optimizer():
    pg = ProcessGroups(rank=0, world_size=2, device=torch.device("cpu"), ranks={"inter_dp": [0, 1], "dp": [0, 1]})
    with pytest.raises(ValueError, match="--num-distributed-optimizer-instances 2 needs --use-distributed-optimizer"):
        DistributedDataParallel(_Net(), config=DDPConfig(), pg=pg)
