"""MLP activations against their formulas written out in float64: quick-GEGLU with GPT-OSS's offset and
clamp, and squared ReLU / quick-GEGLU in the routed experts (both expert forms) as in the dense MLP."""

import math

import pytest
import torch

from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.mlp_activation import MLPActivation
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args

TOL = dict(rtol=1e-12, atol=1e-12)  # float64, the same ops in another order


def config(moe=None, **kw):
    kw.setdefault("num_layers", 2)
    kw.setdefault("hidden_size", 16)
    kw.setdefault("ffn_hidden_size", 24)
    cfg = TransformerConfig(params_dtype=torch.float64, moe=moe or MoEConfig(), **kw).finalize()
    cfg.validate()
    return cfg


def reference(name, x, offset=0.0, clamp=None, gated=True):
    """The activation from its definition (Megatron's glu(): gate half first)."""
    funcs = {
        "quick_gelu": lambda t: t / (1.0 + torch.exp(-1.702 * t)),
        "silu": lambda t: t / (1.0 + torch.exp(-t)),
        "gelu": lambda t: 0.5 * t * (1.0 + torch.erf(t / math.sqrt(2.0))),
        "squared_relu": lambda t: torch.where(t > 0, t, torch.zeros_like(t)) ** 2,
    }
    if not gated:
        return funcs[name](x)
    f = x.shape[-1] // 2
    gate, linear = x[..., :f], x[..., f:]
    if clamp is not None:
        gate = torch.minimum(gate, torch.full_like(gate, clamp))
        linear = torch.maximum(torch.minimum(linear, torch.full_like(linear, clamp)), torch.full_like(linear, -clamp))
    return funcs[name](gate) * (linear + offset)


def test_quick_geglu_with_offset_and_clamp_matches_formula():
    act = MLPActivation.from_config(config(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0))
    assert (act.name, act.gated, act.linear_offset, act.clamp) == ("quick_gelu", True, 1.0, 7.0)
    torch.manual_seed(0)
    x = torch.randn(5, 3, 48, dtype=torch.float64) * 6.0  # many values beyond the clamp
    assert (x.abs() > 7.0).any()
    torch.testing.assert_close(act(x), reference("quick_gelu", x, 1.0, 7.0), **TOL)


def test_quick_geglu_gradient_matches_formula_gradient():
    act = MLPActivation.from_config(config(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=2.0))
    torch.manual_seed(1)
    x = (torch.randn(4, 48, dtype=torch.float64) * 3.0).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    g = torch.randn(4, 24, dtype=torch.float64)
    (act(x) * g).sum().backward()
    (reference("quick_gelu", x_ref, 1.0, 2.0) * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)


def test_mlp_with_quick_geglu_has_a_gated_fc1_and_matches_formula():
    cfg = config(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=7.0)
    assert cfg.gated_linear_unit  # finalize: --quick-geglu makes fc1 hold both halves, as Megatron's config
    torch.manual_seed(0)
    mlp = MLP(cfg, device="cpu")
    assert mlp.linear_fc1.weight.shape == (48, 16)
    x = torch.randn(5, 2, 16, dtype=torch.float64) * 4.0
    out, _ = mlp(x)
    h = x @ mlp.linear_fc1.weight.t() + mlp.linear_fc1.bias
    want = reference("quick_gelu", h, 1.0, 7.0) @ mlp.linear_fc2.weight.t() + mlp.linear_fc2.bias
    torch.testing.assert_close(out, want, **TOL)


@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize(
    "flags, name, gated",
    [
        (dict(squared_relu=True), "squared_relu", False),
        (dict(quick_geglu=True, glu_linear_offset=1.0, activation_func_clamp_value=0.5), "quick_gelu", True),
        (dict(gated_linear_unit=True), "silu", True),
    ],
)
def test_routed_experts_use_the_configured_activation(flags, name, gated, grouped):
    # The experts used to run GeLU (or SwiGLU) whatever --squared-relu said; now the one activation of the config.
    moe = MoEConfig(num_moe_experts=2, moe_ffn_hidden_size=8, moe_grouped_gemm=grouped)
    cfg = config(moe, add_bias_linear=False, **flags)
    torch.manual_seed(0)
    experts = (GroupedMLP if grouped else SequentialMLP)(cfg, 2, device="cpu")
    for p in experts.parameters():  # as under DDP: the fused expert loop would apply to plain GeLU / SwiGLU
        p.main_grad = torch.zeros_like(p)
    tokens = torch.randn(7, 16, dtype=torch.float64)
    probs = torch.rand(7, dtype=torch.float64)
    counts = [3, 4]
    out = experts(tokens, counts, probs)
    want = []
    for i, (x, p) in enumerate(zip(tokens.split(counts), probs.split(counts))):
        if grouped:
            w1, w2 = experts.linear_fc1.weight[i], experts.linear_fc2.weight[i]
        else:
            w1, w2 = experts.local_experts[i].linear_fc1.weight, experts.local_experts[i].linear_fc2.weight
        h = x @ w1.t()
        assert h.shape[-1] == (16 if gated else 8)
        act = reference(name, h, cfg.glu_linear_offset, cfg.activation_func_clamp_value, gated)
        want.append((act * p.unsqueeze(-1)) @ w2.t())
    torch.testing.assert_close(out, torch.cat(want), **TOL)


def _model_cfg(*flags):
    base = "--num-layers 2 --hidden-size 16 --num-attention-heads 4 --mock-data --vocab-size 64".split()
    cfg = parse_args(base + list(flags)).resolve()
    cfg.validate()
    return cfg.model


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--swiglu", "--quick-geglu"], "--quick-geglu and --swiglu each set the MLP activation"),
        (["--squared-relu", "--quick-geglu"], "--quick-geglu and --squared-relu each set"),
        (["--swiglu", "--activation-func-clamp-value", "7"], "with --swiglu is only supported in MoE models"),
        (["--quick-geglu", "--activation-func-clamp-value", "-1"], "must be finite and > 0"),
    ],
)
def test_activation_flag_mistakes_name_the_flags(flags, match):
    with pytest.raises(ValueError, match=match):
        _model_cfg(*flags)


def test_gelu_ignores_glu_offset_with_a_warning_as_megatron():
    with pytest.warns(UserWarning, match="apply to gated activations"):
        model = _model_cfg("--glu-linear-offset", "1.0")
    act = MLPActivation.from_config(model)
    assert (act.name, act.gated, act.linear_offset) == ("gelu", False, 0.0)
