"""Tensor-parallel building blocks: column/row parallel linear and vocab-parallel embedding.

Each layer computes its local partition size from the tensor-parallel size and
allocates only its local shard, the way Megatron does, so tensor parallelism can be
added later by inserting the collectives where the comments say. Today only
TP = 1 runs: there the layers are a plain ``F.linear`` / ``F.embedding`` with no
extra copies, except that once DDP has given a weight its ``main_grad`` the linear
and embedding layers add the weight gradient straight into it (gradient-accumulation
fusion, on by default as in Megatron, which fuses the linear layers only). Weights
are stored ``[out, in]`` (``F.linear`` layout).

Unusual here: parameters are allocated directly on the target device (``device``
argument, default: torch's current default device) and initialised there with the
default generator, so ``torch.manual_seed`` alone makes initialisation
deterministic.
"""

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

InitMethod = Callable[[torch.Tensor], None]


def accumulate_wgrad(main_grad: torch.Tensor, grad_output: torch.Tensor, input_: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ input_`` (2-D), accumulated in main_grad's dtype by the GEMM."""
    if grad_output.dtype == main_grad.dtype:
        main_grad.addmm_(grad_output.t(), input_)
    elif main_grad.is_cuda:
        torch.addmm(main_grad, grad_output.t(), input_, out_dtype=main_grad.dtype, out=main_grad)
    else:  # no mixed-dtype GEMM on the CPU
        main_grad.add_(grad_output.t() @ input_)


class LinearWithGradAccumulation(torch.autograd.Function):
    """``F.linear`` whose weight gradient is added straight into ``weight.main_grad``.

    Megatron's gradient-accumulation fusion: the wgrad GEMM reads the low-precision
    activations and accumulates in fp32 into the DDP buffer, so no bf16 wgrad is
    written, kept or added later. Autograd gets ``None`` for the weight; its
    AccumulateGrad node still runs (once, after every use of the weight), so DDP's
    post-accumulate hook still learns when the weight's gradient is complete.
    """

    @staticmethod
    def forward(ctx, input_, weight, bias):
        ctx.save_for_backward(input_, weight)
        ctx.has_bias = bias is not None
        return F.linear(input_, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        input_, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_2d = grad_output.reshape(-1, grad_output.shape[-1])
        accumulate_wgrad(weight.main_grad, grad_2d, input_.reshape(-1, input_.shape[-1]))
        grad_bias = grad_2d.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
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


def _fuses_wgrad(enabled: bool, weight: torch.Tensor) -> bool:
    """Whether this call should add the weight gradient straight into ``weight.main_grad``."""
    return enabled and weight.requires_grad and torch.is_grad_enabled() and hasattr(weight, "main_grad")


def linear(input_: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, *, fuse_wgrad: bool):
    """``F.linear``, or ``LinearWithGradAccumulation`` when the weight has a main_grad to fuse into."""
    if _fuses_wgrad(fuse_wgrad, weight):
        return LinearWithGradAccumulation.apply(input_, weight, bias)
    return F.linear(input_, weight, bias)


def init_method_normal(std: float) -> InitMethod:
    """Returns an in-place initialiser drawing from N(0, std)."""

    def init_(tensor: torch.Tensor) -> None:
        with torch.no_grad():
            tensor.normal_(mean=0.0, std=std)

    return init_


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)): Megatron's init for the output projections of residual branches."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def resolve_device(device=None) -> torch.device:
    """The device to allocate parameters on: ``device`` or torch's current default device."""
    if device is not None:
        return torch.device(device)
    get_default = getattr(torch, "get_default_device", None)  # torch >= 2.3
    return get_default() if get_default is not None else torch.device("cpu")


def get_tensor_model_parallel_size(pg) -> int:
    """Tensor-parallel size of ``pg``: ``None`` -> 1, a ``ProcessGroups`` -> its ``tp_size``."""
    if pg is None:
        return 1
    if hasattr(pg, "tp_size"):
        return int(pg.tp_size)
    import torch.distributed as dist  # a raw torch ProcessGroup standing for the TP group

    return dist.get_world_size(pg)


def _check_tp_supported(tp_size: int, name: str) -> None:
    # ParallelConfig.validate() already rejects --tensor-model-parallel-size > 1 for users;
    # this guards direct construction until the TP collectives exist.
    if tp_size != 1:
        raise NotImplementedError(f"{name}: tensor parallelism (tp_size={tp_size}) is not implemented yet.")


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator != 0:
        raise ValueError(
            f"{what} ({numerator}) must be divisible by --tensor-model-parallel-size ({denominator}); "
            "pick sizes that divide."
        )
    return numerator // denominator


