"""The MoE block (router -> dispatch -> experts -> combine, + shared experts) and the
model-level hooks the training loop calls around it.

``MoELayer`` takes the place of the MLP in an MoE transformer layer (``...mlp.router``,
``...mlp.experts``, ``...mlp.shared_experts``, Megatron's names). Its phases are
separate methods with tensors in and out so the layer can graph the static ones
(``MoETransformerLayer`` in ``transformer_layer.py``); nothing is kept on ``self``
between phases.

What crosses a step lives in buffers with a clear owner:
- ``router.aux_loss_scale``: d(objective)/d(aux loss), set by ``set_aux_loss_scale``
  before the step (1 / micro-batches, times the fp16 loss scale).
- ``metrics`` / ``tokens_per_expert``: the router statistics, summed over the step's
  micro-batches by the layer's eager code (``accumulate_stats``) and read by
  ``collect_moe_metrics`` (the log) and ``moe_after_optimizer_step`` (expert bias).
"""

import torch
import torch.distributed as dist

from megatron.core.tensor_parallel.layers import resolve_device
from megatron.core.transformer.cuda_graphs.regions import GraphRegions, RegionSpec
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP, SharedExpertMLP
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.token_dispatcher import build_token_dispatcher
from megatron.core.transformer.recompute import checkpointed, recomputes
from megatron.core.transformer.transformer_layer import TransformerLayer


