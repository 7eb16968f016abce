"""Fused per-token cross entropy on the GPU (Triton): one pass forward, one pass backward.

The unfused path (``F.log_softmax(logits, dtype=float32)`` + ``nll_loss``) casts the
bf16 logits to an fp32 copy, writes fp32 log-probabilities, and in backward a zero
tensor, an fp32 gradient and its bf16 cast: several fp32 copies of the logits. Here each row is read once in forward
(online max and sum of exponentials in fp32, giving the log-sum-exp and the loss) and
once in backward, which writes ``(softmax - onehot) * grad`` in the logits' dtype
*into the logits' own memory* (they are dead by then). Only the fp32 log-sum-exp per
token is saved.

Used only on CUDA when Triton is importable; ``available()`` says so. The math runs
in fp32 whatever the logits' dtype, as in the unfused path, but in another order, so
results differ from it in the last bits (not across eager and graphed runs: both take
the same path).
"""

import os

import torch
import torch.distributed as dist

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs, or a platform without Triton
    HAVE_TRITON = False

_BLOCK = 4096
# The vocabulary size is a compile-time constant of the kernels (one compile per size).


def available(logits: torch.Tensor | None = None) -> bool:
    """Whether the fused kernel can run (on ``logits``' device, when given)."""
    if not HAVE_TRITON:
        return False
    return logits is None or logits.is_cuda or _interpreting()


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


if HAVE_TRITON:

    @triton.jit
    def _forward_kernel(
        logits_ptr, row_stride, target_ptr, loss_ptr, lse_ptr, n_cols: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        offs = tl.arange(0, BLOCK)
        # Per-lane running max and sum of exp(x - max), merged across lanes at the end.
        run_max = tl.full([BLOCK], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK], tl.float32)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            x = tl.load(base + cols, mask=cols < n_cols, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            seen = new_max != float("-inf")  # a lane that has seen no element yet stays at 0
            run_sum = tl.where(seen, run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max), 0.0)
            run_max = new_max
        row_max = tl.max(run_max, 0)
        lanes = tl.where(run_max != float("-inf"), run_sum * tl.exp(run_max - row_max), 0.0)
        lse = row_max + tl.log(tl.sum(lanes, 0))
        target = tl.load(target_ptr + row)
        target_logit = tl.load(base + target).to(tl.float32)
        tl.store(loss_ptr + row, lse - target_logit)
        tl.store(lse_ptr + row, lse)

    @triton.jit
    def _backward_kernel(
        logits_ptr,
        row_stride,
        grad_ptr,
        grad_row_stride,
        target_ptr,
        lse_ptr,
        grad_loss_ptr,
        n_cols: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * row_stride
        out = grad_ptr + row * grad_row_stride
        lse = tl.load(lse_ptr + row)
        scale = tl.load(grad_loss_ptr + row)
        target = tl.load(target_ptr + row)
        offs = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            cols = start + offs
            mask = cols < n_cols
            x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            p = tl.where(cols == target, p - 1.0, p)
            tl.store(out + cols, (p * scale).to(out.dtype.element_ty), mask=mask)


class FusedCrossEntropy(torch.autograd.Function):
    """``loss[i] = logsumexp(logits[i]) - logits[i, target[i]]`` in fp32, per row.

    ``logits [N, V]`` (rows contiguous), ``target [N]`` integer ids in ``[0, V)``.
    The backward overwrites ``logits`` with its gradient: pass logits nothing else reads.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, V] with contiguous rows"
        n, v = logits.shape
        target = target.contiguous()
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        block = min(_BLOCK, triton.next_power_of_2(v))
        if n:
            _forward_kernel[(n,)](logits, logits.stride(0), target, loss, lse, v, BLOCK=block, num_warps=8)
        ctx.save_for_backward(logits, target, lse)
        ctx.block = block
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        logits, target, lse = ctx.saved_tensors
        n, v = logits.shape
        grad_loss = grad_loss.contiguous().float()
        grad = logits  # written in place: every element is read before its own store
        if n:
            _backward_kernel[(n,)](
                logits, logits.stride(0), grad, grad.stride(0), target, lse, grad_loss, v, BLOCK=ctx.block, num_warps=8
            )
        return grad, None


def fused_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Per-token fp32 loss of ``logits [..., V]`` against ``target [...]`` (see ``FusedCrossEntropy``)."""
    vocab = logits.shape[-1]
    loss = FusedCrossEntropy.apply(logits.reshape(-1, vocab), target.reshape(-1))
    return loss.view(target.shape)


class FusedVocabParallelCrossEntropy(torch.autograd.Function):
    """``FusedCrossEntropy`` over logits whose vocabulary is split across ``group``.

    ``logits [N, V_local]`` (rows contiguous) hold columns ``[vocab_start, vocab_start +
    V_local)``; ``target [N]`` ids of the full vocabulary. The backward overwrites
    ``logits`` with their gradient.
    """

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start):
        assert logits.dim() == 2 and logits.stride(1) == 1, "logits must be [N, V] with contiguous rows"
        n, v = logits.shape
        local = target - vocab_start
        outside = (local < 0) | (local >= v)
        local = local.masked_fill(outside, 0).contiguous()
        local_loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        block = min(_BLOCK, triton.next_power_of_2(v))
        if n:
            _forward_kernel[(n,)](logits, logits.stride(0), local, local_loss, lse, v, BLOCK=block, num_warps=8)
        # local_loss = lse - x[local]: the target logit of this slice, zeroed where it is not ours.
        target_logit = (lse - local_loss).masked_fill(outside, 0.0)
        lse_max = lse.clone()
        dist.all_reduce(lse_max, op=dist.ReduceOp.MAX, group=group)
        sums = torch.stack([torch.exp(lse - lse_max), target_logit])
        dist.all_reduce(sums, group=group)
        global_lse = lse_max + torch.log(sums[0])
        ctx.save_for_backward(logits, local.masked_fill(outside, -1), global_lse)
        ctx.block = block
        return global_lse - sums[1]

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local, lse = ctx.saved_tensors
        n, v = logits.shape
        grad_loss = grad_loss.contiguous().float()
        if n:
            _backward_kernel[(n,)](
                logits,
                logits.stride(0),
                logits,
                logits.stride(0),
                local,
                lse,
                grad_loss,
                v,
                BLOCK=ctx.block,
                num_warps=8,
            )
        return logits, None, None, None


def fused_vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group, vocab_start: int):
    """Per-token fp32 loss of vocab-parallel ``logits [..., V_local]`` (see ``FusedVocabParallelCrossEntropy``)."""
    vocab = logits.shape[-1]
    loss = FusedVocabParallelCrossEntropy.apply(logits.reshape(-1, vocab), target.reshape(-1), group, vocab_start)
    return loss.view(target.shape)
