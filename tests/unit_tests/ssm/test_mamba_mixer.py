"""MambaMixer: Megatron's parameter names, shapes and init; the whole mixer against a step-by-step reference."""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.ssm.mamba_mixer import GatedGroupRMSNorm, MambaMixer
from megatron.core.ssm.ssd import ssd_sequential_scan
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.ssm.sequence_mixer_checks import assert_causal_and_every_parameter_learns

HIDDEN = 32


def make_mixer(seed=0, dtype=torch.float32, chunk_size=8, **mamba):
    cfg = TransformerConfig(hidden_size=HIDDEN, num_attention_heads=4, num_layers=2).finalize()
    cfg.params_dtype = dtype
    mc = MambaConfig(**{"mamba_state_dim": 8, "mamba_head_dim": 8, "mamba_num_groups": 2, **mamba})
    torch.manual_seed(seed)
    return MambaMixer(cfg, mc, chunk_size=chunk_size, device="cpu")


def test_parameter_names_shapes_and_dtypes():
    m = make_mixer(dtype=torch.bfloat16)
    heads, p, g, n = 8, 8, 2, 8  # 2 * 32 / 8 heads
    d_inner = heads * p
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in m.named_parameters()}
    bf16 = torch.bfloat16
    assert shapes == {
        "in_proj.weight": ((2 * d_inner + 2 * g * n + heads, HIDDEN), bf16),
        "conv1d.weight": ((d_inner + 2 * g * n, 1, 4), bf16),
        "conv1d.bias": ((d_inner + 2 * g * n,), bf16),
        "dt_bias": ((heads,), bf16),
        "A_log": ((heads,), bf16),  # Megatron's Float16Module casts them too (none is marked keep_in_fp32)
        "D": ((heads,), bf16),
        "norm.weight": ((d_inner,), bf16),
        "out_proj.weight": ((HIDDEN, d_inner), bf16),
    }
    assert m.in_proj.weight.partition_sizes == [d_inner, d_inner, g * n, g * n, heads]
    assert make_mixer(mamba_num_heads=4).in_proj.weight.shape[0] == 2 * 32 + 2 * g * n + 4


def test_initialisation_follows_megatron():
    m = make_mixer()
    dt = F.softplus(m.dt_bias)
    assert dt.min() >= 1e-3 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)
    A = torch.exp(m.A_log)
    assert A.min() >= 1.0 and A.max() <= 16.0
    assert torch.equal(m.D, torch.ones_like(m.D)) and torch.equal(m.norm.weight, torch.ones_like(m.norm.weight))
    bound = 1 / math.sqrt(4)  # kaiming-uniform(a=sqrt(5)) of a [c, 1, 4] filter and its bias
    assert m.conv1d.weight.abs().max() <= bound and m.conv1d.bias.abs().max() <= bound
    assert abs(m.in_proj.weight.std().item() - 0.02) < 0.002
    assert abs(m.out_proj.weight.std().item() - 0.02 / math.sqrt(2 * 2)) < 0.002


