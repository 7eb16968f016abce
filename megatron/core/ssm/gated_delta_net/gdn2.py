"""GDN2 (Gated DeltaNet-2) attention: ``--experimental-attention-variant gdn2``.

The gated delta net layer (``gated_delta_net.py``) with Megatron's GDN2 gates: the
per-head decay and write strength become channel-wise gates (``gdn2_rule.py``). The
in-projection produces, per position, ``q, k`` (key heads), ``v, z`` (value heads) and
then ``f`` (decay pre-activation, key channels), ``b`` (erase gate, key channels) and
``w`` (write gate, value channels), in that order, all full rank (Megatron fuses them
into the one column-parallel ``in_proj``)::

    g = -exp(A_log[head of c]) * softplus(f_c + dt_bias_c)     per key channel c
    b = sigmoid(b),  w = sigmoid(w)

``A_log`` holds one rate per key head, ``dt_bias`` one bias per key channel; ``g`` and
``b`` are repeated to the value heads that share a key head, as ``q`` and ``k`` are.
Everything else (the causal conv over ``q, k, v``, the L2 norms, the normalised and
``act(z)``-gated output, the projections, the tensor-parallel layout, the parameter
names) is the gated delta net's.

Initialisation is Megatron's: ``A = uniform(A_init_range)`` per key head, and
``dt_bias`` the softplus inverse of step sizes drawn log-uniformly from ``[1e-3, 0.1]``
(clamped at ``1e-4``), drawn after the conv weight and before ``A``.
"""

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet, _at_least_fp32
from megatron.core.ssm.gated_delta_net.gdn2_rule import gdn2_rule

DT_MIN, DT_MAX, DT_FLOOR = 1e-3, 0.1, 1e-4


class GatedDeltaNet2(GatedDeltaNet):
    """GDN2 attention; the arguments are ``GatedDeltaNet``'s."""

    def _split_sizes(self) -> list[int]:
        """Rank-local widths of ``q, k, v, z, f, b, w`` in the in-projection output."""
        qk = self.num_key_heads_local * self.key_head_dim
        v = self.num_value_heads_local * self.value_head_dim
        return [qk, qk, v, v, qk, qk, v]

    def _draw_dt_bias(self, device, dtype) -> torch.Tensor:
        """The one-process ``dt_bias``: ``softplus^-1(dt)``, ``dt`` log-uniform in ``[DT_MIN, DT_MAX]``, per key
        channel."""
        size = self.num_key_heads * self.key_head_dim
        u = torch.rand(size, device=device, dtype=torch.float32)
        dt = torch.exp(u * (math.log(DT_MAX) - math.log(DT_MIN)) + math.log(DT_MIN)).clamp(min=DT_FLOOR)
        return (dt + torch.log(-torch.expm1(-dt))).to(dtype)

    def _a_log_size(self) -> int:
        """Entries of the one-process ``A_log``: one per key head."""
        return self.num_key_heads

    def _gates(self, f: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> dict[str, torch.Tensor]:
        """Channel-wise decay and erase / write gates from the ``f, b, w`` sections (``[b, s, width]``)."""
        rate = _at_least_fp32(self.A_log).exp().repeat_interleave(self.key_head_dim)  # [key channels]
        g = -rate * F.softplus(_at_least_fp32(f) + _at_least_fp32(self.dt_bias))
        g = rearrange(g, "b s (h d) -> b s h d", d=self.key_head_dim)
        b = rearrange(_at_least_fp32(b).sigmoid(), "b s (h d) -> b s h d", d=self.key_head_dim)
        w = rearrange(_at_least_fp32(w).sigmoid(), "b s (h d) -> b s h d", d=self.value_head_dim)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:  # value head j reads key head j // repeat
            g, b = g.repeat_interleave(repeat, dim=2), b.repeat_interleave(repeat, dim=2)
        return {"g": g, "b": b, "w": w}

    def _rule(self, q, k, v, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """The GDN2 rule on the prepared inputs: ``[b, s, value heads, V]``."""
        return gdn2_rule(q, k, v, gates["g"], gates["b"], gates["w"], self.chunk_size, use_fused=self.use_fused_kernels)
