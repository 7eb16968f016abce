"""The distributed optimizer (``--use-distributed-optimizer``), and the optimizer factory.

``DistributedOptimizer`` is ``MixedPrecisionOptimizer`` over *shards*: DDP (built with
``use_distributed_optimizer``) lays every bucket out in equal contiguous shards, one
per DP rank, for both the gradients (fp32, or bf16/fp16 with ``--grad-reduce-in-bf16``) and
the parameters. This rank optimizes only
the pieces of parameters that fall in its shards: each piece is a flat
``torch.nn.Parameter`` aliasing the parameter buffer, whose ``main_grad`` is the same
slice of the (reduce-scattered) gradient buffer. So fp32 main params (for bf16/fp16
models) and Adam's moments exist for about 1/DP of the model on each rank. After the
inner step, DDP all-gathers every bucket's parameters (``start_param_sync``), at once
or, with ``--overlap-param-gather``, overlapped with the next forward.

With ``--num-distributed-optimizer-instances N`` the shards are those of the DP / N
ranks of one optimizer instance (``pg.intra_dp``, ``pg.intra_expt_dp``): every instance
holds the whole optimizer state once, and the instances take the same steps on the same
(all-reduced) gradients. So the state per rank is 1 / (DP / N) of the model.

The gradient norm sums each rank's squares over the instance's DP ranks and the
model-parallel group; weight decay follows the *full* parameter's shape (a shard is
always 1-D).

Checkpoints: ``state_pieces`` (the layout-free ``torch_dist`` format) gives each
shard with the flat range of its parameter; instance 0 writes them (``writes_pieces``).
For the legacy ``torch`` format,
``state_dict`` gathers the shards over DP (one instance) into exactly what the non-distributed
optimizer of the same model-parallel rank would hold (torch's optimizer state dict,
indexed in its parameter order), so DP rank 0 writes one file per model-parallel rank
as without the flag, and ``load_state_dict`` takes this rank's shards out of such a
file: legacy checkpoints move between DP sizes and in and out of
``--use-distributed-optimizer``. (Megatron writes a per-rank ``distrib_optim.pt``
instead, tied to its DP size.)

``build_optimizer`` picks this class or the plain one and hands either the norm
bookkeeping that model parallelism needs.
"""

from typing import Any

import torch
import torch.distributed as dist

from megatron.core.distributed.distributed_data_parallel import is_expert_param
from megatron.core.optimizer.muon import check_saved_scalar, matrix_infos
from megatron.core.optimizer.optimizer import (
    MixedPrecisionOptimizer,
    group_order,
    group_settings,
    mup_width_mult_of,
    param_group_rule,
)

# torch >= 2.10 renamed the single-tensor all-gather; the old name warns.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_IMPL_KEYS = ("fused", "foreach", "capturable", "differentiable")


def counts_for_norm(param: torch.nn.Parameter, pg) -> bool:
    """Whether this rank adds ``param``'s gradient to the global norm: TP-split parameters
    on every TP rank, replicated ones on TP rank 0 only (each TP rank holds a copy); never
    the last pipeline stage's copy of a tied embedding (the first stage counts it).
    Expert parameters count on every rank: with expert TP = 1 the TP ranks route their own
    sequence shards and are expert-DP ranks, with expert TP > 1 each holds its own shard of
    the experts; the expert norm groups (``expert_norm_separate``) count each element once
    per expert-DP group."""
    if getattr(param, "shared_embedding", False):
        return False
    if is_expert_param(param):
        return True
    return pg.tp_size == 1 or pg.tp_rank == 0 or bool(getattr(param, "tensor_model_parallel", False))


