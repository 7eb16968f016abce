"""Normalization layers, chosen by ``--normalization`` (LayerNorm or RMSNorm).

Plain torch modules (``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``, the latter
from torch 2.4), so checkpoints hold ``weight`` (+ ``bias`` for LayerNorm) as in
Megatron's local implementation. Weight starts at 1, bias at 0.

With ``--apply-layernorm-1p`` the stored weight is zero-centred: it starts at 0 and
the norm scales by ``1 + weight`` (Megatron's ``LayerNorm1P`` / TE's zero-centred
gamma), which keeps weight decay pulling the scale towards 1, not 0.
"""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import resolve_device


class _LayerNorm1P(torch.nn.LayerNorm):
    """LayerNorm whose scale is ``1 + weight``; weight starts at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self.weight + 1, self.bias, self.eps)


class _RMSNorm1P(torch.nn.RMSNorm):
    """RMSNorm whose scale is ``1 + weight``; weight starts at 0."""

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if self.elementwise_affine:
            torch.nn.init.zeros_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self.weight + 1, self.eps)


class L2Norm(torch.nn.Module):
    """``--qk-l2-norm`` (Llama 4): each vector scaled to a mean square of 1 over the last dimension, computed
    in float32 or wider, no weight (Megatron's ``L2Norm``, eps 1e-6)."""

    def __init__(self, eps: float = 1e-6):
        super().__init__()
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.promote_types(x.dtype, torch.float32))
        return (wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x)


def build_norm(config, hidden_size: int, device=None) -> torch.nn.Module:
    """Builds the normalization layer the config asks for.

    Args:
        config: ``TransformerConfig`` (reads ``normalization``, ``norm_epsilon``,
            ``apply_layernorm_1p``, ``params_dtype``).
        hidden_size: Size of the normalised (last) dimension.
        device: Device for the parameters (default: torch's default device).
    """
    kwargs = dict(eps=config.norm_epsilon, device=resolve_device(device), dtype=config.params_dtype)
    one_p = getattr(config, "apply_layernorm_1p", False)
    if config.normalization == "LayerNorm":
        return (_LayerNorm1P if one_p else torch.nn.LayerNorm)(hidden_size, **kwargs)
    if config.normalization == "RMSNorm":
        return (_RMSNorm1P if one_p else torch.nn.RMSNorm)(hidden_size, **kwargs)
    raise ValueError(f"--normalization {config.normalization!r} is unknown; use LayerNorm or RMSNorm.")
