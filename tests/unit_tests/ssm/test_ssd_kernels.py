"""The SSD scan's Triton kernels (``ssd_kernels``) against the PyTorch scan in float64.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a child process: the
variable is read when the kernels are defined). On a GPU they run for real at the hybrid
benchmark's shapes, sliced and captured.

Tolerances (norm-wise relative error against the float64 scan on the same rounded inputs): the
kernels compute in float32 in another order, about 1e-7 here, checked to 2e-6. bf16 inputs give
bf16 outputs and gradients, rounded once (2^-9 relative at most), checked to 4e-3; in the
interpreter to 8e-3, since it truncates float32 to bf16 (up to one ulp, 2^-8) where the GPU rounds.
"""

import shutil
import textwrap

import pytest
import torch

from megatron.core.ssm import ssd, ssd_kernels, ssd_trace
from tests.unit_tests.interpreted import needs_triton, run_interpreted


def inputs(b, length, h, g, p, n, dtype, d_shape, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x = rnd(b, length, h, p).to(dtype)
    dt = torch.rand(b, length, h, generator=gen, device=device) * 0.5 + 0.05
    A = -torch.rand(h, generator=gen, device=device) - 0.2
    B, C = rnd(b, length, g, n).to(dtype), rnd(b, length, g, n).to(dtype)
    D = None if d_shape is None else torch.rand(*(h, *d_shape), generator=gen, device=device)
    return x, dt, A, B, C, D, rnd(b, length, h, p).to(dtype)


def rel(got, want):
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm()).item()


def check_against_float64(case, dtype, d_shape, state_dtype, tol, device="cpu"):
    """Forward and every gradient of the kernels against ``_chunked_scan`` / ``_chunked_scan_grads`` in
    float64 (on ``device``)."""
    b, length, h, g, p, n, q = case
    x, dt, A, B, C, D, dy = inputs(b, length, h, g, p, n, dtype, d_shape, device=device)
    wide = [None if t is None else t.double() for t in (x, dt, A, B, C, D)]
    want_y = ssd._chunked_scan(*wide[:5], q, D=wide[5], state_dtype=state_dtype)
    got_y = ssd_kernels.scan(x, dt, A, B, C, q, D=D, state_dtype=state_dtype)
    assert got_y.dtype == dtype and rel(got_y, want_y) < tol, (case, rel(got_y, want_y))
    per_position = A.expand(b, length, h)
    want = ssd._chunked_scan_grads(*wide[:2], per_position.double(), *wide[3:], q, state_dtype, dy.double())
    got = ssd_kernels.scan_grads(x, dt, per_position, B, C, D, q, state_dtype, dy)
    for name, g_, w in zip(("dx", "ddt", "dA", "dB", "dC"), got, want):
        assert rel(g_, w) < tol, (case, name, rel(g_, w))


CASES = [
    (2, 50, 4, 2, 8, 16, 16),  # a partial last chunk; p and n below a tile
    (1, 130, 4, 1, 20, 24, 64),  # two row blocks a chunk in backward; sizes no power of two
    (2, 24, 2, 2, 16, 16, 64),  # a sequence shorter than the chunk: one chunk of 24
]