def expert_norm_separate(pg) -> bool:
    """Whether the expert gradients' squared norm needs groups of its own: under expert
    parallelism other ranks hold other experts, and under expert tensor parallelism other
    shards of them, which the dense groups (DP x MP) do not cover once each. With EP = 1
    and TP = ETP = 1 an expert element is where a dense one would be: one set of groups
    serves both."""
    return pg.ep_size > 1 or pg.tp_size > 1 or getattr(pg, "expt_tp_size", 1) > 1


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Optimizer state and fp32 main params sharded over the data-parallel group (over
    the ranks of one optimizer instance with ``--num-distributed-optimizer-instances``).

    Args:
        ddp: A ``DistributedDataParallel`` built with ``use_distributed_optimizer``.
        pg: Process groups (``intra_dp`` and ``intra_expt_dp`` for the shards, ``mp`` for
            the norm, ``inter_dp`` for the instance).
        config, precision, preallocate_state, kwargs: As ``MixedPrecisionOptimizer``.

    Attributes:
        shards: ``(model param, start, end)`` per optimized piece: flat element range of
            the parameter this rank owns.
        instance: This rank's distributed-optimizer instance (0 with one instance).
        writes_pieces: Whether this rank writes its pieces to a sharded checkpoint: the
            other instances hold copies of instance 0's.
    """

    sharded_over_dp = True

    def __init__(self, ddp, *, pg, config, precision, preallocate_state: bool = False, **kwargs):
        if not ddp.use_distributed_optimizer:
            raise ValueError("DistributedOptimizer needs DDP built with use_distributed_optimizer=True.")
        self.ddp = ddp
        self.pg = pg
        self.group_of = param_group_rule(ddp.module, config)
        self.shards: list[tuple[torch.nn.Parameter, int, int]] = []
        self.instance = pg.inter_dp_rank
        self.writes_pieces = self.instance == 0
        pieces, full_of = [], {}
        # Per buffer: (its owned shards, the owned gradients that count for the norm, pieces).
        dense = self._shard(ddp.grad_buffer, pg.intra_dp_rank, pg.intra_dp_size, pg, pieces, full_of)
        expert = None
        if ddp.expert_grad_buffer is not None:
            expert = self._shard(
                ddp.expert_grad_buffer, pg.intra_expt_dp_rank, pg.intra_expt_dp_size, pg, pieces, full_of
            )
        if not pieces:
            raise ValueError(
                "this data-parallel rank owns no parameter elements: the model is too small for "
                f"--use-distributed-optimizer over {pg.intra_dp_size} ranks; drop the flag."
            )
        norm = {}
        if expert is not None and expert_norm_separate(pg):
            # Dense shards: one owner per element in (instance) DP x MP. Expert shards: one
            # owner per element in (instance) expert-DP, distinct experts over EP (and PP).
            norm["grad_norm_parts"] = [
                (dense[1], (pg.mp, pg.intra_dp)),
                (expert[1], (pg.ep, pg.expt_tp, pg.pp, pg.intra_expt_dp)),
            ]
        else:
            owned = dense[0] + (expert[0] if expert else [])
            norm_pieces = dense[1] + (expert[1] if expert else [])
            all_count = len(norm_pieces) == len(pieces)
            norm = dict(
                # Every owned element counts on TP rank 0: one reduction per bucket shard.
                grad_buffers=owned if all_count else (),
                grad_norm_tensors=None if all_count else norm_pieces,
                grad_norm_groups=(pg.mp, pg.intra_dp),
            )
        if config.optimizer == "muon":
            infos = matrix_infos([ddp.module], pg, config)
            kwargs["muon_info"] = lambda piece: infos[id(full_of[id(piece)])]
            kwargs["muon_assemble"] = self._assemble_muon
        super().__init__(
            pieces,
            config=config,
            precision=precision,
            preallocate_state=preallocate_state,
            group_of=lambda piece: self.group_of(full_of[id(piece)]),
            **norm,
            **kwargs,
        )

    def _shard(self, buffer, rank: int, size: int, pg, pieces: list, full_of: dict):
        """This rank's pieces of ``buffer`` (shard ``rank`` of ``size`` in every bucket),
        appended to ``pieces``; returns ``(owned shards, owned gradients for the norm)``."""
        owned, norm_pieces = [], []
        for bucket in buffer.buckets:
            lo, hi = bucket.shard_range(rank, size)
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
        return owned, norm_pieces

    @torch.no_grad()
    def step(self, skip: torch.Tensor | None = None) -> tuple[bool, torch.Tensor | None, int | None]:
        """The inner step on this rank's shards, then the all-gather of the parameters."""
        self.ddp.finish_param_sync()  # a gather still writing the buffer would race the update
        success, grad_norm, num_zeros = super().step(skip)
        if success:
            self.ddp.start_param_sync()
        return success, grad_norm, num_zeros

    def _piece_range(self, index: int) -> tuple[torch.nn.Parameter, int, int]:
        return self.shards[index]

    def _assemble_muon(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[tuple[torch.Tensor, int, int]]:
        """Muon's whole matrices: every rank's update pieces all-gathered over (instance) DP, per bucket.

        A collective over the data-parallel group(s): every rank calls it each step, with or
        without pieces of Muon parameters.
        """
        index = {id(main): i for i, main in enumerate(self.main_params)}
        updates = {i: update for i, update in ((index[id(main)], update) for main, update in pairs)}
        zero = torch.zeros(0, dtype=torch.float32, device=self.device)
        flats = self._gather_flat(lambda i: updates.get(i, zero), only=updates)
        wholes = []
        for main, _update in pairs:
            param, start, end = self.shards[index[id(main)]]
            buffer = self._buffer_of(param)
            lo, hi = buffer.param_range(param)
            wholes.append((flats[id(buffer)][lo:hi], start, end))
        return wholes

    # ------------------------------------------------------------------ legacy (torch format) checkpoints

    def _full_order(self) -> list[torch.nn.Parameter]:
        """The non-distributed optimizer's parameter order: group by group (``GROUP_ORDER``)."""
        params = list(dict.fromkeys(p for p in self.ddp.module.parameters() if p.requires_grad))
        return [p for key in group_order(self.config) for p in params if self.group_of(p) == key]

    def _lowp_order(self) -> list[torch.nn.Parameter]:
        """Model order of the bf16/fp16 parameters (the non-distributed ``main_params`` list)."""
        params = dict.fromkeys(p for p in self.ddp.module.parameters() if p.requires_grad)
        return [p for p in params if p.dtype in (torch.bfloat16, torch.float16)]

    def _main_params_order(self) -> list[torch.Tensor]:
        return self._lowp_order()

    def _buffer_of(self, param: torch.nn.Parameter):
        """The gradient buffer holding ``param`` (expert parameters: the expert-DP buffer)."""
        expert = self.ddp.expert_grad_buffer
        return expert if expert is not None and is_expert_param(param) else self.ddp.grad_buffer

    def _gather_flat(self, pieces_of, only=None) -> dict[int, torch.Tensor]:
        """Per gradient buffer (by ``id``), one fp32 tensor laid out like it, with every
        rank's shards filled in: the dense buffer's over DP, the expert buffer's over
        expert-DP (of this rank's optimizer instance, which holds the whole state).

        ``pieces_of(i)`` gives this rank's flat tensor for piece ``i`` (for the indices in ``only``
        when given; the other pieces stay zero).
        """
        pg = self.pg
        groups = [(self.ddp.grad_buffer, pg.intra_dp, pg.intra_dp_rank, pg.intra_dp_size)]
        if self.ddp.expert_grad_buffer is not None:
            groups.append((self.ddp.expert_grad_buffer, pg.intra_expt_dp, pg.intra_expt_dp_rank, pg.intra_expt_dp_size))
        flats = {
            id(buffer): torch.zeros(buffer.numel, dtype=torch.float32, device=buffer.data.device)
            for buffer, *_ in groups
        }
        for i, (param, start, end) in enumerate(self.shards):
            if only is not None and i not in only:
                continue
            buffer = self._buffer_of(param)
            at = buffer.param_range(param)[0] + start
            flats[id(buffer)][at : at + end - start].copy_(pieces_of(i).reshape(-1))
        for buffer, group, rank, size in groups:
            if group is None or size == 1:
                continue
            flat = flats[id(buffer)]
            for bucket in buffer.buckets:
                lo, hi = bucket.shard_range(rank, size)
                _all_gather_single(flat[bucket.offset : bucket.offset + bucket.numel], flat[lo:hi], group=group)
        return flats

    def state_dict(self) -> dict[str, Any]:
        """The whole state of this model-parallel rank, gathered over DP within this rank's optimizer
        instance (a collective: call on every rank).

        Laid out as ``MixedPrecisionOptimizer.state_dict`` of the same parameters.
        """
        buffer = self.ddp.grad_buffer
        order = self._full_order()
        pieces = self.state_pieces()
        # Every rank steps every piece, so all ranks hold the same state names.
        names = sorted({k for piece in pieces for k, v in piece.state.items() if torch.is_tensor(v)})
        # Every rank steps every piece, but with Muon a piece holds its kind's state only.
        for group in dict.fromkeys((self.pg.intra_dp, self.pg.intra_expt_dp)):
            if group is not None and self.config.optimizer == "muon":
                every = [None] * dist.get_world_size(group)
                dist.all_gather_object(every, names, group=group)
                names = sorted({k for ks in every for k in ks})
        zero = torch.zeros(0, dtype=torch.float32, device=buffer.data.device)
        flats = {
            k: self._gather_flat(
                lambda i, k=k: pieces[i].state[k] if k in pieces[i].state else zero,
                only={i for i, piece in enumerate(pieces) if k in piece.state},
            )
            for k in names
            if k != "step"
        }
        steps = None
        if "step" in names:
            index = {id(p): i for i, p in enumerate(order)}
            steps = torch.zeros(len(order), dtype=torch.float32, device=buffer.data.device)
            for piece in pieces:
                if "step" in piece.state:
                    steps[index[id(piece.param)]] = piece.state["step"].to(steps.device, torch.float32)
            for group in dict.fromkeys((self.pg.intra_dp, self.pg.intra_expt_dp)):  # the owners of every piece
                if group is not None:
                    dist.all_reduce(steps, op=dist.ReduceOp.MAX, group=group)
        lowp = self._lowp_order()
        main_flat = self._gather_flat(lambda i: pieces[i].main) if lowp else None

        def of(per_buffer, param):
            owner = self._buffer_of(param)
            start, end = owner.param_range(param)
            return per_buffer[id(owner)][start:end].view(param.shape).clone()

        names_for = getattr(self.optimizer, "state_names_for", None)  # Muon: each kind its own state
        state = {}
        if names:
            for i, param in enumerate(order):
                kept = names if names_for is None else names_for(group_settings(self.group_of(param), self.config))
                entry = {k: of(per_buffer, param) for k, per_buffer in flats.items() if k in kept}
                if steps is not None and "step" in kept:
                    entry["step"] = steps[i].cpu().clone()
                state[i] = entry
        groups, first = [], 0
        for key in group_order(self.config):
            members = [i for i, p in enumerate(order) if self.group_of(p) == key]
            if members:
                if hasattr(self.optimizer, "group_template"):
                    live = self.optimizer.group_template(key[3])
                else:
                    live = self.optimizer.param_groups[0]
                template = {k: v for k, v in live.items() if k not in ("params", "max_lr", "min_lr")}
                # lr: the scheduler sets it on load
                group = dict(template, **group_settings(key, self.config, self.mup_width_mult))
                groups.append(dict(group, params=list(range(first, first + len(members)))))
                first += len(members)
        return {
            "optimizer": {"state": state, "param_groups": groups},
            "main_params": [of(main_flat, p) for p in lowp],
            "grad_scaler": None if self.grad_scaler is None else self.grad_scaler.state_dict(),
        }

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes this rank's shards out of a state in ``state_dict``'s (the non-distributed) layout."""
        order = self._full_order()
        saved = state["optimizer"]
        saved_count = sum(len(g["params"]) for g in saved["param_groups"])
        lowp = self._lowp_order()
        if saved_count != len(order) or len(state["main_params"]) != len(lowp):
            raise ValueError(
                f"optimizer checkpoint holds {saved_count} parameters ({len(state['main_params'])} bf16/fp16) but "
                f"this model has {len(order)} ({len(lowp)}): it was saved with another model or precision; load it "
                "with the saving run's model flags and --bf16/--fp16 setting, or pass --no-load-optim."
            )
        if self.config.optimizer == "muon":
            check_saved_scalar(saved["param_groups"], self.config)
        index = {id(p): i for i, p in enumerate(order)}
        lowp_index = {id(p): i for i, p in enumerate(lowp)}
        names = sorted({k for entry in saved["state"].values() for k in entry})
        self.allocate_state(names)
        pieces = self.state_pieces()
        for piece in pieces:
            for name, value in saved["state"].get(index[id(piece.param)], {}).items():
                value = torch.as_tensor(value)
                if value.dim() == 0:  # step
                    piece.state[name].copy_(value)
                else:
                    piece.state[name].copy_(value.reshape(-1)[piece.start : piece.end])
            if piece.fp32_copy:
                value = state["main_params"][lowp_index[id(piece.param)]]
                piece.main.copy_(value.reshape(-1)[piece.start : piece.end])
        # Hyper-parameters by group kind (this rank may hold pieces of one kind only).
        kinds = {}
        for group in saved["param_groups"]:
            if group["params"]:
                kinds[self.group_of(order[group["params"][0]])] = group
        piece_of = {id(piece.main): piece for piece in pieces}
        for group in self.optimizer.param_groups:
            key = self.group_of(piece_of[id(group["params"][0])].param)
            if key in kinds:
                group.update({k: v for k, v in kinds[key].items() if k != "params" and k not in _IMPL_KEYS})
        self.after_state_load()
        if self.grad_scaler is not None and state.get("grad_scaler") is not None:
            self.grad_scaler.load_state_dict(state["grad_scaler"])

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
    kwargs.setdefault("mup_width_mult", mup_width_mult_of(ddp.module))
    if ddp.use_distributed_optimizer:
        return DistributedOptimizer(
            ddp, pg=pg, config=config, precision=precision, preallocate_state=preallocate_state, **kwargs
        )
    params = [p for p in ddp.module.parameters() if p.requires_grad]
    buffers = [b.data for b in ddp.grad_buffers]
    kwargs.setdefault("group_of", param_group_rule(ddp.module, config))
    if config.optimizer == "muon":
        infos = matrix_infos([ddp.module], pg, config)
        kwargs.setdefault("muon_info", lambda param: infos[id(param)])
    if ddp.expert_grad_buffer is not None and expert_norm_separate(pg):
        # Dense gradients are replicated over DP: summed over MP. Expert gradients are
        # replicated over expert-DP only: summed over EP, expert TP (the shards) and PP;
        # with expert TP = 1 the TP ranks are expert-DP ranks, so no TP sum for them.
        dense = [p for p in dict.fromkeys(params) if not is_expert_param(p)]
        dense_norm = [p.main_grad for p in dense if counts_for_norm(p, pg)]
        if len(dense_norm) == len(dense):
            dense_norm = [ddp.grad_buffer.data]
        kwargs["grad_norm_parts"] = [
            (dense_norm, (pg.mp,)),
            ([ddp.expert_grad_buffer.data], (pg.ep, pg.expt_tp, pg.pp)),
        ]
    elif getattr(pg, "mp", None) is not None:
        kwargs["grad_norm_groups"] = (pg.mp,)
        if not all(counts_for_norm(p, pg) for p in params):
            kwargs["grad_norm_tensors"] = [p.main_grad for p in dict.fromkeys(params) if counts_for_norm(p, pg)]
    return MixedPrecisionOptimizer(
        params,
        config=config,
        precision=precision,
        preallocate_state=preallocate_state,
        grad_buffers=buffers,
        **kwargs,
    )
