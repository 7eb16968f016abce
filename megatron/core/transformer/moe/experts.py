"""The routed experts (a loop of MLPs, or grouped GEMMs) and the shared experts.

Expert inputs arrive permuted: the rows of local expert 0, then of expert 1, ...,
with ``tokens_per_expert`` rows each, plus one routing probability per row. As in
Megatron the probability scales the activation (``act(fc1(x)) * p``) before fc2.

``SequentialMLP`` (``experts.local_experts.N.linear_fc1...``) slices the rows per
expert, so it needs the counts on the host: either static (drop-and-pad) or read by
the eager dispatch. ``GroupedMLP`` (``--moe-grouped-gemm``; ``experts.linear_fc1.weight``
of shape ``[experts, out, in]``) runs one ``torch.nn.functional.grouped_mm`` per
linear on CUDA with bf16, taking the counts as a device tensor (no host sync); elsewhere
it falls back to the same per-expert loop.

Every expert parameter is marked ``is_expert = True`` and ``allreduce = False``: its
gradient belongs to the expert-data-parallel buffer, not the dense one.
"""

import dataclasses

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import resolve_device
from megatron.core.transformer.mlp import MLP


def mark_expert_params(module: torch.nn.Module) -> None:
    """Tags every parameter of ``module`` as an expert parameter (expert-DP gradients)."""
    for p in module.parameters():
        p.is_expert = True
        p.allreduce = False


def _activate(intermediate: torch.Tensor, gated: bool) -> torch.Tensor:
    if gated:
        gate, up = torch.chunk(intermediate, 2, dim=-1)
        return F.silu(gate) * up
    return F.gelu(intermediate)


def _as_host_counts(tokens_per_expert) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(c) for c in tokens_per_expert.tolist()]  # host sync: eager callers only
    return [int(c) for c in tokens_per_expert]


def expert_config(config, ffn_hidden_size: int):
    """A copy of ``config`` whose MLP hidden size is ``ffn_hidden_size``."""
    return dataclasses.replace(config, ffn_hidden_size=ffn_hidden_size)


class SequentialMLP(torch.nn.Module):
    """The local experts as a list of MLPs run one after the other.

    Args:
        config: Finalized ``TransformerConfig`` (``config.moe`` set).
        num_local_experts: Experts on this rank.
        device: Device for the parameters.
    """

    def needs_host_counts(self, tokens: torch.Tensor) -> bool:
        """The loop slices rows per expert: it needs the counts as Python ints."""
        return True

    def __init__(self, config, num_local_experts: int, *, device=None):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.gated = config.gated_linear_unit
        cfg = expert_config(config, config.moe.moe_ffn_hidden_size)
        self.local_experts = torch.nn.ModuleList(MLP(cfg, None, device=device) for _ in range(num_local_experts))
        mark_expert_params(self)

    def _expert(self, i: int, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        mlp = self.local_experts[i]
        intermediate, _ = mlp.linear_fc1(x)
        act = _activate(intermediate, self.gated) * probs.unsqueeze(-1).to(intermediate.dtype)
        out, _ = mlp.linear_fc2(act)
        return out

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs: torch.Tensor) -> torch.Tensor:
        """``tokens [N, h]`` (expert-major), ``tokens_per_expert`` (list or tensor), ``probs [N]`` -> ``[N, h]``."""
        counts = _as_host_counts(tokens_per_expert)
        if len(counts) == 1:
            return self._expert(0, tokens, probs)
        outs = [
            self._expert(i, x, p)
            for i, (x, p) in enumerate(zip(torch.split(tokens, counts), torch.split(probs, counts)))
        ]
        return torch.cat(outs, dim=0)


class GroupedLinear(torch.nn.Module):
    """``num_experts`` linear layers of one shape as one ``[E, out, in]`` weight (and ``[E, out]`` bias)."""

    def __init__(
        self, num_experts: int, in_features: int, out_features: int, *, bias: bool, std: float, config, device
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.empty(num_experts, out_features, in_features, device=device, dtype=config.params_dtype)
        )
        with torch.no_grad():
            self.weight.normal_(0.0, std)
        self.bias = (
            torch.nn.Parameter(torch.zeros(num_experts, out_features, device=device, dtype=config.params_dtype))
            if bias
            else None
        )


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM can run these inputs (CUDA, bf16, a build that has it)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


