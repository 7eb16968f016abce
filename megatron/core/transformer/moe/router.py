"""The top-k router: logits -> (probs, routing map, statistics).

``TopKRouter.forward`` is a pure function of its input, its parameters and two
buffers that only change between steps (``expert_bias``, ``aux_loss_scale``), so it
can run inside a CUDA-graph region. Everything eager code needs afterwards is
returned: the per-expert probabilities, the routing map, and a statistics vector
(the detached auxiliary-loss values for the log, then the routed token count of each
expert for the expert-bias update). The auxiliary losses reach the gradient through
``AuxLossAutoScaler`` (see ``moe_utils``); none is stored.

With ``--moe-router-load-balancing-type sinkhorn`` the training-time selection runs
Sinkhorn iterations until they converge, reading the error on the host each step, so
such a router is eager only.

The other exception is ``global_aux_loss``: it balances over the global batch, so it
keeps the counts of the step's earlier micro-batches in a buffer (reset after each
step) and all-reduces the counts over the data-parallel group; a layer using it
declares no graph regions that contain the router.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import resolve_device
from megatron.core.transformer.moe import moe_utils


class TopKRouter(torch.nn.Module):
    """Routes each token to its top-k experts.

    Args:
        config: Finalized ``TransformerConfig`` with ``config.moe`` set.
        dp_group: Data-parallel group (``global_aux_loss`` reduces counts over it).
        tp_group: Tensor-parallel group under sequence parallelism (each TP rank routes its
            sequence shard): the balancing losses count tokens over it, as Megatron does, so
            the TP ranks' partial losses sum to the single-process loss.
        device: Device for the parameters.

    Attributes:
        weight: ``[E, h]`` gate weight (``router.weight`` as in Megatron).
        expert_bias: ``[E]`` fp32 buffer of aux-loss-free balancing, or None.
        aux_loss_scale: 0-dim fp32 buffer, d(objective)/d(aux loss); see ``set_aux_loss_scale``.
    """

    def __init__(self, config, dp_group=None, *, tp_group=None, device=None):
        super().__init__()
        moe = config.moe
        self.config = config
        self.moe = moe
        self.dp_group = dp_group
        self.tp_group = tp_group
        self.tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
        self.num_experts = moe.num_moe_experts
        self.topk = moe.moe_router_topk
        device = resolve_device(device)
        self.weight = torch.nn.Parameter(
            torch.empty(self.num_experts, config.hidden_size, device=device, dtype=config.params_dtype)
        )
        with torch.no_grad():
            self.weight.normal_(0.0, config.hidden_init_std())
        if config.add_bias_linear:
            self.bias = torch.nn.Parameter(torch.zeros(self.num_experts, device=device, dtype=config.params_dtype))
        else:
            self.bias = None
        if moe.moe_router_enable_expert_bias:
            self.register_buffer("expert_bias", torch.zeros(self.num_experts, device=device, dtype=torch.float32))
        else:
            self.expert_bias = None
        self.register_buffer("aux_loss_scale", torch.ones((), device=device, dtype=torch.float32), persistent=False)
        self.aux_coeffs = moe.aux_loss_coeffs()  # type -> coeff, positive ones only
        if "global_aux_loss" in self.aux_coeffs:
            self.register_buffer(
                "global_tokens_per_expert", torch.zeros(self.num_experts, device=device), persistent=False
            )
            self.register_buffer("global_aux_steps", torch.zeros((), device=device), persistent=False)
        else:
            self.global_tokens_per_expert = None
            self.global_aux_steps = None

    # ------------------------------------------------------------------ statistics layout
    def metric_names(self) -> list[str]:
        """Names of the loss entries at the front of the statistics vector (Megatron's names)."""
        return self.moe.metric_names()

    @property
    def num_stats(self) -> int:
        return len(self.metric_names()) + self.num_experts

    # ------------------------------------------------------------------ forward
    def gating(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., h] -> [T, E]`` logits in the router dtype."""
        dtype = moe_utils.router_compute_dtype(self.moe.moe_router_dtype, hidden_states.dtype)
        x = hidden_states.reshape(-1, hidden_states.shape[-1]).to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return F.linear(x, self.weight.to(dtype), bias)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Routes ``[s, b, h]`` tokens.

        Returns:
            ``probs [T, E]`` (router dtype; zero off the selected experts),
            ``routing_map [T, E]`` bool, and ``stats [num_stats]`` fp32: the loss values
            (without their coefficients) named by ``metric_names()``, then the number of
            tokens routed to each expert.
        """
        seq_len = hidden_states.shape[0]
        moe = self.moe
        if moe.moe_input_jitter_eps is not None:
            eps = moe.moe_input_jitter_eps
            hidden_states = hidden_states * torch.empty_like(hidden_states).uniform_(1.0 - eps, 1.0 + eps)
        logits = self.gating(hidden_states)
        if moe.moe_router_force_load_balancing:
            logits = moe_utils.random_logits(logits)
        losses = []
        training = self.training and torch.is_grad_enabled()
        if moe.moe_z_loss_coeff is not None:
            # Each TP rank's mean over its shard: 1 / TP of it sums to the mean over all.
            z_coeff = moe.moe_z_loss_coeff / self.tp_size
            z = moe_utils.z_loss(logits, z_coeff) if training else logits.new_zeros(())
            if training:
                logits = moe_utils.AuxLossAutoScaler.apply(logits, z, self.aux_loss_scale)
            z_value = z.detach() / moe.moe_z_loss_coeff if moe.moe_z_loss_coeff > 0 else z.detach()
        if moe.sinkhorn:
            probs, routing_map = moe_utils.sinkhorn_routing(logits, self.topk, self.training)
        else:
            probs, routing_map = moe_utils.topk_routing(
                logits,
                self.topk,
                score_function=moe.moe_router_score_function,
                pre_softmax=moe.moe_router_pre_softmax,
                num_groups=moe.moe_router_num_groups,
                group_topk=moe.moe_router_group_topk,
                scaling_factor=moe.moe_router_topk_scaling_factor,
                expert_bias=self.expert_bias,
            )
        if moe.moe_expert_capacity_factor is not None:
            capacity = moe_utils.expert_capacity(
                logits.shape[0], self.num_experts, self.topk, moe.moe_expert_capacity_factor
            )
            probs, routing_map = moe_utils.apply_token_dropping(
                probs,
                routing_map,
                capacity,
                drop_policy=moe.moe_token_drop_policy,
                pad_to_capacity=moe.moe_pad_expert_input_to_capacity,
            )
        if self.aux_coeffs:
            if training:
                aux_map, scores = moe_utils.scores_for_aux_loss(logits, self.topk, moe.moe_router_score_function)
                probs, losses = self._apply_aux_losses(probs, aux_map, scores, seq_len)
            else:
                losses = [logits.new_zeros((), dtype=torch.float32) for _ in self.aux_coeffs]
        if moe.moe_z_loss_coeff is not None:
            losses.append(z_value)
        counts = routing_map.sum(dim=0, dtype=torch.float32)
        if losses:
            values = torch.stack([v.float() for v in losses])
            if self.tp_group is not None and training:
                dist.all_reduce(values, group=self.tp_group)  # the TP ranks' partial losses
            stats = torch.cat([values, counts])
        else:
            stats = counts
        return probs, routing_map, stats

    def _apply_aux_losses(self, probs, aux_map, scores, seq_len):
        """Attaches each load-balancing loss to ``probs``; returns them without coefficients."""
        num_tokens = aux_map.shape[0]
        tp = self.tp_size
        values = []
        for kind in ("aux_loss", "seq_aux_loss", "global_aux_loss"):
            coeff = self.aux_coeffs.get(kind)
            if coeff is None:
                continue
            if kind == "aux_loss":
                counts = self._tp_sum(aux_map.sum(dim=0, dtype=scores.dtype))
                loss = moe_utils.switch_load_balancing_loss(scores, counts, num_tokens * tp, self.topk, coeff)
            elif kind == "seq_aux_loss":
                # Tokens are [s, b] in order: [s, b * E] columns are (sequence, expert) pairs.
                batch = num_tokens // seq_len
                s_scores = scores.reshape(seq_len, batch * self.num_experts)
                s_counts = aux_map.reshape(seq_len, batch * self.num_experts).sum(dim=0, dtype=scores.dtype)
                s_counts = self._tp_sum(s_counts)
                loss = (
                    moe_utils.switch_load_balancing_loss(
                        s_scores, s_counts, seq_len * tp, self.topk, coeff, self.num_experts
                    )
                    / batch
                )
            else:
                counts = self._tp_sum(aux_map.sum(dim=0, dtype=torch.float32))
                dp = 1
                if self.dp_group is not None:
                    dist.all_reduce(counts, group=self.dp_group)
                    dp = dist.get_world_size(self.dp_group)
                with torch.no_grad():
                    self.global_tokens_per_expert.add_(counts)
                    self.global_aux_steps.add_(1)
                mean_counts = (self.global_tokens_per_expert / self.global_aux_steps).to(scores.dtype)
                loss = moe_utils.switch_load_balancing_loss(scores, mean_counts, num_tokens * dp * tp, self.topk, coeff)
            probs = moe_utils.AuxLossAutoScaler.apply(probs, loss, self.aux_loss_scale)
            values.append(loss.detach() / coeff)
        return probs, values

    def _tp_sum(self, counts: torch.Tensor) -> torch.Tensor:
        """Token counts summed over the TP ranks' sequence shards (no gradient flows through counts)."""
        if self.tp_group is None:
            return counts
        counts = counts.detach().clone()
        dist.all_reduce(counts, group=self.tp_group)
        return counts

    # ------------------------------------------------------------------ between steps
    @torch.no_grad()
    def reset_global_aux_loss(self) -> None:
        """Starts a new global batch for ``global_aux_loss`` (call once per optimizer step)."""
        if self.global_tokens_per_expert is not None:
            self.global_tokens_per_expert.zero_()
            self.global_aux_steps.zero_()

    @torch.no_grad()
    def update_expert_bias(self, tokens_per_expert: torch.Tensor, group=None) -> None:
        """Aux-loss-free balancing step: raise the bias of under-loaded experts, lower the others.

        Args:
            tokens_per_expert: ``[E]`` tokens routed to each expert this step on this rank.
            group: Group to sum the counts over (the data-parallel group), or None.
        """
        if self.expert_bias is None:
            return
        counts = self._tp_sum(tokens_per_expert.to(torch.float32).clone())
        if group is not None:
            dist.all_reduce(counts, group=group)
        offset = counts.mean() - counts
        self.expert_bias.add_(torch.sign(offset) * self.moe.moe_router_bias_update_rate)
