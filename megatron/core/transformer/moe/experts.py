"""The routed experts (a loop of MLPs, or grouped GEMMs) and the shared experts.

Expert inputs arrive permuted: the rows of local expert 0, then of expert 1, ...,
with ``tokens_per_expert`` rows each, plus one routing probability per row. As in
Megatron the probability scales the activation (``act(fc1(x)) * p``) before fc2.

``SequentialMLP`` (``experts.local_experts.N.linear_fc1...``) slices the rows per
expert, so it needs the counts on the host: either static (drop-and-pad) or read by the
eager dispatch. When its weights fuse their gradients into ``main_grad`` (under DDP) and
have no biases, the loop is one autograd node (``_ExpertLoop``): GEMMs per expert,
elementwise ops once, the same values as the per-module path with a fraction of its host
work. It computes GeLU and SwiGLU itself; the other activations (``mlp_activation``:
squared ReLU, quick-GEGLU, a GLU offset or clamp) take the per-module path. With
data-dependent counts on CUDA each expert's rows are padded with zero rows to a multiple
of 128 (``_RowPadding``), so the GEMMs run at shapes that recur from step to step; the
real rows' outputs and the weight gradients are the same values (not bit for bit: other
shapes may run other kernels).

``GroupedMLP`` (``--moe-grouped-gemm``; ``experts.linear_fc1.weight`` of shape
``[experts, out, in]``) runs one ``torch.nn.functional.grouped_mm`` per linear on CUDA
with bf16, taking the counts as a device tensor (no host sync); elsewhere it falls back
to the same per-expert loop, and so it does (saying so once) when the hidden or expert
FFN size is not a multiple of 16 bytes, which the kernel's strides need.

Every expert parameter is marked ``is_expert = True`` and ``allreduce = False``: its
gradient belongs to the expert-data-parallel buffer, not the dense one.

Layout-independent init: every rank draws the full weights of all ``num_experts``
experts in a single process's order and keeps its local experts (expert parallelism)
and, with expert tensor parallelism (ETP), its shard of each: fc1 split by output
features (SwiGLU's gate and up halves split separately), fc2 by input features, as
``tensor_parallel.layers`` does. The experts themselves communicate nothing: the token
dispatcher all-gathers their inputs over ETP and sums the fc2 partial outputs.
"""

import contextlib
import dataclasses
import warnings

import torch
import torch.nn.functional as F

from megatron.core.tensor_parallel.layers import (
    _fuses_wgrad,
    accumulate_wgrad_t,
    resolve_device,
    shard_of,
    uses_sequence_parallel,
)
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.mlp_activation import MLPActivation
from megatron.core.transformer.offload import offloader_for
from megatron.core.transformer.recompute import OutputDiscarder, recomputes


def mark_expert_params(module: torch.nn.Module) -> None:
    """Tags every parameter of ``module`` as an expert parameter (expert-DP gradients)."""
    for p in module.parameters():
        p.is_expert = True
        p.allreduce = False