class GroupedMLP(torch.nn.Module):
    """The local experts as grouped GEMMs over one ``[E, out, in]`` weight per linear.

    Args:
        config: Finalized ``TransformerConfig`` (``config.moe`` set).
        num_local_experts: Experts on this rank.
        device: Device for the parameters.
    """

    def __init__(self, config, num_local_experts: int, *, device=None):
        super().__init__()
        device = resolve_device(device)
        self.num_local_experts = num_local_experts
        self.gated = config.gated_linear_unit
        ffn = config.moe.moe_ffn_hidden_size
        std = config.init_method_std
        out_std = std / (2.0 * config.num_layers) ** 0.5
        h = config.hidden_size
        bias = config.add_bias_linear
        self.linear_fc1 = GroupedLinear(
            num_local_experts, h, 2 * ffn if self.gated else ffn, bias=bias, std=std, config=config, device=device
        )
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, h, bias=bias, std=out_std, config=config, device=device)
        mark_expert_params(self)

    def needs_host_counts(self, tokens: torch.Tensor) -> bool:
        """Only the fallback loop needs the counts on the host; grouped_mm takes them on the device."""
        return not grouped_mm_available(tokens)

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs: torch.Tensor) -> torch.Tensor:
        """``tokens [N, h]`` (expert-major), ``tokens_per_expert`` (list or tensor), ``probs [N]`` -> ``[N, h]``."""
        if grouped_mm_available(tokens):
            return self._grouped(tokens, tokens_per_expert, probs)
        return self._loop(tokens, tokens_per_expert, probs)

    def _grouped(self, tokens, tokens_per_expert, probs):
        n = self.num_local_experts
        experts = torch.arange(n, device=tokens.device)
        if isinstance(tokens_per_expert, torch.Tensor):
            counts = tokens_per_expert.to(device=tokens.device)
            offs = torch.cumsum(counts, dim=0).to(torch.int32)
        elif len(set(tokens_per_expert)) == 1:
            # Static counts (drop-and-pad): offsets from a device arange, no host-to-device copy,
            # so this runs inside a captured graph.
            counts = int(tokens_per_expert[0])
            offs = ((experts + 1) * counts).to(torch.int32)
        else:
            counts = torch.tensor(tokens_per_expert, device=tokens.device)  # eager: read on the host already
            offs = torch.cumsum(counts, dim=0).to(torch.int32)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        intermediate = F.grouped_mm(tokens, fc1.weight.transpose(-2, -1), offs=offs)
        if fc1.bias is not None or fc2.bias is not None:
            row_expert = torch.repeat_interleave(experts, counts, output_size=tokens.shape[0])
        if fc1.bias is not None:
            intermediate = intermediate + fc1.bias.index_select(0, row_expert)
        act = _activate(intermediate, self.gated) * probs.unsqueeze(-1).to(intermediate.dtype)
        out = F.grouped_mm(act, fc2.weight.transpose(-2, -1), offs=offs)
        if fc2.bias is not None:
            out = out + fc2.bias.index_select(0, row_expert)
        return out

    def _loop(self, tokens, tokens_per_expert, probs):
        counts = _as_host_counts(tokens_per_expert)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        outs = []
        for i, (x, p) in enumerate(zip(torch.split(tokens, counts), torch.split(probs, counts))):
            b1 = None if fc1.bias is None else fc1.bias[i]
            b2 = None if fc2.bias is None else fc2.bias[i]
            act = _activate(F.linear(x, fc1.weight[i], b1), self.gated) * p.unsqueeze(-1).to(x.dtype)
            outs.append(F.linear(act, fc2.weight[i], b2))
        return torch.cat(outs, dim=0)


class SharedExpertMLP(MLP):
    """The shared experts: one MLP every token goes through, optionally gated per token.

    With ``--moe-shared-expert-gate`` the output is scaled by ``sigmoid(x @ gate_weight^T)``
    (``shared_experts.gate_weight``, ``[1, h]``).
    """

    def __init__(self, config, *, device=None):
        moe = config.moe
        super().__init__(expert_config(config, moe.moe_shared_expert_intermediate_size), None, device=device)
        if moe.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty(1, config.hidden_size, device=resolve_device(device), dtype=config.params_dtype)
            )
            with torch.no_grad():
                self.gate_weight.normal_(0.0, config.init_method_std)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., h] -> [..., h]``."""
        out, _ = super().forward(hidden_states)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return out
