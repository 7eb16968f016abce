"""Token dispatchers: move routed tokens to their experts and the results back.

Structured as four functional phases so CUDA-graph regions can cover the static ones:

1. ``preprocess(hidden, probs, routing_map)`` (graphable: no host sync, static shapes):
   orders the routed (token, expert) slots expert-major and gathers the tokens. Returns
   ``(permuted [M, h], slot_probs [M], token_idx [M], tokens_per_expert)``; ``M`` depends
   only on the config and the token count (``num_slots``).
2. ``dispatch(...)`` (eager): the communication. Split sizes that depend on the data are
   read on the host here and nowhere else; with drop-and-pad they are static and there
   is no host read at all (the whole MoE block is capturable).
3. ``combine(expert_output, state)`` (eager): the reverse communication; the output has
   ``M`` rows again (zeros where slots were dropped), so phase 4 is static.
4. ``postprocess(combined, token_idx, num_tokens)`` (graphable): sums each token's
   expert outputs.

Nothing is stored on the dispatcher between phases: what ``combine`` needs comes back
from ``dispatch`` as a ``DispatchState`` and is passed in.

The expert-parallel (EP) and expert-tensor-parallel (ETP) groups are passed in; EP
ranks hold ``num_experts / EP`` experts each, ETP ranks a shard of every local expert
(fc1 split by columns, fc2 by rows: each ETP rank's expert output is a partial sum).
So every ETP rank must see all the tokens routed to its experts, and the partial
outputs are summed on the way back (Megatron's layout):

- ``alltoall`` sends each EP rank exactly the tokens of its experts
  (``all_to_all_single`` with split sizes; equal splits with drop-and-pad), then
  all-gathers them over ETP; ``combine`` reduce-scatters over ETP, then all-to-alls back.
- ``allgather`` gathers the tokens of the whole ETP x EP group, computes the local
  experts' share of all of them and reduce-scatters the sums back over that group
  (the one reduce-scatter sums both the experts and the ETP partial outputs).

With tensor and sequence parallelism each TP rank brings its own sequence shard, so
the ranks of a group route different tokens.
"""

import dataclasses

import torch
import torch.distributed as dist

from megatron.core.transformer.moe import moe_utils


@dataclasses.dataclass
class DispatchState:
    """What ``combine`` needs from ``dispatch``: host-side sizes, no tensors.

    Attributes:
        num_slots: ``M``, the static slot count ``combine`` returns.
        num_sent: Slots that left this rank (``M`` unless tokens were dropped without padding).
        input_splits: Rows sent to each EP rank (None: equal splits or EP = 1).
        output_splits: Rows received from each EP rank.
        recv_counts: Rows received per (source, local expert), source-major; a source
            is an (ETP rank, EP rank) pair, ``etp * EP + ep``.
        etp_sizes: Rows each ETP rank gathered (its share of the ETP all-gather).
    """

    num_slots: int
    num_sent: int
    input_splits: list[int] | None = None
    output_splits: list[int] | None = None
    recv_counts: list[int] | None = None
    etp_sizes: list[int] | None = None


