"""The Mamba mixer on CUDA: bf16 forward + backward against a float64 CPU reference; capturable.

Tolerances (norm-wise relative error, ``||a - ref|| / ||ref||``): the bf16 mixer rounds
its activations to bf16 between its steps (in-projection, conv, scan output, norm,
out-projection; the scan itself runs in fp32), 2^-9 relative each, which puts the
output error near 0.5%; it is checked to 1.5e-2, and the gradients, which pass the
roundings of both directions, to 3e-2. The reference is the same mixer in float64 on
the CPU with the bf16-rounded weights and input, so weight rounding is no part of it.
"""

import copy

import pytest
import torch

from megatron.core.ssm import ssd, ssd_kernels
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM, MambaMixer
from megatron.core.transformer.transformer_config import TransformerConfig

pytestmark = pytest.mark.gpu

FWD_TOL, GRAD_TOL = 1.5e-2, 3e-2
GROUPS = 4  # the test mixers' Mamba groups


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return ((a - b).norm() / b.norm()).item()


def mixers(hidden=256, chunk_size=64, fused=False):
    cfg = TransformerConfig(hidden_size=hidden, num_attention_heads=4, num_layers=4).finalize()
    mc = MambaConfig(mamba_state_dim=64, mamba_head_dim=32, mamba_num_groups=GROUPS)
    torch.manual_seed(0)
    cfg.params_dtype = torch.bfloat16
    gpu = MambaMixer(cfg, mc, chunk_size=chunk_size, device="cuda", use_fused_kernels=fused)
    ref = copy.deepcopy(gpu).cpu().double()  # the bf16 weights (and fp32 A_log, D), widened
    ref.use_fused_kernels = False
    return gpu, ref


def run(mixer, x, cotangent):
    x = x.detach().requires_grad_()
    out, _ = mixer(x)
    (out.float() * cotangent.to(out.device, torch.float32)).sum().backward()
    return out, x.grad, {n: p.grad for n, p in mixer.named_parameters()}


@pytest.mark.parametrize("seq", [200, 256], ids=["seq200", "seq256"])
@pytest.mark.parametrize(
    "path",
    [
        "torch",
        pytest.param("triton", marks=pytest.mark.skipif(not ssd_kernels.HAVE_TRITON, reason="Triton not installed")),
        pytest.param("mamba_ssm", marks=pytest.mark.skipif(not HAVE_MAMBA_SSM, reason="mamba-ssm not installed")),
    ],
)
def test_bf16_forward_backward_matches_fp64_cpu_reference(seq, path, monkeypatch):
    """The scan on PyTorch, on ``ssd_kernels`` (the CPU reference takes PyTorch) or on mamba-ssm."""
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "triton" if path == "triton" else "torch")
    gpu, ref = mixers(fused=path == "mamba_ssm")
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(seq, 2, 256, generator=gen).bfloat16()
    cotangent = torch.randn(seq, 2, 256, generator=gen)
    out, dx, grads = run(gpu, x.cuda(), cotangent)
    ref_out, ref_dx, ref_grads = run(ref, x.double(), cotangent.double())
    assert out.dtype == torch.bfloat16
    assert rel(out, ref_out) < FWD_TOL
    assert rel(dx, ref_dx) < GRAD_TOL
    for name, g in grads.items():
        assert rel(g, ref_grads[name]) < GRAD_TOL, name


class OutputOnly(torch.nn.Module):
    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, x):
        return self.mixer(x)[0]


def test_forward_and_backward_are_capturable_and_replay_like_eager(monkeypatch):
    """No host sync and static shapes: torch's graph capture of forward + backward succeeds and replays.
    The capture slices the scan finer (one group a slice here) than eager (one slice): the same bits."""
    monkeypatch.setattr(ssd, "SLICE_BYTES", 1)
    slices = []  # (capturing, number of slices) of each sliced pass, forward or backward
    group_slices = ssd._group_slices

    def recording(*args):
        found = group_slices(*args)
        slices.append((torch.cuda.is_current_stream_capturing(), len(found)))
        return found

    monkeypatch.setattr(ssd, "_group_slices", recording)
    gpu, _ = mixers()
    sample = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    graphed = torch.cuda.make_graphed_callables(OutputOnly(copy.deepcopy(gpu)), (sample,), num_warmup_iters=2)
    x = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    cotangent = torch.randn(128, 2, 256, device="cuda", dtype=torch.bfloat16)
    out_graph = graphed(x)
    (dx_graph,) = torch.autograd.grad(out_graph, x, cotangent)
    out_eager = OutputOnly(gpu)(x)
    (dx_eager,) = torch.autograd.grad(out_eager, x, cotangent)
    assert torch.equal(out_graph, out_eager)  # the same kernels: bitwise
    assert torch.equal(dx_graph, dx_eager)
    assert [n for capturing, n in slices if capturing] == [GROUPS, GROUPS]  # forward and backward captured
    assert {n for capturing, n in slices if not capturing} == {1}


@pytest.mark.parametrize(
    "path",
    ["torch", pytest.param("triton", marks=pytest.mark.skipif(not ssd_kernels.HAVE_TRITON, reason="no Triton"))],
)
def test_slicing_changes_no_bit_on_the_gpu(path, monkeypatch):
    """The scan at the hybrid benchmark's mixer shapes (bf16), deterministic, on PyTorch or on ``ssd_kernels``:
    the captured budget's slices (SLICE_BYTES) and one group a slice give exactly the values and gradients
    of one slice (eager)."""
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, path)
    torch.use_deterministic_algorithms(True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, length, h, p, g, n = 2, 2048, 32, 64, 8, 128
    x = torch.randn(b, length, h, p, device="cuda", generator=gen).bfloat16()
    dt = torch.rand(b, length, h, device="cuda", generator=gen) * 0.1
    A = -torch.rand(h, device="cuda", generator=gen)
    B, C = (torch.randn(b, length, g, n, device="cuda", generator=gen).bfloat16() for _ in range(2))
    D = torch.rand(h, device="cuda", generator=gen)
    cotangent = torch.randn(x.shape, device="cuda", generator=gen).bfloat16()

    def values_and_gradients(budget):
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C, D)]
        monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", budget)
        y = ssd.ssd_chunked_scan(*leaves[:5], 128, D=leaves[5])
        return [y, *torch.autograd.grad(y, leaves, cotangent)]

    one_slice = values_and_gradients(2**40)
    differ = [
        f"{name} at {budget} bytes a slice"
        for budget in (ssd.SLICE_BYTES, 1)
        for name, got, want in zip("y x dt A B C D".split(), values_and_gradients(budget), one_slice)
        if not torch.equal(got, want)
    ]
    assert not differ, differ
