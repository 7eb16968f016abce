"""The tensor-parallel collectives, as autograd functions (Megatron's "mappings").

Each function is one collective forward and its adjoint backward, over the TP group
passed in (a torch ``ProcessGroup``; ``None`` means a group of one, where every
function is the identity and no autograd node is added):

=============================================  ==========================  ==========================
function                                       forward                     backward
=============================================  ==========================  ==========================
``copy_to_tensor_model_parallel_region``       identity                    all-reduce
``reduce_from_tensor_model_parallel_region``   all-reduce                  identity
``scatter_to_tensor_model_parallel_region``    split the last dim          all-gather the last dim
``gather_from_tensor_model_parallel_region``   all-gather the last dim     split the last dim
``scatter_to_sequence_parallel_region``        split the first dim         all-gather the first dim
``gather_from_sequence_parallel_region``       all-gather the first dim    reduce-scatter the first dim
``reduce_scatter_to_sequence_parallel_region`` reduce-scatter the first    all-gather the first dim
=============================================  ==========================  ==========================

The first dimension is the sequence (activations are ``[s, b, h]``), so first-dim
gathers and scatters are single contiguous collectives with no re-layout.
"""

import torch
import torch.distributed as dist

# torch >= 2.10 renamed the single-tensor collectives; the old names warn.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ``group``, in place on a contiguous copy-free tensor; returns it."""
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def all_gather_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``[n, ...]`` on each rank -> ``[size * n, ...]``, rank order."""
    size = group_size(group)
    x = x.contiguous()
    out = torch.empty((size * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, x, group=group)
    return out


def reduce_scatter_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``[size * n, ...]`` on each rank -> the rank's ``[n, ...]`` slice of the sum."""
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(
            f"the sequence length ({x.shape[0]}) must be divisible by --tensor-model-parallel-size ({size}) "
            "with --sequence-parallel."
        )
    x = x.contiguous()
    out = torch.empty((x.shape[0] // size, *x.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, x, group=group)
    return out


def split_first_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(
            f"the sequence length ({x.shape[0]}) must be divisible by --tensor-model-parallel-size ({size}) "
            "with --sequence-parallel."
        )
    n = x.shape[0] // size
    rank = group_rank(group)
    return x[rank * n : (rank + 1) * n].contiguous()


def all_gather_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    """``[..., n]`` on each rank -> ``[..., size * n]``, rank order."""
    size = group_size(group)
    # Gather along dim 0 (one contiguous collective), then move the rank axis last.
    gathered = all_gather_first_dim(x.unsqueeze(0), group)  # [size, ..., n]
    return gathered.movedim(0, -2).reshape(*x.shape[:-1], size * x.shape[-1])


def split_last_dim(x: torch.Tensor, group) -> torch.Tensor:
    size = group_size(group)
    assert x.shape[-1] % size == 0, (tuple(x.shape), size)
    n = x.shape[-1] // size
    rank = group_rank(group)
    return x[..., rank * n : (rank + 1) * n].contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad, ctx.group), None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        if not x.is_contiguous():
            return all_reduce(x, group)  # a new contiguous copy, reduced in place
        # In place (no copy of the partial sums): x is a fresh GEMM output nothing else reads.
        dist.all_reduce(x, group=group)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_last_dim(grad, ctx.group), None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_last_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return split_last_dim(grad, ctx.group), None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_first_dim(grad, ctx.group), None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_first_dim(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_first_dim(grad, ctx.group), None


def _apply(fn, x: torch.Tensor, group) -> torch.Tensor:
    if group_size(group) == 1:
        return x
    return fn.apply(x, group)


def copy_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Identity forward; backward all-reduces the gradient (input of a column-parallel layer)."""
    return _apply(_CopyToRegion, x, group)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-reduce forward (output of a row-parallel layer); identity backward."""
    return _apply(_ReduceFromRegion, x, group)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keeps this rank's chunk of the last dim; backward all-gathers it."""
    return _apply(_ScatterToRegion, x, group)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gathers the last dim; backward keeps this rank's chunk."""
    return _apply(_GatherFromRegion, x, group)


def scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Keeps this rank's chunk of the sequence (first) dim; backward all-gathers it."""
    return _apply(_ScatterToSequence, x, group)


def gather_from_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """All-gathers the sequence dim; backward reduce-scatters (Megatron's SP column input)."""
    return _apply(_GatherFromSequence, x, group)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group) -> torch.Tensor:
    """Reduce-scatters the sequence dim (Megatron's SP row output); backward all-gathers."""
    return _apply(_ReduceScatterToSequence, x, group)
