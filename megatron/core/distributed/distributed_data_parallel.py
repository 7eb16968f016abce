"""Data-parallel wrapper: main_grad in one contiguous buffer, bucketed all-reduce.

``DistributedDataParallel`` wraps a model, gives each trainable parameter a
``main_grad`` view into one ``GradBuffer`` and, after each backward, averages the
buffer over the data-parallel group bucket by bucket. The buffer is fp32 by default
(``grad_reduce_in_fp32``); without it, it has the parameters' dtype (Megatron's
``--grad-reduce-in-bf16``, or ``--fp16`` without ``--accumulate-allreduce-grads-in-fp32``):
gradients then accumulate across micro-batches and are reduced in that dtype, and the
optimizer turns them into fp32 gradients of its fp32 main params.

How gradients arrive. Eager parameters: with ``overlap_grad_reduce``, a
post-accumulate-grad hook adds ``param.grad`` into ``main_grad``, drops ``param.grad``
and calls ``register_grad_ready(param)`` so buckets can launch during backward.
Without overlap nothing can launch early, so there are no hooks: ``accumulate_grads()``
folds every ``param.grad`` into ``main_grad`` with multi-tensor kernels after each
micro-batch's backward (``no_sync`` exit and ``finish_grad_sync`` call it). That is
the same ``main_grad += grad`` per element, bitwise, without a Python hook per
parameter on the step's critical path.
Weights of linear layers with gradient-accumulation fusion: the wgrad GEMM adds into
``main_grad`` itself; autograd still runs the weight's AccumulateGrad (with no
gradient), so the same hook marks it ready.
Parameters inside a CUDA-graphed region: the backward graph adds wgrads into
``main_grad`` itself, and the graph session, for which this class is a grad sink
(``manages`` / ``mark_ready`` / ``add_event``), marks them ready with an event recorded
after the replay; the bucket waits on that event before it is read.

Unusual choices:
- Buckets are launched strictly in index order (a bucket that becomes ready waits
  for its predecessors), so every rank issues the same collectives in the same order
  even if hooks fire in a different order somewhere.
- Averaging is ``ReduceOp.AVG`` on NCCL and ``x * (1/dp)`` then ``SUM`` elsewhere
  (gloo has no AVG). With DP = 1 nothing is communicated, but events are still waited.
- No host synchronisation anywhere on this path (readiness is plain Python sets).

With ``use_distributed_optimizer`` each bucket is reduce-scattered instead of
all-reduced (DP rank r keeps the r-th equal shard of every bucket: only that part of
``main_grad`` is averaged afterwards), and the parameters live in a flat buffer laid
out like the gradients, so ``start_param_sync`` refreshes them with one all-gather per
bucket after the optimizer updated its shards. With ``overlap_param_gather`` those
all-gathers run asynchronously and a forward pre-hook on each module waits for the
buckets of its parameters, so the gather overlaps the next forward.

With ``--num-distributed-optimizer-instances N`` (Megatron's partial distributed
optimizer) the shards are those of the DP / N ranks of this rank's optimizer instance
(``pg.intra_dp``): a bucket is reduce-scattered within the instance, then the reduced
shard is all-reduced across the instances (``pg.inter_dp``), and the parameters are
all-gathered within the instance. Overlapped on CUDA, the two reductions run on a
communication stream of their own, as in Megatron.

Expert parameters (``is_expert``, set by the MoE experts) live in a second buffer,
``expert_grad_buffer``, bucketed the same way and reduced over the expert-data-parallel
group (the ranks that hold the same experts) instead of the data-parallel group. Their
gradient already sums every token routed to them from the whole expert-parallel group,
so the buffer is summed over expert-DP and scaled by 1 / DP (the dense DP size, as
Megatron): the result is the gradient of the DP-mean loss, like the dense one. With
expert-DP = 1 only the scaling remains. Each buffer launches its own buckets in order;
with the distributed optimizer the expert buffer is sharded over expert-DP.

With sequence parallelism, parameters marked ``sequence_parallel`` (norms and biases
on sequence shards) have partial gradients on each TP rank; ``finish_grad_sync`` sums
them over TP after the DP reduction, in one all-reduce (Megatron does this in
``finalize_model_grads``).
"""

