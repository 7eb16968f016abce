"""Rotary embeddings: cached table identity, rotation properties, partial rotation."""

import math

import pytest
import torch

from megatron.core.models.common.rotary import RotaryEmbedding, apply_rotary_pos_emb, llama3_scaled_inv_freq


def rotate_reference(t, freqs):
    """Pairs (i, i + d/2) rotated by angle freqs[..., i], written channel by channel."""
    s, r = t.shape[0], freqs.shape[-1]
    out = t.clone()
    half = r // 2
    for i in range(half):
        theta = freqs[:s, 0, 0, i].double().view(s, *([1] * (t.dim() - 2)))
        x1, x2 = t[..., i], t[..., i + half]
        out[..., i] = x1 * torch.cos(theta) - x2 * torch.sin(theta)
        out[..., i + half] = x2 * torch.cos(theta) + x1 * torch.sin(theta)
    return out


def test_table_is_cached_object_with_expected_values():
    rope = RotaryEmbedding(8, rotary_base=100)
    freqs = rope(6, "cpu")
    assert freqs.shape == (6, 1, 1, 8) and freqs.dtype == torch.float32
    assert rope(6, "cpu") is freqs
    assert rope(6, torch.device("cpu")) is freqs
    assert rope(7, "cpu") is not freqs
    inv = [1.0 / 100 ** (2 * j / 8) for j in range(4)]
    expected = torch.tensor([[p * f for f in inv + inv] for p in range(6)], dtype=torch.float32)
    torch.testing.assert_close(freqs[:, 0, 0, :], expected)


def test_table_built_under_inference_mode_works_in_training():
    rope = RotaryEmbedding(8)
    with torch.inference_mode():
        freqs = rope(4, "cpu")
    t = torch.randn(4, 1, 2, 8, requires_grad=True)
    apply_rotary_pos_emb(t, rope(4, "cpu")).sum().backward()
    assert rope(4, "cpu") is freqs and t.grad is not None


@pytest.mark.parametrize("percent", [1.0, 0.5])
def test_matches_pairwise_rotation_and_preserves_norm(percent):
    torch.manual_seed(0)
    freqs = RotaryEmbedding(16, rotary_percent=percent)(10, "cpu")
    t = torch.randn(9, 2, 3, 16, dtype=torch.float64)
    out = apply_rotary_pos_emb(t, freqs)
    assert out.dtype == t.dtype and out.shape == t.shape
    torch.testing.assert_close(out, rotate_reference(t, freqs), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.norm(dim=-1), t.norm(dim=-1))
    r = freqs.shape[-1]
    assert torch.equal(out[..., r:], t[..., r:])
    # Position 0 is not rotated.
    torch.testing.assert_close(out[0], t[0])


def test_relative_position_property():
    """<rope(q, m), rope(k, n)> depends only on m - n."""
    torch.manual_seed(0)
    freqs = RotaryEmbedding(8)(12, "cpu")
    q, k = torch.randn(8, dtype=torch.float64), torch.randn(8, dtype=torch.float64)

    def at(v, pos):
        t = v.expand(12, 1, 1, 8).clone()
        return apply_rotary_pos_emb(t, freqs)[pos, 0, 0]

    d1 = torch.dot(at(q, 5), at(k, 2))
    d2 = torch.dot(at(q, 9), at(k, 6))
    assert math.isclose(d1.item(), d2.item(), rel_tol=1e-5)


def test_bf16_cached_tables_and_5d_input():
    torch.manual_seed(0)
    rope = RotaryEmbedding(8)
    freqs = rope(5, "cpu")
    t = torch.randn(5, 2, 2, 3, 8)
    ref = apply_rotary_pos_emb(t.double(), freqs).to(torch.bfloat16)
    out = apply_rotary_pos_emb(t.to(torch.bfloat16), freqs)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
    # Uncached freqs (a copy without the attached tables) give identical results.
    torch.testing.assert_close(apply_rotary_pos_emb(t, freqs.clone()), apply_rotary_pos_emb(t, freqs))


def test_odd_rotary_dim_is_refused():
    with pytest.raises(ValueError, match="rotary-percent"):
        RotaryEmbedding(10, rotary_percent=0.5)


def test_llama3_scaling_keeps_short_wavelengths_divides_long_ones_and_blends_between():
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    scaled = llama3_scaled_inv_freq(inv_freq, 8.0)
    wavelength = 2 * math.pi / inv_freq
    short, long = wavelength < 8192 / 4, wavelength > 8192
    assert short.any() and long.any() and (~short & ~long).any()
    assert torch.equal(scaled[short], inv_freq[short])
    torch.testing.assert_close(scaled[long], inv_freq[long] / 8, rtol=0, atol=0)
    mid = ~short & ~long
    r = (8192 / wavelength[mid] - 1) / 3  # 0 at the long end, 1 at the short end
    torch.testing.assert_close(scaled[mid], (1 - r) * inv_freq[mid] / 8 + r * inv_freq[mid], rtol=1e-12, atol=0)
    assert torch.all(scaled <= inv_freq) and torch.all(scaled >= inv_freq / 8)


def test_rope_scaling_and_interpolation_change_the_table():
    plain = RotaryEmbedding(16, rotary_base=10000)(32)
    halved = RotaryEmbedding(16, rotary_base=10000, seq_len_interpolation_factor=2)(32)
    torch.testing.assert_close(halved, plain / 2)
    scaled = RotaryEmbedding(16, rotary_base=10000, rope_scaling=True, rope_scaling_factor=4.0)(32)
    inv = 1.0 / (10000 ** (torch.arange(0, 16, 2, dtype=torch.float32) / 16))
    want = torch.outer(torch.arange(32, dtype=torch.float32), llama3_scaled_inv_freq(inv, 4.0))
    torch.testing.assert_close(scaled[:, 0, 0, :8], want)
