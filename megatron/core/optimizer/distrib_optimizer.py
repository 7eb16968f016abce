"""The distributed optimizer (``--use-distributed-optimizer``), and the optimizer factory.

``DistributedOptimizer`` is ``MixedPrecisionOptimizer`` over *shards*: DDP (built with
``use_distributed_optimizer``) lays every bucket out in equal contiguous shards, one
per DP rank, for both the fp32 gradients and the parameters. This rank optimizes only
the pieces of parameters that fall in its shards: each piece is a flat
``torch.nn.Parameter`` aliasing the parameter buffer, whose ``main_grad`` is the same
slice of the (reduce-scattered) gradient buffer. So fp32 main params (for bf16/fp16
models) and Adam's moments exist for about 1/DP of the model on each rank. After the
inner step, DDP all-gathers every bucket's parameters (``start_param_sync``), at once
or, with ``--overlap-param-gather``, overlapped with the next forward.

The gradient norm sums each rank's squares over DP and the model-parallel group;
weight decay follows the *full* parameter's shape (a shard is always 1-D).

``build_optimizer`` picks this class or the plain one and hands either the norm
bookkeeping that model parallelism needs.
"""

from typing import Any

import torch

from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer, _uses_weight_decay


def counts_for_norm(param: torch.nn.Parameter, pg) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm: TP-split parameters
    on every TP rank, replicated ones on TP rank 0 only (each TP rank holds a copy); never
    the last pipeline stage's copy of a tied embedding (the first stage counts it)."""
    if getattr(param, "shared_embedding", False):
        return False
    return pg.tp_size == 1 or pg.tp_rank == 0 or bool(getattr(param, "tensor_model_parallel", False))


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Optimizer state and fp32 main params sharded over the data-parallel group.

    Args:
        ddp: A ``DistributedDataParallel`` built with ``use_distributed_optimizer``.
        pg: Process groups (``dp`` for the shards, ``mp`` for the norm).
        config, precision, preallocate_state, kwargs: As ``MixedPrecisionOptimizer``.

    Attributes:
        shards: ``(model param, start, end)`` per optimized piece: flat element range of
            the parameter this rank owns.
    """

    def __init__(self, ddp, *, pg, config, precision, preallocate_state: bool = False, **kwargs):
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs DDP built with use_distributed_optimizer=True.")
        self.ddp = ddp
        self.shards: list[tuple[torch.nn.Parameter, int, int]] = []
        buffer = ddp.grad_buffer
        dp_size, dp_rank = pg.dp_size, pg.dp_rank
        pieces, full_of, owned, norm_pieces = [], {}, [], []
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range(dp_rank, dp_size)
            owned.append(buffer.data[lo:hi])
            for param in bucket.params:
                start, end = buffer.param_range(param)
                a, b = max(start, lo), min(end, hi)
                if a >= b:
                    continue
                piece = torch.nn.Parameter(buffer.param_data[a:b], requires_grad=True)  # aliases the buffer
                piece.main_grad = buffer.data[a:b]
                pieces.append(piece)
                full_of[id(piece)] = param
                self.shards.append((param, a - start, b - start))
                if counts_for_norm(param, pg):
                    norm_pieces.append(piece.main_grad)
        if not pieces:
            raise ValueError(
                "this data-parallel rank owns no parameter elements: the model is too small for "
                f"--use-distributed-optimizer over {dp_size} ranks; drop the flag."
            )
        all_count = len(norm_pieces) == len(pieces)
        super().__init__(
            pieces,
            config=config,
            precision=precision,
            preallocate_state=preallocate_state,
            # Every owned element counts on TP rank 0: one reduction per bucket shard.
            grad_buffers=owned if all_count else (),
            grad_norm_tensors=None if all_count else norm_pieces,
            grad_norm_groups=(pg.mp, pg.dp),
            uses_weight_decay=lambda piece: _uses_weight_decay(full_of[id(piece)]),
            **kwargs,
        )

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> tuple[bool, torch.Tensor | None, int | None]:
        """The inner step on this rank's shards, then the all-gather of the parameters."""
        self.ddp.finish_param_sync()  # a gather still writing the buffer would race the update
        success, grad_norm, num_zeros = super().step(skip)
        if success:
            self.ddp.start_param_sync()
        return success, grad_norm, num_zeros

    def state_numel(self) -> int:
        """Elements of optimizer state (moments) and fp32 main copies held by this rank."""
        total = sum(m.numel() for m in self._lowp_main)
        for state in self.optimizer.state.values():
            total += sum(v.numel() for k, v in state.items() if torch.is_tensor(v) and k != "step")
        return total


def build_optimizer(ddp, *, pg, config, precision, preallocate_state: bool = False, **kwargs) -> Any:
    """The run's optimizer: distributed when DDP shards the buckets, else replicated.

    Args:
        ddp: The model wrapped in ``DistributedDataParallel``.
        pg: Process groups.
        config: ``OptimizerConfig``.
        precision: ``PrecisionConfig``.
        preallocate_state: Allocate Adam's moments now (CUDA graphs).
        kwargs: Further ``MixedPrecisionOptimizer`` arguments (``skip_non_finite``).
    """
    if ddp.use_distributed_optimizer:
        return DistributedOptimizer(
            ddp, pg=pg, config=config, precision=precision, preallocate_state=preallocate_state, **kwargs
        )
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    if getattr(pg, "mp", None) is not None:
        kwargs["grad_norm_groups"] = (pg.mp,)
        if not all(counts_for_norm(p, pg) for p in params):
            kwargs["grad_norm_tensors"] = [p.main_grad for p in dict.fromkeys(params) if counts_for_norm(p, pg)]
    return MixedPrecisionOptimizer(
        params,
        config=config,
        precision=precision,
        preallocate_state=preallocate_state,
        grad_buffers=[ddp.grad_buffer.data],
        **kwargs,
    )
