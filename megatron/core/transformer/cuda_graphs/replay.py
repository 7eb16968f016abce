"""Autograd glue: recording the backward order, and replaying captured graphs.

``RecordBackward`` is an identity on a region's outputs during the eager recording
iteration; its backward runs when the gradient for those outputs is complete, i.e.
right before the region's own backward, which gives the backward order. Its outputs
share memory with the region's but are not autograd views of them, so a pipeline
schedule may free a sent output's storage (Megatron's ``deallocate_pipeline_outputs``
refuses views) in the recording iteration as after capture.

``GraphReplay`` runs a region's forward graph of one micro-batch slot and, in
backward, the backward graph of the same slot (through the session, which checks the
order).
It takes one extra ``anchor`` input that requires grad so that autograd always
calls its backward, even when no tensor argument needs a gradient (parameters are
not inputs: their gradients are added to ``main_grad`` inside the graph).
"""

import torch
from torch.autograd.function import once_differentiable


class RecordBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, on_backward, *outputs):
        ctx.on_backward = on_backward
        return tuple(o.detach() for o in outputs)

    @staticmethod
    def backward(ctx, *grads):
        ctx.on_backward(grads)
        return (None,) + grads


class GraphReplay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, session, region, slot, anchor, *args):
        ctx.session, ctx.region, ctx.slot = session, region, slot
        outputs = session.replay_forward(region, slot, args)
        frozen = [o for o, rg in zip(outputs, region.output_requires_grad) if not rg]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, *grads):
        return (None, None, None, None) + ctx.session.replay_backward(ctx.region, ctx.slot, grads)
