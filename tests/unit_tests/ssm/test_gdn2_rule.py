"""The chunked GDN2 rule against the step-by-step recurrence: outputs, states, gradients, strong decay.

Errors are norm-wise relative, ``||y - y_ref|| / ||y_ref||``, against the recurrence in
float64: below 1e-10 for float64 inputs, 1e-5 for float32 (the chunked form sums in
another order and solves a triangular system per chunk). The recurrence itself is
checked against Megatron's matrix form of one step,
``S_t = (I - k (b k)^T) Diag(exp(g)) S + k (w v)^T``.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_delta_net.gated_delta_rule import l2norm
from megatron.core.ssm.gated_delta_net.gdn2_rule import (
    HAVE_FLA_GDN2,
    chunk_gdn2,
    decayed_scores,
    gdn2_rule,
    recurrent_gdn2,
)

# (batch, length, heads, key dim, value dim, chunk, block): lengths mostly not multiples of the chunk.
CASES = [
    (2, 37, 3, 8, 16, 8, 4),
    (1, 100, 2, 16, 8, 32, 16),
    (2, 64, 2, 4, 4, 16, 16),  # a multiple of the chunk, one block per chunk
    (1, 5, 2, 8, 8, 64, 16),  # shorter than one chunk
    (1, 130, 2, 8, 4, 64, 16),  # two full chunks and a 2-step tail
    (2, 50, 3, 6, 10, 7, 3),  # odd chunk, a block that does not divide it
]


def inputs(b, length, h, dk, dv, dtype=torch.float64, seed=0, decay_scale=1.0):
    """L2-normalised keys, gates in (0, 1), channel-wise g from Megatron's A range, dt init and a softplus."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k, v = rnd(b, length, h, dk), l2norm(rnd(b, length, h, dk)), rnd(b, length, h, dv)
    a = torch.empty(h, 1, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen)
    g = -decay_scale * a * F.softplus(rnd(b, length, h, dk) - 4.0)
    erase, write = torch.sigmoid(rnd(b, length, h, dk)), torch.sigmoid(rnd(b, length, h, dv))
    return [t.to(dtype) for t in (q, k, v, g, erase, write)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_the_recurrence_is_megatrons_matrix_form():
    q, k, v, g, erase, write = inputs(1, 6, 1, 4, 3)
    state = torch.zeros(4, 3, dtype=torch.float64)
    outputs = []
    for t in range(6):
        kt, gt = k[0, t, 0], g[0, t, 0]
        transition = torch.eye(4, dtype=torch.float64) - torch.outer(kt, erase[0, t, 0] * kt)
        state = transition @ torch.diag(gt.exp()) @ state + torch.outer(kt, write[0, t, 0] * v[0, t, 0])
        outputs.append(state.t() @ q[0, t, 0] * 4**-0.5)
    o, _ = recurrent_gdn2(q, k, v, g, erase, write)
    assert rel(o[0, :, 0], torch.stack(outputs)) < 1e-14


def test_decayed_scores_equal_the_pairwise_sum():
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(2, 11, 5, generator=gen, dtype=torch.float64), torch.randn(2, 11, 5, generator=gen).double()
    cum = -torch.rand(2, 11, 5, generator=gen, dtype=torch.float64).cumsum(1)
    pairwise = torch.einsum("bic,bjc,bijc->bij", x, y, (cum[:, :, None] - cum[:, None]).exp())
    for block in (1, 3, 4, 11):
        assert rel(decayed_scores(x, y, cum, block), pairwise.tril()) < 1e-14
        assert rel(decayed_scores(x, y, cum, block, strict=True), pairwise.tril(-1)) < 1e-14


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}l{}h{}k{}v{}c{}x{}".format(*c))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_chunked_equals_recurrent(case, dtype, tol):
    *shape, chunk, block = case
    args = inputs(*shape, dtype=dtype)
    b, _, h, dk, dv = shape
    state0 = torch.randn(b, h, dk, dv, dtype=torch.float64, generator=torch.Generator().manual_seed(1)).to(dtype)
    for initial in (None, state0):
        o, state = chunk_gdn2(*args, chunk, block_size=block, initial_state=initial, output_final_state=True)
        assert o.shape == args[2].shape and o.dtype == dtype and state.shape == (b, h, dk, dv)
        ref_o, ref_state = recurrent_gdn2(
            *[t.double() for t in args],
            initial_state=None if initial is None else initial.double(),
            output_final_state=True,
        )
        assert rel(o, ref_o) < tol
        assert rel(state, ref_state) < tol


@pytest.mark.parametrize("decay_scale", [0.0, 1e-3, 30.0, 1e4], ids=["none", "slow", "fast", "extreme"])
def test_any_decay_stays_finite_and_accurate_in_fp32(decay_scale):
    """Per-channel decays far beyond exp's fp32 range over a chunk: no exponent is positive, nothing overflows."""
    args = inputs(1, 96, 2, 16, 16, decay_scale=decay_scale)
    o, state = chunk_gdn2(*[t.float() for t in args], 64, output_final_state=True)
    ref_o, ref_state = recurrent_gdn2(*args, output_final_state=True)
    assert torch.isfinite(o).all() and torch.isfinite(state).all()
    assert rel(o, ref_o) < 1e-5 and rel(state, ref_state) < 1e-5


