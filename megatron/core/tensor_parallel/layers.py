"""Tensor-parallel building blocks: column/row parallel linear and vocab-parallel embedding.

Megatron's layers: a column-parallel linear splits its output features across the
TP ranks, a row-parallel linear its input features (its partial products are summed
by an all-reduce, or a reduce-scatter over the sequence with sequence parallelism),
and the embedding splits the vocabulary. The collectives are the autograd functions
of ``mappings.py``. At TP = 1 the layers are a plain ``F.linear`` / ``F.embedding``
with no extra copies and no collective. Once DDP has given a weight its ``main_grad``
the linear and embedding layers add the weight gradient straight into it
(gradient-accumulation fusion, on by default as in Megatron). Weights are stored
``[out, in]`` (``F.linear`` layout).

Unusual here: initialisation does not depend on the TP layout. Every rank draws the
*full* weight from the default generator, in the order a single process would (all
ranks share the seed), and keeps its shard, so one seed gives the same full model at
any TP size (Megatron does this only with ``--use-cpu-initialization``). Parameters
are allocated on the target device (``device`` argument, default: torch's current
default device).
"""

from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from megatron.core.transformer.cuda_graphs.turn import outside_turn

InitMethod = Callable[[torch.Tensor], None]


def accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input_`` (2-D), accumulated in main_grad's dtype by the GEMM."""
    accumulate_wgrad_t(main_grad, grad_output.t(), input_)


def accumulate_wgrad_t(main_grad: torch.Tensor, grad_output_t: torch.Tensor, input_: torch.Tensor) -> None:
    """``accumulate_wgrad`` given the transposed output gradient, ``[out, rows]``."""
    if grad_output_t.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output_t, input_)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output_t, input_, out_dtype=main_grad.dtype, out=main_grad)
    else:  # no mixed-dtype GEMM on the CPU
        main_grad.add_(grad_output_t @ input_)


class _LinearFunction(torch.autograd.Function):
    """``F.linear`` under autograd that saves its input and weight; a subclass's backward says what
    becomes of the weight gradient (:meth:`_parts` gives it the rest)."""

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight)
        # The parameter itself for its main_grad: under activation recomputation the saved
        # weight comes back as a plain tensor without it.
        ctx.param = weight
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    def _parts(ctx, grad_output):
        """``(grad_input, grad_bias, grad_output as rows, input as rows)``; None for what is not wanted."""
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_input, grad_bias, grad_2d, input_.reshape(-1, input_.shape[-1])


class LinearWithGradAccumulation(_LinearFunction):
    """``F.linear`` whose weight gradient is added straight into ``weight.main_grad``.

    Megatron's gradient-accumulation fusion: the wgrad GEMM reads the low-precision
    activations and accumulates in fp32 into the DDP buffer, so no bf16 wgrad is
    written, kept or added later. Autograd gets ``None`` for the weight; its
    AccumulateGrad node still runs (once, after every use of the weight), so DDP's
    post-accumulate hook still learns when the weight's gradient is complete.
    """

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_bias, grad_2d, input_2d = _LinearFunction._parts(ctx, grad_output)
        accumulate_wgrad(ctx.param.main_grad, grad_2d, input_2d)
        return grad_input, None, grad_bias


