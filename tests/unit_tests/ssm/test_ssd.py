"""The SSD chunked scan against the naive sequential recurrence: values, states, gradients.

Errors are norm-wise relative: ``||y - y_ref|| / ||y_ref||`` with the reference in float64.
"""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm import ssd, ssd_kernels, ssd_trace
from megatron.core.ssm.ssd import ssd_chunked_scan, ssd_sequential_scan

# (batch, length, heads, head dim, groups, state dim, chunk): lengths mostly not multiples of the chunk.
CASES = [
    (2, 37, 4, 8, 2, 16, 8),
    (1, 100, 6, 4, 3, 8, 32),
    (2, 64, 4, 4, 4, 4, 16),  # a multiple of the chunk, one head per group
    (1, 5, 2, 3, 1, 4, 8),  # shorter than one chunk
    (1, 130, 8, 4, 2, 8, 128),  # one full chunk and a 2-step tail
    (2, 50, 8, 2, 1, 6, 7),  # odd chunk, all heads in one group
]


def inputs(b, length, h, p, g, n, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    x = rnd(b, length, h, p)
    dt = F.softplus(rnd(b, length, h) - 1.0)  # ~0.3 on average; some steps near 2
    A = -torch.empty(h, dtype=torch.float64).uniform_(1.0, 16.0, generator=gen)  # Megatron's A init range
    B, C = rnd(b, length, g, n), rnd(b, length, g, n)
    D = rnd(h)
    return [t.to(dtype) for t in (x, dt, A, B, C, D)]


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}l{}h{}p{}g{}n{}q{}".format(*c))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["fp64", "fp32"])
def test_chunked_equals_sequential(case, dtype, tol):
    *shape, chunk = case
    args = inputs(*shape, dtype=dtype)
    x, dt, A, B, C, D = args
    y, state = ssd_chunked_scan(x, dt, A, B, C, chunk, D=D, return_final_states=True)
    assert y.shape == x.shape and y.dtype == dtype
    assert state.shape == (x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    ref_y, ref_state = ssd_sequential_scan(*[t.double() for t in args[:5]], D=D.double(), return_final_states=True)
    assert rel(y, ref_y) < tol
    assert rel(state, ref_state) < tol


@pytest.mark.parametrize("chunk", [1, 4, 16, 64])
def test_chunk_size_does_not_change_the_result(chunk):
    x, dt, A, B, C, D = inputs(2, 45, 4, 4, 2, 8)
    base = ssd_chunked_scan(x, dt, A, B, C, 45, D=D)
    assert rel(ssd_chunked_scan(x, dt, A, B, C, chunk, D=D), base) < 1e-12


def test_initial_state_continues_a_split_sequence():
    x, dt, A, B, C, D = inputs(2, 41, 4, 4, 2, 8)
    whole, whole_state = ssd_chunked_scan(x, dt, A, B, C, 8, D=D, return_final_states=True)
    cut = 19
    first, state = ssd_chunked_scan(
        x[:, :cut], dt[:, :cut], A, B[:, :cut], C[:, :cut], 8, D=D, return_final_states=True
    )
    second, end_state = ssd_chunked_scan(
        x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], 8, D=D, initial_states=state, return_final_states=True
    )
    assert rel(torch.cat([first, second], 1), whole) < 1e-12
    assert rel(end_state, whole_state) < 1e-12
    ref = ssd_sequential_scan(x[:, cut:], dt[:, cut:], A, B[:, cut:], C[:, cut:], D=D, initial_states=state)
    assert rel(second, ref) < 1e-12


def test_per_channel_D_and_no_D():
    x, dt, A, B, C, _ = inputs(1, 20, 4, 3, 2, 4)
    D = torch.randn(4, 3, dtype=torch.float64)
    assert rel(ssd_chunked_scan(x, dt, A, B, C, 8, D=D), ssd_sequential_scan(x, dt, A, B, C, D=D)) < 1e-10
    assert rel(ssd_chunked_scan(x, dt, A, B, C, 8), ssd_sequential_scan(x, dt, A, B, C)) < 1e-10


@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=["l37q8", "l100q32", "l50q7"])
def test_gradients_match_the_sequential_recurrence(case):
    *shape, chunk = case
    leaves = [t.requires_grad_() for t in inputs(*shape)]
    x, dt, A, B, C, D = leaves
    cotangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y, state = ssd_chunked_scan(x, dt, A, B, C, chunk, D=D, return_final_states=True)
    grads = torch.autograd.grad((y * cotangent).sum() + state.sum(), leaves)
    ref_y, ref_state = ssd_sequential_scan(x, dt, A, B, C, D=D, return_final_states=True)
    ref_grads = torch.autograd.grad((ref_y * cotangent).sum() + ref_state.sum(), leaves)
    for name, g, ref in zip("x dt A B C D".split(), grads, ref_grads):
        assert rel(g, ref) < 1e-10, name


