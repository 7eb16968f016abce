"""Attention cores beyond plain causal SDPA: sliding windows and softmax sinks.

- **Sliding window** (``--window-size LEFT,RIGHT`` on the layers ``--window-attn-skip-freq``
  picks): query ``i`` attends to keys ``i - LEFT .. i``. The model is causal, so RIGHT
  counts as 0 (Transformer Engine's rule). It runs through SDPA with a boolean mask;
  flash kernels take no mask, so the backend's other kernels (or the math kernel) run it.
- **Softmax sink** (``--softmax-type off-by-one | learnable``): every softmax row gets one
  more logit, 0 (off-by-one) or a learned one per head (``core_attention.softmax_offset``,
  Megatron's name), which adds to the denominator and takes no value:
  ``p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))``. No SDPA kernel has it, so
  this runs unfused (scores, float32 softmax with the sink column, dropout, probs @ v), as
  Megatron's local ``DotProductAttention`` does; it holds the ``[b, n, s, s]`` scores.

Both take ``[b, n, s, d]`` q, k, v (k and v may be the expanded views of grouped-query
attention) and return ``[b, n, s, d]``.
"""

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import init_method_normal, rank_slice, resolve_device


def window_mask(seq: int, left: int, device) -> torch.Tensor:
    """``[seq, seq]`` bool, True where query ``i`` may attend key ``j``: ``i - left <= j <= i``."""
    i = torch.arange(seq, device=device).unsqueeze(1)
    j = torch.arange(seq, device=device).unsqueeze(0)
    return (j <= i) & (j >= i - left)


class SoftmaxOffset(torch.nn.Module):
    """The learned sink logits of this tensor-parallel rank's heads (``softmax_offset``, ``[heads / TP]``).

    Drawn from N(0, ``std``) over all heads in one process's order, each rank keeping its
    heads' slice, so the values do not depend on the layout.
    """

    def __init__(self, num_heads: int, *, std: float, tp_size: int, tp_rank: int, device=None, dtype=None):
        super().__init__()
        full = torch.empty(num_heads, device=resolve_device(device), dtype=dtype)
        init_method_normal(std)(full)  # the same draws as a single process makes
        self.softmax_offset = torch.nn.Parameter(rank_slice(full, tp_size, tp_rank).clone())
        self.softmax_offset.tensor_model_parallel = True  # this rank's heads (checkpoint and optimizer code)
        self.softmax_offset.partition_dim = 0


def sink_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    sink: torch.Tensor,
    *,
    scale: float,
    window_left: int | None,
    dropout_p: float,
    attention_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention whose softmax rows each have one more logit, ``sink[h]`` (unfused).

    Args:
        q, k, v: ``[b, n, s, d]``.
        sink: ``[n]`` sink logits (zeros for off-by-one).
        scale: Softmax scale of the scores.
        window_left: Sliding window (keys ``i - window_left .. i``), or None for full causal attention.
        dropout_p: Dropout on the probabilities (0 outside training).
        attention_mask: bool ``[b, 1, s, s]``, True where query i may attend key j, or None (the
            sink logit stays in every row, as a query that sees only itself still sees the sink).
    """
    b, n, s, _ = q.shape
    fp32 = torch.promote_types(q.dtype, torch.float32)  # the softmax in at least float32
    scores = torch.matmul(q, k.transpose(-2, -1)).to(fp32) * scale  # [b, n, s, s]
    if window_left is None:
        allowed = torch.ones(s, s, dtype=torch.bool, device=q.device).tril_()
    else:
        allowed = window_mask(s, window_left, q.device)
    if attention_mask is not None:
        allowed = allowed & attention_mask
    scores = scores.masked_fill(~allowed, float("-inf"))
    column = sink.to(fp32).view(1, n, 1, 1).expand(b, n, s, 1)
    probs = torch.softmax(torch.cat([scores, column], dim=-1), dim=-1)[..., :-1]
    probs = probs.to(v.dtype)
    if dropout_p > 0.0:
        probs = F.dropout(probs, p=dropout_p, training=True)
    return torch.matmul(probs, v)
