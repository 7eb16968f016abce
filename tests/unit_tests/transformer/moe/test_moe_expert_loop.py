"""The experts' one-node loop (``_ExpertLoop``) against the module path it replaces, bit for bit."""

import pytest
import torch

from megatron.core.transformer.moe import experts as experts_mod
from megatron.core.transformer.moe.experts import SequentialMLP
from tests.unit_tests.transformer.moe.moe_helpers import make_config


def _experts(gated: bool, main_grad: bool) -> SequentialMLP:
    torch.manual_seed(3)
    cfg = make_config(torch.float32, hidden=16, ffn=24, gated_linear_unit=gated, add_bias_linear=False)
    mlp = SequentialMLP(cfg, cfg.moe.num_moe_experts)
    if main_grad:
        for p in mlp.parameters():
            p.main_grad = torch.zeros_like(p)
    return mlp


def _run(mlp, counts, probs_need_grad=True):
    torch.manual_seed(4)
    tokens = torch.randn(sum(counts), 16, requires_grad=True)
    probs = torch.rand(sum(counts), requires_grad=probs_need_grad)
    out = mlp(tokens, counts, probs)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [p.main_grad.clone() for p in mlp.parameters()]
    return out, tokens.grad, probs.grad, grads


@pytest.mark.parametrize("gated", [True, False])
@pytest.mark.parametrize("counts", [[5, 0, 7, 3], [0, 0, 9, 0], [0, 0, 0, 0]])
def test_expert_loop_matches_the_module_path_bitwise(monkeypatch, gated, counts):
    fused_mlp = _experts(gated, main_grad=True)
    assert fused_mlp._fused_weights() is not None
    calls = []
    original = experts_mod._ExpertLoop.apply
    monkeypatch.setattr(experts_mod._ExpertLoop, "apply", lambda *a: calls.append(1) or original(*a))
    fused = _run(fused_mlp, counts)
    assert calls, "the fused loop did not run"
    module_mlp = _experts(gated, main_grad=True)
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