class _ExpertLoop(torch.autograd.Function):
    """The whole loop of expert MLPs as one autograd node, weight gradients fused into ``main_grad``.

    Per expert ``i``: ``out_i = fc2_i(act(fc1_i(x_i)) * p_i)``, the GEMMs per expert (written
    into slices of one buffer), the elementwise ops once over all rows: the activation, the
    probability scaling and their backward act on each row alone, so they give the values
    the per-expert module path gives (``SequentialMLP._expert`` through the linear layers'
    ``LinearWithGradAccumulation``), and the backward runs the ops autograd runs for that
    graph. GeLU on the CPU is the exception kept per expert: there the kernel's vectorised
    and scalar tails differ and a contiguous tensor is one run of elements, so its split
    points must stay where they were. One Python ``backward`` per layer replaces two per
    expert plus an autograd node per elementwise op. Only for linears without biases whose
    weights all fuse their gradient (``SequentialMLP._fused_weights``); the weights'
    AccumulateGrad nodes still run (with no gradient), so DDP's hooks see them.

    With ``rows`` (``_RowPadding``) each expert's rows are followed by zero rows up to a
    bucket size, so the GEMMs run at shapes that repeat across steps; the outputs and input
    gradients are returned for the real rows only. The zero rows stay zero through the
    activation (``silu(0) * 0``, ``gelu(0)``) and get zero gradients, so they add nothing
    to the weight gradients.
    """

    @staticmethod
    def forward(ctx, tokens, probs, rows, gated, *weights):
        counts = rows.padded
        n = len(counts)
        fc1, fc2 = weights[:n], weights[n:]
        tokens, probs = rows.pad(tokens), rows.pad(probs)
        inter = tokens.new_empty((tokens.shape[0], fc1[0].shape[0]))
        for x, w, o in zip(tokens.split_with_sizes(counts), fc1, inter.split_with_sizes(counts)):
            if x.shape[0]:
                F.linear(x, w, out=o)  # x @ w^T, one op
        pu = probs.unsqueeze(-1).to(inter.dtype)
        if gated:
            gate, up = torch.chunk(inter, 2, dim=-1)
            s = F.silu(gate)
            a = s * up
        else:
            s = None
            a = _per_expert(F.gelu, counts, inter) if inter.device.type == "cpu" else F.gelu(inter)
        act = a * pu
        out = tokens.new_empty((tokens.shape[0], fc2[0].shape[0]))
        for x, w, o in zip(act.split_with_sizes(counts), fc2, out.split_with_sizes(counts)):
            if x.shape[0]:
                F.linear(x, w, out=o)
        ctx.rows, ctx.gated = rows, gated
        # The parameters themselves for their main_grad: under activation recomputation the
        # saved tensors come back as plain tensors without it.
        ctx.params = weights
        ctx.saved = (inter, s, a, pu, act)
        ctx.save_for_backward(tokens, probs, *weights)
        return rows.unpad(out)

    @staticmethod
    def backward(ctx, grad_out):
        tokens, probs, *weights = ctx.saved_tensors
        inter, s, a, pu, act = ctx.saved
        ctx.saved = None
        rows = ctx.rows
        counts, n = rows.padded, len(rows.padded)
        fc1, fc2 = weights[:n], weights[n:]
        main_grads = [w.main_grad for w in ctx.params]
        grad_out = rows.pad(grad_out)
        # Each intermediate is dropped once its last use has run, as autograd frees saved tensors.
        grad_act = _dgrad_wgrad(grad_out, act, fc2, main_grads[n:], counts, True)
        del act, grad_out
        grad_a = grad_act * pu
        grad_p = None
        if ctx.needs_input_grad[1]:
            grad_p = rows.unpad((grad_act * a).sum(-1).to(probs.dtype))
        del grad_act, a, pu
        if ctx.gated:
            # Both halves written in place into one buffer: no concatenation.
            gate, up = torch.chunk(inter, 2, dim=-1)
            grad_inter = torch.empty_like(inter)
            grad_gate, grad_up = torch.chunk(grad_inter, 2, dim=-1)
            torch.ops.aten.silu_backward.grad_input(grad_a * up, gate, grad_input=grad_gate)
            del gate, up, inter
            torch.mul(grad_a, s, out=grad_up)
            del grad_a, s, grad_gate, grad_up
        elif inter.device.type == "cpu":
            grad_inter = _per_expert(torch.ops.aten.gelu_backward, counts, grad_a, inter)
            del grad_a, inter
        else:
            grad_inter = torch.ops.aten.gelu_backward(grad_a, inter)
            del grad_a, inter
        grad_x = _dgrad_wgrad(grad_inter, tokens, fc1, main_grads[:n], counts, ctx.needs_input_grad[0])
        if grad_x is not None:
            grad_x = rows.unpad(grad_x)
        return (grad_x, grad_p, None, None) + (None,) * (2 * n)


