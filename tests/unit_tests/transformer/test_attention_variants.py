"""Sliding-window attention and softmax sinks (GPT-OSS's attention) against float64 loops written out:
p_ij = exp(s_ij) / (exp(sink_h) + sum_{j in window} exp(s_ij))."""

import math

import pytest
import torch

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.attention_variants import SoftmaxOffset
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.arguments import parse_args

TOL = dict(rtol=1e-10, atol=1e-10)  # float64: the same sums in another order


def make(layer_number=1, heads=4, groups=None, **kw):
    cfg = TransformerConfig(
        num_layers=4,
        hidden_size=32,
        num_attention_heads=heads,
        group_query_attention=groups is not None,
        num_query_groups=groups,
        attention_dropout=0.0,
        params_dtype=torch.float64,
        **kw,
    ).finalize()
    cfg.validate()
    torch.manual_seed(0)
    attn = SelfAttention(cfg, layer_number=layer_number, device="cpu")
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 1 and "softmax_offset" not in name:
                p.normal_(std=0.1)
    return cfg, attn


def reference(attn, cfg, x, *, left=None, sink=None):
    """Head by head, query by query: keys j with i - left <= j <= i (all j <= i when left is None)."""
    s, b, _ = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hpg = n // g
    qkv = (x @ attn.linear_qkv.weight.t() + attn.linear_qkv.bias).view(s, b, g, hpg + 2, d)
    out = torch.zeros(s, b, n, d, dtype=torch.float64)
    for h in range(n):
        grp, j = divmod(h, hpg)
        q, k, v = qkv[:, :, grp, j], qkv[:, :, grp, hpg], qkv[:, :, grp, hpg + 1]
        for bi in range(b):
            for i in range(s):
                keys = [t for t in range(i + 1) if left is None or t >= i - left]
                logits = torch.stack([q[i, bi] @ k[t, bi] / math.sqrt(d) for t in keys])
                weights = torch.exp(logits)
                denominator = weights.sum() + (torch.exp(sink[h]) if sink is not None else 0.0)
                out[i, bi, h] = sum(w * v[t, bi] for w, t in zip(weights / denominator, keys))
    return out.reshape(s, b, n * d) @ attn.linear_proj.weight.t() + attn.linear_proj.bias


@pytest.mark.parametrize("groups", [None, 2])
def test_sliding_window_matches_reference(groups):
    cfg, attn = make(groups=groups, window_size="2,0")
    assert attn.window_left == 2
    x = torch.randn(7, 2, 32, dtype=torch.float64)
    out, _ = attn(x)
    torch.testing.assert_close(out, reference(attn, cfg, x, left=2), **TOL)
    _, full = make(groups=groups)
    assert not torch.allclose(out, full(x)[0])  # the window changes rows past its width


@pytest.mark.parametrize("window", [None, "3,0"])
@pytest.mark.parametrize("groups", [None, 1])
def test_learnable_sink_matches_reference_forward_and_backward(window, groups):
    cfg, attn = make(groups=groups, softmax_type="learnable", window_size=window)
    sink = attn.core_attention.softmax_offset
    assert sink.shape == (4,) and sink.tensor_model_parallel and sink.partition_dim == 0
    x = torch.randn(6, 2, 32, dtype=torch.float64, requires_grad=True)
    out, _ = attn(x)
    x_ref = x.detach().clone().requires_grad_()
    sink_ref = sink.detach().clone().requires_grad_()
    want = reference(attn, cfg, x_ref, left=None if window is None else 3, sink=sink_ref)
    torch.testing.assert_close(out, want, **TOL)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, **TOL)
    torch.testing.assert_close(sink.grad, sink_ref.grad, **TOL)


def test_off_by_one_is_a_zero_sink_and_has_no_parameter():
    cfg, attn = make(softmax_type="off-by-one")
    assert not any("softmax_offset" in n for n, _ in attn.named_parameters())
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    torch.testing.assert_close(attn(x)[0], reference(attn, cfg, x, sink=torch.zeros(4, dtype=torch.float64)), **TOL)


def test_learnable_sink_is_megatrons_parameter_and_layout_independent():
    _, attn = make(softmax_type="learnable")
    names = [n for n, _ in attn.named_parameters()]
    assert "core_attention.softmax_offset" in names  # Megatron: self_attention.core_attention.softmax_offset
    torch.manual_seed(5)
    full = SoftmaxOffset(8, std=0.02, tp_size=1, tp_rank=0, device="cpu", dtype=torch.float32).softmax_offset
    for rank in range(2):
        torch.manual_seed(5)
        part = SoftmaxOffset(8, std=0.02, tp_size=2, tp_rank=rank, device="cpu", dtype=torch.float32)
        torch.testing.assert_close(part.softmax_offset, full[4 * rank : 4 * rank + 4], rtol=0, atol=0)
    assert 0.005 < full.std().item() < 0.05  # drawn from N(0, --init-method-std)