class MoELayer(torch.nn.Module):
    """Mixture of experts replacing the MLP.

    With tensor parallelism the input is the TP rank's sequence shard (sequence
    parallelism is required, as in Megatron): the router runs on the local tokens, the
    shared experts are split over TP, and the routed experts over the expert-tensor-parallel
    group (``pg.expt_tp``), with the token dispatcher moving tokens over ``pg.ep``,
    ``pg.expt_tp`` and ``pg.tp_ep``.

    Args:
        config: Finalized ``TransformerConfig`` with ``config.moe`` enabled.
        pg: ``ProcessGroups`` (``pg.dp`` for global_aux_loss, the TP and expert groups), or None.
        ep_group: Expert-parallel group; overrides ``pg.ep`` (tests pass their own).
        device: Device for the parameters.
    """

    def __init__(self, config, pg=None, *, ep_group=None, device=None):
        super().__init__()
        moe = config.moe
        if not moe.enabled:
            raise ValueError("an MoE layer needs --num-experts N.")
        if pg is not None and getattr(pg, "tp_size", 1) > 1 and not getattr(pg, "sequence_parallel", False):
            raise ValueError(
                "--num-experts with --tensor-model-parallel-size > 1 needs --sequence-parallel (as in Megatron): "
                "each tensor-parallel rank then routes its own sequence shard."
            )
        self.config = config
        self.moe = moe
        if ep_group is None and pg is not None:
            ep_group = getattr(pg, "ep", None)
        etp_group = getattr(pg, "expt_tp", None)
        tp_ep_group = getattr(pg, "tp_ep", None)
        dp_group = None if pg is None else pg.dp
        sp = bool(getattr(pg, "sequence_parallel", False))
        self.router = TopKRouter(config, dp_group, tp_group=pg.tp if sp else None, device=device)
        for p in self.router.parameters():  # replicated over TP, applied to a sequence shard
            p.sequence_parallel = sp
        self.token_dispatcher = build_token_dispatcher(moe, ep_group, etp_group, tp_ep_group)
        n_local = self.token_dispatcher.num_local_experts
        experts_cls = GroupedMLP if moe.moe_grouped_gemm else SequentialMLP
        self.experts = experts_cls(
            config,
            n_local,
            device=device,
            local_experts=self.token_dispatcher.local_expert_indices,
            etp_size=self.token_dispatcher.etp_size,
            etp_rank=self.token_dispatcher.etp_rank,
        )
        if moe.moe_shared_expert_intermediate_size is not None:
            self.shared_experts = SharedExpertMLP(config, pg, device=device)
        else:
            self.shared_experts = None
        self.recompute_shared_experts = recomputes(config, "shared_experts")
        device = resolve_device(device)
        self.metric_names = self.router.metric_names()
        self.register_buffer("metrics", torch.zeros(len(self.metric_names), device=device), persistent=False)
        self.register_buffer("tokens_per_expert", torch.zeros(moe.num_moe_experts, device=device), persistent=False)

    # ------------------------------------------------------------------ phases
    def route(self, hidden_states: torch.Tensor):
        """Graphable. ``[s, b, h]`` -> ``(probs [T, E], routing_map [T, E], stats)``."""
        return self.router(hidden_states)

    def shared(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Graphable. The shared experts' output, ``[s, b, h]`` (checkpointed with --recompute-modules
        shared_experts)."""
        if self.recompute_shared_experts and self.training:
            return checkpointed(self.shared_experts, hidden_states)
        return self.shared_experts(hidden_states)

    def preprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Graphable. ``(permuted, slot_probs, token_idx, tokens_per_expert)``; see token_dispatcher."""
        return self.token_dispatcher.preprocess(hidden_states.reshape(-1, hidden_states.shape[-1]), probs, routing_map)

    def dispatch_experts_combine(
        self, permuted: torch.Tensor, slot_probs: torch.Tensor, tokens_per_expert: torch.Tensor, num_tokens: int
    ) -> torch.Tensor:
        """Eager (graphable only with drop-and-pad). Dispatch, the experts, combine: ``[M, h]``."""
        x, p, counts, state = self.token_dispatcher.dispatch(
            permuted,
            slot_probs,
            tokens_per_expert,
            num_tokens=num_tokens,
            needs_host_counts=self.experts.needs_host_counts(permuted),
        )
        return self.token_dispatcher.combine(self.experts(x, counts, p), state)

    def postprocess(self, combined: torch.Tensor, token_idx: torch.Tensor, shape) -> torch.Tensor:
        """Graphable. ``[M, h]`` -> ``[s, b, h]`` (the routed experts' part of the output)."""
        out = self.token_dispatcher.postprocess(combined, token_idx, shape[0] * shape[1])
        return out.view(shape)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[s, b, h]`` -> ``(output [s, b, h], stats)``; all phases in order."""
        probs, routing_map, stats = self.route(hidden_states)
        permuted, slot_probs, token_idx, tokens_per_expert = self.preprocess(hidden_states, probs, routing_map)
        combined = self.dispatch_experts_combine(
            permuted, slot_probs, tokens_per_expert, hidden_states.shape[0] * hidden_states.shape[1]
        )
        out = self.postprocess(combined, token_idx, hidden_states.shape)
        if self.shared_experts is not None:
            out = out + self.shared(hidden_states)
        return out, stats

    # ------------------------------------------------------------------ statistics
    @torch.no_grad()
    def accumulate_stats(self, stats: torch.Tensor) -> None:
        """Adds one micro-batch's router statistics (eager code, after the router ran)."""
        n = len(self.metric_names)
        if n:
            self.metrics.add_(stats[:n])
        if self.router.expert_bias is not None:
            self.tokens_per_expert.add_(stats[n:])

    def side_effect_buffers(self) -> list[torch.Tensor]:
        """Buffers the layer's ``forward`` adds into (a whole-layer graph replays those adds):
        save and restore them around warm-up runs."""
        bufs = [self.metrics, self.tokens_per_expert]
        if self.router.global_tokens_per_expert is not None:
            bufs += [self.router.global_tokens_per_expert, self.router.global_aux_steps]
        return bufs