def _mark_tp(param: torch.nn.Parameter, is_parallel: bool, partition_dim: int) -> None:
    # Attributes Megatron's checkpoint/optimizer code reads to know how a tensor is sharded.
    param.tensor_model_parallel = is_parallel
    param.partition_dim = partition_dim


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its output dimension across TP ranks.

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
        device=None,
    ):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_size(pg)
        _check_tp_supported(self.tp_size, "ColumnParallelLinear")
        self.input_size = input_size
        self.output_size = output_size
        self.output_size_per_partition = _divide(output_size, self.tp_size, "ColumnParallelLinear output size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)
        device = resolve_device(device)
        dtype = config.params_dtype
        if skip_weight_param_allocation:
            self.weight = None
        else:
            self.weight = torch.nn.Parameter(
                torch.empty(self.output_size_per_partition, input_size, device=device, dtype=dtype)
            )
            init_method(self.weight)
            _mark_tp(self.weight, True, 0)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(self.output_size_per_partition, device=device, dtype=dtype))
            _mark_tp(self.bias, True, 0)
        else:
            self.bias = None

    def forward(
        self, input_: torch.Tensor, weight: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer to ``input_ [..., input_size]``.

        Args:
            input_: Input activations.
            weight: Weight to use instead of ``self.weight`` (required when the layer
                was built with ``skip_weight_param_allocation``).

        Returns:
            ``(output [..., output_size_per_partition], bias or None)``; the bias is
            returned only with ``skip_bias_add``.
        """
        if weight is None:
            assert self.weight is not None, "ColumnParallelLinear built without a weight needs forward(weight=...)"
            weight = self.weight
        fuse = self.gradient_accumulation_fusion
        # TP > 1: input goes through copy-to-TP-region (identity fwd, all-reduce of the grad bwd),
        # and the output through a gather when gather_output is set.
        if self.skip_bias_add:
            return linear(input_, weight, None, fuse_wgrad=fuse), self.bias
        return linear(input_, weight, self.bias, fuse_wgrad=fuse), None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, out={self.output_size}, out_per_partition={self.output_size_per_partition}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"
        )


class RowParallelLinear(torch.nn.Module):
    """Y = X A^T + b with A split along its input dimension across TP ranks.

    The bias is not partitioned: it is added once, after the partial products are summed.

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
        _check_tp_supported(self.tp_size, "RowParallelLinear")
        self.input_size = input_size
        self.output_size = output_size
        self.input_size_per_partition = _divide(input_size, self.tp_size, "RowParallelLinear input size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)
        device = resolve_device(device)
        dtype = config.params_dtype
        self.weight = torch.nn.Parameter(
            torch.empty(output_size, self.input_size_per_partition, device=device, dtype=dtype)
        )
        init_method(self.weight)
        _mark_tp(self.weight, True, 1)
        if bias:
            self.bias = torch.nn.Parameter(torch.zeros(output_size, device=device, dtype=dtype))
            _mark_tp(self.bias, False, 0)
        else:
            self.bias = None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Applies the layer to ``input_ [..., input_size_per_partition]``.

        Returns:
            ``(output [..., output_size], bias or None)``; the bias is returned only
            with ``skip_bias_add``.
        """
        # TP > 1: scatter the input unless input_is_parallel, all-reduce the partial output,
        # and only then add the (unsplit) bias.
        fuse = self.gradient_accumulation_fusion
        if self.skip_bias_add:
            return linear(input_, self.weight, None, fuse_wgrad=fuse), self.bias
        return linear(input_, self.weight, self.bias, fuse_wgrad=fuse), None

    def extra_repr(self) -> str:
        return (
            f"in={self.input_size}, in_per_partition={self.input_size_per_partition}, out={self.output_size}, "
            f"bias={self.bias is not None}, skip_bias_add={self.skip_bias_add}"
        )


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding table split along the vocabulary across TP ranks.

    Rank r holds rows ``[vocab_start_index, vocab_end_index)``.

    Args:
        num_embeddings: Vocabulary size (all ranks together, already padded).
        embedding_dim: Hidden size.
        config: ``TransformerConfig`` (reads ``params_dtype``).
        init_method: In-place weight initialiser.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self, num_embeddings: int, embedding_dim: int, *, config, init_method: InitMethod, pg=None, device=None
    ):
        super().__init__()
        self.tp_size = get_tensor_model_parallel_size(pg)
        _check_tp_supported(self.tp_size, "VocabParallelEmbedding")
        tp_rank = 0
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_per_partition = _divide(num_embeddings, self.tp_size, "padded vocabulary size")
        self.vocab_start_index = tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        self.weight = torch.nn.Parameter(
            torch.empty(
                self.num_embeddings_per_partition,
                embedding_dim,
                device=resolve_device(device),
                dtype=config.params_dtype,
            )
        )
        init_method(self.weight)
        _mark_tp(self.weight, True, 0)
        self.gradient_accumulation_fusion = getattr(config, "gradient_accumulation_fusion", False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Looks up ``input_ids [...]`` and returns ``[..., embedding_dim]``."""
        # TP > 1: shift ids by vocab_start_index, zero rows of ids outside this shard, all-reduce.
        if _fuses_wgrad(self.gradient_accumulation_fusion, self.weight):
            return EmbeddingWithGradAccumulation.apply(input_ids, self.weight)
        return F.embedding(input_ids, self.weight)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, per_partition={self.num_embeddings_per_partition}"
