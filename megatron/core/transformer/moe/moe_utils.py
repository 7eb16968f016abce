"""Pure functions of the MoE layer: top-k routing, load-balancing losses, capacity,
the token permutation, and autograd-aware collectives.

Every function here is a function of its tensor arguments with static output shapes
(given the config), so callers can run them inside CUDA-graph regions. The only
exceptions are the collectives with split sizes (``all_to_all``), whose host-side
split lists are computed by the eager dispatch code, never here.

Unusual here: the auxiliary losses reach the gradient through ``AuxLossAutoScaler``,
an identity on an activation whose backward also hands the loss a gradient (``scale``,
a device tensor at a fixed address: 1 / micro-batches, times the fp16 loss scale), so
no loss tensor has to travel from the router to the end of the model and nothing is
read on the host.
"""

import math

import torch
import torch.distributed as dist


def router_compute_dtype(moe_router_dtype: str | None, input_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the router logits: ``--moe-router-dtype`` or the input's."""
    if moe_router_dtype == "fp32":
        return torch.float32
    if moe_router_dtype == "fp64":
        return torch.float64
    return input_dtype


def group_limited_topk(
    scores: torch.Tensor, topk: int, num_groups: int, group_topk: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k restricted to the ``group_topk`` best groups of experts per token.

    A group's score is the sum of its best ``topk // group_topk`` expert scores.

    Args:
        scores: ``[T, E]`` selection scores.

    Returns:
        ``(values [T, k], indices [T, k])`` of the selected experts.
    """
    num_tokens, num_experts = scores.shape
    grouped = scores.view(num_tokens, num_groups, num_experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [T, G]
    group_idx = group_scores.topk(group_topk, dim=-1, sorted=False).indices
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape(num_tokens, num_experts)
    masked = scores.masked_fill(~expert_mask, float("-inf"))
    return masked.topk(topk, dim=-1)


def _topk(scores, topk, num_groups, group_topk):
    if group_topk:
        return group_limited_topk(scores, topk, num_groups, group_topk)
    return scores.topk(topk, dim=-1)


def _score_dtype(logits: torch.Tensor) -> torch.dtype:
    """Scores in fp32 at least (fp64 stays fp64 with --moe-router-dtype fp64)."""
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _normalised_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    if score_function == "sigmoid":
        return torch.sigmoid(logits.to(_score_dtype(logits)))
    if score_function == "sqrtsoftplus":
        return torch.nn.functional.softplus(logits.to(_score_dtype(logits))).sqrt()
    raise ValueError(f"unknown --moe-router-score-function {score_function!r}")


def topk_routing(
    logits: torch.Tensor,
    topk: int,
    *,
    score_function: str = "softmax",
    pre_softmax: bool = False,
    num_groups: int | None = None,
    group_topk: int | None = None,
    scaling_factor: float | None = None,
    expert_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing, Megatron's semantics.

    softmax: the softmax runs over the k selected logits (or over all experts before the
    selection with ``pre_softmax``). sigmoid / sqrtsoftplus: per-expert scores, the
    selection optionally shifted by ``expert_bias`` (the probabilities are not), and the k
    selected scores renormalised to sum to 1 when k > 1. Scores are computed in fp32
    (fp64 for fp64 logits); the probabilities come back in the logits' dtype.

    Args:
        logits: ``[T, E]`` router logits.
        topk: Experts per token.

    Returns:
        ``(probs [T, E], routing_map [T, E] bool)``: probabilities on the selected
        experts and zeros elsewhere; True where a token goes to an expert.
    """
    if score_function == "softmax":
        if pre_softmax:
            scores = torch.softmax(logits, dim=-1, dtype=_score_dtype(logits))
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        else:
            top_logits, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1, dtype=_score_dtype(logits))
    else:
        scores = _normalised_scores(logits, score_function)
        if expert_bias is not None:
            _, indices = _topk(scores + expert_bias.to(scores.dtype), topk, num_groups, group_topk)
            probs = scores.gather(1, indices)
        else:
            probs, indices = _topk(scores, topk, num_groups, group_topk)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    probs = probs.to(logits.dtype)
    routing_probs = torch.zeros_like(logits).scatter_(1, indices, probs)
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    return routing_probs, routing_map


def sinkhorn(cost: torch.Tensor, tol: float = 1e-4) -> torch.Tensor:
    """Sinkhorn-Knopp balancing of ``exp(cost)`` (S-BASE routing), Megatron's iteration.

    Finds row scalings ``d0 [T]`` and column scalings ``d1 [E]`` such that
    ``d0[:, None] * exp(cost) * d1`` has rows summing to ``1 / T`` and columns to ``1 / E``
    (each step rescales the rows, then the columns), stopping once the column scalings
    move by at most ``tol`` on average. Reads the error on the host every step: eager only.

    Args:
        cost: ``[T, E]`` logits.

    Returns:
        ``[T, E]`` the balanced matrix.
    """
    k = torch.exp(cost)
    eps = 1e-8
    d1 = torch.ones(k.shape[1], device=k.device, dtype=k.dtype)
    while True:
        d0 = (1.0 / k.shape[0]) / (k @ d1 + eps)
        d1_new = (1.0 / k.shape[1]) / (d0 @ k + eps)
        error = (d1_new - d1).abs().mean()
        d1 = d1_new
        if error <= tol:
            break
    return d0.unsqueeze(1) * k * d1


def sinkhorn_routing(logits: torch.Tensor, topk: int, training: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``--moe-router-load-balancing-type sinkhorn``: Megatron's semantics.

    Training selects each token's top-k experts from the Sinkhorn-balanced fp32 logits
    (no gradient through the selection); evaluation from the scores. The probabilities
    are the scores of the selected experts, not renormalised: ``sigmoid(logits)`` for
    k = 1, the softmax over all experts for k > 1 (in fp32 at least, back in the logits' dtype).
    The score function, pre-softmax, groups, scaling factor and expert bias do not apply.

    Returns:
        ``(probs [T, E], routing_map [T, E] bool)`` as ``topk_routing``.
    """
    if topk == 1:
        scores = torch.sigmoid(logits)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=_score_dtype(logits)).to(logits.dtype)
    if training:
        with torch.no_grad():
            indices = sinkhorn(logits.detach().to(torch.float32)).topk(topk, dim=-1).indices
    else:
        indices = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, indices, True)
    return scores * routing_map, routing_map


def scores_for_aux_loss(logits: torch.Tensor, topk: int, score_function: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(routing_map [T, E], scores [T, E] fp32 or fp64)`` the load-balancing losses are computed on:
    plain top-k over the normalised scores (no groups, no expert bias, no dropping)."""
    if score_function == "softmax":
        scores = torch.softmax(logits, dim=-1, dtype=_score_dtype(logits))
    else:
        scores = _normalised_scores(logits, score_function)
        scores = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    indices = scores.topk(topk, dim=-1).indices
    routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter_(1, indices, True)
    return routing_map, scores


def switch_load_balancing_loss(
    scores: torch.Tensor,
    tokens_per_expert: torch.Tensor,
    total_num_tokens: int,
    topk: int,
    coeff: float,
    num_experts: int | None = None,
) -> torch.Tensor:
    """Switch-Transformer load-balancing loss, ``coeff * E * sum_i f_i * P_i``.

    ``f_i`` is the fraction of routed slots on expert i (``tokens_per_expert / (T * k)``),
    ``P_i`` the mean score of expert i over the local tokens (``scores.sum(0) / T``).

    Args:
        scores: ``[T, E]`` scores of the local tokens.
        tokens_per_expert: ``[E]`` routed counts at the level the loss balances over.
        total_num_tokens: Token count at that same level.
        num_experts: E (default: the scores' last dim; the per-sequence loss folds the batch into it).
    """
    num_experts = scores.shape[-1] if num_experts is None else num_experts
    scale = num_experts * coeff / (topk * total_num_tokens * total_num_tokens)
    return torch.sum(scores.sum(dim=0) * tokens_per_expert) * scale


def z_loss(logits: torch.Tensor, coeff: float) -> torch.Tensor:
    """Router z-loss (ST-MoE): ``coeff * mean(logsumexp(logits) ** 2)``."""
    return torch.logsumexp(logits, dim=-1).square().mean() * coeff


class _RandomLogits(torch.autograd.Function):
    """Standard normal values in place of the logits; the gradient passes straight through."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor) -> torch.Tensor:
        return torch.randn_like(logits)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        return grad_output


def random_logits(logits: torch.Tensor) -> torch.Tensor:
    """Random logits for ``--moe-router-force-load-balancing`` (straight-through).

    Drawn from the default generator, so a recompute replays the same draw and a CUDA
    graph draws anew at every replay.
    """
    return _RandomLogits.apply(logits)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Slots per expert: ``ceil(T * k / E * capacity_factor)``."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_token_dropping(
    probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, *, drop_policy: str, pad_to_capacity: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keeps at most ``capacity`` tokens per expert (Megatron's drop-and-pad).

    ``drop_policy`` "probs" keeps each expert's highest-probability tokens, "position"
    its first ones. With ``pad_to_capacity`` every expert gets exactly ``capacity``
    slots: the routing map holds ``capacity`` True per column (padding slots have
    probability 0), which is what makes the expert inputs static.

    Returns:
        ``(probs, routing_map)`` after dropping, same shapes.
    """
    num_tokens = probs.shape[0]
    if capacity >= num_tokens:
        keep = torch.ones_like(routing_map)
    else:
        if drop_policy == "probs":
            key = probs.detach()  # only the indices are used: no backward node keeps them
        else:  # routed tokens first, earlier ones first: a key without ties
            position = torch.arange(num_tokens, 0, -1, device=probs.device).unsqueeze(1)
            key = routing_map.long() * (2 * num_tokens) + position
        idx = key.topk(capacity, dim=0, sorted=False).indices  # [C, E]
        keep = torch.zeros_like(routing_map).scatter_(0, idx, True)
    new_map = keep if pad_to_capacity else routing_map & keep
    return probs * new_map, new_map


class AuxLossAutoScaler(torch.autograd.Function):
    """Identity on ``activation``; in backward, ``aux_loss`` receives the gradient ``scale``.

    This is how an auxiliary loss computed deep inside the model joins the objective
    without being carried to the loss: ``scale`` is d(objective)/d(aux loss), i.e.
    1 / micro-batches (times the fp16 loss scale). It is a device tensor read at
    backward time, so a captured backward graph reads its current value at replay.
    """

    @staticmethod
    def forward(ctx, activation: torch.Tensor, aux_loss: torch.Tensor, scale: torch.Tensor):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale  # not saved: its value may be set between forward and backward
        return activation.view_as(activation)

    @staticmethod
    def backward(ctx, grad_output):
        (aux_loss,) = ctx.saved_tensors
        scale = ctx.scale
        return grad_output, torch.ones_like(aux_loss) * scale.to(aux_loss.dtype), None


def permutation_by_expert(
    routing_map: torch.Tensor, probs: torch.Tensor, num_out: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Where each routed (token, expert) slot goes in the expert-major order.

    Slots are ordered by expert, then by token, as every dispatcher here lays out
    expert inputs. ``num_out`` is static: ``T * k`` dropless, ``E * capacity`` with
    drop-and-pad, ``T * k`` as an upper bound when tokens are dropped without padding
    (then the slots past ``routing_map.sum()`` are filler that the caller cuts off).

    Args:
        routing_map: ``[T, E]`` bool.
        probs: ``[T, E]`` routing probabilities.
        num_out: Number of slots to return.

    Returns:
        ``(token_idx [num_out] int64, slot_probs [num_out], tokens_per_expert [E] int64)``.
    """
    num_tokens = routing_map.shape[0]
    mask = routing_map.t().reshape(-1)  # [E * T], expert-major
    # Stable descending sort puts the routed slots first, in expert-major order: no host sync.
    order = torch.argsort(mask.view(torch.uint8), descending=True, stable=True)[:num_out]
    token_idx = order % num_tokens
    # Indexed in place (no transposed copy of probs); each entry is picked at most once.
    slot_probs = probs[token_idx, order // num_tokens]
    tokens_per_expert = routing_map.sum(dim=0)
    return token_idx, slot_probs, tokens_per_expert


def unpermute(expert_output: torch.Tensor, token_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sums each token's expert outputs: ``out[t] = sum of expert_output[i] with token_idx[i] == t``."""
    out = expert_output.new_zeros(num_tokens, expert_output.shape[-1])
    return out.index_add_(0, token_idx, expert_output)  # in place: no copy of the zeros


# ---------------------------------------------------------------------------- collectives

# torch 2.13 renamed the tensor collectives (the old names warn).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def all_gather_tensor(out: torch.Tensor, x: torch.Tensor, group) -> None:
    """Non-differentiable all-gather along dim 0 into ``out``."""
    _all_gather_single(out, x.contiguous(), group=group)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows,) + tuple(x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group) -> torch.Tensor:
    """Differentiable ``all_to_all_single`` along dim 0 (``None`` splits: equal chunks)."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] * size,) + tuple(x.shape[1:]))
        _all_gather_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _ReduceScatter.apply(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = x.new_empty((x.shape[0] // size,) + tuple(x.shape[1:]))
        _reduce_scatter_single(out, x.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        return _AllGather.apply(grad, ctx.group), None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable all-gather along dim 0 (backward: reduce-scatter of the sum)."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Differentiable reduce-scatter (sum) along dim 0 (backward: all-gather)."""
    return _ReduceScatter.apply(x, group)


def all_gather_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Differentiable all-gather along dim 0 of ``sizes[r]`` rows from each rank r, in rank order.

    An all-to-all that sends this rank's rows to every rank (gloo has no uneven
    all-gather); its backward returns each rank's gradient rows to their owner, where
    the copies are summed: a reduce-scatter.
    """
    size = dist.get_world_size(group)
    return all_to_all(x.repeat(size, *([1] * (x.dim() - 1))), sizes, [x.shape[0]] * size, group)


def reduce_scatter_uneven(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Differentiable reduce-scatter (sum) along dim 0: rank r gets the sum over ranks of rows
    ``[sum(sizes[:r]), sum(sizes[:r + 1]))`` (the adjoint of ``all_gather_uneven``)."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = sizes[rank]
    parts = all_to_all(x, [mine] * size, sizes, group)
    return parts.view(size, mine, *x.shape[1:]).sum(dim=0)
