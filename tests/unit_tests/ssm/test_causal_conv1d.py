"""Causal depthwise conv: against an explicit sum, with the rolling state handed over."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.ssm.causal_conv1d import causal_conv1d, causal_conv1d_update


def explicit(x, weight, bias, activation):
    """y[b, d, t] = bias[d] + sum_j w[d, j] * x[b, d, t - (k - 1) + j] (zero before t = 0)."""
    b, d, length = x.shape
    k = weight.shape[-1]
    w = weight.reshape(d, k)
    y = torch.zeros_like(x)
    for t in range(length):
        for j in range(k):
            src = t - (k - 1) + j
            if src >= 0:
                y[:, :, t] += w[:, j] * x[:, :, src]
    y = y + bias[:, None]
    return F.silu(y) if activation == "silu" else y


@pytest.mark.parametrize("length", [1, 3, 4, 11])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_explicit_sum(length, activation):
    torch.manual_seed(0)
    x = torch.randn(2, 5, length, dtype=torch.float64)
    w, bias = torch.randn(5, 1, 4, dtype=torch.float64), torch.randn(5, dtype=torch.float64)
    y, state = causal_conv1d(x, w, bias, activation=activation, return_final_state=True)
    assert y.shape == x.shape
    torch.testing.assert_close(y, explicit(x, w, bias, activation), rtol=1e-12, atol=1e-12)
    assert state.shape == (2, 5, 4)  # Megatron's conv state: the last d_conv inputs
    expected_state = F.pad(x, (max(0, 4 - length), 0))[..., -4:]
    assert torch.equal(state, expected_state)


def test_state_hand_over_and_stepwise_decode_equal_the_whole_sequence():
    torch.manual_seed(0)
    x = torch.randn(2, 6, 13, dtype=torch.float64)
    w, bias = torch.randn(6, 1, 4, dtype=torch.float64), torch.randn(6, dtype=torch.float64)
    whole, whole_state = causal_conv1d(x, w, bias, return_final_state=True)
    first, state = causal_conv1d(x[..., :5], w, bias, return_final_state=True)
    second, end = causal_conv1d(x[..., 5:], w, bias, initial_state=state, return_final_state=True)
    torch.testing.assert_close(torch.cat([first, second], -1), whole, rtol=0, atol=1e-13)
    assert torch.equal(end, whole_state)
    state = torch.zeros(2, 6, 4, dtype=torch.float64)
    steps = []
    for t in range(13):
        given, copy = state, state.clone()
        y_t, state = causal_conv1d_update(x[..., t], given, w, bias)
        assert torch.equal(given, copy)  # functional: the state passed in is left as it was
        steps.append(y_t)
    torch.testing.assert_close(torch.stack(steps, -1), whole, rtol=0, atol=1e-13)
    assert torch.equal(state, whole_state)