class MoETokenDispatcher:
    """Shared by both dispatchers: the single-rank path and the static sizes.

    Args:
        moe: The ``MoEConfig``.
        ep_group: Expert-parallel process group, or None for EP = 1.
        etp_group: Expert-tensor-parallel process group, or None for ETP = 1.
        tp_ep_group: The ETP x EP group (the allgather dispatcher gathers over it); None:
            the EP group when ETP = 1, the ETP group when EP = 1.
    """

    def __init__(self, moe, ep_group=None, etp_group=None, tp_ep_group=None):
        self.moe = moe
        self.ep_group = ep_group
        self.ep_size = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.etp_group = etp_group
        self.etp_size = 1 if etp_group is None else dist.get_world_size(etp_group)
        self.etp_rank = 0 if etp_group is None else dist.get_rank(etp_group)
        if tp_ep_group is None and min(self.ep_size, self.etp_size) == 1:
            tp_ep_group = ep_group if self.ep_size > 1 else etp_group
        self.tp_ep_group = tp_ep_group
        self.tp_ep_size = 1 if tp_ep_group is None else dist.get_world_size(tp_ep_group)
        assert self.tp_ep_size == self.ep_size * self.etp_size, "the ETP x EP group must hold ETP * EP ranks"
        self.num_experts = moe.num_moe_experts
        if self.num_experts % self.ep_size:
            raise ValueError(
                f"--num-experts ({self.num_experts}) must be divisible by --expert-model-parallel-size "
                f"({self.ep_size})."
            )
        self.num_local_experts = self.num_experts // self.ep_size
        self.local_expert_indices = range(
            self.ep_rank * self.num_local_experts, (self.ep_rank + 1) * self.num_local_experts
        )
        self.topk = moe.moe_router_topk
        self.pad = moe.drop_and_pad
        self.dropping = moe.moe_expert_capacity_factor is not None and not self.pad

    def capacity(self, num_tokens: int) -> int:
        """Rows per expert from each rank with drop-and-pad: ``min(capacity, tokens)``."""
        cap = moe_utils.expert_capacity(num_tokens, self.num_experts, self.topk, self.moe.moe_expert_capacity_factor)
        return min(cap, num_tokens)

    # ------------------------------------------------------------------ EP = 1 helpers
    def _local_dispatch(self, permuted, slot_probs, tokens_per_expert, needs_host_counts, per_expert_static):
        num_slots = permuted.shape[0]
        if self.pad:
            return (
                permuted,
                slot_probs,
                [per_expert_static] * len(self.local_expert_indices),
                DispatchState(num_slots, num_slots),
            )
        if self.dropping or needs_host_counts:
            counts = [int(c) for c in tokens_per_expert.tolist()]  # host sync, eager part
            n = sum(counts)
            if n == num_slots:  # dropless: every slot is routed (a full slice would cost a copy in backward)
                return permuted, slot_probs, counts, DispatchState(num_slots, n)
            return permuted[:n], slot_probs[:n], counts, DispatchState(num_slots, n)
        return permuted, slot_probs, tokens_per_expert, DispatchState(num_slots, num_slots)

    @staticmethod
    def _pad_rows(x: torch.Tensor, num_slots: int) -> torch.Tensor:
        if x.shape[0] == num_slots:
            return x
        return torch.cat([x, x.new_zeros((num_slots - x.shape[0],) + tuple(x.shape[1:]))], dim=0)


