"""Cross entropy over (vocab-parallel) logits, per token, in fp32.

Works for any leading layout (``[s, b, v]`` or ``[b, s, v]``): the loss has the
target's shape. The softmax runs in fp32 whatever the logits' dtype, as Megatron does, so bf16 runs get the same loss as fp32 ones up to the
logits' rounding. With TP > 1 the vocabulary is split across ranks and the max,
the sum of exponentials and the target logit would each be all-reduced; only
TP = 1 is implemented today, where this is ``F.cross_entropy(reduction="none")``, or
with ``fused=True`` on CUDA the one-pass Triton kernel of
``megatron.core.fusions.fused_cross_entropy``.
"""

import torch
import torch.nn.functional as F

from megatron.core.fusions import fused_cross_entropy
from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_size


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, pg=None, *, fused: bool = False
) -> torch.Tensor:
    """Per-token cross entropy.

    Args:
        logits: ``[..., vocab_per_partition]`` logits of any float dtype.
        target: ``[...]`` integer token ids, same leading shape as ``logits``.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        fused: Use the fused Triton kernel where it can run (CUDA + Triton). Its backward
            overwrites ``logits`` with their gradient: only for logits nothing else reads.

    Returns:
        fp32 loss with ``target``'s shape (no reduction, no masking).
    """
    if get_tensor_model_parallel_size(pg) != 1:
        raise NotImplementedError("vocab_parallel_cross_entropy: tensor parallelism is not implemented yet.")
    assert logits.shape[:-1] == target.shape, f"logits {tuple(logits.shape)} vs target {tuple(target.shape)}"
    if fused and fused_cross_entropy.available(logits) and logits.is_contiguous():
        return fused_cross_entropy.fused_cross_entropy(logits, target)
    vocab = logits.shape[-1]
    # log_softmax(dtype=fp32) gives the same values as F.cross_entropy(logits.float()); for fp16
    # logits torch fuses the upcast into the kernel (no fp32 copy), for bf16 it casts first.
    # reshape (not view): target is often a transposed view of the [b, s] labels.
    log_probs = F.log_softmax(logits.reshape(-1, vocab), dim=-1, dtype=torch.float32)
    loss = F.nll_loss(log_probs, target.reshape(-1), reduction="none")
    return loss.view(target.shape)