import contextlib
import weakref

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from megatron.core.config_utils import require
from megatron.core.distributed.grad_fold import FoldPlan, fold_grad
from megatron.core.distributed.param_and_grad_buffer import Bucket, GradBuffer

# torch >= 2.10 renamed the single-tensor collectives; the old names warn.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default bucket size in elements: max(40M, 1M * DP)."""
    return max(40_000_000, 1_000_000 * dp_size)


class DistributedDataParallel(torch.nn.Module):
    """Wraps ``module`` for data-parallel training with a contiguous gradient buffer.

    Args:
        module: The model. Its trainable parameters must all live on one device.
        config: ``DDPConfig`` (``overlap_grad_reduce``, ``ddp_bucket_size``,
            ``use_distributed_optimizer``, ``overlap_param_gather``).
        pg: Process groups; ``pg.dp`` is the data-parallel group (``None`` for DP = 1),
            ``pg.expt_dp`` the expert-data-parallel one, ``pg.tp`` the tensor-parallel
            group (sequence-parallel gradients).
        grad_reduce_in_fp32: fp32 gradient buffers (default); False gives buffers of the
            parameters' dtype, which must then be one dtype per buffer.

    Attributes:
        module: The wrapped model.
        grad_buffer: The ``GradBuffer`` holding every dense ``main_grad``.
        expert_grad_buffer: The ``GradBuffer`` of the expert parameters (``None``
            without experts), reduced over ``pg.expt_dp``.
    """

    def __init__(self, module: torch.nn.Module, *, config, pg, grad_reduce_in_fp32: bool = True):
        super().__init__()
        self.module = module
        self.config = config
        self.pg = pg
        self.dp_size = pg.dp_size
        params = [p for p in module.parameters() if p.requires_grad]
        bucket_size, num_buckets = config.ddp_bucket_size, getattr(config, "ddp_num_buckets", None)
        if num_buckets is not None:
            require(bucket_size is None, "--ddp-num-buckets and --ddp-bucket-size cannot both be given; pick one.")
            require(num_buckets >= 1, f"--ddp-num-buckets must be >= 1, got {num_buckets}.")
            bucket_size = max(1, sum(p.numel() for p in params) // num_buckets)  # Megatron's rule
        if bucket_size is None:
            bucket_size = default_bucket_size(self.dp_size)
        require(bucket_size >= 1, f"--ddp-bucket-size must be >= 1, got {bucket_size}; drop it for the default.")
        devices = {p.device for p in params}
        require(
            len(devices) <= 1, f"all trainable parameters must live on one device, found {sorted(map(str, devices))}."
        )
        device = devices.pop() if devices else pg.device
        self.use_distributed_optimizer = bool(getattr(config, "use_distributed_optimizer", False))
        self.overlap_param_gather = self.use_distributed_optimizer and bool(
            getattr(config, "overlap_param_gather", False)
        )
        dense = [p for p in params if not is_expert_param(p)]
        expert = [p for p in params if is_expert_param(p)]
        self.grad_reduce_in_fp32 = grad_reduce_in_fp32
        self.expt_dp_size = pg.expt_dp_size
        self.num_instances = pg.inter_dp_size
        require(
            self.num_instances == 1 or self.use_distributed_optimizer,
            f"--num-distributed-optimizer-instances {self.num_instances} needs --use-distributed-optimizer; add it "
            "or drop --num-distributed-optimizer-instances.",
        )
        # The distributed optimizer shards each bucket over the ranks of one optimizer instance.
        dense_group, expert_group = (
            ("intra_dp", "intra_expt_dp") if self.use_distributed_optimizer else ("dp", "expt_dp")
        )
        # Backward order: the last parameters get their gradients first.
        self.grad_buffer = GradBuffer(
            list(reversed(dense)),
            bucket_size=bucket_size,
            device=device,
            dtype=_grad_dtype(dense, grad_reduce_in_fp32),
            shard_count=pg.intra_dp_size if self.use_distributed_optimizer else 1,
            param_buffer=self.use_distributed_optimizer,
        )
        self.expert_grad_buffer = None
        if expert:
            self.expert_grad_buffer = GradBuffer(
                list(reversed(expert)),
                bucket_size=bucket_size,
                device=device,
                dtype=_grad_dtype(expert, grad_reduce_in_fp32),
                shard_count=pg.intra_expt_dp_size if self.use_distributed_optimizer else 1,
                param_buffer=self.use_distributed_optimizer,
            )
        self._sequence_parallel_params = [p for p in params if getattr(p, "sequence_parallel", False)]

        # --ddp-average-in-collective: ReduceOp.AVG where the backend has it (NCCL); gloo has no
        # AVG, so there the gradients get the pre-scale and a SUM, as without the flag (NCCL's
        # AVG of floating-point data is that pre-scaled sum too).
        use_avg = (
            bool(getattr(config, "ddp_average_in_collective", False))
            and self.dp_group is not None
            and dist.get_backend(self.dp_group) == "nccl"
        )
        self._syncs = [
            _BufferSync(self.grad_buffer, dense_group, *_place(pg, dense_group), 1.0 / self.dp_size, use_avg)
        ]
        if self.expert_grad_buffer is not None:
            # Summed over expert-DP, scaled by 1 / DP: no AVG op gives that factor.
            self._syncs.append(
                _BufferSync(self.expert_grad_buffer, expert_group, *_place(pg, expert_group), 1.0 / self.dp_size)
            )
        self._comm_stream = None  # several optimizer instances, overlapped on CUDA: the reductions' stream
        self._sync_of_id: dict[int, tuple] = {}  # id(param) -> (its _BufferSync, its bucket)
        for sync in self._syncs:
            for pid, bucket in sync.buffer.bucket_of_id.items():
                self._sync_of_id[pid] = (sync, bucket)
        self._sync_enabled = True
        self._params = params
        self._fold_plan = None  # how accumulate_grads folds; the same parameters every step
        self._hook_handles = []
        if config.overlap_grad_reduce:
            hook = _WeakHook(self._on_grad_accumulated)
            self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in params]
        if self.overlap_param_gather:
            self._hook_handles += self._register_param_gather_hooks(module)

    @property
    def dp_group(self):
        """The data-parallel group, read from ``pg`` (no second handle to keep it alive)."""
        return self.pg.dp

    # ------------------------------------------------------------------ forward

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def state_dict(self, *args, **kwargs):
        """The wrapped module's state dict (no ``module.`` prefix, as Megatron)."""
        self.finish_param_sync()
        return self.module.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, **kwargs):
        return self.module.load_state_dict(state_dict, strict=strict, **kwargs)

    # ------------------------------------------------------------------ buffer

    @property
    def grad_buffers(self) -> list[GradBuffer]:
        """The dense buffer, then the expert buffer if the model has experts."""
        return [sync.buffer for sync in self._syncs]

    @property
    def buckets(self) -> list[Bucket]:
        """Every bucket: the dense buffer's, then the expert buffer's."""
        return [bucket for sync in self._syncs for bucket in sync.buffer.buckets]

    def scale_grads(self, factor) -> None:
        """Multiplies every ``main_grad`` by ``factor`` (a number or a 0-d device tensor)."""
        for buffer in self.grad_buffers:
            buffer.data.mul_(factor)

    def zero_grad_buffer(self) -> None:
        """Zeroes every ``main_grad`` in place and starts a new gradient sync.

        Outstanding events and reductions are waited on first, so nothing still
        writing into the buffer can race with the zeroing.
        """
        for bucket in self.buckets:
            bucket.wait_events()
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
            bucket.reset()
        for sync in self._syncs:
            sync.next_bucket = 0
            sync.buffer.zero_()

    @contextlib.contextmanager
    def no_sync(self):
        """Inside: gradients accumulate in ``main_grad`` and nothing is reduced.

        Wrap every micro-batch but the last of an iteration in it.
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
            self.accumulate_grads()

    # ------------------------------------------------------------------ readiness

    def accumulate_grads(self) -> None:
        """Adds every pending ``param.grad`` into ``main_grad`` and drops it.

        A no-op with hooks (``overlap_grad_reduce``): they have done it already.
        """
        with_grad = [p for p in self._params if p.grad is not None]
        if not with_grad:
            return
        # A .grad that already *is* main_grad (someone left it attached) has been
        # accumulated into the buffer by autograd itself: adding it again would double it.
        pending = [p for p in with_grad if p.grad.data_ptr() != p.main_grad.data_ptr()]
        if pending:
            key = tuple(map(id, pending))
            if self._fold_plan is None or self._fold_plan.key != key:
                self._fold_plan = None  # its scratch is free for the new plan
                self._fold_plan = FoldPlan(pending, key)
            self._fold_plan.run(pending)
        for p in with_grad:
            p.grad = None

    def fold_grads_on_arrival(self) -> None:
        """Folds each ``param.grad`` into ``main_grad`` when autograd produces it (the same add, bitwise), not
        after the backward. The CUDA graphs' eager turn needs it: no gradient may wait past the first backward
        graph. With ``overlap_grad_reduce`` the hooks do this already."""
        if not self.config.overlap_grad_reduce:
            self._hook_handles += [p.register_post_accumulate_grad_hook(fold_grad) for p in self._params]

    def _on_grad_accumulated(self, param: torch.nn.Parameter) -> None:
        fold_grad(param)  # autograd has just put the full gradient of this backward into param.grad
        self.register_grads_ready((param,))

    def register_grad_ready(self, param: torch.nn.Parameter, event=None) -> None:
        """Marks ``param``'s gradient as complete in ``main_grad`` for this backward.

        Args:
            param: A parameter of the wrapped module.
            event: Optional ``torch.cuda.Event`` recorded after the work that wrote
                ``main_grad`` (a graph replay, maybe on another stream). It is waited on
                before the bucket is scaled or reduced, with or without overlap.
        """
        self.register_grads_ready((param,), event)

    def register_grads_ready(self, params, event=None) -> None:
        """``register_grad_ready`` for many parameters written by the same work (one
        graph replay): each bucket they touch gets ``event`` once. Runs once per backward
        graph replay, so it keys by ``id`` (a tensor's ``__hash__`` is a Python call)."""
        of_id = self._sync_of_id
        touched = {}
        for param in params:
            found = of_id.get(id(param))
            if found is None:
                raise RuntimeError("register_grad_ready got a parameter that this DDP does not manage.")
            bucket = found[1]
            touched[id(bucket)] = bucket
            if self._sync_enabled:
                if bucket.launched:
                    raise RuntimeError(
                        f"a gradient arrived for bucket {bucket.index} after its reduction was launched; run "
                        "every micro-batch but the last under no_sync(), and call zero_grad_buffer() before "
                        "the next iteration's backward."
                    )
                bucket.ready.add(id(param))
        if event is not None:
            for bucket in touched.values():
                bucket.add_event(event)
        if self._sync_enabled and self.config.overlap_grad_reduce:
            self._launch_in_order(only_ready=True)

    # ------------------------------------------------------------------ GradSink (cuda_graphs)

    def manages(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param``'s gradient lives in this DDP's buffer."""
        return id(param) in self._sync_of_id

    def mark_ready(self, params, event) -> None:
        """A backward graph completed ``params``' main_grads; ``event`` follows its replay."""
        self.register_grads_ready(params, event)

    def add_event(self, params, event) -> None:
        """A backward graph wrote part of ``params``' main_grads; read them after ``event``."""
        for param in params:
            self.add_grad_event(param, event)

    def add_grad_event(self, param: torch.nn.Parameter, event) -> None:
        """Makes ``param``'s bucket wait on ``event`` before it is read, without marking
        the parameter ready (part of its gradient is still to come, e.g. a tied weight)."""
        found = self._sync_of_id.get(id(param))
        if found is None:
            raise RuntimeError("add_grad_event got a parameter that this DDP does not manage.")
        found[1].add_event(event)

    # ------------------------------------------------------------------ reduction

    def _launch(self, sync: "_BufferSync", bucket: Bucket) -> None:
        bucket.wait_events()
        bucket.launched = True
        group = getattr(self.pg, sync.group_name)
        inter = self.pg.inter_dp if self.use_distributed_optimizer else None
        if group is None and inter is None:
            if sync.scale != 1.0:  # expert-DP = 1 under DP > 1: the 1 / DP is all there is
                bucket.data.mul_(sync.scale)
            return
        if sync.use_avg_op:
            op = dist.ReduceOp.AVG
        else:
            bucket.data.mul_(sync.scale)
            op = dist.ReduceOp.SUM
        if not self.use_distributed_optimizer:
            bucket.handle = dist.all_reduce(bucket.data, op=op, group=group, async_op=True)
            return
        # In place: this rank's shard of the bucket receives the reduced shard.
        start, end = bucket.shard_range(sync.rank, sync.size)
        shard = sync.buffer.data[start:end]
        if inter is None:
            bucket.handle = _reduce_scatter_single(shard, bucket.data, op=op, group=group, async_op=True)
        else:
            bucket.handle = self._reduce_over_instances(shard, bucket.data, op, group, inter)

    def _reduce_over_instances(self, shard, data, op, group, inter):
        """Reduce-scatter ``data`` within this optimizer instance (``group``; ``None``: one
        rank, nothing to scatter), then all-reduce the reduced ``shard`` across the
        instances. Returns a handle whose ``wait()`` orders the caller after both.

        Overlapped on CUDA, both run on a communication stream of their own, which waits
        for the gradients first: the all-reduce has to wait for the reduce-scatter, and
        on the compute stream that wait would hold back the rest of backward.
        """
        if data.is_cuda and self.config.overlap_grad_reduce:
            if self._comm_stream is None:
                self._comm_stream = torch.cuda.Stream(device=data.device)
            stream = self._comm_stream
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                if group is not None:
                    _reduce_scatter_single(shard, data, op=op, group=group)
                dist.all_reduce(shard, op=op, group=inter)
            return _StreamWork(stream)
        if group is not None:
            _reduce_scatter_single(shard, data, op=op, group=group)
        return dist.all_reduce(shard, op=op, group=inter, async_op=True)

    def _launch_in_order(self, only_ready: bool) -> None:
        for sync in self._syncs:
            buckets = sync.buffer.buckets
            while sync.next_bucket < len(buckets):
                bucket = buckets[sync.next_bucket]
                if only_ready and not bucket.is_ready():
                    break
                self._launch(sync, bucket)
                sync.next_bucket += 1

    def start_grad_sync(self) -> None:
        """Launches the reduction of every bucket not launched yet (waiting its events)."""
        self._launch_in_order(only_ready=False)

    def finish_grad_sync(self) -> None:
        """Makes every ``main_grad`` hold the DP-averaged gradient.

        Launches whatever is left (buckets with unused or unmarked parameters included)
        and waits on every handle. Waiting on an NCCL handle orders the current stream
        after the collective; it does not block the host.
        """
        self.accumulate_grads()
        self.start_grad_sync()
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
                bucket.handle = None
        self._allreduce_sequence_parallel_grads()

    def _allreduce_sequence_parallel_grads(self) -> None:
        tp = getattr(self.pg, "tp", None)
        if tp is None or not self._sequence_parallel_params:
            return
        grads = [p.main_grad for p in self._sequence_parallel_params]
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=tp)
        for grad, summed in zip(grads, _unflatten_dense_tensors(flat, grads)):
            grad.copy_(summed)

    # ------------------------------------------------------------------ parameters (distributed optimizer)

    def start_param_sync(self) -> None:
        """All-gathers every bucket's parameters from the DP ranks' shards.

        Waits for it unless ``overlap_param_gather``: then each module's forward
        pre-hook waits for its own buckets. Buckets are launched in forward order (the
        last bucket holds the first layers).
        """
        assert self.use_distributed_optimizer, "start_param_sync is for the distributed optimizer"
        self.finish_param_sync()  # never two gathers into the same memory
        for sync in self._syncs:
            group = getattr(self.pg, sync.group_name)
            if group is None:
                continue
            for bucket in reversed(sync.buffer.buckets):
                size = bucket.numel // sync.size
                shard = bucket.param_data[sync.rank * size : (sync.rank + 1) * size]
                bucket.param_handle = _all_gather_single(
                    bucket.param_data, shard, group=group, async_op=self.overlap_param_gather
                )
                if not self.overlap_param_gather:
                    bucket.param_handle = None

    def finish_param_sync(self, buckets=None) -> None:
        """Waits for the parameter all-gathers in flight (of ``buckets``, default all)."""
        for bucket in self.buckets if buckets is None else buckets:
            if bucket.param_handle is not None:
                bucket.param_handle.wait()
                bucket.param_handle = None

    def _register_param_gather_hooks(self, module: torch.nn.Module) -> list:
        """A forward pre-hook per module that waits for the buckets of the parameters it
        uses: its own, and those of its childless children (a parent may read a child's
        weight directly, as the embedding reads its position table); every parameter below
        it for a module that says ``reads_descendant_params`` (the sequential experts' fused
        loop reads their weights without calling their forwards)."""
        handles = []
        of_id = {pid: bucket for pid, (_sync, bucket) in self._sync_of_id.items()}
        order = {id(bucket): i for i, bucket in enumerate(self.buckets)}
        for name, sub in module.named_modules():
            used = list(sub.parameters(recurse=getattr(sub, "reads_descendant_params", False)))
            if name:  # the root's leaves are its own modules, with hooks of their own
                for child in sub.children():
                    if next(child.children(), None) is None:
                        used += list(child.parameters(recurse=False))
            buckets = {order[id(of_id[id(p)])]: of_id[id(p)] for p in used if id(p) in of_id}
            if not buckets:
                continue
            ordered = [buckets[i] for i in sorted(buckets)]

            def wait(_module, _args, ordered=ordered):
                self.finish_param_sync(ordered)

            handles.append(sub.register_forward_pre_hook(wait))
        return handles

    # ------------------------------------------------------------------ helpers

    def broadcast_params(self) -> None:
        """Copies every parameter from DP rank 0 to the other DP ranks (expert parameters
        over the expert-DP group: other expert-parallel ranks hold other experts)."""
        for param in self.module.parameters():
            group = self.pg.expt_dp if is_expert_param(param) else self.dp_group
            if group is not None:
                dist.broadcast(param.data, src=dist.get_global_rank(group, 0), group=group)


def _grad_dtype(params: list[torch.nn.Parameter], grad_reduce_in_fp32: bool) -> torch.dtype:
    """The gradient buffer's dtype: fp32, or the one dtype of ``params`` (Megatron's rule,
    which gives each parameter dtype a buffer of its own; one buffer here)."""
    if grad_reduce_in_fp32 or not params:
        return torch.float32
    dtypes = {p.dtype for p in params}
    require(
        len(dtypes) == 1,
        f"gradients in the parameters' dtype (--grad-reduce-in-bf16, or --fp16 without "
        f"--accumulate-allreduce-grads-in-fp32) need every trainable parameter in one dtype, found "
        f"{sorted(map(str, dtypes))}; add --accumulate-allreduce-grads-in-fp32.",
    )
    return dtypes.pop()


def _place(pg, group_name: str) -> tuple[int, int]:
    """``(size, this rank's index)`` of group ``group_name`` of ``pg``."""
    return getattr(pg, f"{group_name}_size"), getattr(pg, f"{group_name}_rank")


def is_expert_param(param: torch.nn.Parameter) -> bool:
    """Whether ``param``'s gradient belongs to the expert-data-parallel buffer."""
    return bool(getattr(param, "is_expert", False))


class _WeakHook:
    """A parameter's gradient hook that calls a method of its owner while the owner lives.

    Autograd keeps a tensor's hooks in C++, where Python's cycle collector cannot see them. A hook
    holding the owner strongly, on a parameter the owner holds, is a cycle that keeps the owner, the
    model and its buffers alive for good once the training run drops them."""

    def __init__(self, method):
        self._method = weakref.WeakMethod(method)

    def __call__(self, *args):
        method = self._method()
        if method is not None:
            method(*args)


class _StreamWork:
    """The collectives issued on a communication stream, as a handle: ``wait()`` orders
    the current stream after them (no host sync)."""

    def __init__(self, stream):
        self.stream = stream

    def wait(self) -> None:
        torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)


class _BufferSync:
    """One gradient buffer and how it is reduced: over which group of ``pg`` (with the
    distributed optimizer the ranks of one optimizer instance, which shard the buffer),
    this rank's place in it, the pre-scale, and the next bucket to launch this sync."""

    def __init__(self, buffer: GradBuffer, group_name: str, size: int, rank: int, scale: float, use_avg_op=False):
        self.buffer = buffer
        self.group_name = group_name
        self.size = size
        self.rank = rank
        self.scale = scale
        self.use_avg_op = use_avg_op
        self.next_bucket = 0