CPU_SCRIPT = textwrap.dedent(
    """
    import os
    import torch
    from megatron.core.ssm import ssd, ssd_kernels
    from megatron.core.ssm.mamba_config import MambaConfig
    from megatron.core.ssm.mamba_mixer import MambaMixer
    from megatron.core.transformer.transformer_config import TransformerConfig
    from tests.unit_tests.ssm.test_ssd_kernels import CASES, check_against_float64, inputs, rel
    assert ssd_kernels.available(torch.empty(1))
    for case in CASES:
        for d_shape in (None, (), (case[4],)):
            check_against_float64(case, torch.float32, d_shape, None, 2e-6)
    check_against_float64(CASES[0], torch.bfloat16, (), None, 8e-3)
    check_against_float64(CASES[1], torch.bfloat16, (), torch.bfloat16, 8e-3)
    check_against_float64(CASES[0], torch.float32, (), torch.bfloat16, 8e-3)  # the states truncated too
    tiles = ssd_kernels._BQ_FORWARD, ssd_kernels._BQ_BACKWARD
    ssd_kernels._BQ_FORWARD = ssd_kernels._BQ_BACKWARD = 16  # four row blocks a chunk both ways
    check_against_float64(CASES[1], torch.float32, (), None, 2e-6)
    ssd_kernels._BQ_FORWARD, ssd_kernels._BQ_BACKWARD = tiles

    # Through autograd (GroupSlicedScan): one group a slice gives the bits of one slice; no input is
    # written over; no-grad gives the same output.
    x, dt, A, B, C, D, dy = inputs(2, 50, 4, 2, 8, 16, torch.float32, ())
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D)]
    before = [t.detach().clone() for t in leaves]
    runs = []
    for budget in (2**40, 1):
        ssd.EAGER_SLICE_BYTES = budget
        y = ssd.ssd_chunked_scan(*leaves[:5], 16, D=leaves[5])
        runs.append([y, *torch.autograd.grad(y, leaves, dy)])
    assert len(ssd._group_slices(x, B, 16, 1)) == 2
    assert all(torch.equal(a, b) for a, b in zip(*runs)), "slicing changed a bit"
    assert all(torch.equal(t, u) for t, u in zip(leaves, before)), "an input was written over"
    with torch.no_grad():  # evaluation runs the kernels of the training forward
        assert torch.equal(ssd.ssd_chunked_scan(x, dt, A, B, C, 16, D=D), runs[0][0])
    wide = [t.detach().double().requires_grad_() for t in leaves]
    y = ssd._chunked_scan(*wide[:5], 16, D=wide[5])
    for got, want in zip(runs[0], [y, *torch.autograd.grad(y, wide, dy.double())]):
        assert rel(got, want) < 2e-6

    # Each input in other memory layouts (the mixer's are views of [s, b, d] and [b, d, s] tensors),
    # batch 2, whole chunks (no padding copy): the same bits as contiguous.
    x, dt, A, B, C, D, dy = inputs(2, 48, 4, 2, 8, 16, torch.float32, ())
    named = dict(x=x, dt=dt, B=B, C=C, dy=dy)

    def both(t):
        return [ssd_kernels.scan(t["x"], t["dt"], A, t["B"], t["C"], 16, D=D),
                *ssd_kernels.scan_grads(t["x"], t["dt"], A.expand(2, 48, 4), t["B"], t["C"], D, 16, None, t["dy"])]

    want = both(named)
    for name, t in named.items():
        for order in ((1, 0, *range(2, t.dim())), (0, *range(2, t.dim()), 1)):  # sequence first, last
            inverse = [order.index(k) for k in range(t.dim())]
            relaid = t.permute(order).contiguous().permute(inverse)
            assert torch.equal(relaid, t) and relaid.stride() != t.stride()
            got = both(dict(named, **{name: relaid}))
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, relaid.stride())

    # The whole mixer, batch 2 (its scan inputs are views): the kernels against the PyTorch scan, both
    # float32 (they differ in the last bits: about 1e-7, the parameters' gradients up to 3e-6).
    cfg = TransformerConfig(hidden_size=64, num_attention_heads=4, num_layers=1).finalize()
    torch.manual_seed(0)
    mixer = MambaMixer(cfg, MambaConfig(mamba_state_dim=16, mamba_head_dim=16, mamba_num_groups=2), chunk_size=16)
    hidden = torch.randn(48, 2, 64)
    outs = []
    for switch in ("torch", "triton"):
        os.environ[ssd_kernels.ENV_SWITCH] = switch
        inp = hidden.clone().requires_grad_()
        out = mixer(inp)[0]
        outs.append([out, *torch.autograd.grad(out.float().square().sum(), [inp, *mixer.parameters()])])
    for name, a, b in zip(["out", "dx", *dict(mixer.named_parameters())], *outs):
        assert rel(a, b) < 1e-5, (name, rel(a, b))
    print("ok")
    """
)


@needs_triton
def test_kernels_match_the_float64_scan_in_the_interpreter():
    run_interpreted(CPU_SCRIPT, timeout=600, **{ssd_kernels.ENV_SWITCH: "triton"})


def test_the_switch(monkeypatch):
    """On by default where the kernels can run (``triton``); ``torch`` turns them off; anything else is
    an error naming it."""
    x = torch.empty(1)
    monkeypatch.delenv(ssd_kernels.ENV_SWITCH, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not ssd_kernels.available(x)  # a CPU tensor without the interpreter
    assert ssd_kernels.takes(torch.bfloat16) == ssd_kernels.HAVE_TRITON
    assert not ssd_kernels.takes(torch.float64)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert ssd_kernels.available(x) == ssd_kernels.HAVE_TRITON
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "torch")
    assert not ssd_kernels.available(x) and not ssd_kernels.takes(torch.bfloat16)
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "fused")
    with pytest.raises(ValueError, match=ssd_kernels.ENV_SWITCH):
        ssd_kernels.available(x)