def _dgrad_wgrad(grad_out, inputs, weights, main_grads, counts: list[int], need_dgrad: bool):
    """Per expert: ``main_grad += grad^T @ input`` and the input gradient ``grad @ weight``
    written into that expert's rows of one buffer (returned; None without ``need_dgrad``)."""
    dgrad = grad_out.new_empty((grad_out.shape[0], weights[0].shape[1])) if need_dgrad else None
    outs = dgrad.split_with_sizes(counts) if need_dgrad else [None] * len(counts)
    grads = grad_out.split_with_sizes(counts)
    grads_t = grad_out.t().split_with_sizes(counts, dim=1)  # every expert's grad^T from one transpose
    for g, g_t, w, mg, x, o in zip(grads, grads_t, weights, main_grads, inputs.split_with_sizes(counts), outs):
        if g.shape[0]:
            if o is not None:
                torch.mm(g, w, out=o)
            accumulate_wgrad_t(mg, g_t, x)
    return dgrad


def _per_expert(fn, counts: list[int], *tensors: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to each expert's rows of ``tensors``, the results concatenated."""
    parts = zip(*(t.split_with_sizes(counts) for t in tensors))
    return torch.cat([fn(*p) for p in parts], dim=0)


CUDA_ROW_MULTIPLE = 128
"""On CUDA each expert's rows are padded to a multiple of this (see ``_RowPadding``)."""


def expert_row_multiple(device: torch.device) -> int:
    """The bucket size of the experts' row counts on ``device``: ``CUDA_ROW_MULTIPLE`` on CUDA,
    1 (no padding) elsewhere."""
    return CUDA_ROW_MULTIPLE if device.type == "cuda" else 1


class _RowPadding:
    """Each expert's rows padded with zero rows to a multiple of ``multiple``.

    Dropless routing gives the experts new row counts every step, and cuBLAS picks (and
    caches) its kernel per GEMM shape on the host, so a shape it has not seen pays that
    choice again. Rounded up to a multiple of 128, an expert's row count takes at most
    ``rows / 128 + 1`` values, the same ones every step, and every GEMM of the loop
    (forward, dgrad, and the wgrad whose reduction runs over the rows) gets a shape
    already seen. 128 rows is a tile of the GEMM kernels, so the forward and dgrad GEMMs
    mostly compute the padded rows anyway in their last, ragged tile; the padding costs at
    most 127 rows per expert, where a geometric set of buckets with as few shapes would pad
    by a fraction of the rows. Padding puts expert ``i``'s ``counts[i]`` rows first in a
    block of ``padded[i]`` rows, zeros after them; ``unpad`` keeps the first ``counts[i]``
    rows of each block.

    Args:
        counts: Rows of each expert.
        multiple: Bucket size (1: no padding; ``pad`` and ``unpad`` return their input).
    """

    def __init__(self, counts: list[int], multiple: int):
        self.counts = counts
        self.padded = [-(-c // multiple) * multiple for c in counts] if multiple > 1 else counts
        self.fill = [p - c for p, c in zip(self.padded, counts)]
        self.active = any(self.fill)
        # Sizes splitting the padded rows into (real, zeros) per expert.
        self.blocks = [size for pair in zip(counts, self.fill) for size in pair]
        self._zeros = {}  # (row shape, dtype, device) -> the zero blocks, shared by forward and backward

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[sum(counts), ...]`` -> ``[sum(padded), ...]``, zero rows after each expert's."""
        if not self.active:
            return x
        key = (x.shape[1:], x.dtype, x.device)
        zeros = self._zeros.get(key)
        if zeros is None:  # read only: cat copies them
            zeros = x.new_zeros((sum(self.fill),) + tuple(x.shape[1:])).split_with_sizes(self.fill)
            self._zeros[key] = zeros
        parts = x.split_with_sizes(self.counts)
        return torch.cat([t for pair in zip(parts, zeros) for t in pair])

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """``[sum(padded), ...]`` -> ``[sum(counts), ...]``: each expert's real rows."""
        if not self.active:
            return x
        return torch.cat(x.split_with_sizes(self.blocks)[::2])


def _as_host_counts(tokens_per_expert) -> list[int]:
    if isinstance(tokens_per_expert, torch.Tensor):
        return [int(c) for c in tokens_per_expert.tolist()]  # host sync: eager callers only
    return [int(c) for c in tokens_per_expert]


def _local_range(num_local_experts: int, local_experts: range | None) -> range:
    local = range(num_local_experts) if local_experts is None else local_experts
    assert len(local) == num_local_experts, (local, num_local_experts)
    return local


def _num_drawn(config, local: range) -> int:
    """How many experts' weights to draw: all of them, so the draws match one process's."""
    total = getattr(getattr(config, "moe", None), "num_moe_experts", None) or local.stop
    return max(total, local.stop)


class _ExpertShard:
    """Stands for a TP group in ``MLP``'s linears: the ETP size and rank, no group. The
    linears then keep their shard of the full weight and run no collective."""

    sequence_parallel = False
    tp = None

    def __init__(self, size: int, rank: int):
        self.tp_size, self.tp_rank = size, rank


def _mark_expert_tp(module: torch.nn.Module, etp_size: int) -> None:
    # Split over ETP or replicated: what the gradient norm's bookkeeping reads.
    for p in module.parameters():
        p.tensor_model_parallel = etp_size > 1


def expert_config(config, ffn_hidden_size: int):
    """A copy of ``config`` whose MLP hidden size is ``ffn_hidden_size``."""
    return dataclasses.replace(config, ffn_hidden_size=ffn_hidden_size)


def probs_on_input(tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``--moe-apply-probs-on-input``: each token's input scaled by its probability (in the tokens' dtype),
    and probabilities of 1 for the activation, which the probability scales otherwise (Megatron's)."""
    return (probs.unsqueeze(-1) * tokens).to(tokens.dtype), torch.ones_like(probs)


class SequentialMLP(torch.nn.Module):
    """The local experts as a list of MLPs run one after the other.

    ``row_multiple``: each expert's rows are padded to a multiple of it (``_RowPadding``);
    None (dropless or dropping) takes ``expert_row_multiple`` of the tokens' device, 1
    (drop-and-pad, whose counts are static) pads nothing. Set it to force a bucket size.

    Args:
        config: Finalized ``TransformerConfig`` (``config.moe`` set).
        num_local_experts: Experts on this rank.
        device: Device for the parameters.
        local_experts: Global indices of this rank's experts (default: the first ones).
        etp_size, etp_rank: Expert-tensor-parallel size and this rank's index in it.
    """

    reads_descendant_params = True
    """The fused loop (``_ExpertLoop``) reads the experts' weights without calling their forwards:
    with --overlap-param-gather, DDP's pre-hook of this module waits for all of them."""

    def needs_host_counts(self, tokens: torch.Tensor) -> bool:
        """The loop slices rows per expert: it needs the counts as Python ints."""
        return True

    def __init__(
        self,
        config,
        num_local_experts: int,
        *,
        device=None,
        local_experts: range | None = None,
        etp_size: int = 1,
        etp_rank: int = 0,
    ):
        super().__init__()
        self.num_local_experts = num_local_experts
        self.probs_on_input = config.moe.moe_apply_probs_on_input
        self.activation = MLPActivation.from_config(config)
        self.gated = self.activation.gated
        cfg = expert_config(config, config.moe.moe_ffn_hidden_size)
        local = _local_range(num_local_experts, local_experts)
        shard = _ExpertShard(etp_size, etp_rank) if etp_size > 1 else None
        kept = []
        for i in range(_num_drawn(config, local)):
            mlp = MLP(cfg, shard, device=device)  # drawn even when another rank keeps it
            if i in local:
                kept.append(mlp)
        self.local_experts = torch.nn.ModuleList(kept)
        mark_expert_params(self)
        _mark_expert_tp(self, etp_size)
        # Rows per expert are padded to a multiple of this (None: ``expert_row_multiple`` of the
        # tokens' device); drop-and-pad's counts are static already.
        self.row_multiple: int | None = 1 if config.moe.drop_and_pad else None

    def _expert(self, i: int, x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        mlp = self.local_experts[i]
        intermediate, _ = mlp.linear_fc1(x)
        act = self.activation(intermediate) * probs.unsqueeze(-1).to(intermediate.dtype)
        out, _ = mlp.linear_fc2(act)
        return out

    def _fused_weights(self) -> list[torch.Tensor] | None:
        """fc1 then fc2 weights of every local expert, when ``_ExpertLoop`` applies (else None)."""
        if not torch.is_grad_enabled() or not self.activation.is_plain:
            return None
        linears = self.__dict__.get("_linears")
        if linears is None:  # the linear modules, fc1s then fc2s (a plain list: no second registration)
            linears = [m.linear_fc1 for m in self.local_experts] + [m.linear_fc2 for m in self.local_experts]
            self.__dict__["_linears"] = linears
        weights = []
        for linear in linears:
            params = linear._parameters
            weight = params["weight"]
            if params.get("bias") is not None or not _fuses_wgrad(linear.gradient_accumulation_fusion, weight):
                return None
            weights.append(weight)
        return weights

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs: torch.Tensor) -> torch.Tensor:
        """``tokens [N, h]`` (expert-major), ``tokens_per_expert`` (list or tensor), ``probs [N]`` -> ``[N, h]``."""
        if self.probs_on_input:
            tokens, probs = probs_on_input(tokens, probs)
        multiple = self.row_multiple or expert_row_multiple(tokens.device)
        rows = _RowPadding(_as_host_counts(tokens_per_expert), multiple)
        weights = self._fused_weights()
        if weights is not None:
            return _ExpertLoop.apply(tokens, probs, rows, self.gated, *weights)
        if len(rows.counts) == 1 and not rows.active:
            return self._expert(0, tokens, probs)
        tokens, probs = rows.pad(tokens), rows.pad(probs)
        outs = [
            self._expert(i, x, p)
            for i, (x, p) in enumerate(zip(torch.split(tokens, rows.padded), torch.split(probs, rows.padded)))
        ]
        return rows.unpad(torch.cat(outs, dim=0))


class GroupedLinear(torch.nn.Module):
    """``num_experts`` linear layers of one shape as one ``[E, out, in]`` weight (and ``[E, out]`` bias)."""

    def __init__(
        self,
        num_experts: int,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        std: float,
        config,
        device,
        local: range | None = None,
        shard_dim: int = 1,
        stride: int = 1,
        etp_size: int = 1,
        etp_rank: int = 0,
    ):
        """``in_features`` / ``out_features`` are the full sizes; with ETP the weight keeps this
        rank's shard along ``shard_dim`` (1: output features, 2: input features)."""
        super().__init__()
        local = _local_range(num_experts, local)
        with torch.no_grad():
            full = torch.empty(
                _num_drawn(config, local), out_features, in_features, device=device, dtype=config.params_dtype
            )
            full.normal_(0.0, std)
            weight = shard_of(full[local.start : local.stop], shard_dim, etp_size, etp_rank, stride)
        self.weight = torch.nn.Parameter(weight.contiguous())
        self.weight.partition_dim, self.weight.partition_stride = shard_dim, stride  # how ETP splits it
        bias_size = out_features // etp_size if shard_dim == 1 else out_features
        self.bias = (
            torch.nn.Parameter(torch.zeros(num_experts, bias_size, device=device, dtype=config.params_dtype))
            if bias
            else None
        )


def grouped_mm_available(x: torch.Tensor) -> bool:
    """Whether torch's grouped GEMM can run these inputs (CUDA, bf16, a build that has it)."""
    return x.is_cuda and x.dtype == torch.bfloat16 and hasattr(F, "grouped_mm")


def grouped_mm_shapes_conform(hidden_size: int, ffn_hidden_size: int, dtype: torch.dtype) -> bool:
    """Whether every operand of the experts' grouped GEMMs (forward and backward) can have
    the layout torch's kernel accepts: one unit stride and the other a multiple of 16
    bytes. The operands' leading strides are the hidden size (tokens, fc1 weight) and the
    expert FFN size (activations, fc2 weight), so both must be multiples of 16 bytes
    (8 elements in bf16)."""
    align = 16 // torch.empty((), dtype=dtype).element_size()
    return hidden_size % align == 0 and ffn_hidden_size % align == 0


_fallback_said = False


def _say_fallback_once(hidden_size: int, ffn_hidden_size: int) -> None:
    global _fallback_said
    if not _fallback_said:
        _fallback_said = True
        warnings.warn(
            f"--moe-grouped-gemm: torch's grouped GEMM needs --hidden-size ({hidden_size}) and the expert FFN size "
            f"({ffn_hidden_size}) to be multiples of 8 in bf16 (16-byte strides); the experts run as a loop of "
            "GEMMs instead, which reads the token counts on the host.",
            stacklevel=3,
        )


class GroupedMLP(torch.nn.Module):
    """The local experts as grouped GEMMs over one ``[E, out, in]`` weight per linear.

    Args:
        config: Finalized ``TransformerConfig`` (``config.moe`` set).
        num_local_experts: Experts on this rank.
        device: Device for the parameters.
        local_experts: Global indices of this rank's experts (default: the first ones).
        etp_size, etp_rank: Expert-tensor-parallel size and this rank's index in it.
    """

    def __init__(
        self,
        config,
        num_local_experts: int,
        *,
        device=None,
        local_experts: range | None = None,
        etp_size: int = 1,
        etp_rank: int = 0,
    ):
        super().__init__()
        device = resolve_device(device)
        self.num_local_experts = num_local_experts
        self.probs_on_input = config.moe.moe_apply_probs_on_input
        self.recompute_activation = recomputes(config, "moe_act")
        self.offload = offloader_for(config)  # --offload-modules expert_fc1 moe_act
        self.activation = MLPActivation.from_config(config)
        self.gated = self.activation.gated
        ffn = config.moe.moe_ffn_hidden_size
        std = config.hidden_init_std()
        out_std = std / (2.0 * config.num_layers) ** 0.5
        h = config.hidden_size
        bias = config.add_bias_linear
        self.hidden_size, self.ffn_hidden_size = h, ffn // etp_size  # this rank's shard of the FFN
        self.last_path: str | None = None  # "grouped" or "loop": which one the last forward took
        kw = dict(bias=bias, config=config, device=device, local=local_experts, etp_size=etp_size, etp_rank=etp_rank)
        fc1_out, stride = (2 * ffn, 2) if self.gated else (ffn, 1)
        self.linear_fc1 = GroupedLinear(num_local_experts, h, fc1_out, std=std, shard_dim=1, stride=stride, **kw)
        self.linear_fc2 = GroupedLinear(num_local_experts, ffn, h, std=out_std, shard_dim=2, **kw)
        mark_expert_params(self)
        _mark_expert_tp(self, etp_size)

    def uses_grouped_mm(self, tokens: torch.Tensor) -> bool:
        """Whether ``forward`` takes torch's grouped GEMM for these tokens (else the loop)."""
        if not grouped_mm_available(tokens):
            return False
        if not grouped_mm_shapes_conform(self.hidden_size, self.ffn_hidden_size, tokens.dtype):
            _say_fallback_once(self.hidden_size, self.ffn_hidden_size)
            return False
        return True

    def needs_host_counts(self, tokens: torch.Tensor) -> bool:
        """Only the fallback loop needs the counts on the host; grouped_mm takes them on the device."""
        return not self.uses_grouped_mm(tokens)

    def forward(self, tokens: torch.Tensor, tokens_per_expert, probs: torch.Tensor) -> torch.Tensor:
        """``tokens [N, h]`` (expert-major), ``tokens_per_expert`` (list or tensor), ``probs [N]`` -> ``[N, h]``."""
        if self.probs_on_input:
            tokens, probs = probs_on_input(tokens, probs)
        if self.uses_grouped_mm(tokens):
            self.last_path = "grouped"
            return self._grouped(tokens, tokens_per_expert, probs)
        self.last_path = "loop"
        return self._loop(tokens, tokens_per_expert, probs)

    def _grouped(self, tokens, tokens_per_expert, probs):
        n, device = self.num_local_experts, tokens.device
        if isinstance(tokens_per_expert, torch.Tensor):
            counts = tokens_per_expert.to(device=device)
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        elif len(set(tokens_per_expert)) == 1:
            # Static counts (drop-and-pad): offsets from a device arange, no host-to-device copy,
            # so this runs inside a captured graph.
            counts = int(tokens_per_expert[0])
            offs = torch.arange(1, n + 1, device=device, dtype=torch.int32) * counts
        else:
            counts = torch.tensor(tokens_per_expert, device=device)  # eager: read on the host already
            offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        # Row-major tokens and activations, column-major (transposed) weights: each has a
        # unit stride and a leading stride of h or ffn elements (grouped_mm_shapes_conform).
        tokens = tokens.contiguous()
        with self.offload.scope("expert_fc1", self.training):
            intermediate = F.grouped_mm(tokens, fc1.weight.transpose(-2, -1), offs=offs)
        if fc1.bias is not None or fc2.bias is not None:
            experts = torch.arange(n, device=device)
            row_expert = torch.repeat_interleave(experts, counts, output_size=tokens.shape[0])
        if fc1.bias is not None:
            intermediate = intermediate + fc1.bias.index_select(0, row_expert)
        discarder = self._act_discarder()
        with contextlib.nullcontext() if discarder is None else discarder.hooks():
            act = self._scaled_activation(intermediate, probs, discarder)
            out = F.grouped_mm(act.contiguous(), fc2.weight.transpose(-2, -1), offs=offs)
        if fc2.bias is not None:
            out = out + fc2.bias.index_select(0, row_expert)
        return out

    def _loop(self, tokens, tokens_per_expert, probs):
        counts = _as_host_counts(tokens_per_expert)
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        outs = []
        discarder = self._act_discarder()
        with contextlib.nullcontext() if discarder is None else discarder.hooks():
            for i, (x, p) in enumerate(zip(torch.split(tokens, counts), torch.split(probs, counts))):
                b1 = None if fc1.bias is None else fc1.bias[i]
                b2 = None if fc2.bias is None else fc2.bias[i]
                with self.offload.scope("expert_fc1", self.training):
                    intermediate = F.linear(x, fc1.weight[i], b1)
                act = self._scaled_activation(intermediate, p, discarder)
                outs.append(F.linear(act, fc2.weight[i], b2))
        return torch.cat(outs, dim=0)

    def _act_discarder(self) -> OutputDiscarder | None:
        """--recompute-modules moe_act: the activation's output is recomputed for fc2's backward."""
        return OutputDiscarder() if self.recompute_activation and self.training and torch.is_grad_enabled() else None

    def _scaled_activation(self, intermediate, probs, discarder: OutputDiscarder | None) -> torch.Tensor:
        """``act(fc1 output) * probs`` (Megatron's order: the probability scales the activation)."""

        def scaled(x, p):
            return self.activation(x) * p.unsqueeze(-1).to(x.dtype)

        with self.offload.scope("moe_act", self.training):
            return scaled(intermediate, probs) if discarder is None else discarder.run(scaled, intermediate, probs)


class SharedExpertMLP(MLP):
    """The shared experts: one MLP every token goes through, optionally gated per token.

    With ``--moe-shared-expert-gate`` the output is scaled by ``sigmoid(x @ gate_weight^T)``
    (``shared_experts.gate_weight``, ``[1, h]``). Split over the dense TP group like the MLP
    (``pg``), with the input sequence-sharded under sequence parallelism.
    """

    def __init__(self, config, pg=None, *, device=None):
        moe = config.moe
        super().__init__(expert_config(config, moe.moe_shared_expert_intermediate_size), pg, device=device)
        if moe.moe_shared_expert_gate:
            self.gate_weight = torch.nn.Parameter(
                torch.empty(1, config.hidden_size, device=resolve_device(device), dtype=config.params_dtype)
            )
            with torch.no_grad():
                self.gate_weight.normal_(0.0, config.hidden_init_std())
            # Applied to a sequence shard: its gradient is partial on each TP rank.
            self.gate_weight.sequence_parallel = uses_sequence_parallel(pg)
        else:
            self.gate_weight = None

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., h] -> [..., h]``."""
        out, _ = super().forward(hidden_states)
        if self.gate_weight is not None:
            out = out * torch.sigmoid(F.linear(hidden_states, self.gate_weight))
        return out
