"""Checks every sequence mixer here (Mamba-2, gated delta net) must pass, shared by their tests."""

import torch


def assert_causal_and_every_parameter_learns(mixer: torch.nn.Module, hidden_size: int) -> None:
    """In float64: changing tokens from position 7 on leaves the outputs before it bit for bit
    and changes those after it; backward gives every parameter a nonzero gradient."""
    mixer = mixer.double()
    hidden = torch.randn(12, 2, hidden_size, dtype=torch.float64, requires_grad=True)
    out, _ = mixer(hidden)
    changed = hidden.detach().clone()
    changed[7:] += 1.0
    out2, _ = mixer(changed)
    assert torch.equal(out[:7], out2[:7]) and not torch.equal(out[7:], out2[7:])
    out.pow(2).sum().backward()
    for name, param in mixer.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