def test_low_precision_inputs_compute_in_fp32_and_states_dtype_rounds():
    x, dt, A, B, C, D = inputs(1, 40, 4, 8, 2, 16)
    ref = ssd_sequential_scan(x, dt, A, B, C, D=D)
    y = ssd_chunked_scan(x.bfloat16(), dt.float(), A.float(), B.bfloat16(), C.bfloat16(), 16, D=D.float())
    assert y.dtype == torch.bfloat16
    assert rel(y, ref) < 2e-2  # bf16 inputs and output; the scan itself runs in fp32
    x32, B32, C32 = x.float(), B.float(), C.float()
    exact = ssd_chunked_scan(x32, dt.float(), A.float(), B32, C32, 16, D=D.float())
    rounded = ssd_chunked_scan(x32, dt.float(), A.float(), B32, C32, 16, D=D.float(), state_dtype=torch.bfloat16)
    assert 0 < rel(rounded, exact) < 2e-2


def saved_bytes(fn):
    """``(result, bytes of distinct storages autograd keeps for backward while fn runs)``."""
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(storages.values())


def slice_budget(monkeypatch, nbytes: int):
    """GroupSlicedScan's budget, captured or eager (the CPU runs eagerly)."""
    monkeypatch.setattr(ssd, "SLICE_BYTES", nbytes)
    monkeypatch.setattr(ssd, "EAGER_SLICE_BYTES", nbytes)


