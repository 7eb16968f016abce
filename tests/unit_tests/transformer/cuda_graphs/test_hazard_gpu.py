"""The weak-reference + shared-pool hazard, through our API (``pytest -m gpu``).

Weak-referencing graph A's output lets graph B's
capture take the same pool block, so replaying A then B leaves A's output holding B's
numbers (5.0 instead of 3.0). Here A's output escapes to eager code that reads it after
B has replayed. Our plan keeps it strong until A's backward capture, so the value stays
right; forcing the naive release (right after A's forward capture) shows the hazard
is real on this allocator. The regions have no backward (frozen weights, inputs without
grad), so nothing but the plan holds A's output.
"""

import pytest
import torch

from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs import plan as plan_lib
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec

pytestmark = pytest.mark.gpu

N = 1 << 20


class Region(torch.nn.Module):
    """y = x * w + c, with a temporary of the same size as y (a block B can take)."""

    def __init__(self, c: float):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(N, device="cuda"), requires_grad=False)
        self.c = c

    graph_regions = GraphRegions(RegionSpec("attn", "forward"), whole=("attn",))

    def forward(self, x):
        tmp = torch.full_like(x, self.c)  # same size as the output: reuses a freed block
        return x * self.w + tmp


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = Region(3.0)
        self.b = Region(5.0)

    def graph_layers(self):
        return [self.a, self.b]

    def forward(self, x):
        ya = self.a(x)
        yb = self.b(x + 1)
        seen = ya.clone()  # eager reads A's output after B ran
        return yb, seen


def run(naive: bool, monkeypatch):
    if naive:
        real = plan_lib.build_plan

        def naive_plan(cycle, regions, comm=(), chunk_of=None):
            plan = real(cycle, regions, comm, chunk_of)
            plan.buffers[("output", 0, 0)].release_after = plan.position(plan_lib.FWD, 0)
            return plan

        monkeypatch.setattr("megatron.core.transformer.cuda_graphs.session.build_plan", naive_plan)
    model = TwoBranches()
    manager = cuda_graphs.attach(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=["attn"]))
    seen_values = []
    for _ in range(3):
        x = torch.zeros(N, device="cuda")
        _, seen = model(x)
        manager.end_of_iteration()
        seen_values.append(seen)
    torch.cuda.synchronize()
    return manager, seen_values


def test_escaping_output_survives_later_graphs(monkeypatch):
    manager, seen = run(naive=False, monkeypatch=monkeypatch)
    assert manager.captured and manager.num_graphs() == 2
    for s in seen:
        assert torch.equal(s, torch.full_like(s, 3.0)), f"A's output read {s[0].item()} after B replayed"


def test_naive_release_reproduces_the_corruption(monkeypatch):
    manager, seen = run(naive=True, monkeypatch=monkeypatch)
    # Iteration 1 is eager; iterations 2 and 3 replay with A's output released too early.
    assert torch.equal(seen[0], torch.full_like(seen[0], 3.0))
    corrupted = [not torch.equal(s, torch.full_like(s, 3.0)) for s in seen[1:]]
    assert all(corrupted), "expected B's capture to reuse A's released block (the hazard our plan avoids)"
