"""Tests for the driver-made side stream (cuda_graphs/streams.py).

CPU: the fallback to torch's stream pool warns once and is cached per device.
GPU (in a fresh process, so torch's stream pool does not exist yet): the stream
costs next to nothing outside the allocator, is reused, and graphs captured on it
replay correctly on the default stream; ``warm_blas`` makes the cuBLAS workspaces
that a first step on the stream would otherwise make and keep.
"""

import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

from megatron.core.transformer.cuda_graphs import streams


def test_fallback_to_torch_pool_warns_once_and_is_cached(monkeypatch):
    def no_driver(device):
        raise OSError("libcuda.so.1: cannot open shared object file")

    made = []
    monkeypatch.setattr(streams, "_driver_stream", no_driver)
    monkeypatch.setattr(streams, "_streams", {})
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: made.append(device) or f"pool stream {device}")
    with pytest.warns(UserWarning, match="torch's stream pool"):
        first = streams.side_stream("cuda:0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert streams.side_stream("cuda:0") is first
    assert first == "pool stream 0" and made == [0]


_PROBE = textwrap.dedent(
    """
    import torch
    from megatron.core.transformer.cuda_graphs.streams import side_stream

    def outside():
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        return total - free - torch.cuda.memory_reserved()

    x = torch.randn(1024, 1024, device="cuda")
    y = x * 2 + 1  # modules and the default stream are set up before the baseline
    base = outside()
    s = side_stream()
    assert side_stream() is s and s != torch.cuda.default_stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        z = x * 2 + 1  # a kernel on the side stream
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=s):
        out = x * 2 + 1
    x.fill_(3.0)
    g.replay()  # on the default stream
    torch.cuda.synchronize()
    assert torch.equal(out, torch.full_like(out, 7.0)) and torch.equal(z, y)
    print("OUTSIDE_MIB", (outside() - base) / 2**20)
    """
)


@pytest.mark.gpu
def test_side_stream_costs_no_stream_pool():
    # torch.cuda.Stream() here would create torch's stream pool (device memory outside the allocator).
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("OUTSIDE_MIB")]
    assert float(line.split()[1]) < 16, line


_WARM = textwrap.dedent(
    """
    import sys
    import torch
    from megatron.core.transformer.cuda_graphs.streams import running_on, side_stream, warm_blas

    def step_leaves():
        # One linear forward and backward on the side stream; what it leaves allocated once its
        # tensors are gone: cuBLAS workspaces made on first use (the forward's and autograd's thread).
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with running_on(s):
            x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            w = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            b = torch.randn(512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            torch.nn.functional.linear(x, w, b).float().square().sum().backward()
            del x, w, b
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated() - before

    s = side_stream()
    if sys.argv[1] == "warm":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        warm_blas(s, torch.bfloat16)
        torch.cuda.synchronize()
        print("WARM_MIB", (torch.cuda.memory_allocated() - before) / 2**20)
    print("STEP_LEAVES_MIB", step_leaves() / 2**20)
    """
)


def _run_warm(mode: str) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _WARM, mode], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [ln.split() for ln in done.stdout.splitlines() if ln.startswith(("WARM_MIB", "STEP_LEAVES_MIB"))]
    return {name: float(mib) for name, mib in rows}


@pytest.mark.gpu
def test_warm_blas_makes_the_workspaces_a_first_step_would_leave_behind():
    cold = _run_warm("cold")  # a fresh process: the first step makes the workspaces and keeps them
    assert cold["STEP_LEAVES_MIB"] > 0, cold
    warm = _run_warm("warm")
    assert warm["STEP_LEAVES_MIB"] == 0, warm  # nothing new left behind: warm_blas made them all
    assert warm["WARM_MIB"] == cold["STEP_LEAVES_MIB"], (warm, cold)
