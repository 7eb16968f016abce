"""Tied word embeddings across pipeline stages: one weight, two copies, one gradient.

With ``--pipeline-model-parallel-size > 1`` and tied embeddings, the first stage holds
the word embedding and the last stage a copy for its output layer (initialised equal,
``gpt_model.build_gpt_stage_chunks``). After the data-parallel reduction the two copies'
gradients are summed over Megatron's embedding group (``pg.embd``: first and last stage
of the pipeline), so both take the same optimizer step and stay equal. Only the first
stage's copy counts in the gradient norm (the copy is marked ``shared_embedding``).

Unusual here: with ``--use-distributed-optimizer`` a rank's ``main_grad`` is reduced only
on the shard it owns, and the two stages own different element ranges of the weight;
so the owned parts are first made whole over the data-parallel ranks that shard them (DP,
or one optimizer instance's ranks: ``pg.intra_dp``; the other parts zeroed, then summed),
then summed over the embedding group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tied_weights(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    chunks = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    weights = []
    for chunk in chunks:
        if not getattr(chunk, "share_embeddings_and_output_weights", False):
            continue
        if chunk.pre_process or chunk.post_process:
            weight = chunk.shared_embedding_or_output_weight()
            if weight is not None and weight.requires_grad:
                weights.append(weight)
    return weights


class TiedEmbeddingGrads:
    """Sums the tied embedding's gradient over the embedding group, once per step.

    Args:
        model: The (unwrapped) model of this rank: a stage or a ``ModuleList`` of chunks.
        pg: ``ProcessGroups`` (``embd`` is None where there is nothing to do).
    """

    def __init__(self, model: torch.nn.Module, pg):
        self.pg = pg
        self.weights = _tied_weights(model) if getattr(pg, "embd", None) is not None else []

    def allreduce(self, ddp) -> None:
        """After ``ddp.finish_grad_sync()``: every tied copy's ``main_grad`` holds the sum."""
        if not self.weights:
            return
        for weight in self.weights:
            grad = weight.main_grad
            if ddp.use_distributed_optimizer and self.pg.intra_dp is not None:
                self._whole_over_dp(ddp, weight)
            dist.all_reduce(grad, group=self.pg.embd)

    def _whole_over_dp(self, ddp, weight: torch.nn.Parameter) -> None:
        buffer = ddp.grad_buffer
        start, end = buffer.param_range(weight)
        flat = weight.main_grad.view(-1)
        whole = torch.zeros_like(flat)
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range(self.pg.intra_dp_rank, self.pg.intra_dp_size)
            a, b = max(start, lo), min(end, hi)
            if a < b:
                whole[a - start : b - start] = flat[a - start : b - start]
        dist.all_reduce(whole, group=self.pg.intra_dp)  # the shards of one optimizer instance
        flat.copy_(whole)
