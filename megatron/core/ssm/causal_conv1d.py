"""Causal depthwise 1-D convolution of the Mamba mixer, with the rolling convolution state.

Each channel is convolved with its own ``d_conv`` taps over the current and the
``d_conv - 1`` previous time steps (left zero padding, no look-ahead). The state is
Megatron's layout: the last ``d_conv`` inputs of each channel, ``[b, channels, d_conv]``,
zero-padded on the left for sequences shorter than that; a sequence cut in two pieces
and run with the state handed over gives the output of the whole sequence.

The fused ``causal-conv1d`` kernel is used when it is installed and the input is on
CUDA with no state to carry (``causal_conv1d_fn``); otherwise ``F.conv1d``.
"""

import torch
import torch.nn.functional as F

try:  # optional fused kernel; never required
    from causal_conv1d import causal_conv1d_fn as _fused_causal_conv1d
except ImportError:  # pragma: no cover - depends on the environment
    _fused_causal_conv1d = None

HAVE_CAUSAL_CONV1D = _fused_causal_conv1d is not None


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return F.silu(y)
    raise ValueError(f"unknown activation {activation!r}; use silu or None")


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
    initial_state: torch.Tensor | None = None,
    return_final_state: bool = False,
    use_fused: bool | None = None,
):
    """Causal depthwise convolution of ``x [b, d, l]`` with ``weight [d, 1, k]`` (or ``[d, k]``).

    Args:
        x: Input, channels before time.
        weight: One filter of ``k`` taps per channel.
        bias: ``[d]`` or None.
        activation: ``"silu"`` or None, applied after the bias.
        initial_state: ``[b, d, k]`` the inputs before ``x`` (the last ``k - 1`` are read), or None (zeros).
        return_final_state: Also return the state after ``x``: its last ``k`` inputs.
        use_fused: Use the ``causal-conv1d`` kernel (None: when installed, on CUDA and stateless).

    Returns:
        ``y [b, d, l]``, or ``(y, final_state [b, d, k])``.
    """
    weight = weight.reshape(weight.shape[0], -1)  # [d, k]
    d, k = weight.shape
    stateless = initial_state is None and not return_final_state
    if use_fused is None:
        use_fused = HAVE_CAUSAL_CONV1D and x.is_cuda and stateless
    if use_fused:
        if not HAVE_CAUSAL_CONV1D:
            raise RuntimeError("use_fused=True needs the causal-conv1d package (pip install causal-conv1d)")
        assert stateless, "the fused causal-conv1d path carries no state here"
        return _fused_causal_conv1d(x=x, weight=weight, bias=bias, activation=activation)
    if initial_state is None:
        prefix = x.new_zeros(x.shape[0], d, k)
    else:
        prefix = initial_state.to(x.dtype)
    padded = torch.cat([prefix[..., 1:], x], dim=-1)  # [b, d, k - 1 + l]
    y = F.conv1d(padded, weight.unsqueeze(1), bias, groups=d)  # [b, d, l]
    y = _activate(y, activation)
    if return_final_state:
        return y, torch.cat([prefix, x], dim=-1)[..., -k:]
    return y


def causal_conv1d_update(
    x: torch.Tensor,
    state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoding step: ``x [b, d]`` and ``state [b, d, k]`` -> ``(y [b, d], new state)``.

    Functional: the new state is returned, ``state`` is left as it was.
    """
    weight = weight.reshape(weight.shape[0], -1)
    new_state = torch.cat([state[..., 1:], x.unsqueeze(-1).to(state.dtype)], dim=-1)
    y = (new_state * weight).sum(dim=-1)
    if bias is not None:
        y = y + bias
    return _activate(y, activation).to(x.dtype), new_state
