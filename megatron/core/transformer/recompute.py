"""Full activation recompute of transformer layers (``--recompute-granularity full``).

``run_layers`` runs a block's layers in order; with full recompute it wraps chunks of
layers in ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout
draws the same masks when backward recomputes), which keeps only each chunk's input
alive until backward:

- ``uniform``: consecutive chunks of ``--recompute-num-layers`` layers, every one
  recomputed (the last chunk may be shorter);
- ``block``: the first ``--recompute-num-layers`` layers, one at a time; the rest run
  normally.

Losses and gradients equal the run without recompute: the same kernels run on the
same inputs, once more in backward. Selective recompute (core attention only) lives
in ``attention.py``. Recompute is off in evaluation and under ``torch.no_grad()``.
"""

import torch
import torch.utils.checkpoint


def _run_chunk(layers, hidden_states, rotary_pos_emb):
    for layer in layers:
        hidden_states = layer(hidden_states, rotary_pos_emb=rotary_pos_emb)
    return hidden_states


def recomputed_chunks(config, num_layers: int) -> list[tuple[int, int, bool]]:
    """``(start, end, recompute)`` layer ranges of one block, in order (pure)."""
    method, n = getattr(config, "recompute_method", None), getattr(config, "recompute_num_layers", None)
    if getattr(config, "recompute_granularity", None) != "full" or not n:
        return [(0, num_layers, False)] if num_layers else []
    if method == "uniform":
        return [(i, min(i + n, num_layers), True) for i in range(0, num_layers, n)]
    chunks = [(i, i + 1, True) for i in range(min(n, num_layers))]
    if n < num_layers:
        chunks.append((n, num_layers, False))
    return chunks


def run_layers(layers, hidden_states: torch.Tensor, rotary_pos_emb, config) -> torch.Tensor:
    """Runs ``layers`` (a ``ModuleList``) in order, recomputing as the config asks."""
    if not (torch.is_grad_enabled() and layers.training) or getattr(config, "recompute_granularity", None) != "full":
        return _run_chunk(layers, hidden_states, rotary_pos_emb)
    for start, end, recompute in recomputed_chunks(config, len(layers)):
        chunk = layers[start:end]
        if recompute:
            hidden_states = torch.utils.checkpoint.checkpoint(
                _run_chunk, chunk, hidden_states, rotary_pos_emb, use_reentrant=False
            )
        else:
            hidden_states = _run_chunk(chunk, hidden_states, rotary_pos_emb)
    return hidden_states