class EmbeddingWithGradAccumulation(torch.autograd.Function):
    """``F.embedding`` whose weight gradient is added straight into ``weight.main_grad``.

    The gradient rows of every token are accumulated in fp32 into the rows they looked
    up (``index_put_`` with ``accumulate=True``: sort-based on CUDA, deterministic).
    Unlike ``F.embedding``'s backward, no dense ``[vocab, hidden]`` gradient is built
    and added later: the only temporary is the fp32 copy of the token gradients.
    """

    @staticmethod
    def forward(ctx, input_ids, weight):
        ctx.save_for_backward(input_ids)
        ctx.weight = weight
        return F.embedding(input_ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        (input_ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
        main_grad.index_put_((input_ids.reshape(-1),), rows, accumulate=True)
        return None, None


class LinearWithHeldWgrad(_LinearFunction):
    """``F.linear`` whose weight gradient autograd holds for the weight's other use: the output layer
    tied to the word embeddings, without gradient-accumulation fusion, whose gradient waits for the
    embedding's part and is summed with it (in the weight's dtype, as ``F.linear``'s would be). The
    weight GEMM runs under ``outside_turn``: in a CUDA graph eager turn it lives in the eager cache,
    not in the turn's memory, which the next backward graph overwrites.
    """

    @staticmethod
    def backward(ctx, grad_output):
        grad_input, grad_bias, grad_2d, input_2d = _LinearFunction._parts(ctx, grad_output)
        grad_weight = None
        if ctx.needs_input_grad[1]:
            with outside_turn():
                grad_weight = grad_2d.t().mm(input_2d)
        return grad_input, grad_weight, grad_bias


def _fuses_wgrad(enabled: bool, weight: torch.Tensor) -> bool:
    """Whether this call should add the weight gradient straight into ``weight.main_grad``."""
    return enabled and weight.requires_grad and torch.is_grad_enabled() and hasattr(weight, "main_grad")


def linear(
    input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, fuse_wgrad: bool, shared: bool = False
):
    """``F.linear``, or ``LinearWithGradAccumulation`` when the weight has a main_grad to fuse into;
    otherwise ``LinearWithHeldWgrad`` for a ``shared`` weight (another layer differentiates it too)
    whose gradient is wanted (it requires grad, grad mode is on)."""
    if _fuses_wgrad(fuse_wgrad, weight):
        return LinearWithGradAccumulation.apply(input_, weight, bias)
    if shared and weight.requires_grad and torch.is_grad_enabled():
        return LinearWithHeldWgrad.apply(input_, weight, bias)
    return F.linear(input_, weight, bias)


def init_method_normal(std: float) -> InitMethod:
    """Returns an in-place initialiser drawing from N(0, std)."""

    def init_(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.normal_(mean=0.0, std=std)

    return init_


def resolve_device(device=None) -> torch.device:
    """The device to allocate parameters on: ``device`` or torch's current default device."""
    if device is not None:
        return torch.device(device)
    return torch.get_default_device()


def get_tensor_model_parallel_size(pg) -> int:
    """Tensor-parallel size of ``pg``: ``None`` -> 1, a ``ProcessGroups`` -> its ``tp_size``."""
    if pg is None:
        return 1
    if hasattr(pg, "tp_size"):
        return int(pg.tp_size)
    return dist.get_world_size(pg)  # a raw torch ProcessGroup standing for the TP group


def get_tensor_model_parallel_rank(pg) -> int:
    """This rank's index in the TP group of ``pg`` (``None`` -> 0)."""
    if pg is None:
        return 0
    if hasattr(pg, "tp_rank"):
        return int(pg.tp_rank)
    return dist.get_rank(pg)


def tp_group(pg):
    """The torch TP group of ``pg`` (``None`` for a group of one)."""
    if pg is None or get_tensor_model_parallel_size(pg) == 1:
        return None
    return pg.tp if hasattr(pg, "tp_size") else pg


def uses_sequence_parallel(pg) -> bool:
    """Whether the TP group of ``pg`` also splits the sequence (``--sequence-parallel``)."""
    return bool(getattr(pg, "sequence_parallel", False)) and get_tensor_model_parallel_size(pg) > 1


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by --tensor-model-parallel-size ({denominator}); "
            "pick sizes that divide."
        )
    return numerator // denominator


def _mark_tp(param: torch.nn.Parameter, is_parallel: bool, partition_dim: int, stride: int = 1) -> None:
    # Attributes Megatron's checkpoint/optimizer code reads to know how a tensor is sharded.
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim
    param.partition_stride = stride


def shard_of(full: torch.Tensor, dim: int, tp_size: int, tp_rank: int, stride: int = 1) -> torch.Tensor:
    """This rank's shard of a full tensor (a copy).

    ``full`` is cut along ``dim`` into ``stride`` blocks (SwiGLU's gate and up halves:
    stride 2), each block into ``tp_size`` pieces, and rank r keeps piece r of every
    block, in block order, as Megatron's ``stride`` does.
    """
    if tp_size == 1:
        return full
    pieces = torch.chunk(full, stride * tp_size, dim=dim)
    return torch.cat(pieces[tp_rank::tp_size], dim=dim).contiguous()


def section_shard(full: torch.Tensor, local_sections: list[int], tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's rows of a tensor made of sections (dim 0): slice ``tp_rank`` of each full section.

    Args:
        full: The one-process tensor; its dim 0 is the sections ``tp_size * s`` for ``s`` in ``local_sections``.
        local_sections: Each section's rows on one rank.
        tp_size, tp_rank: The tensor-parallel layout.
    """
    sections = full.split([s * tp_size for s in local_sections], dim=0)
    return torch.cat([section[tp_rank * s : (tp_rank + 1) * s] for section, s in zip(sections, local_sections)])


def rank_slice(full: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's contiguous share of dim 0 (its heads, or its heads' channels)."""
    size = full.shape[0] // tp_size
    return full[tp_rank * size : (tp_rank + 1) * size]


def sectioned_init(init_method, local_sections: list[int], tp_size: int):
    """An init method for a column-parallel weight whose rank-local rows are ``local_sections``.

    ``ColumnParallelLinear`` initialises the full weight and gives rank r its r-th block of
    rows; this draws the full weight in the one-process (section after section) layout and
    reorders it rank by rank, so that block is the rank's slice of every section.
    """

    def init_(full: torch.Tensor) -> None:
        init_method(full)
        if tp_size > 1:
            with torch.no_grad():
                full.copy_(torch.cat([section_shard(full, local_sections, tp_size, r) for r in range(tp_size)]))

    return init_


def full_from_shards(shards: list[torch.Tensor], dim: int, stride: int = 1) -> torch.Tensor:
    """Inverse of ``shard_of``: the full tensor from every rank's shard, in rank order."""
    blocks = [torch.chunk(s, stride, dim=dim) for s in shards]
    return torch.cat([blocks[r][b] for b in range(stride) for r in range(len(shards))], dim=dim)


def _init_param(
    shape: tuple, dim: int, init_method: InitMethod, *, tp_size: int, tp_rank: int, device, dtype, stride: int = 1
) -> torch.nn.Parameter:
    """A parameter holding this rank's shard of a full tensor initialised by ``init_method``."""
    full_shape = list(shape)
    full_shape[dim] *= tp_size
    full = torch.empty(full_shape, device=device, dtype=dtype)
    init_method(full)  # the same draws as a single process would make
    return torch.nn.Parameter(shard_of(full, dim, tp_size, tp_rank, stride))


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its output dimension across TP ranks.

    The input enters through copy-to-TP-region (identity forward, gradient all-reduce),
    or with sequence parallelism through an all-gather over the sequence (its backward
    a reduce-scatter).

    Args:
        input_size: Input features.
        output_size: Output features (all ranks together).
        config: ``TransformerConfig`` (reads ``params_dtype``).
        init_method: In-place weight initialiser.
        bias: Add a bias (zero-initialised).
        gather_output: Gather the output partitions so every rank has all of them.
        skip_bias_add: Return the bias instead of adding it, for a later fused add.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        skip_weight_param_allocation: Allocate no weight; ``forward`` then needs ``weight``
            (used for an output layer tied to the word embeddings).
        stride: Blocks of the output dimension that are split separately (2 for
            SwiGLU's ``[gate; up]``: each rank holds ``[gate_r; up_r]``).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: InitMethod,
        bias: bool = True,
        gather_output: bool = False,
        skip_bias_add: bool = False,
        pg=None,
        skip_weight_param_allocation: bool = False,
        stride: int = 1,
        device=None,
    ):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_size(pg)
        tp_rank = get_tensor_model_parallel_rank(pg)
        self.group = tp_group(pg)
        self.sequence_parallel = uses_sequence_parallel(pg)
        if self.sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output cannot be combined with --sequence-parallel.")
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "ColumnParallelLinear output size")
        _divide(output_size, self.tp_size * stride, "ColumnParallelLinear output size / stride")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)
        device = resolve_device(device)
        dtype = config.params_dtype
        if skip_weight_param_allocation:
            self.weight = None
        elif self.tp_size == 1:
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=dtype))
            init_method(self.weight)
        else:
            self.weight = _init_param(
                (self.output_size_per_partition, input_size),
                0,
                init_method,
                tp_size=self.tp_size,
                tp_rank=tp_rank,
                device=device,
                dtype=dtype,
                stride=stride,
            )
        if self.weight is not None:
            _mark_tp(self.weight, True, 0, stride)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=dtype))
            _mark_tp(self.bias, True, 0, stride)
        else:
            self.bias = None

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer to ``input_ [s, ..., input_size]`` (``[s / TP, ...]`` with sequence parallelism).

        Args:
            input_: Input activations.
            weight: Weight to use instead of ``self.weight`` (required when the layer
                was built with ``skip_weight_param_allocation``).

        Returns:
            ``(output [s, ..., output_size_per_partition], bias or None)`` (all output
            features with ``gather_output``); the bias is returned only with ``skip_bias_add``.
        """
        shared = weight is not None and weight is not self.weight  # the word embeddings' (a tied output layer)
        if weight is None:
            assert self.weight is not None, "ColumnParallelLinear built without a weight needs forward(weight=...)"
            weight = self.weight
        fuse = self.gradient_accumulation_fusion
        if self.sequence_parallel:
            input_ = gather_from_sequence_parallel_region(input_, self.group)
        else:
            input_ = copy_to_tensor_model_parallel_region(input_, self.group)
        bias = None if self.skip_bias_add else self.bias
        output = linear(input_, weight, bias, fuse_wgrad=fuse, shared=shared)
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, self.group)
        return output, (self.bias if self.skip_bias_add else None)

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, out_per_partition={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"
        )


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its input dimension across TP ranks.

    The partial products are summed by an all-reduce (a reduce-scatter over the
    sequence with sequence parallelism); the bias is not partitioned and is added once,
    after the sum. At TP = 1 the bias is added inside the GEMM.

    Args:
        input_size: Input features (all ranks together).
        output_size: Output features.
        config: ``TransformerConfig`` (reads ``params_dtype``).
        init_method: In-place weight initialiser.
        bias: Add a bias (zero-initialised).
        input_is_parallel: The input is already split across TP ranks (output of a
            column-parallel layer); otherwise it is scattered first.
        skip_bias_add: Return the bias instead of adding it.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        *,
        config,
        init_method: InitMethod,
        bias: bool = True,
        input_is_parallel: bool = True,
        skip_bias_add: bool = False,
        pg=None,
        device=None,
    ):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_size(pg)
        tp_rank = get_tensor_model_parallel_rank(pg)
        self.group = tp_group(pg)
        self.sequence_parallel = uses_sequence_parallel(pg)
        if self.sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: --sequence-parallel needs input_is_parallel=True.")
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "RowParallelLinear input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)
        device = resolve_device(device)
        dtype = config.params_dtype
        if self.tp_size == 1:
            self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, device=device, dtype=dtype))
            init_method(self.weight)
        else:
            self.weight = _init_param(
                (output_size, self.input_size_per_partition),
                1,
                init_method,
                tp_size=self.tp_size,
                tp_rank=tp_rank,
                device=device,
                dtype=dtype,
            )
        _mark_tp(self.weight, True, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            _mark_tp(self.bias, False, 0)
            # Added to a sequence shard: each rank's gradient is partial, summed over TP by DDP.
            self.bias.sequence_parallel = self.sequence_parallel
        else:
            self.bias = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer to ``input_ [s, ..., input_size_per_partition]``.

        Returns:
            ``(output [s, ..., output_size] ([s / TP, ...] with sequence parallelism),
            bias or None)``; the bias is returned only with ``skip_bias_add``.
        """
        fuse = self.gradient_accumulation_fusion
        if self.tp_size == 1:
            if self.skip_bias_add:
                return linear(input_, self.weight, None, fuse_wgrad=fuse), self.bias
            return linear(input_, self.weight, self.bias, fuse_wgrad=fuse), None
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, self.group)
        partial = linear(input_, self.weight, None, fuse_wgrad=fuse)
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, self.group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, self.group)
        if self.skip_bias_add or self.bias is None:
            return output, self.bias
        return output + self.bias, None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, in_per_partition={self.input_size_per_partition}, out={self.output_size}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary across TP ranks.

    Rank r holds rows ``[vocab_start_index, vocab_end_index)``; ids outside them look
    up zeros, and the partial lookups are summed over TP (all-reduce, or a
    reduce-scatter over the first dim with ``reduce_scatter_embeddings``).

    Args:
        num_embeddings: Vocabulary size (all ranks together, already padded).
        embedding_dim: Hidden size.
        config: ``TransformerConfig`` (reads ``params_dtype``).
        init_method: In-place weight initialiser.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        reduce_scatter_embeddings: Sum by a reduce-scatter over the first dim
            (sequence parallelism, ids given ``[s, b]``).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        config,
        init_method: InitMethod,
        pg=None,
        reduce_scatter_embeddings: bool = False,
        device=None,
    ):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_size(pg)
        tp_rank = get_tensor_model_parallel_rank(pg)
        self.group = tp_group(pg)
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and self.tp_size > 1
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = _divide(num_embeddings, self.tp_size, "padded vocabulary size")
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        device, dtype = resolve_device(device), config.params_dtype
        if self.tp_size == 1:
            self.weight = torch.nn.Parameter(torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype))
            init_method(self.weight)
        else:
            self.weight = _init_param(
                (self.num_embeddings_per_partition, embedding_dim),
                0,
                init_method,
                tp_size=self.tp_size,
                tp_rank=tp_rank,
                device=device,
                dtype=dtype,
            )
        _mark_tp(self.weight, True, 0)
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Looks up ``input_ids [...]`` and returns ``[..., embedding_dim]``."""
        outside = None
        if self.tp_size > 1:
            outside = (input_ids < self.vocab_start_index) | (input_ids >= self.vocab_end_index)
            input_ids = (input_ids - self.vocab_start_index).masked_fill(outside, 0)
        if _fuses_wgrad(self.gradient_accumulation_fusion, self.weight):
            output = EmbeddingWithGradAccumulation.apply(input_ids, self.weight)
        else:
            output = F.embedding(input_ids, self.weight)
        if outside is None:
            return output
        output = output.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(output, self.group)
        return reduce_from_tensor_model_parallel_region(output, self.group)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, per_partition={self.num_embeddings_per_partition}"
