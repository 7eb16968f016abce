"""GatedDeltaNet2: Megatron's parameter names, shapes and init; the layer against a written-out reference.

The reference (float64) spells out every step with other ops than the module: the fused
in-projection split by hand into ``q, k, v, z, f, b, w``, ``F.conv1d`` for the causal
conv, explicit L2 and RMS norms, the key head of each value head picked by index, the
per-channel decay ``-exp(A_log[head]) * softplus(f + dt_bias)`` and the step-by-step GDN2
recurrence. The module must match it within 1e-10 relative (float64).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_delta_net.gdn2 import DT_MAX, DT_MIN, GatedDeltaNet2
from megatron.core.ssm.gated_delta_net.gdn2_rule import recurrent_gdn2
from tests.unit_tests.ssm.sequence_mixer_checks import assert_causal_and_every_parameter_learns
from tests.unit_tests.ssm.test_gated_delta_net import HIDDEN, make_config

KH, KD, VH, VD = 2, 8, 4, 6  # test_gated_delta_net's sizes


def make_gdn2(seed=0, dtype=torch.float32, chunk_size=8, **linear):
    cfg = make_config(dtype=dtype, experimental_attention_variant="gdn2", **linear)
    torch.manual_seed(seed)
    return GatedDeltaNet2(cfg, chunk_size=chunk_size, device="cpu")


def test_parameter_names_shapes_and_dtypes():
    m = make_gdn2(dtype=torch.bfloat16)
    qk, v = KH * KD, VH * VD
    bf16 = torch.bfloat16
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in m.named_parameters()}
    assert shapes == {
        "in_proj.weight": ((4 * qk + 3 * v, HIDDEN), bf16),  # q, k, v, z, f, b, w
        "conv1d.weight": ((2 * qk + v, 1, 4), bf16),
        "dt_bias": ((qk,), bf16),  # one per key channel
        "A_log": ((KH,), bf16),  # one per key head
        "out_norm.weight": ((VD,), bf16),
        "out_proj.weight": ((HIDDEN, v), bf16),
    }
    assert m.in_proj.weight.partition_sizes == [qk, qk, v, v, qk, qk, v]
    for p in (m.conv1d.weight, m.dt_bias, m.A_log):
        assert p.tensor_model_parallel and p.partition_dim == 0


def test_initialisation_follows_megatron():
    m = make_gdn2()
    dt = F.softplus(m.dt_bias.double())  # dt_bias = softplus^-1(dt), dt log-uniform in [1e-3, 0.1]
    assert dt.min() >= DT_MIN * (1 - 1e-5) and dt.max() <= DT_MAX * (1 + 1e-5)
    assert dt.log().std() > 0.3 * (math.log(DT_MAX) - math.log(DT_MIN)) / math.sqrt(12)
    A = torch.exp(m.A_log)
    assert A.min() >= 1.0 * (1 - 1e-6) and A.max() <= 16.0 * (1 + 1e-6)
    assert abs(m.in_proj.weight.std().item() - 0.02) < 0.002
    # Draw order (one process): in_proj, conv (kaiming-uniform), dt, A, as Megatron's reset_parameters.
    qk, v = KH * KD, VH * VD
    torch.manual_seed(0)
    in_proj = torch.empty(4 * qk + 3 * v, HIDDEN).normal_(0.0, 0.02)
    conv = torch.empty(2 * qk + v, 1, 4)
    torch.nn.init.kaiming_uniform_(conv, a=math.sqrt(5))
    u = torch.rand(qk)
    a = torch.empty(KH).uniform_(1.0, 16.0)
    dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=1e-4)
    assert torch.equal(m.in_proj.weight, in_proj) and torch.equal(m.conv1d.weight, conv)
    assert torch.allclose(m.dt_bias, dt + torch.log(-torch.expm1(-dt)), rtol=1e-6, atol=0)
    assert torch.equal(m.A_log, torch.log(a))


def reference_gdn2(m, hidden, activation=F.silu):
    """The layer written out (see the module docstring)."""
    s, b, _ = hidden.shape
    qk, v_width = KH * KD, VH * VD
    x = (hidden @ m.in_proj.weight.t()).transpose(0, 1)  # [b, s, .]
    q, k, v, z, f, erase, write = x.split([qk, qk, v_width, v_width, qk, qk, v_width], dim=-1)
    qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [b, channels, s]
    taps = m.conv1d.weight.shape[-1]
    conv = F.conv1d(qkv, m.conv1d.weight, padding=taps - 1, groups=qkv.shape[1])[..., :s]
    q, k, v = activation(conv).transpose(1, 2).split([qk, qk, v_width], dim=-1)
    q, k, v = q.reshape(b, s, KH, KD), k.reshape(b, s, KH, KD), v.reshape(b, s, VH, VD)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    head_of_channel = torch.arange(qk) // KD
    g = -torch.exp(m.A_log)[head_of_channel] * torch.log1p(torch.exp(f + m.dt_bias))
    g, erase = g.reshape(b, s, KH, KD), torch.sigmoid(erase).reshape(b, s, KH, KD)
    key_of = torch.arange(VH) // (VH // KH)  # value head j reads key head j // (vh / kh)
    q, k, g, erase = q[:, :, key_of], k[:, :, key_of], g[:, :, key_of], erase[:, :, key_of]
    o, _ = recurrent_gdn2(q, k, v, g, erase, torch.sigmoid(write).reshape(b, s, VH, VD))
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.out_norm.weight
    o = o * activation(z.reshape(b, s, VH, VD))
    return o.reshape(b, s, v_width).transpose(0, 1) @ m.out_proj.weight.t()


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
def test_layer_equals_the_written_out_reference(chunk_size):
    m = make_gdn2(chunk_size=chunk_size).double()
    with torch.no_grad():
        m.out_norm.weight.uniform_(0.5, 1.5)
    hidden = torch.randn(19, 2, HIDDEN, dtype=torch.float64)
    out, bias = m(hidden)
    want = reference_gdn2(m, hidden)
    assert bias is None and out.shape == (19, 2, HIDDEN)
    assert ((out - want).norm() / want.norm()).item() < 1e-10


def test_layer_is_causal_and_backward_reaches_every_parameter():
    assert_causal_and_every_parameter_learns(make_gdn2(), HIDDEN)


def test_bf16_layer_runs():
    m = make_gdn2(dtype=torch.bfloat16)
    out, _ = m(torch.randn(10, 2, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_a_gpt_with_gdn2_builds_gdn2_layers_where_linear_attention_freq_says():
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
    from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet
    from megatron.core.transformer.attention import SelfAttention

    cfg = make_config(num_layers=4, experimental_attention_variant="gdn2", linear_attention_freq="2")
    attention = [spec.submodules.self_attention for spec in get_gpt_decoder_layer_specs(cfg)]
    assert attention == [GatedDeltaNet2, SelfAttention] * 2
    cfg = make_config(num_layers=4, linear_attention_freq="2")
    assert [spec.submodules.self_attention for spec in get_gpt_decoder_layer_specs(cfg)][0] is GatedDeltaNet


def test_gdn2_flops_count_its_wider_in_projection():
    from megatron.training.logging_utils import num_floating_point_operations

    gdn = make_config(num_layers=2, linear_attention_freq="2")
    gdn2 = make_config(num_layers=2, experimental_attention_variant="gdn2", linear_attention_freq="2")
    qk, v = KH * KD, VH * VD
    extra = 2 * HIDDEN * ((4 * qk + 3 * v) - (2 * qk + 2 * v + 2 * VH))  # per token, one GDN layer
    kwargs = dict(batch_size=2, seq_length=16, vocab_size=64)
    diff = num_floating_point_operations(gdn2, **kwargs) - num_floating_point_operations(gdn, **kwargs)
    assert diff == 3 * 2 * 16 * extra