def moe_layers(model: torch.nn.Module) -> list[MoELayer]:
    """Every ``MoELayer`` of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoELayer)]


@torch.no_grad()
def set_aux_loss_scale(model: torch.nn.Module, scale) -> None:
    """Sets d(objective)/d(aux loss) for every router: ``1 / num_microbatches`` (times the
    fp16 loss scale). A float or a device tensor (copied on the device, no host sync)."""
    for layer in moe_layers(model):
        layer.router.aux_loss_scale.copy_(torch.as_tensor(scale, dtype=torch.float32))


@torch.no_grad()
def collect_moe_metrics(
    model: torch.nn.Module,
    num_microbatches: int = 1,
    dp_group=None,
    reset: bool = True,
    *,
    pp_group=None,
    names: list[str] | None = None,
) -> dict[str, torch.Tensor]:
    """The step's MoE losses for the log line, with Megatron's names and averaging.

    Each value is the sum over MoE layers of the loss (without its coefficient), per
    micro-batch, divided by the number of MoE layers, averaged over ``dp_group``.
    Device tensors: reading them is the caller's (logging's) host sync.

    Args:
        model: The model (any wrapper; MoE layers are found by type).
        num_microbatches: Micro-batches summed into the statistics since the last reset.
        dp_group: Data-parallel group to average over, or None.
        reset: Zero the statistics afterwards.
        pp_group: Pipeline group: the layers of every stage count (Megatron reduces its
            tracker over the stages before the last one logs). Every stage must call,
            those without an MoE layer too.
        names: The metric names (``MoEConfig.metric_names()``); needed with ``pp_group``
            on a stage without an MoE layer, which contributes zeros.
    """
    layers = moe_layers(model)
    names = list(layers[0].metric_names) if layers else list(names or [])
    if not names:
        return {}
    staged = pp_group is not None and dist.get_world_size(pp_group) > 1
    if not layers and not staged:
        return {}
    if layers:
        sums = torch.stack([layer.metrics for layer in layers]).sum(dim=0)
    else:
        sums = torch.zeros(len(names), device=_device_of(model))
    if staged:  # every stage's sums and layer count
        both = torch.cat([sums, sums.new_tensor([len(layers)])])
        dist.all_reduce(both, group=pp_group)
        stacked = both[:-1] / (both[-1].clamp(min=1) * num_microbatches)
    else:
        stacked = sums / (len(layers) * num_microbatches)
    stacked = _dp_mean(stacked, dp_group)
    if reset:
        for layer in layers:
            layer.metrics.zero_()
    return {name: stacked[i] for i, name in enumerate(names)}


def per_layer_moe_metrics(
    model: torch.nn.Module,
    num_layers: int,
    num_microbatches: int = 1,
    dp_group=None,
    *,
    pp_group=None,
    names: list[str],
) -> dict[str, torch.Tensor]:
    """Each MoE layer's losses of the step (``--moe-per-layer-logging``), without resetting them.

    Call before ``collect_moe_metrics`` (which resets). Every pipeline stage must call (the
    stages' layers are summed over ``pp_group``), and every data-parallel rank (averaged).

    Returns:
        ``moe/<name>_layer_<i>`` -> the loss per micro-batch of the layer with 0-based index ``i``
        (Megatron's TensorBoard names), for the MoE layers of the whole model.
    """
    if not names:
        return {}
    # One row per layer: its losses, then 1 where the layer is an MoE layer of some stage.
    table = torch.zeros(num_layers, len(names) + 1, device=_device_of(model))
    for module in model.modules():
        layer = getattr(module, "mlp", None)
        if isinstance(layer, MoELayer) and hasattr(module, "layer_number"):
            table[module.layer_number - 1, :-1] = layer.metrics / num_microbatches
            table[module.layer_number - 1, -1] = 1.0
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(table, group=pp_group)
    table = _dp_mean(table, dp_group)
    out = {}
    for i in table[:, -1].nonzero().flatten().tolist():
        for j, name in enumerate(names):
            out[f"moe/{name}_layer_{i}"] = table[i, j]
    return out


def _dp_mean(t: torch.Tensor, dp_group) -> torch.Tensor:
    """``t`` averaged over the data-parallel group (``t`` itself without one)."""
    if dp_group is None or dist.get_world_size(dp_group) == 1:
        return t
    dist.all_reduce(t, group=dp_group)
    return t / dist.get_world_size(dp_group)


def _device_of(model: torch.nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


@torch.no_grad()
def moe_after_optimizer_step(model: torch.nn.Module, dp_group=None) -> None:
    """Call once after every optimizer step: updates the expert biases (aux-loss-free
    balancing) from the step's token counts summed over ``dp_group``, and starts a new
    global batch for ``global_aux_loss``."""
    for layer in moe_layers(model):
        if layer.router.expert_bias is not None:
            layer.router.update_expert_bias(layer.tokens_per_expert, dp_group)
            layer.tokens_per_expert.zero_()
        layer.router.reset_global_aux_loss()


@torch.no_grad()
def reset_moe_state(model: torch.nn.Module) -> None:
    """Zeroes every per-step accumulator (e.g. after a graph capture's warm-up runs)."""
    for layer in moe_layers(model):
        for buf in layer.side_effect_buffers():
            buf.zero_()


def _router_graphable(config) -> str | None:
    """Why no region may contain the router under ``config`` (None: it may)."""
    if config.moe.sinkhorn:
        return (
            "--moe-router-load-balancing-type sinkhorn iterates until convergence, reading the error on the "
            "host; use aux_loss, seq_aux_loss or none to graph the router"
        )
    if "global_aux_loss" in config.moe.aux_loss_coeffs():
        return (
            "--moe-router-load-balancing-type global_aux_loss keeps the step's token counts in a buffer "
            "across micro-batches; use aux_loss or seq_aux_loss to graph the router"
        )
    return None


def _block_graphable(config) -> str | None:
    """Why the whole MoE block cannot be one graph under ``config`` (None: it can)."""
    if not config.moe.drop_and_pad:
        return (
            "it needs drop-and-pad (--moe-expert-capacity-factor X and --moe-pad-expert-input-to-capacity): "
            "without it the experts' token counts are data-dependent and read on the host"
        )
    return _router_graphable(config)


class MoETransformerLayer(TransformerLayer):
    """A transformer layer whose MLP is an ``MoELayer``, split into graphable regions.

    ``forward`` = attention region, then the MoE block. The MoE block is
    ``_forward_moe_router`` (pre-MLP norm, router, shared experts) ->
    ``_forward_moe_preprocess`` (the dispatcher's permutation) -> dispatch, experts and
    combine (eager: the all-to-all split sizes are read on the host there, unless
    drop-and-pad makes them static) -> ``_forward_moe_postprocess`` (unpermute, shared
    experts, bias-dropout-add). ``_forward_moe`` is all of it, one region with
    drop-and-pad. Each region method is a pure function of its tensor arguments: what
    later phases need is returned. ``forward`` adds the router statistics into
    ``mlp.metrics`` / ``mlp.tokens_per_expert`` (eager, outside every region but the
    whole-layer graph; see ``MoELayer.side_effect_buffers``).

    Graph regions: ``attn``; ``moe_router``, ``moe_preprocess`` (needs ``moe_router``),
    with dispatch, experts and combine eager, and ``moe_postprocess`` graphed with
    ``moe_preprocess`` (no scope of its own: it undoes that graph's permutation, reading
    its ``token_idx``); or ``moe``, the whole block, with drop-and-pad only. ``attn moe``
    captures the whole layer (drop-and-pad only).
    """

    graph_regions = GraphRegions(
        RegionSpec("attn", "_forward_attention"),
        RegionSpec("moe_router", "_forward_moe_router", excludes=("moe",), when=_router_graphable),
        RegionSpec(
            "moe_preprocess",
            "_forward_moe_preprocess",
            requires=("moe_router",),
            excludes=("moe",),
            when=_router_graphable,
        ),
        RegionSpec(
            "moe_postprocess",
            "_forward_moe_postprocess",
            requires=("moe_router",),
            excludes=("moe",),
            when=_router_graphable,
            selected_by="moe_preprocess",
        ),
        RegionSpec("moe", "_forward_moe", when=_block_graphable),
        whole=("attn", "moe"),
        whole_when=_block_graphable,
    )

    _router_norm_discarder = None  # set by _forward_moe_phases for the router region's norm (eager only)

    @property
    def recompute_moe(self) -> bool:
        """--recompute-modules moe: the MoE layer keeps only its input."""
        return recomputes(self.config, "moe")

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[s, b, h] -> [s, b, h]``."""
        return self._forward_moe_counted(self._forward_attention(hidden_states, rotary_pos_emb, attention_mask))

    def _forward_moe_counted(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The MoE half (``_forward_moe``, graphed or not), its router statistics added up eagerly
        while training (evaluation does not count)."""
        hidden_states, stats = self._forward_moe(hidden_states)
        if self.training and torch.is_grad_enabled():
            self.mlp.accumulate_stats(stats)
        return hidden_states

    def _forward_moe(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE block: ``[s, b, h] -> (hidden [s, b, h], router stats)``.

        Selective recompute (eager only: CUDA graphs refuse it): with ``layernorm`` the norm's
        output is discarded and recomputed for its readers' backward; with ``moe`` the MoE
        layer keeps only its input (``MoELayer.forward``, the same phases in the same order).
        """
        discarder = self._norm_discarder()
        if discarder is not None or (self.recompute_moe and self._recomputing()):
            with self._readers(discarder):
                if not (self.recompute_moe and self._recomputing()):
                    return self._forward_moe_phases(hidden_states, discarder)
                with self.offload.scope("mlp_norm", self.training):
                    ln_out = self._norm(self.pre_mlp_layernorm, hidden_states, discarder)
                out, stats = checkpointed(self.mlp, ln_out)
            return self._bias_dropout_add(out, None, hidden_states), stats
        return self._forward_moe_phases(hidden_states)

    def _forward_moe_phases(self, hidden_states: torch.Tensor, discarder=None) -> tuple[torch.Tensor, torch.Tensor]:
        self._router_norm_discarder = discarder
        try:
            routed = self._forward_moe_router(hidden_states)
        finally:
            self._router_norm_discarder = None
        ln_out, probs, routing_map, stats = routed[:4]
        permuted, slot_probs, token_idx, tokens_per_expert = self._forward_moe_preprocess(ln_out, probs, routing_map)
        combined = self.mlp.dispatch_experts_combine(
            permuted, slot_probs, tokens_per_expert, hidden_states.shape[0] * hidden_states.shape[1]
        )
        out = self._forward_moe_postprocess(combined, token_idx, hidden_states, *routed[4:])
        return out, stats

    def _forward_moe_router(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Router region: ``(norm output, probs, routing_map, stats[, shared experts' output])``."""
        with self.offload.scope("mlp_norm", self.training):
            ln_out = self._norm(self.pre_mlp_layernorm, hidden_states, self._router_norm_discarder)
        probs, routing_map, stats = self.mlp.route(ln_out)
        if self.mlp.shared_experts is None:
            return ln_out, probs, routing_map, stats
        return ln_out, probs, routing_map, stats, self.mlp.shared(ln_out)

    def _forward_moe_preprocess(
        self, ln_out: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Preprocess region: ``(permuted tokens, slot probs, token_idx, tokens_per_expert)``."""
        return self.mlp.preprocess(ln_out, probs, routing_map)

    def _forward_moe_postprocess(
        self,
        combined: torch.Tensor,
        token_idx: torch.Tensor,
        residual: torch.Tensor,
        shared_output: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Postprocess region: unpermute, add the shared experts, bias-dropout-add onto the residual."""
        out = self.mlp.postprocess(combined, token_idx, residual.shape)
        if shared_output is not None:
            out = out + shared_output
        return self._bias_dropout_add(out, None, residual)