@pytest.mark.parametrize("chunk,block", [(1, 1), (3, 2), (16, 4), (64, 16), (64, 64)])
def test_chunk_and_block_sizes_do_not_change_the_result(chunk, block):
    args = inputs(2, 45, 2, 8, 4)
    o, _ = chunk_gdn2(*args, chunk, block_size=block)
    assert rel(o, recurrent_gdn2(*args)[0]) < 1e-12


def test_gradients_equal_the_recurrent_ones():
    args = [t.requires_grad_() for t in inputs(2, 29, 3, 8, 6)]
    state0 = torch.randn(2, 3, 8, 6, dtype=torch.float64, requires_grad=True)
    weights = [torch.randn(2, 29, 3, 6, dtype=torch.float64), torch.randn(2, 3, 8, 6, dtype=torch.float64)]

    def grads(fn, **kw):
        o, state = fn(*args, initial_state=state0, output_final_state=True, **kw)
        loss = (o * weights[0]).sum() + (state * weights[1]).sum()
        return torch.autograd.grad(loss, [*args, state0])

    chunked = grads(chunk_gdn2, chunk_size=8, block_size=3)
    reference = grads(recurrent_gdn2)
    for name, got, want in zip(("q", "k", "v", "g", "b", "w", "initial_state"), chunked, reference):
        assert rel(got, want) < 1e-10, name


def test_gradients_stay_finite_under_extreme_decay():
    args = [t.float().requires_grad_() for t in inputs(1, 40, 2, 8, 8, decay_scale=1e4)]
    o, _ = chunk_gdn2(*args, 16)
    grads = torch.autograd.grad(o.square().sum(), args)
    ref = torch.autograd.grad(recurrent_gdn2(*[t.double() for t in args])[0].square().sum(), args)
    scale = max(want.abs().max().item() for want in ref)
    for name, got, want in zip(("q", "k", "v", "g", "b", "w"), grads, ref):
        # g's and b's gradients are ~1e-33 here (fp32 denormals), so the error is taken against the largest one.
        assert torch.isfinite(got).all() and (got.double() - want).abs().max() < 1e-6 * scale, name


def test_state_handover_splits_a_sequence():
    args = inputs(1, 70, 2, 8, 8)
    whole, whole_state = chunk_gdn2(*args, 16, output_final_state=True)
    cut = 33
    first, state = chunk_gdn2(*[t[:, :cut] for t in args], 16, output_final_state=True)
    second, last_state = chunk_gdn2(*[t[:, cut:] for t in args], 16, initial_state=state, output_final_state=True)
    assert rel(torch.cat([first, second], dim=1), whole) < 1e-12
    assert rel(last_state, whole_state) < 1e-12


def test_the_output_is_causal():
    q, k, v, g, erase, write = inputs(1, 40, 2, 4, 4)
    base, _ = chunk_gdn2(q, k, v, g, erase, write, 8)
    w2 = write.clone()
    w2[:, 25:] = 1.0 - w2[:, 25:]  # a change at step 25 leaves steps 0..24 as they were
    changed, _ = chunk_gdn2(q, k, v, g, erase, w2, 8)
    assert torch.equal(changed[:, :25], base[:, :25])
    assert not torch.allclose(changed[:, 25:], base[:, 25:])


def test_low_precision_inputs_compute_in_fp32_and_return_their_dtype():
    args = inputs(1, 50, 2, 8, 8)
    o, _ = chunk_gdn2(*[t.to(torch.bfloat16) for t in args], 16)
    assert o.dtype == torch.bfloat16
    ref, _ = recurrent_gdn2(*[t.to(torch.bfloat16).double() for t in args])
    assert rel(o, ref) < 1e-2  # bf16 inputs and output rounding; the sums run in fp32


@pytest.mark.skipif(HAVE_FLA_GDN2, reason="fla's GDN2 kernel is installed")
def test_asking_for_fla_without_it_says_how_to_install_it():
    with pytest.raises(RuntimeError, match="flash-linear-attention>=0.5.1"):
        gdn2_rule(*inputs(1, 4, 1, 4, 4), use_fused=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_chunked_rule_replays_in_a_cuda_graph_as_eager():
    args = [t.float().cuda() for t in inputs(2, 100, 2, 16, 16)]
    eager = chunk_gdn2(*args, 64)[0]
    static = [t.clone() for t in args]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        chunk_gdn2(*static, 64)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = chunk_gdn2(*static, 64)[0]
    graph.replay()
    assert torch.equal(out, eager)


@pytest.mark.gpu
@pytest.mark.skipif(not (HAVE_FLA_GDN2 and torch.cuda.is_available()), reason="needs CUDA and fla's GDN2 kernel")
def test_fla_kernel_matches_the_pytorch_rule():
    args = [t.float().cuda() for t in inputs(2, 200, 2, 64, 64)]
    fused = gdn2_rule(*args, use_fused=True)
    assert rel(fused, chunk_gdn2(*args, 64)[0]) < 2e-3  # fla computes its chunks in bf16/tf32 tiles
