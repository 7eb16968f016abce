"""The chunked gated delta rule against the step-by-step recurrence: outputs, states, gradients.

Errors are norm-wise relative, ``||y - y_ref|| / ||y_ref||``, against the recurrence in
float64: below 1e-10 for float64 inputs, 1e-5 for float32 (the chunked form sums in
another order and solves a triangular system per chunk).
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_delta_net.gated_delta_rule import (
    HAVE_FLA,
    chunk_gated_delta_rule,
    gated_delta_rule,
    l2norm,
    sequential_gated_delta_rule,
)

# (batch, length, heads, key dim, value dim, chunk): lengths mostly not multiples of the chunk.
CASES = [
    (2, 37, 4, 8, 16, 8),
    (1, 100, 3, 16, 8, 32),
    (2, 64, 2, 4, 4, 16),  # a multiple of the chunk
    (1, 5, 2, 8, 8, 64),  # shorter than one chunk
    (1, 130, 2, 8, 4, 64),  # two full chunks and a 2-step tail
    (2, 50, 5, 6, 10, 7),  # odd chunk and sizes
]


def inputs(b, length, h, dk, dv, dtype=torch.float64, seed=0, decay_scale=1.0):
    """Realistic inputs: L2-normalised keys, beta in (0, 1), g from Megatron's A range and a softplus."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(b, length, h, dk), l2norm(rnd(b, length, h, dk)), rnd(b, length, h, dv)
    a = torch.empty(h, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen)
    g = -decay_scale * a * F.softplus(rnd(b, length, h) - 4.0)  # mostly slow decay, some steps fast
    beta = torch.sigmoid(rnd(b, length, h))
    return [t.to(dtype) for t in (q, k, v, g, beta)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}l{}h{}k{}v{}c{}".format(*c))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_chunked_equals_sequential(case, dtype, tol):
    *shape, chunk = case
    args = inputs(*shape, dtype=dtype)
    b, _, h, dk, dv = shape
    state0 = torch.randn(b, h, dk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    for initial in (None, state0):
        o, state = chunk_gated_delta_rule(*args, chunk, initial_state=initial, output_final_state=True)
        assert o.shape == args[2].shape and o.dtype == dtype
        assert state.shape == (b, h, dk, dv)
        ref_o, ref_state = sequential_gated_delta_rule(
            *[t.double() for t in args],
            initial_state=None if initial is None else initial.double(),
            output_final_state=True,
        )
        assert rel(o, ref_o) < tol
        assert rel(state, ref_state) < tol


@pytest.mark.parametrize("decay_scale", [0.0, 1e-3, 30.0], ids=["no_decay", "slow_decay", "fast_decay"])
def test_extreme_decays_stay_accurate_in_fp32(decay_scale):
    # No decay: the state carries everything through 300 steps; fast decay: exp(G) underflows within a chunk.
    args = inputs(2, 300, 3, 8, 8, dtype=torch.float32, decay_scale=decay_scale)
    o, state = chunk_gated_delta_rule(*args, 64, output_final_state=True)
    ref_o, ref_state = sequential_gated_delta_rule(*[t.double() for t in args], output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert rel(o, ref_o) < 1e-5
    assert rel(state, ref_state) < 1e-5


@pytest.mark.parametrize("chunk", [1, 3, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk):
    args = inputs(2, 45, 4, 8, 8)
    base, _ = chunk_gated_delta_rule(*args, 45)
    assert rel(chunk_gated_delta_rule(*args, chunk)[0], base) < 1e-12


def test_gradients_equal_the_sequential_ones():
    args = [t.requires_grad_() for t in inputs(2, 29, 3, 8, 6)]
    state0 = torch.randn(2, 3, 8, 6, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(2, 29, 3, 6, dtype=torch.float64), torch.randn(2, 3, 8, 6, dtype=torch.float64)]

    def grads(fn, **kw):
        o, state = fn(*args, initial_state=state0, output_final_state=True, **kw)
        loss = (o * weights[0]).sum() + (state * weights[1]).sum()
        return torch.autograd.grad(loss, [*args, state0])

    chunked = grads(chunk_gated_delta_rule, chunk_size=8)
    reference = grads(sequential_gated_delta_rule)
    for name, got, want in zip(("q", "k", "v", "g", "beta", "initial_state"), chunked, reference):
        assert rel(got, want) < 1e-10, name


def test_state_handover_splits_a_sequence():
    q, k, v, g, beta = inputs(1, 70, 2, 8, 8)
    whole, whole_state = chunk_gated_delta_rule(q, k, v, g, beta, 16, output_final_state=True)
    cut = 33
    first, state = chunk_gated_delta_rule(
        q[:, :cut], k[:, :cut], v[:, :cut], g[:, :cut], beta[:, :cut], 16, output_final_state=True
    )
    second, last_state = chunk_gated_delta_rule(
        q[:, cut:], k[:, cut:], v[:, cut:], g[:, cut:], beta[:, cut:], 16, initial_state=state, output_final_state=True
    )
    assert rel(torch.cat([first, second], dim=1), whole) < 1e-12
    assert rel(last_state, whole_state) < 1e-12


def test_the_output_is_causal():
    q, k, v, g, beta = inputs(1, 40, 2, 4, 4)
    base, _ = chunk_gated_delta_rule(q, k, v, g, beta, 8)
    v2 = v.clone()
    v2[:, 25:] += 1.0  # a change at step 25 leaves steps 0..24 as they were
    changed, _ = chunk_gated_delta_rule(q, k, v2, g, beta, 8)
    assert torch.equal(changed[:, :25], base[:, :25])
    assert not torch.allclose(changed[:, 25:], base[:, 25:])


def test_low_precision_inputs_compute_in_fp32_and_return_their_dtype():
    args = inputs(1, 50, 2, 8, 8)
    o, _ = chunk_gated_delta_rule(*[t.to(torch.bfloat16) for t in args], 16)
    assert o.dtype == torch.bfloat16
    ref, _ = sequential_gated_delta_rule(*[t.to(torch.bfloat16).double() for t in args])
    assert rel(o, ref) < 1e-2  # bf16 inputs and output rounding; the sums run in fp32


def test_l2norm_matches_its_definition():
    x = torch.randn(3, 5, 8, dtype=torch.float64)
    want = x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)
    assert torch.allclose(l2norm(x), want, rtol=1e-14, atol=0)
    assert l2norm(x.to(torch.bfloat16)).dtype == torch.float32


@pytest.mark.skipif(HAVE_FLA, reason="fla is installed")
def test_asking_for_fla_without_it_says_how_to_install_it():
    with pytest.raises(RuntimeError, match="flash-linear-attention"):
        gated_delta_rule(*inputs(1, 8, 2, 4, 4), use_fused=True)
    # Without fla (and on the CPU) the default is the PyTorch path.
    args = inputs(1, 8, 2, 4, 4)
    assert torch.equal(gated_delta_rule(*args, 4), chunk_gated_delta_rule(*args, 4)[0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_rule_replays_in_a_cuda_graph_as_eager():
    args = [t.float().cuda() for t in inputs(2, 100, 4, 16, 16)]
    eager, _ = chunk_gated_delta_rule(*args, 32)
    static = [t.clone() for t in args]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chunk_gated_delta_rule(*static, 32)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, _ = chunk_gated_delta_rule(*static, 32)
    fresh = inputs(2, 100, 4, 16, 16, seed=5)
    for dst, src in zip(static, fresh):
        dst.copy_(src)
    graph.replay()
    want, _ = chunk_gated_delta_rule(*[t.float().cuda() for t in fresh], 32)
    assert torch.equal(out, want)
    assert not torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_FLA and torch.cuda.is_available()), reason="needs CUDA and fla")
def test_fla_kernel_matches_the_pytorch_rule():
    args = [t.float().cuda() for t in inputs(2, 200, 4, 64, 64)]
    fused = gated_delta_rule(*args, use_fused=True)
    ref, _ = sequential_gated_delta_rule(*[t.double() for t in args])
    assert rel(fused, ref) < 1e-3  # fla computes in tf32/fp32 tiles
