"""SelfAttention against an explicit float64 softmax(QK^T / sqrt(d) + causal mask) V reference."""

import math

import pytest
import torch

from megatron.core.models.common.rotary import RotaryEmbedding, apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig


def make(heads=4, groups=None, hidden=32, kv_channels=None, bias=True, dropout=0.0, output_gate=False):
    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=hidden,
        num_attention_heads=heads,
        group_query_attention=groups is not None,
        num_query_groups=groups,
        kv_channels=kv_channels,
        add_bias_linear=bias,
        attention_dropout=dropout,
        attention_output_gate=output_gate,
        params_dtype=torch.float64,
    ).finalize()
    cfg.validate()
    torch.manual_seed(0)
    attn = SelfAttention(cfg, layer_number=1, device="cpu")
    with torch.no_grad():  # non-zero biases so their placement is checked too
        for p in attn.parameters():
            if p.dim() == 1:
                p.normal_(std=0.1)
    return cfg, attn


def naive_attention(attn, cfg, x, freqs=None):
    """Loops over heads; QKV rows are read per query group: [q_1..q_hpg, k, v] for each group
    ([q_1..q_hpg, gate_1..gate_hpg, k, v] with --attention-output-gate)."""
    s, b, _ = x.shape
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    hpg = n // g
    gated = cfg.attention_output_gate
    w, bq = attn.linear_qkv.weight, attn.linear_qkv.bias
    qkv = x @ w.t() + (bq if bq is not None else 0)  # [s, b, g * (hpg + 2) * d]
    qkv = qkv.view(s, b, g, 2 * hpg + 2 if gated else hpg + 2, d)
    k_at = 2 * hpg if gated else hpg
    mask = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)
    heads = []
    for head in range(n):
        grp, j = divmod(head, hpg)
        q, k, v = qkv[:, :, grp, j], qkv[:, :, grp, k_at], qkv[:, :, grp, k_at + 1]  # [s, b, d]
        if freqs is not None:
            q = apply_rotary_pos_emb(q.unsqueeze(2), freqs).squeeze(2)
            k = apply_rotary_pos_emb(k.unsqueeze(2), freqs).squeeze(2)
        scores = torch.einsum("sbd,tbd->bst", q, k) / math.sqrt(d) + mask
        probs = torch.softmax(scores, dim=-1)
        head_out = torch.einsum("bst,tbd->sbd", probs, v)
        if gated:
            head_out = head_out * torch.sigmoid(qkv[:, :, grp, hpg + j])
        heads.append(head_out)
    context = torch.cat(heads, dim=-1)  # [s, b, n * d]
    return context @ attn.linear_proj.weight.t() + attn.linear_proj.bias


@pytest.mark.parametrize(
    "heads,groups,kv_channels,rope",
    [(4, None, None, False), (4, None, None, True), (4, 2, None, True), (4, 1, None, False), (4, 2, 6, True)],
)
def test_matches_naive_reference(heads, groups, kv_channels, rope):
    cfg, attn = make(heads=heads, groups=groups, kv_channels=kv_channels)
    torch.manual_seed(1)
    x = torch.randn(7, 3, cfg.hidden_size, dtype=torch.float64)
    freqs = RotaryEmbedding(cfg.kv_channels)(7, "cpu") if rope else None
    out, bias = attn(x, rotary_pos_emb=freqs)
    assert out.shape == x.shape and out.dtype == torch.float64
    assert bias is None  # added inside the output projection's GEMM
    torch.testing.assert_close(out, naive_attention(attn, cfg, x, freqs), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("heads,groups,rope", [(4, None, False), (4, None, True), (4, 2, True), (4, 1, False)])
def test_attention_output_gate_matches_naive_reference(heads, groups, rope):
    cfg, attn = make(heads=heads, groups=groups, output_gate=True)
    g, d = cfg.num_query_groups, cfg.kv_channels
    assert attn.linear_qkv.weight.shape == ((2 * heads + 2 * g) * d, cfg.hidden_size)
    torch.manual_seed(1)
    x = torch.randn(7, 3, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    freqs = RotaryEmbedding(d)(7, "cpu") if rope else None
    out, _ = attn(x, rotary_pos_emb=freqs)
    ref = naive_attention(attn, cfg, x, freqs)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, attn.linear_qkv.weight), grad)
    want = torch.autograd.grad(ref, (x, attn.linear_qkv.weight), grad)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_qkv_size_follows_groups():
    cfg, attn = make(heads=8, groups=2, hidden=64)
    assert attn.linear_qkv.weight.shape == ((8 + 2 * 2) * 8, 64)
    assert attn.linear_proj.weight.shape == (64, 64)


def test_causal_future_tokens_do_not_leak():
    cfg, attn = make()
    x = torch.randn(6, 2, cfg.hidden_size, dtype=torch.float64)
    y = x.clone()
    y[4:] += 1.0
    torch.testing.assert_close(attn(x)[0][:4], attn(y)[0][:4])


def test_gradients_match_reference():
    cfg, attn = make(heads=4, groups=2)
    x = torch.randn(5, 2, cfg.hidden_size, dtype=torch.float64, requires_grad=True)
    freqs = RotaryEmbedding(cfg.kv_channels)(5, "cpu")
    out, _ = attn(x, freqs)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, (x, attn.linear_qkv.weight), grad)
    ref_out = naive_attention(attn, cfg, x, freqs)
    ref = torch.autograd.grad(ref_out, (x, attn.linear_qkv.weight), grad)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_attention_dropout_only_in_training():
    cfg, attn = make(dropout=0.5)
    x = torch.randn(6, 2, cfg.hidden_size, dtype=torch.float64)
    attn.eval()
    torch.testing.assert_close(attn(x)[0], naive_attention(attn, cfg, x), rtol=1e-10, atol=1e-10)
    attn.train()
    assert not torch.allclose(attn(x)[0], naive_attention(attn, cfg, x))