@pytest.mark.parametrize("per_channel_D", [False, True, None], ids=["D", "D-per-channel", "no-D"])
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[5]], ids=["l37q8", "l100q32", "l50q7"])
def test_sliced_scan_gradients_match_the_sequential_recurrence(case, per_channel_D, monkeypatch):
    """With a gradient wanted the scan runs as GroupSlicedScan; one group per slice here."""
    slice_budget(monkeypatch, 1)
    *shape, chunk = case
    x, dt, A, B, C, D = inputs(*shape)
    if per_channel_D:
        D = D[:, None].repeat(1, x.shape[-1]) * torch.linspace(0.5, 1.5, x.shape[-1], dtype=torch.float64)
    elif per_channel_D is None:
        D = None
    leaves = [t.requires_grad_() for t in (x, dt, A, B, C, D) if t is not None]
    assert len(ssd._group_slices(x, B, chunk, ssd.SLICE_BYTES)) == B.shape[2]
    cotangent = torch.randn(x.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    y = ssd_chunked_scan(x, dt, A, B, C, chunk, D=D)
    assert type(y.grad_fn).__name__ == "GroupSlicedScanBackward"
    grads = torch.autograd.grad((y * cotangent).sum(), leaves)
    ref_y = ssd_sequential_scan(x, dt, A, B, C, D=D)
    ref_grads = torch.autograd.grad((ref_y * cotangent).sum(), leaves)
    assert rel(y, ref_y) < 1e-10
    for name, g, ref in zip("x dt A B C D".split(), grads, ref_grads):
        assert rel(g, ref) < 1e-10, name


@pytest.mark.parametrize("slice_bytes", [1, 2**40], ids=["one-group-per-slice", "one-slice"])
def test_sliced_scan_equals_the_autograd_scan_and_keeps_only_its_inputs(slice_bytes, monkeypatch):
    """bf16 inputs as the mixer gives them: the same values and gradients as autograd through the plain
    scan (up to float32 rounding), and nothing kept for backward beyond the inputs."""
    slice_budget(monkeypatch, slice_bytes)
    x, dt, A, B, C, D = inputs(2, 100, 8, 8, 4, 16)
    args = [x.bfloat16(), dt.float(), A.float(), B.bfloat16(), C.bfloat16(), D.float()]
    leaves = [t.requires_grad_() for t in args]
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    y, kept = saved_bytes(lambda: ssd_chunked_scan(*leaves[:5], 32, D=leaves[5], state_dtype=torch.bfloat16))
    grads = torch.autograd.grad(y, leaves, cotangent)
    ref, ref_kept = saved_bytes(lambda: ssd._chunked_scan(*leaves[:5], 32, D=leaves[5], state_dtype=torch.bfloat16))
    ref_grads = torch.autograd.grad(ref, leaves, cotangent)
    assert y.dtype == torch.bfloat16 and rel(y, ref) < 1e-2  # bf16 outputs: one rounding apart at most
    for name, g, r in zip("x dt A B C D".split(), grads, ref_grads):
        assert g.dtype == r.dtype and rel(g, r) < 1e-4, name
    assert kept == sum(t.untyped_storage().nbytes() for t in leaves)
    assert ref_kept > 10 * kept


def sliced_scan_values_and_gradients(budget: int, monkeypatch) -> list[torch.Tensor]:
    """y and the six gradients of GroupSlicedScan with bf16 inputs (as the mixer gives them), at ``budget``."""
    slice_budget(monkeypatch, budget)
    x, dt, A, B, C, D = inputs(2, 150, 12, 8, 4, 16)  # 3 heads a group, 150 = 4 chunks of 32 + 22
    args = [x.bfloat16(), dt.float(), A.float(), B.bfloat16(), C.bfloat16(), D.float()]
    leaves = [t.requires_grad_() for t in args]
    cotangent = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    y = ssd_chunked_scan(*leaves[:5], 32, D=leaves[5])
    return [y, *torch.autograd.grad(y, leaves, cotangent)]


def test_slicing_changes_no_bit(monkeypatch):
    """Graphed steps slice finer than eager ones (SLICE_BYTES vs EAGER_SLICE_BYTES); both must agree bit for bit."""
    one_slice = sliced_scan_values_and_gradients(2**40, monkeypatch)
    per_group = 2 * 3 * 5 * 32 * 32 * 4  # batch x heads a group x chunks x chunk^2 x float32
    x, B = torch.empty(2, 150, 12, 8), torch.empty(2, 150, 4, 16)
    assert [len(ssd._group_slices(x, B, 32, n)) for n in (1, 2 * per_group, 2**40)] == [4, 2, 1]
    for budget in (1, per_group, 2 * per_group):  # slices of 1, 1, 2 groups
        for name, got, want in zip(
            "y x dt A B C D".split(), sliced_scan_values_and_gradients(budget, monkeypatch), one_slice
        ):
            assert torch.equal(got, want), (budget, name)


def test_a_scan_recorded_for_capture_slices_as_the_graph_will_in_forward_and_backward(monkeypatch):
    """The recording iteration runs a region it captures next eagerly, and its peak counts as the
    graphed run's: a scan there takes the captured budget, and so does its backward, which autograd
    runs outside the region (the budget goes with the scan's saved state)."""
    from megatron.core.transformer.cuda_graphs.recorder import in_recorded_region, recording_region

    budgets = []
    real = ssd._group_slices
    monkeypatch.setattr(ssd, "_group_slices", lambda x, B, q, budget: budgets.append(budget) or real(x, B, q, budget))
    x, dt, A, B, C, D = (t.requires_grad_() for t in inputs(2, 40, 4, 8, 2, 16))
    y = ssd_chunked_scan(x, dt, A, B, C, 8, D=D)
    y.sum().backward()
    assert budgets == [ssd.EAGER_SLICE_BYTES] * 2
    budgets.clear()
    with recording_region():
        assert in_recorded_region()
        y = ssd_chunked_scan(x, dt, A, B, C, 8, D=D)
    assert not in_recorded_region()
    y.sum().backward()
    assert budgets == [ssd.SLICE_BYTES] * 2


def test_eager_scans_in_turns_take_the_captured_budget_when_asked(monkeypatch):
    """MEGATRON_CG_TURN_SCAN_BUDGET=captured: an eager scan whose scratch goes to the backward graphs'
    pool (a graphed run's, after capture) slices as a captured one; by default, and wherever the
    scratch does not route, it keeps the eager budget. A value it does not know is an error naming it."""
    from megatron.core.transformer.cuda_graphs import scratch as scratch_module

    class Session:
        _scratch_open = True

    session = Session()
    scratch_module.own_scratch(session)
    try:
        assert ssd._slice_budget() == ssd.EAGER_SLICE_BYTES
        monkeypatch.setenv(ssd.TURN_BUDGET_ENV, "captured")
        assert ssd._slice_budget() == ssd.SLICE_BYTES
        session._scratch_open = False  # before capture, or the scratch stayed in the eager cache
        assert ssd._slice_budget() == ssd.EAGER_SLICE_BYTES
        monkeypatch.setenv(ssd.TURN_BUDGET_ENV, "small")
        with pytest.raises(ValueError, match="MEGATRON_CG_TURN_SCAN_BUDGET='small': use eager"):
            ssd._slice_budget()
    finally:
        scratch_module.disown_scratch(session)
    monkeypatch.setenv(ssd.TURN_BUDGET_ENV, "captured")
    assert ssd._slice_budget() == ssd.EAGER_SLICE_BYTES  # no graphed run


def test_scan_without_gradient_or_with_states_runs_the_plain_scan():
    x, dt, A, B, C, D = inputs(1, 20, 4, 4, 2, 4)
    with torch.no_grad():
        assert ssd_chunked_scan(x.requires_grad_(), dt, A, B, C, 8, D=D).grad_fn is None
    y, _ = ssd_chunked_scan(x, dt, A, B, C, 8, D=D, return_final_states=True)
    assert type(y.grad_fn).__name__ != "GroupSlicedScanBackward"


def test_live_bytes_counts_storages_while_they_live():
    before = torch.empty(1024)
    counter = ssd_trace._LiveBytes()
    with counter:
        a = torch.empty(256, dtype=torch.float32)  # 1 KiB
        b = torch.empty(512, dtype=torch.float32)
        view = b[:10]  # no storage of its own
        old_view = before[:512]  # nor a view of a tensor made before counting
        before.mul_(2)
        del a
        c = torch.empty(128, dtype=torch.float32)
    assert counter.peak == 3 * 1024 and counter.live == 2 * 1024 + 512
    del b, view, c, old_view
    assert counter.live == 0


@pytest.mark.parametrize("slices", [1, 2, 4])
def test_traced_backward_peak_is_what_a_real_backward_allocates(slices, monkeypatch):
    """``captured_backward_peak_bytes`` traces the backward on the meta device at SLICE_BYTES;
    a real CPU backward through autograd at the same budget allocates exactly as much at its peak."""
    b, length, h, p, g, n, q = 2, 96, 8, 8, 4, 16, 32
    per_group = b * (h // g) * (length // q) * q * q * 4
    slice_budget(monkeypatch, g // slices * per_group)
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "torch")  # the CPU backward runs the PyTorch scan
    traced = ssd_trace.captured_backward_peak_bytes(b, length, h, p, g, n, q, torch.bfloat16)
    x, dt, A, B, C, D = inputs(b, length, h, p, g, n)
    leaves = [t.requires_grad_() for t in (x.bfloat16(), dt.float(), A.float(), B.bfloat16(), C.bfloat16(), D.float())]
    y = ssd_chunked_scan(*leaves[:5], q, D=leaves[5])
    dy = torch.randn_like(y)
    counter = ssd_trace._LiveBytes()
    with counter:
        torch.autograd.backward(y, dy)
    assert len(ssd._group_slices(leaves[0], leaves[3], q, ssd.SLICE_BYTES)) == slices
    assert traced == counter.peak


def test_backward_peak_is_about_half_of_autograd_through_the_recompute():
    """The hand-written backward drops each intermediate when its part is done; autograd through a
    recompute of the plain scan (this backward before) keeps them all until the end. Meta tensors,
    one slice, a decay matrix about as large against the rest as in a real mixer (chunk >> head dim)."""
    b, length, h, p, g, n, q = 2, 256, 8, 16, 2, 16, 64
    meta = dict(device="meta")
    x, dy = torch.empty(b, length, h, p, dtype=torch.bfloat16, **meta), torch.empty(b, length, h, p, **meta)
    dt, A = torch.empty(b, length, h, **meta), torch.empty(h, **meta).expand(b, length, h)
    B, C = (torch.empty(b, length, g, n, dtype=torch.bfloat16, **meta) for _ in range(2))
    D = torch.empty(h, **meta)
    recompute = ssd_trace._LiveBytes()
    with recompute:
        leaves = [t.detach().requires_grad_() for t in (x, dt, A, B, C)]
        with torch.enable_grad():
            y = ssd._chunked_scan(*leaves, q, D=D)
        torch.autograd.grad(y, leaves, dy.bfloat16())
    lean = ssd_trace._traced_backward_peak(b, length, h, p, g, n, q, torch.bfloat16, 2**40)
    assert lean < 0.6 * recompute.peak, (lean, recompute.peak)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=["fp64", "fp32", "bf16"])
@pytest.mark.parametrize("length,chunk", [(37, 8), (16, 16)], ids=["padded", "one-chunk"])
def test_the_scan_writes_over_none_of_its_inputs(dtype, length, chunk):
    """The scan scales its laid-out copies in place; where the dtype is already the compute dtype (or
    the layout needs no move), those copies must still be copies, in forward and in backward."""
    x, dt, A, B, C, D = inputs(2, length, 4, 8, 2, 16)
    args = [x.to(dtype), dt.float(), A.float(), B.to(dtype), C.to(dtype), D.float()]
    before = [t.clone() for t in args]
    with torch.no_grad():
        ssd_chunked_scan(*args[:5], chunk, D=args[5])
    leaves = [t.requires_grad_() for t in args]
    y = ssd_chunked_scan(*leaves[:5], chunk, D=leaves[5])
    dy = torch.ones_like(y)
    torch.autograd.grad(y, leaves, dy)
    assert torch.equal(dy, torch.ones_like(y))
    for name, t, was in zip("x dt A B C D".split(), args, before):
        assert torch.equal(t.detach(), was), name