def test_window_attn_skip_freq_picks_the_layers():
    # N: layers N, 2N, ... attend fully (Megatron's is_layer_window_attention); a list: 1 = window, 0 = full.
    cfg = TransformerConfig(num_layers=6, window_size="127,0", window_attn_skip_freq="2").finalize()
    assert cfg.window == [127, 0] and cfg.window_layer_pattern == [1, 0, 1, 0, 1, 0]
    cfg = TransformerConfig(num_layers=6, window_size="(4,0)", window_attn_skip_freq="([1]*2+[0])*2").finalize()
    assert cfg.window == [4, 0] and cfg.window_layer_pattern == [1, 1, 0, 1, 1, 0]
    assert [cfg.uses_window(n) for n in range(1, 7)] == [True, True, False, True, True, False]
    assert TransformerConfig(num_layers=3, window_size="4,0").finalize().window_layer_pattern == [1, 1, 1]
    _, full_layer = make(layer_number=2, window_size="2,0", window_attn_skip_freq="2")
    assert full_layer.window_left is None
    _, unlimited = make(window_size="-1,0")
    assert unlimited.window_left is None  # -1: no limit, plain causal attention


def _cfg(*flags):
    base = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --mock-data --vocab-size 64".split()
    cfg = parse_args(base + list(flags)).resolve()
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    "flags, match",
    [
        (["--window-size", "127"], "--window-size '127': expected two integers LEFT,RIGHT"),
        (["--window-size", "-5,0"], "LEFT and RIGHT must be >= -1"),
        (["--window-size", "8,0", "--window-attn-skip-freq", "[1,0]"], "has 2 entries but --num-layers is 4"),
        (["--window-size", "8,0", "--window-attn-skip-freq", "[1,2,1,0]"], "may only hold 1 .* and 0"),
        (["--window-size", "8,0", "--window-attn-skip-freq", "x"], "--window-attn-skip-freq 'x': expected an int"),
        (["--softmax-type", "other"], None),
        (["--no-position-embedding"], "--no-position-embedding is deprecated"),
    ],
)
def test_attention_flag_mistakes_name_the_flag(flags, match):
    if match is None:  # argparse's own choices
        with pytest.raises(SystemExit):
            _cfg(*flags)
        return
    with pytest.raises(ValueError, match=match):
        _cfg(*flags)


def test_megatron_spellings_accepted():
    cfg = _cfg("--position-embedding-type", "rope", "--no-position-embedding", "--recompute-activations")
    assert cfg.model.recompute_granularity == "selective"  # Megatron: --recompute-activations sets it
    with pytest.warns(UserWarning, match="RIGHT is taken as 0"):
        assert _cfg("--window-size", "8,4").model.window == [8, 4]
    with pytest.warns(UserWarning, match="has no effect without --window-size"):
        _cfg("--window-attn-skip-freq", "2")


def test_qk_l2_norm_scales_each_query_and_key_head_to_unit_mean_square():
    """--qk-l2-norm (Llama 4): weightless; replaces --qk-layernorm as in Megatron's layer spec."""
    from megatron.core.models.common.rotary import RotaryEmbedding
    from megatron.core.transformer.norm import L2Norm

    cfg, attn = make(qk_l2_norm=True, qk_layernorm=True, position_embedding_type="rope")
    assert isinstance(attn.q_layernorm, L2Norm) and isinstance(attn.k_layernorm, L2Norm)
    assert not [n for n, _ in attn.named_parameters() if "layernorm" in n]
    x = torch.randn(5, 2, 32, dtype=torch.float64)
    torch.testing.assert_close(attn.q_layernorm(x), x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt(), **TOL)
    seen = {}
    attn.q_layernorm.register_forward_hook(lambda m, i, o: seen.setdefault("q", o))
    freqs = RotaryEmbedding(cfg.kv_channels).forward(5, torch.device("cpu")).to(torch.float64)
    attn(x, freqs)
    q = seen["q"]  # before RoPE, one vector per head
    torch.testing.assert_close(q.pow(2).mean(-1), torch.ones_like(q[..., 0]), rtol=0, atol=1e-3)  # ms / (ms + eps)


def test_no_rope_freq_leaves_those_layers_without_rope():
    from megatron.core.models.common.rotary import RotaryEmbedding

    x = torch.randn(5, 2, 32, dtype=torch.float64)
    for layer, skips in ((3, False), (4, True)):
        cfg, attn = make(layer_number=layer, no_rope_freq="4", position_embedding_type="rope")
        assert cfg.no_rope_layers == [0, 0, 0, 1] and attn.skips_rope is skips
        freqs = RotaryEmbedding(cfg.kv_channels).forward(5, torch.device("cpu")).to(torch.float64)
        same = torch.equal(attn(x, freqs)[0], attn(x, None)[0])
        assert same is skips
    cfg, _ = make(no_rope_freq="([1]+[0]*3)", position_embedding_type="rope")
    assert cfg.no_rope_layers == [1, 0, 0, 0]
    with pytest.raises(ValueError, match=r"--no-rope-freq 3 must divide --num-layers \(4\)"):
        make(no_rope_freq="3")
    with pytest.raises(ValueError, match="gives 2 layers; the model has 4"):
        make(no_rope_freq="[0,1]")