def reference_mixer(m, hidden):
    """The mixer written out: in_proj, conv, sequential recurrence, gate, grouped RMSNorm, out_proj."""
    s, b, _ = hidden.shape
    heads, p, g, n = m.nheads, m.headdim, m.ngroups, m.d_state
    d_inner = heads * p
    zxbcdt = (hidden @ m.in_proj.weight.t()).transpose(0, 1)  # [b, s, .]
    z, xbc, dt = zxbcdt.split([d_inner, d_inner + 2 * g * n, heads], dim=-1)
    conv = F.conv1d(xbc.transpose(1, 2), m.conv1d.weight, m.conv1d.bias, padding=3, groups=xbc.shape[-1])
    xbc = F.silu(conv[..., :s]).transpose(1, 2)
    x, B, C = xbc.split([d_inner, g * n, g * n], dim=-1)
    dt = F.softplus(dt + m.dt_bias)
    y = ssd_sequential_scan(
        x.reshape(b, s, heads, p), dt, -torch.exp(m.A_log), B.reshape(b, s, g, n), C.reshape(b, s, g, n), D=m.D
    ).reshape(b, s, d_inner)
    y = (y * F.silu(z)).reshape(b, s, g, d_inner // g)
    y = (y / torch.sqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).reshape(b, s, d_inner) * m.norm.weight
    return y.transpose(0, 1) @ m.out_proj.weight.t()


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_mixer_equals_the_step_by_step_reference(chunk_size):
    m = make_mixer(chunk_size=chunk_size).double()
    with torch.no_grad():  # non-trivial D and norm weight
        m.D.uniform_(0.5, 1.5)
        m.norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(19, 2, HIDDEN, dtype=torch.float64)
    out, bias = m(hidden)
    assert bias is None and out.shape == hidden.shape
    ref = reference_mixer(m, hidden)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-10


def test_mixer_is_causal_and_backward_reaches_every_parameter():
    assert_causal_and_every_parameter_learns(make_mixer(), HIDDEN)


def test_bf16_mixer_runs():
    m = make_mixer(dtype=torch.bfloat16)
    out, _ = m(torch.randn(10, 2, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_mixer_rejects_sizes_that_do_not_divide():
    with pytest.raises(ValueError, match="--mamba-num-groups"):
        make_mixer(mamba_num_groups=3)
    with pytest.raises(ValueError, match="--mamba-head-dim"):
        make_mixer(mamba_head_dim=7)


def plain_gated_norm(x, z, weight, group_size, eps=1e-5):
    """``norm(x * silu(z)) * weight`` per group, for autograd (in x's dtype)."""
    u = x if z is None else x * F.silu(z)
    grouped = u.unflatten(-1, (-1, group_size))
    normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + eps)
    return normed.flatten(-2) * weight


@pytest.mark.parametrize("gated", [True, False])
def test_gated_group_norm_backward_equals_autograd(gated):
    gen = torch.Generator().manual_seed(3)
    x, z = (torch.randn(3, 5, 24, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    weight = (1 + 0.1 * torch.randn(24, generator=gen, dtype=torch.float64)).requires_grad_()
    z_or_none = z if gated else None
    cotangent = torch.randn(3, 5, 24, generator=gen, dtype=torch.float64)
    out = GatedGroupRMSNorm.apply(x, z_or_none, weight, 8, 1e-5)
    ref = plain_gated_norm(x, z_or_none, weight, 8)
    leaves = [x, weight] + ([z] if gated else [])
    grads = torch.autograd.grad(out, leaves, cotangent)
    ref_grads = torch.autograd.grad(ref, leaves, cotangent)
    assert torch.allclose(out, ref, rtol=1e-12, atol=0)
    for name, g, r in zip(["x", "weight", "z"], grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12), name


def test_gated_group_norm_in_bf16_keeps_its_inputs_and_one_scale_per_group():
    gen = torch.Generator().manual_seed(4)
    x, z = (torch.randn(2, 7, 64, generator=gen).bfloat16().requires_grad_() for _ in range(2))
    weight = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    kept = {}

    def pack(t):
        kept[t.untyped_storage().data_ptr()] = (t.dtype, t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = GatedGroupRMSNorm.apply(x, z, weight, 16, 1e-5)
    assert out.dtype == torch.bfloat16
    assert sorted(kept.values(), key=str) == sorted(
        [(torch.bfloat16, x.numel()), (torch.bfloat16, z.numel()), (torch.bfloat16, 64), (torch.float32, 2 * 7 * 4)],
        key=str,
    )
    # Against float64 autograd of the same formula, from the same bf16 values.
    wide = [t.detach().double().requires_grad_() for t in (x, z, weight)]
    ref = plain_gated_norm(wide[0], wide[1], wide[2], 16)
    cotangent = torch.randn(2, 7, 64, generator=gen)
    grads = torch.autograd.grad(out, (x, z, weight), cotangent.bfloat16())
    ref_grads = torch.autograd.grad(ref, wide, cotangent.bfloat16().double())
    assert (out.double() - ref).abs().max() < 2e-2
    for name, g, r in zip(["x", "z", "weight"], grads, ref_grads):
        assert ((g.double() - r).norm() / r.norm()).item() < 1e-2, name
