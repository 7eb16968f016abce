"""GatedDeltaNet: Megatron's parameter names, shapes and init; the layer against a written-out reference.

The reference (float64) spells out every step with other ops than the module: the fused
in-projection split by hand, ``F.conv1d`` for the causal conv, explicit L2 and RMS norms,
the key head of each value head picked by index, and the step-by-step gated delta rule.
The module must match it within 1e-10 relative for several chunk sizes and a sequence
length that no chunk size divides.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig
from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.gated_delta_net.gated_delta_rule import sequential_gated_delta_rule
from megatron.core.tensor_parallel.layers import section_shard
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.unit_tests.ssm.sequence_mixer_checks import assert_causal_and_every_parameter_learns

HIDDEN = 32


def make_config(dtype=torch.float32, num_layers=2, model=None, **linear):
    la = LinearAttentionConfig(
        **{
            "experimental_attention_variant": "gdn",
            "linear_attention_freq": "1",
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 6,
            "linear_num_key_heads": 2,
            "linear_num_value_heads": 4,
            **linear,
        }
    )
    model = {"normalization": "RMSNorm", "gated_linear_unit": True, **(model or {})}
    cfg = TransformerConfig(
        hidden_size=HIDDEN, num_attention_heads=4, num_layers=num_layers, linear_attention=la, **model
    )
    cfg.finalize()
    cfg.params_dtype = dtype
    return cfg


def make_gdn(seed=0, dtype=torch.float32, chunk_size=8, model=None, **linear):
    cfg = make_config(dtype=dtype, model=model, **linear)
    torch.manual_seed(seed)
    return GatedDeltaNet(cfg, chunk_size=chunk_size, device="cpu")


def test_parameter_names_shapes_and_dtypes():
    m = make_gdn(dtype=torch.bfloat16)
    kh, kd, vh, vd = 2, 8, 4, 6
    qk, v = kh * kd, vh * vd
    bf16 = torch.bfloat16
    shapes = {name: (tuple(t.shape), t.dtype) for name, t in m.named_parameters()}
    assert shapes == {
        "in_proj.weight": ((2 * qk + 2 * v + 2 * vh, HIDDEN), bf16),
        "conv1d.weight": ((2 * qk + v, 1, 4), bf16),
        "dt_bias": ((vh,), bf16),
        "A_log": ((vh,), bf16),
        "out_norm.weight": ((vd,), bf16),
        "out_proj.weight": ((HIDDEN, v), bf16),
    }
    assert m.in_proj.weight.partition_sizes == [qk, qk, v, v, vh, vh]
    assert m.conv1d.weight.partition_sizes == [qk, qk, v]
    for name in ("conv1d.weight", "dt_bias", "A_log"):
        p = m.get_parameter(name)
        assert p.tensor_model_parallel and p.partition_dim == 0, name
    assert make_gdn(linear_conv_kernel_dim=2).conv1d.weight.shape == (2 * qk + v, 1, 2)


def test_initialisation_follows_megatron():
    m = make_gdn()
    assert torch.equal(m.dt_bias, torch.ones_like(m.dt_bias))
    A = torch.exp(m.A_log)
    assert A.min() >= 1.0 * (1 - 1e-6) and A.max() <= 16.0 * (1 + 1e-6)
    assert torch.equal(m.out_norm.weight, torch.ones_like(m.out_norm.weight))
    bound = 1 / math.sqrt(4)  # kaiming-uniform(a=sqrt(5)) of a [c, 1, 4] filter, as nn.Conv1d
    assert m.conv1d.weight.abs().max() <= bound and m.conv1d.weight.abs().max() > 0.8 * bound
    assert abs(m.in_proj.weight.std().item() - 0.02) < 0.002
    assert abs(m.out_proj.weight.std().item() - 0.02 / math.sqrt(2 * 2)) < 0.003
    conv = GatedDeltaNet(make_config(), conv_init=0.1, device="cpu").conv1d.weight
    assert conv.abs().max() <= 0.1


def reference_gdn(m, hidden, activation=F.silu):
    """The layer written out (see the module docstring)."""
    s, b, _ = hidden.shape
    kh, kd, vh, vd = m.num_key_heads, m.key_head_dim, m.num_value_heads, m.value_head_dim
    qk, v_width = kh * kd, vh * vd
    x = (hidden @ m.in_proj.weight.t()).transpose(0, 1)  # [b, s, .]
    q, k, v, z = (
        x[..., :qk],
        x[..., qk : 2 * qk],
        x[..., 2 * qk : 2 * qk + v_width],
        x[..., 2 * qk + v_width :][..., :v_width],
    )
    beta, alpha = x[..., 2 * qk + 2 * v_width : 2 * qk + 2 * v_width + vh], x[..., 2 * qk + 2 * v_width + vh :]
    qkv = torch.cat([q, k, v], dim=-1).transpose(1, 2)  # [b, channels, s]
    taps = m.conv1d.weight.shape[-1]
    conv = F.conv1d(qkv, m.conv1d.weight, padding=taps - 1, groups=qkv.shape[1])[..., :s]
    q, k, v = activation(conv).transpose(1, 2).split([qk, qk, v_width], dim=-1)
    q, k, v = q.reshape(b, s, kh, kd), k.reshape(b, s, kh, kd), v.reshape(b, s, vh, vd)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    key_of = torch.arange(vh) // (vh // kh)  # value head j reads key head j // (vh / kh)
    q, k = q[:, :, key_of], k[:, :, key_of]
    g = -torch.exp(m.A_log) * torch.log1p(torch.exp(alpha + m.dt_bias))
    o, _ = sequential_gated_delta_rule(q, k, v, g, torch.sigmoid(beta))  # [b, s, vh, vd]
    o = o / torch.sqrt(o.pow(2).mean(-1, keepdim=True) + 1e-5) * m.out_norm.weight
    o = o * activation(z.reshape(b, s, vh, vd))
    return o.reshape(b, s, v_width).transpose(0, 1) @ m.out_proj.weight.t()


def _perturbed(m):
    """Non-trivial values where the init is constant (dt_bias, the norm weight)."""
    with torch.no_grad():
        m.dt_bias.uniform_(-1.0, 1.0)
        m.out_norm.weight.uniform_(0.5, 1.5)
    return m


@pytest.mark.parametrize("chunk_size", [4, 7, 64])
@pytest.mark.parametrize("value_heads", [2, 4])
def test_layer_equals_the_written_out_reference(chunk_size, value_heads):
    m = _perturbed(make_gdn(chunk_size=chunk_size, linear_num_value_heads=value_heads).double())
    hidden = torch.randn(19, 2, HIDDEN, dtype=torch.float64)
    out, bias = m(hidden)
    assert bias is None and out.shape == hidden.shape
    ref = reference_gdn(m, hidden)
    assert ((out - ref).norm() / ref.norm()).item() < 1e-10


def test_the_model_activation_is_the_conv_activation_and_the_gate():
    m = _perturbed(make_gdn(model={"gated_linear_unit": False}).double())  # GeLU model
    hidden = torch.randn(11, 1, HIDDEN, dtype=torch.float64)
    ref = reference_gdn(m, hidden, activation=F.gelu)
    assert ((m(hidden)[0] - ref).norm() / ref.norm()).item() < 1e-10


def test_layer_is_causal_and_backward_reaches_every_parameter():
    assert_causal_and_every_parameter_learns(make_gdn(), HIDDEN)


def test_bf16_layer_runs():
    m = make_gdn(dtype=torch.bfloat16)
    out, _ = m(torch.randn(10, 2, HIDDEN, dtype=torch.bfloat16))
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()


def test_layer_rejects_head_counts_that_do_not_divide():
    with pytest.raises(ValueError, match="--linear-num-value-heads .* --linear-num-key-heads"):
        make_gdn(linear_num_key_heads=3, linear_num_value_heads=4)


def test_section_shard_takes_each_sections_slice():
    full = torch.arange(12)  # sections of 4, 6 and 2 rows at TP = 2
    assert section_shard(full, [2, 3, 1], 2, 0).tolist() == [0, 1, 4, 5, 6, 10]
    assert section_shard(full, [2, 3, 1], 2, 1).tolist() == [2, 3, 7, 8, 9, 11]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_layer_on_cuda_matches_the_cpu():
    """The PyTorch path on CUDA (fp32, TF32 off) against the CPU: the output within 1e-5 relative, the
    gradients within 5e-5. ``dt_bias``'s gradient is a sum over every token and head channel whose
    terms cancel to about 1e-5 of their size, so the two devices' summation orders show at 1.3e-5
    (H200, 2026-12-04); the other gradients stayed under 1e-5 there."""
    cpu = _perturbed(make_gdn(chunk_size=16))
    gpu = _perturbed(make_gdn(chunk_size=16))
    gpu.load_state_dict(cpu.state_dict())
    gpu = gpu.cuda()
    gpu.use_fused_kernels = False
    hidden = torch.randn(70, 2, HIDDEN)
    matmul_tf32, cudnn_tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        want = cpu(hidden)[0]
        got = gpu(hidden.cuda())[0]
        want.square().sum().backward()
        got.square().sum().backward()
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul_tf32, cudnn_tf32
    assert ((got.cpu() - want).norm() / want.norm()).item() < 1e-5
    for (name, p), q in zip(cpu.named_parameters(), gpu.parameters()):
        assert ((q.grad.cpu() - p.grad).norm() / p.grad.norm()).item() < 5e-5, name
