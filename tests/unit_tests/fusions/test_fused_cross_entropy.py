"""The fused (Triton) cross entropy against a float64 reference.

On the CPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, in a child
process: the variable is read when the kernels are defined); on a GPU they run for real
at the benchmark's size and inside a CUDA graph.
"""

import os
import textwrap

import pytest
import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_cross_entropy as fce
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.unit_tests.interpreted import needs_triton, run_interpreted


def reference(logits, target, grad):
    x = logits.double().requires_grad_()
    loss = F.cross_entropy(x, target, reduction="none")
    loss.backward(grad.double())
    return loss.detach(), x.grad


def check(logits, target, grad, grad_atol):
    """Fused loss within fp32 rounding of the reference; gradient within a rounding of its dtype."""
    want_loss, want_grad = reference(logits, target, grad)
    x = logits.clone().requires_grad_()
    loss = fce.fused_cross_entropy(x, target)
    assert loss.dtype == torch.float32 and loss.shape == target.shape
    loss.backward(grad)
    torch.testing.assert_close(loss.double(), want_loss, rtol=2e-6, atol=2e-6)
    assert x.grad.dtype == logits.dtype
    torch.testing.assert_close(x.grad.double(), want_grad, rtol=0, atol=grad_atol)


CPU_SCRIPT = textwrap.dedent(
    """
    import torch
    from tests.unit_tests.fusions.test_fused_cross_entropy import check
    torch.manual_seed(0)
    # Several blocks with a masked tail, one partial block, a single column; logits far
    # from zero (the max subtraction matters) and a target in the masked-tail block.
    # fp32 gradients: exp(x - lse) with |x| ~ 40 carries ~40 * 2^-24 relative error. bf16:
    # the interpreter truncates fp32 -> bf16 (the GPU rounds to nearest), so up to one
    # ulp (2^-7 for gradients in [1, 2)) instead of half.
    for n, v in [(5, 9000), (4, 300), (3, 1)]:
        for dtype, atol in [(torch.float32, 1e-5), (torch.bfloat16, 8e-3)]:
            logits = (torch.randn(n, v) * 4 + 30).to(dtype)
            target = torch.randint(0, v, (n,))
            target[0] = v - 1
            check(logits, target, torch.rand(n) + 0.5, atol)
    print("ok")
    """
)


@needs_triton
def test_kernels_match_reference_in_the_interpreter():
    run_interpreted(CPU_SCRIPT, timeout=300)


def test_cpu_logits_take_the_torch_path():
    torch.manual_seed(0)
    logits, target = torch.randn(2, 3, 17), torch.randint(0, 17, (2, 3))
    assert not fce.available(logits) or os.environ.get("TRITON_INTERPRET") == "1"
    fused = vocab_parallel_cross_entropy(logits, target, fused=True)
    assert torch.equal(fused, vocab_parallel_cross_entropy(logits, target))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype,atol", [(torch.bfloat16, 4e-3), (torch.float16, 5e-4), (torch.float32, 4e-6)])
def test_gpu_benchmark_size_matches_reference(dtype, atol):
    torch.manual_seed(0)
    n, v = 4096, 32000
    logits = (torch.randn(n, v, device="cuda") * 3).to(dtype)
    target = torch.randint(0, v, (n,), device="cuda")
    check(logits, target, torch.rand(n, device="cuda"), atol)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_in_place_deterministic_and_capturable():
    torch.manual_seed(0)
    logits = torch.randn(512, 1000, device="cuda", dtype=torch.bfloat16)
    target = torch.randint(0, 1000, (512,), device="cuda")
    grad = torch.rand(512, device="cuda")

    def run(x):
        x = x.clone().requires_grad_()
        y = x * 1  # a non-leaf, like the output layer's logits
        loss = fce.fused_cross_entropy(y, target)
        (g,) = torch.autograd.grad(loss, y, grad)
        assert g.data_ptr() == y.data_ptr(), "the gradient is written over the logits"
        return loss, g

    (l1, g1), (l2, g2) = run(logits), run(logits)
    assert torch.equal(l1, l2) and torch.equal(g1, g2)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    static_in = logits.clone()
    with torch.cuda.stream(stream):
        run(static_in)  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_loss, static_grad = run(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_loss, l1) and torch.equal(static_grad, g1)