class MoEAlltoAllTokenDispatcher(MoETokenDispatcher):
    """All-to-all dispatcher: each EP rank receives exactly the tokens of its experts."""

    def num_slots(self, num_tokens: int) -> int:
        """``M``: ``E * capacity`` with drop-and-pad, else ``T * k`` (an upper bound when dropping)."""
        if self.pad:
            return self.num_experts * self.capacity(num_tokens)
        return num_tokens * self.topk

    def preprocess(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Graphable. ``hidden [T, h]``, ``probs``/``routing_map`` ``[T, E]`` ->
        ``(permuted [M, h], slot_probs [M], token_idx [M], tokens_per_expert [E])``."""
        m = self.num_slots(hidden.shape[0])
        token_idx, slot_probs, tokens_per_expert = moe_utils.permutation_by_expert(routing_map, probs, m)
        return hidden.index_select(0, token_idx), slot_probs, token_idx, tokens_per_expert

    def dispatch(self, permuted, slot_probs, tokens_per_expert, *, num_tokens: int, needs_host_counts: bool):
        """Eager. Returns ``(expert_input, expert_probs, expert_counts, state)``; ``expert_counts``
        is a list of ints, or a device tensor when the experts take one (dropless, EP = 1)."""
        el, ep, etp = self.num_local_experts, self.ep_size, self.etp_size
        if ep == 1 and etp == 1:
            cap = self.capacity(num_tokens) if self.pad else 0
            return self._local_dispatch(permuted, slot_probs, tokens_per_expert, needs_host_counts, cap)
        num_slots = permuted.shape[0]
        sources = ep * etp
        if self.pad:
            cap = self.capacity(num_tokens)
            x, p = permuted, slot_probs
            if ep > 1:
                x = moe_utils.all_to_all(x, None, None, self.ep_group)
                p = moe_utils.all_to_all(p, None, None, self.ep_group)
            if etp > 1:
                x = moe_utils.all_gather(x, self.etp_group)
                p = moe_utils.all_gather(p, self.etp_group)
            # Received [source][local expert][cap] -> [local expert][source][cap].
            x = x.view(sources, el, cap, -1).transpose(0, 1).reshape(sources * el * cap, -1)
            p = p.view(sources, el, cap).transpose(0, 1).reshape(-1)
            return x, p, [sources * cap] * el, DispatchState(num_slots, num_slots)
        # Exchange the per-expert counts (over EP, then gathered over ETP) and read them on
        # the host together with this rank's own: the one sync.
        recv = tokens_per_expert
        if ep > 1:
            recv = torch.empty_like(tokens_per_expert)
            dist.all_to_all_single(recv, tokens_per_expert.contiguous(), group=self.ep_group)
        if etp > 1:
            gathered = recv.new_empty(etp * recv.numel())
            moe_utils.all_gather_tensor(gathered, recv, self.etp_group)
            recv = gathered
        both = torch.cat([tokens_per_expert, recv]).tolist()
        send, recv_counts = both[: self.num_experts], [int(c) for c in both[self.num_experts :]]
        block = ep * el  # counts one ETP rank received over EP
        mine = recv_counts[self.etp_rank * block : (self.etp_rank + 1) * block]
        input_splits = [int(sum(send[r * el : (r + 1) * el])) for r in range(ep)]
        output_splits = [sum(mine[r * el : (r + 1) * el]) for r in range(ep)]
        n = sum(input_splits)
        x, p = permuted[:n], slot_probs[:n]
        if ep > 1:
            x = moe_utils.all_to_all(x, output_splits, input_splits, self.ep_group)
            p = moe_utils.all_to_all(p, output_splits, input_splits, self.ep_group)
        etp_sizes = None
        if etp > 1:
            etp_sizes = [sum(recv_counts[t * block : (t + 1) * block]) for t in range(etp)]
            x = moe_utils.all_gather_uneven(x, etp_sizes, self.etp_group)
            p = moe_utils.all_gather_uneven(p, etp_sizes, self.etp_group)
        order = [s * el + e for e in range(el) for s in range(sources)]  # source-major -> expert-major
        x_parts, p_parts = x.split(recv_counts), p.split(recv_counts)
        x = torch.cat([x_parts[i] for i in order])
        p = torch.cat([p_parts[i] for i in order])
        expert_counts = [sum(recv_counts[s * el + e] for s in range(sources)) for e in range(el)]
        state = DispatchState(num_slots, n, input_splits, output_splits, recv_counts, etp_sizes)
        return x, p, expert_counts, state

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Eager. Expert outputs back to the ranks their tokens came from, ``[M, h]``."""
        el, ep, etp = self.num_local_experts, self.ep_size, self.etp_size
        if ep == 1 and etp == 1:
            return self._pad_rows(expert_output, state.num_slots)
        sources = ep * etp
        if self.pad:
            cap = expert_output.shape[0] // (sources * el)
            y = expert_output.view(el, sources, cap, -1).transpose(0, 1).reshape(sources * el * cap, -1)
            if etp > 1:
                y = moe_utils.reduce_scatter(y, self.etp_group)
            if ep > 1:
                y = moe_utils.all_to_all(y, None, None, self.ep_group)
            return y
        rc = state.recv_counts
        sizes = [rc[s * el + e] for e in range(el) for s in range(sources)]  # expert-major chunk sizes
        chunks = expert_output.split(sizes)
        # chunk of (expert e, source s) sits at index e * sources + s; restore source-major order.
        y = torch.cat([chunks[e * sources + s] for s in range(sources) for e in range(el)])
        if etp > 1:  # sum the ETP ranks' partial outputs, keep this rank's sources
            y = moe_utils.reduce_scatter_uneven(y, state.etp_sizes, self.etp_group)
        if ep > 1:
            y = moe_utils.all_to_all(y, state.input_splits, state.output_splits, self.ep_group)
        return self._pad_rows(y, state.num_slots)

    def postprocess(self, combined: torch.Tensor, token_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Graphable. ``[M, h] -> [T, h]``: each token's expert outputs summed."""
        return moe_utils.unpermute(combined, token_idx, num_tokens)


class MoEAllGatherTokenDispatcher(MoETokenDispatcher):
    """All-gather dispatcher: every rank of the ETP x EP group sees all the group's tokens and
    computes its experts' (shards') share."""

    def num_slots(self, num_tokens: int) -> int:
        """``M`` on this rank: ``local experts * ETP * EP * capacity`` with drop-and-pad, else an upper bound."""
        el, g = self.num_local_experts, self.tp_ep_size
        if self.pad:
            return el * g * self.capacity(num_tokens)
        return g * num_tokens * min(self.topk, el)

    def preprocess(self, hidden: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor):
        """Graphable. As the all-to-all one, over the gathered tokens and the local experts only;
        ``tokens_per_expert`` is ``[local experts]``."""
        num_tokens = hidden.shape[0]
        if self.tp_ep_size > 1:
            hidden = moe_utils.all_gather(hidden, self.tp_ep_group)
            probs = moe_utils.all_gather(probs, self.tp_ep_group)
            gathered = routing_map.new_empty((routing_map.shape[0] * self.tp_ep_size, routing_map.shape[1]))
            gathered = gathered.to(torch.uint8)
            moe_utils.all_gather_tensor(gathered, routing_map.to(torch.uint8), self.tp_ep_group)
            routing_map = gathered.bool()
        lo, hi = self.local_expert_indices.start, self.local_expert_indices.stop
        m = self.num_slots(num_tokens)
        token_idx, slot_probs, tokens_per_expert = moe_utils.permutation_by_expert(
            routing_map[:, lo:hi], probs[:, lo:hi], m
        )
        return hidden.index_select(0, token_idx), slot_probs, token_idx, tokens_per_expert

    def dispatch(self, permuted, slot_probs, tokens_per_expert, *, num_tokens: int, needs_host_counts: bool):
        """Eager (the communication happened in ``preprocess``): cuts off the filler slots."""
        cap = self.tp_ep_size * self.capacity(num_tokens) if self.pad else 0
        if self.ep_size > 1 and not self.pad:
            # The local share of the gathered tokens varies: M is only an upper bound.
            counts = [int(c) for c in tokens_per_expert.tolist()]  # host sync, eager part
            n = sum(counts)
            return permuted[:n], slot_probs[:n], counts, DispatchState(permuted.shape[0], n)
        return self._local_dispatch(permuted, slot_probs, tokens_per_expert, needs_host_counts, cap)

    def combine(self, expert_output: torch.Tensor, state: DispatchState) -> torch.Tensor:
        """Eager. Pads back to ``M`` rows (the reduce-scatter is in ``postprocess``)."""
        return self._pad_rows(expert_output, state.num_slots)

    def postprocess(self, combined: torch.Tensor, token_idx: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Graphable. ``[M, h] -> [T, h]``: sums over the gathered tokens, then reduce-scatters."""
        out = moe_utils.unpermute(combined, token_idx, num_tokens * self.tp_ep_size)
        if self.tp_ep_size > 1:
            out = moe_utils.reduce_scatter(out, self.tp_ep_group)
        return out


def build_token_dispatcher(moe, ep_group=None, etp_group=None, tp_ep_group=None) -> MoETokenDispatcher:
    """The dispatcher ``--moe-token-dispatcher-type`` names (groups as ``MoETokenDispatcher``).

    ``flex`` gets the all-to-all dispatcher. Megatron's flex dispatcher sends every token to the
    ETP x EP ranks that hold its experts (DeepEP, HybridEP or NCCL EP kernels) with the router's
    probabilities, and its combine sums each token's probability-weighted expert outputs and the
    ETP partial outputs: the tokens, experts, probabilities and sums of ``alltoall``, moved by
    other kernels (which may add the k outputs of a token in another order).
    """
    if moe.moe_token_dispatcher_type in ("alltoall", "flex"):
        return MoEAlltoAllTokenDispatcher(moe, ep_group, etp_group, tp_ep_group)
    if moe.moe_token_dispatcher_type == "allgather":
        return MoEAllGatherTokenDispatcher(moe, ep_group, etp_group, tp_ep_group)
    raise ValueError(
        f"--moe-token-dispatcher-type {moe.moe_token_dispatcher_type} is not supported; use alltoall, allgather "
        "or flex."
    )
