"""MLP against the GeLU / SwiGLU formulas written out."""

import math

import pytest
import torch

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.transformer_config import TransformerConfig


def make(swiglu, bias=True):
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=16,
        ffn_hidden_size=24,
        gated_linear_unit=swiglu,
        add_bias_linear=bias,
        params_dtype=torch.float64,
    ).finalize()
    torch.manual_seed(0)
    mlp = MLP(cfg, device="cpu")
    with torch.no_grad():
        for p in mlp.parameters():
            if p.dim() == 1:
                p.normal_()
    return cfg, mlp


def test_gelu_formula():
    cfg, mlp = make(swiglu=False)
    assert mlp.linear_fc1.weight.shape == (24, 16)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    out, bias = mlp(x)
    h = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    h = 0.5 * h * (1.0 + torch.erf(h / math.sqrt(2.0)))  # exact GeLU
    torch.testing.assert_close(out, h @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias, rtol=1e-12, atol=1e-12)
    assert bias is None  # added inside fc2's GEMM


def test_swiglu_formula_gate_first():
    cfg, mlp = make(swiglu=True)
    assert mlp.linear_fc1.weight.shape == (48, 16)
    x = torch.randn(5, 2, 16, dtype=torch.float64)
    out, _ = mlp(x)
    w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
    gate = x @ w1[:24].t() + b1[:24]
    up = x @ w1[24:].t() + b1[24:]
    h = gate * torch.sigmoid(gate) * up
    torch.testing.assert_close(out, h @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("swiglu", [False, True])
def test_no_bias(swiglu):
    _, mlp = make(swiglu, bias=False)
    assert all(p.dim() == 2 for p in mlp.parameters())
    assert mlp(torch.randn(3, 1, 16, dtype=torch.float64))[1] is None


def test_fc2_uses_scaled_init():
    cfg = TransformerConfig(num_layers=8, hidden_size=256, ffn_hidden_size=1024, init_method_std=0.02).finalize()
    torch.manual_seed(0)
    mlp = MLP(cfg, device="cpu")
    assert abs(mlp.linear_fc1.weight.std().item() - 0.02) < 1e-3
    assert abs(mlp.linear_fc2.weight.std().item() - 0.02 / 4.0) < 3e-4
