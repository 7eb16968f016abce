"""Normalization layers, chosen by ``--normalization`` (LayerNorm or RMSNorm).

Plain torch modules (``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm``, the latter
from torch 2.4), so checkpoints hold ``weight`` (+ ``bias`` for LayerNorm) as in
Megatron's local implementation. Weight starts at 1, bias at 0.
"""

import torch

from megatron.core.tensor_parallel.layers import resolve_device


def build_norm(config, hidden_size: int, device=None) -> torch.nn.Module:
    """Builds the normalization layer the config asks for.

    Args:
        config: ``TransformerConfig`` (reads ``normalization``, ``layernorm_epsilon``, ``params_dtype``).
        hidden_size: Size of the normalised (last) dimension.
        device: Device for the parameters (default: torch's default device).
    """
    kwargs = dict(eps=config.layernorm_epsilon, device=resolve_device(device), dtype=config.params_dtype)
    if config.normalization == "LayerNorm":
        return torch.nn.LayerNorm(hidden_size, **kwargs)
    if config.normalization == "RMSNorm":
        return torch.nn.RMSNorm(hidden_size, **kwargs)
    raise ValueError(f"--normalization {config.normalization!r} is unknown; use LayerNorm or RMSNorm.")
