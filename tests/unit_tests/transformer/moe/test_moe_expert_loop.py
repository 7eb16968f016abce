"""The experts' one-node loop (``_ExpertLoop``) against the module path it replaces, bit for bit,
and the row padding that gives the expert GEMMs repeating shapes."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron.core.transformer.moe import experts as experts_mod
from megatron.core.transformer.moe.experts import SequentialMLP, _RowPadding, expert_row_multiple
from tests.unit_tests.transformer.moe.moe_helpers import make_config


def _experts(
    gated: bool, main_grad: bool, row_multiple: int | None = None, hidden: int = 16, ffn: int = 24, **kw
) -> SequentialMLP:
    torch.manual_seed(3)
    cfg = make_config(torch.float32, hidden=hidden, ffn=ffn, gated_linear_unit=gated, add_bias_linear=False, **kw)
    mlp = SequentialMLP(cfg, cfg.moe.num_moe_experts)
    if row_multiple is not None:
        mlp.row_multiple = row_multiple
    if main_grad:
        for p in mlp.parameters():
            p.main_grad = torch.zeros_like(p)
    return mlp


def _run(mlp, counts, probs_need_grad=True):
    torch.manual_seed(4)
    tokens = torch.randn(sum(counts), mlp.local_experts[0].linear_fc1.weight.shape[1], requires_grad=True)
    probs = torch.rand(sum(counts), requires_grad=probs_need_grad)
    out = mlp(tokens, counts, probs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.main_grad.clone() if hasattr(p, "main_grad") else p.grad.clone() for p in mlp.parameters()]
    return out, tokens.grad, probs.grad, grads


@pytest.mark.parametrize("row_multiple", [1, 4])
@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 9, 0], [0, 0, 0, 0]])
def test_expert_loop_matches_the_module_path_bitwise(monkeypatch, gated, counts, row_multiple):
    fused_mlp = _experts(gated, main_grad=True, row_multiple=row_multiple)
    assert fused_mlp._fused_weights() is not None
    calls = []
    original = experts_mod._ExpertLoop.apply
    monkeypatch.setattr(experts_mod._ExpertLoop, "apply", lambda *a: calls.append(1) or original(*a))
    fused = _run(fused_mlp, counts)
    assert calls, "the fused loop did not run"
    module_mlp = _experts(gated, main_grad=True, row_multiple=row_multiple)
    monkeypatch.setattr(SequentialMLP, "_fused_weights", lambda self: None)
    reference = _run(module_mlp, counts)
    assert torch.equal(fused[0], reference[0])
    assert torch.equal(fused[1], reference[1])
    assert torch.equal(fused[2], reference[2])
    for a, b in zip(fused[3], reference[3], strict=True):
        assert torch.equal(a, b)


def test_expert_loop_without_probability_gradient():
    mlp = _experts(True, main_grad=True)
    out, tokens_grad, probs_grad, grads = _run(mlp, [4, 2, 0, 6], probs_need_grad=False)
    assert probs_grad is None and tokens_grad is not None and any(g.abs().sum() > 0 for g in grads)


def test_expert_loop_not_taken_without_main_grad_or_with_biases():
    assert _experts(True, main_grad=False)._fused_weights() is None
    torch.manual_seed(3)
    cfg = make_config(torch.float32, hidden=16, ffn=24, add_bias_linear=True)
    mlp = SequentialMLP(cfg, cfg.moe.num_moe_experts)
    for p in mlp.parameters():
        p.main_grad = torch.zeros_like(p)
    assert mlp._fused_weights() is None
    with torch.no_grad():
        assert _experts(True, main_grad=True)._fused_weights() is None


# ---------------------------------------------------------------------------- row padding


def test_row_padding_layout():
    rows = _RowPadding([5, 0, 8, 3], 4)
    assert rows.padded == [8, 0, 8, 4] and rows.active
    x = torch.arange(16.0).view(16, 1) + 1
    padded = rows.pad(x)
    assert padded.view(-1).tolist() == [1, 2, 3, 4, 5, 0, 0, 0] + list(range(6, 14)) + [14, 15, 16, 0]
    assert torch.equal(rows.unpad(padded), x)
    same, head = _RowPadding([4, 8], 4), x[:12]
    assert not same.active and same.pad(head) is head and same.unpad(head) is head
    assert _RowPadding([5, 3], 1).padded == [5, 3] and not _RowPadding([5, 3], 1).active


def test_row_multiple_by_device_and_dispatch():
    assert expert_row_multiple(torch.device("cuda", 0)) == experts_mod.CUDA_ROW_MULTIPLE == 128
    assert expert_row_multiple(torch.device("cpu")) == 1
    assert _experts(True, main_grad=False).row_multiple is None  # dropless: by device
    pad = _experts(True, False, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    assert pad.row_multiple == 1  # drop-and-pad: static counts, nothing to pad


class _GemmDims(TorchDispatchMode):
    """Records the dimensions of every GEMM's operands (``linear``, ``mm``, ``addmm``: forward, dgrad, wgrad)."""

    def __init__(self):
        super().__init__()
        self.dims = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in ("linear", "mm", "addmm", "addmm_"):
            self.dims += [d for t in args if isinstance(t, torch.Tensor) for d in t.shape]
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("fused", [True, False])
def test_padded_gemms_run_at_multiples_of_the_bucket(fused):
    """Every GEMM dimension is a feature size (hidden 12, ffn 20, fc1 out 40) or a padded row
    count, a multiple of 16: only 16, 32 and 48 for up to 40 rows per expert."""
    mlp = _experts(True, main_grad=fused, row_multiple=16, hidden=12, ffn=20)
    features, rows = {12, 20, 40}, set()
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        counts = torch.randint(0, 41, (4,), generator=gen).tolist()
        with _GemmDims() as rec:
            _run(mlp, counts)
        assert all(d in features or d % 16 == 0 for d in rec.dims), (counts, rec.dims)
        rows.update(d for d in rec.dims if d not in features)
    assert rows == {16, 32, 48}


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [8, 8, 1, 0], [0, 0, 0, 0], [16, 8, 8, 24]])
@pytest.mark.parametrize("main_grad", [True, False])
def test_padded_loop_matches_the_unpadded_loop(gated, counts, main_grad):
    """Same values as without padding: the zero rows add nothing. fp32 on the CPU, 1e-5 relative
    (the GEMMs differ in shape, so their blocking, not their terms, may differ)."""
    padded = _run(_experts(gated, main_grad, row_multiple=8), counts)
    plain = _run(_experts(gated, main_grad, row_multiple=1), counts)
    for a, b in zip(padded[:3], plain[:3]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(padded[3], plain[3], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_cuda_expert_gemms_are_bucketed_and_match_the_unpadded_loop():
    """bf16 on CUDA: the loop pads to multiples of 128 rows by default, and its outputs and
    gradients match the unpadded loop within bf16's rounding (different GEMM shapes, so
    different kernels: 2e-2 relative)."""
    torch.manual_seed(3)
    cfg = make_config(torch.bfloat16, hidden=64, ffn=96, gated_linear_unit=True, add_bias_linear=False)
    results = []
    for multiple in (None, 1):
        torch.manual_seed(3)
        mlp = SequentialMLP(cfg, cfg.moe.num_moe_experts, device="cuda")
        mlp.row_multiple = multiple
        for p in mlp.parameters():
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device="cuda")
        counts = [130, 0, 77, 300]
        torch.manual_seed(4)
        tokens = torch.randn(sum(counts), 64, dtype=torch.bfloat16, device="cuda", requires_grad=True)
        probs = torch.rand(sum(counts), dtype=torch.bfloat16, device="cuda", requires_grad=True)
        with _GemmDims() as rec:
            out = mlp(tokens, torch.tensor(counts, device="cuda"), probs)
            out.backward(torch.linspace(-1, 1, out.numel(), device="cuda").view_as(out).to(out.dtype))
        if multiple is None:  # feature sizes 64, 96, 192; rows 256, 128, 384
            assert set(rec.dims) == {64, 96, 192, 128, 256, 384}, rec.dims
        results.append((out, tokens.grad, probs.grad, [p.main_grad for p in mlp.parameters()]))
    (out, gx, gp, mg), (ref, rgx, rgp, rmg) = results
    for a, b in zip([out, gx, gp] + mg, [ref, rgx, rgp] + rmg):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)