HYBRID = (2, 2048, 32, 8, 64, 128, 128)  # the hybrid benchmark's mixer: b, l, heads, groups, p, n, chunk


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype,d_shape,state_dtype,tol",
    [(torch.float32, (), None, 2e-6), (torch.bfloat16, (), None, 4e-3), (torch.bfloat16, "p", torch.bfloat16, 4e-3)],
    ids=["fp32", "bf16", "bf16-states"],
)
@pytest.mark.parametrize("case", [HYBRID, (1, 200, 4, 2, 32, 64, 64)], ids=["hybrid", "small"])
def test_gpu_kernels_match_the_float64_scan(case, dtype, d_shape, state_dtype, tol):
    """``d_shape`` ``()`` is a D per head, ``"p"`` one per channel (``[heads, p]``)."""
    d_shape = (case[4],) if d_shape == "p" else d_shape
    check_against_float64(case, dtype, d_shape, state_dtype, tol, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_captured_forward_and_backward_replay_eager_bits(monkeypatch, deterministic):
    """With the kernels on, deterministic: a captured forward + backward replays eager's values and
    gradients bit for bit (slicing is ``test_mamba_gpu.py``'s test, on both paths)."""
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "triton")
    b, length, h, g, p, n, q = HYBRID
    x, dt, A, B, C, D, dy = inputs(b, length, h, g, p, n, torch.bfloat16, (), device="cuda")
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D)]
    monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", 2**40)
    monkeypatch.setattr(ssd, "SLICE_BYTES", 2**40)
    y = ssd.ssd_chunked_scan(*leaves[:5], q, D=leaves[5])
    eager = [y, *torch.autograd.grad(y, leaves, dy)]
    static = [t.detach().clone().requires_grad_() for t in leaves]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up: compile, then capture the same specializations
        y = ssd.ssd_chunked_scan(*static[:5], q, D=static[5])
        torch.autograd.grad(y, static, dy)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = ssd.ssd_chunked_scan(*static[:5], q, D=static[5])
        grads = torch.autograd.grad(y, static, dy)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(got, want) for got, want in zip([y, *grads], eager))


@pytest.fixture
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("budget", ["SLICE_BYTES", "EAGER_SLICE_BYTES"])
@pytest.mark.parametrize("switch", ["torch", "triton"])
def test_gpu_traced_backward_peak_is_what_the_scan_allocates(switch, budget, monkeypatch):
    """``captured_backward_peak_bytes`` (traced on the meta device; the kernels' launches skipped)
    against the allocator's peak over a real backward at the same budget, on either scan."""
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, switch)
    b, length, h, g, p, n, q = HYBRID
    monkeypatch.setattr(ssd, "SLICE_BYTES", getattr(ssd, budget))
    traced = ssd_trace.captured_backward_peak_bytes(b, length, h, p, g, n, q, torch.bfloat16)
    x, dt, A, B, C, D, dy = inputs(b, length, h, g, p, n, torch.bfloat16, (), device="cuda")
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D)]
    monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", ssd.SLICE_BYTES)
    y = ssd.ssd_chunked_scan(*leaves[:5], q, D=leaves[5])
    torch.autograd.grad(y, leaves, dy)  # compiled, and the allocator warm
    y = ssd.ssd_chunked_scan(*leaves[:5], q, D=leaves[5])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(y, leaves, dy)
    torch.cuda.synchronize()
    real = torch.cuda.max_memory_allocated() - before
    print(f"scan backward on {switch} at {budget}: traced {traced / 2**20:.1f} MiB, real {real / 2**20:.1f} MiB")
    assert abs(real - traced) <= 2**20, (traced, real)
    del grads


def _nvidia_backend() -> bool:
    if not ssd_kernels.HAVE_TRITON:
        return False
    from tools.ssd_kernel_resources import cuobjdump

    return shutil.which(cuobjdump()) is not None


@pytest.mark.skipif(not _nvidia_backend(), reason="needs Triton's NVIDIA backend (ptxas, cuobjdump)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernels_compile_for_hopper_within_its_shared_memory(dtype):
    """Every kernel of a forward and a backward at the hybrid benchmark's shapes, as launched (tiles,
    warps, dtypes), compiles for sm_90 ahead of time with no GPU, and asks for no more shared memory
    than an H100/H200 block may have (else it would fail at its first launch there). Registers and
    spills are printed (``-rP``), not bounded: they are speed, and move with Triton's version."""
    from tools.ssd_kernel_resources import HOPPER_SHARED_BYTES, recorded_launches, table

    b, length, h, g, p, n, q = HYBRID
    launches = recorded_launches(dtype, batch=b, seq=length, heads=h, head_dim=p, groups=g, state=n, chunk=q)
    names = {kernel.__name__ for kernel, _, _ in launches}
    assert len(launches) == 9 and len(names) == 6, names  # forward 3 launches, backward 6
    for row in table(launches):
        print(row)
        assert row["shared"] <= HOPPER_SHARED_BYTES, row
