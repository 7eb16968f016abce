"""Cross entropy over (vocab-parallel) logits, per token, in fp32.

Works for any leading layout (``[s, b, v]`` or ``[b, s, v]``): the loss has the
target's shape. The softmax runs in fp32 whatever the logits' dtype, as Megatron
does, so bf16 runs get the same loss as fp32 ones up to the logits' rounding.

At TP = 1 this is ``F.cross_entropy(reduction="none")`` (log_softmax + nll_loss), or
with ``fused=True`` on CUDA the one-pass Triton kernel of
``megatron.core.fusions.fused_cross_entropy``. At TP > 1 each rank holds a slice of
the vocabulary: the row max is all-reduced (MAX), then the sum of exponentials and
the target logit (found on the one rank that holds it) in one SUM all-reduce, as
Megatron's ``_VocabParallelCrossEntropy``; the fused kernel has a vocab-parallel
variant built the same way.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.fusions import fused_cross_entropy
from megatron.core.tensor_parallel.layers import get_tensor_model_parallel_rank, tp_group


def target_in_shard(target: torch.Tensor, vocab_start: int, vocab_per_rank: int):
    """``(local ids with 0 where outside, outside mask)`` of targets against this rank's vocab slice."""
    local = target - vocab_start
    outside = (local < 0) | (local >= vocab_per_rank)
    return local.masked_fill(outside, 0), outside


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """``loss = log(sum_v exp(x_v)) - x_target`` over the vocabulary split across ``group``."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        n, v = logits.shape
        x = logits.float()
        row_max = x.max(dim=-1).values
        dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = x - row_max.unsqueeze(-1)  # a new fp32 tensor
        local, outside = target_in_shard(target, vocab_start, v)
        target_logit = shifted.gather(1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp = shifted.exp_()
        sums = torch.stack([exp.sum(dim=-1), target_logit])  # one all-reduce for both
        dist.all_reduce(sums, group=group)
        sum_exp, target_logit = sums[0], sums[1]
        loss = torch.log(sum_exp) - target_logit
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local, outside)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local, outside = ctx.saved_tensors
        grad = softmax  # only backward reads it, once
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local] -= (~outside).to(grad.dtype)
        grad.mul_(grad_loss.float().unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, pg=None, *, fused: bool = False
) -> torch.Tensor:
    """Per-token cross entropy.

    Args:
        logits: ``[..., vocab_per_partition]`` logits of any float dtype.
        target: ``[...]`` integer token ids (of the full vocabulary), same leading shape as ``logits``.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        fused: Use the fused Triton kernel where it can run (CUDA + Triton). Its backward
            overwrites ``logits`` with their gradient: only for logits nothing else reads.

    Returns:
        fp32 loss with ``target``'s shape (no reduction, no masking).
    """
    assert logits.shape[:-1] == target.shape, f"logits {tuple(logits.shape)} vs target {tuple(target.shape)}"
    vocab = logits.shape[-1]
    group = tp_group(pg)
    use_fused = fused and fused_cross_entropy.available(logits) and logits.is_contiguous()
    if group is not None:
        vocab_start = get_tensor_model_parallel_rank(pg) * vocab
        if use_fused:
            return fused_cross_entropy.fused_vocab_parallel_cross_entropy(logits, target, group, vocab_start)
        loss = _VocabParallelCrossEntropy.apply(logits.reshape(-1, vocab), target.reshape(-1), group, vocab_start)
        return loss.view(target.shape)
    if use_fused:
        return fused_cross_entropy.fused_cross_entropy(logits, target)
    # log_softmax(dtype=fp32) gives the same values as F.cross_entropy(logits.float()); for fp16
    # logits torch fuses the upcast into the kernel (no fp32 copy), for bf16 it casts first.
    # reshape (not view): target is often a transposed view of the [b, s] labels.
    log_probs = F.log_softmax(logits.reshape(-1, vocab), dim=-1, dtype=torch.float32)
    loss = F.nll_loss(log_probs, target.reshape(-1), reduction="none")
    return loss.view(target.shape)
