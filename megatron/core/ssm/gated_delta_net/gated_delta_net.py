"""The gated delta net attention of a transformer layer (``--experimental-attention-variant gdn``).

``[s, b, h] -> [s, b, h]``, in place of softmax attention. One column-parallel
in-projection produces, per position, ``q, k`` (key heads), ``v, z`` (value heads),
``beta`` and ``alpha`` (one per value head), in that order; ``q, k, v`` go through a
short causal depthwise conv and the activation, ``q`` and ``k`` are L2-normalised per
head and repeated so each value head has its own (``value heads / key heads`` value
heads share a key head, as grouped-query attention shares keys), then the gated delta
rule (``gated_delta_rule.py``) runs with decay ``g = -exp(A_log) * softplus(alpha +
dt_bias)`` and write strength ``sigmoid(beta)``. Its output is normalised per head (the
model's ``--normalization`` over the value head dim, ``--apply-layernorm-1p`` included),
gated by ``act(z)`` and projected back by a row-parallel out-projection. ``act`` is the
model's activation (SiLU with ``--swiglu``), as in Megatron. The projections carry no
bias, the conv none either (Megatron's defaults).

Parameter names and initialisation are Megatron's: ``in_proj``, ``conv1d.weight``
``[channels, 1, kernel]`` (kaiming-uniform, as ``nn.Conv1d``), ``dt_bias`` (ones),
``A_log`` (``log`` of uniform draws in ``[1, 16]``), ``out_norm``, ``out_proj``.

Tensor parallelism splits the heads: each rank's in-projection rows are its own ``[q, k,
v, z, beta, alpha]`` slices (``partition_sizes``), its conv channels its ``[q, k, v]``
slices, so the conv, the rule and the norm are rank-local and only the two linear
layers communicate (a gather over the sequence in, a reduce-scatter out, with
``--sequence-parallel``). Unusual here: the full weights are drawn in the one-process
layout and each rank keeps its slices of every section, so one seed gives the same
model at any TP size; and ``out_norm``, shared by every head, sums its gradient over
TP (it sees only this rank's heads) also without sequence parallelism.

The forward has no host syncs and static shapes; fla's fused rule is used when
installed (``gated_delta_rule``), never required.
"""

import math

import torch
import torch.nn.functional as F
from einops import rearrange

from megatron.core.ssm.causal_conv1d import causal_conv1d
from megatron.core.ssm.gated_delta_net.gated_delta_rule import gated_delta_rule, l2norm
from megatron.core.ssm.mamba_mixer import ConvWeights
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    init_method_normal,
    rank_slice,
    resolve_device,
    section_shard,
    sectioned_init,
)
from megatron.core.transformer.norm import build_norm


def _at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _squared_relu(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


def model_activation(config):
    """The model's activation function, as Megatron's ``config.activation_func``: SiLU with
    ``--swiglu``, squared ReLU with ``--squared-relu``, else GeLU."""
    if config.gated_linear_unit:
        return F.silu
    if getattr(config, "squared_relu", False):
        return _squared_relu
    return F.gelu


class GatedDeltaNet(torch.nn.Module):
    """Gated delta net attention.

    Args:
        config: Finalized ``TransformerConfig``; its ``linear_attention`` gives the sizes.
        layer_number: 1-based global layer number.
        pg: ``ProcessGroups`` (or ``None`` for a world of one); heads are split over its TP size.
        device: Device for the parameters (default: torch's default device).
        conv_init: Uniform init range of the conv weight (None: kaiming-uniform, as ``nn.Conv1d``).
        A_init_range: ``A`` is drawn uniformly from this range (``A_log = log A``).
        use_qk_l2norm: L2-normalise each query and key head.
        chunk_size: Chunk length of the PyTorch gated delta rule.
        use_fused_kernels: Use fla's rule (None: when installed, on CUDA, deterministic algorithms off).
    """

    def __init__(
        self,
        config,
        layer_number: int = 1,
        pg=None,
        *,
        device=None,
        conv_init: float | None = None,
        A_init_range: tuple[float, float] = (1.0, 16.0),
        use_qk_l2norm: bool = True,
        chunk_size: int = 64,
        use_fused_kernels: bool | None = None,
    ):
        super().__init__()
        la = config.linear_attention
        self.config = config
        self.layer_number = layer_number
        self.key_head_dim, self.value_head_dim = la.linear_key_head_dim, la.linear_value_head_dim
        self.num_key_heads, self.num_value_heads = la.linear_num_key_heads, la.linear_num_value_heads
        self.conv_kernel_dim = la.linear_conv_kernel_dim
        self.use_qk_l2norm = use_qk_l2norm
        self.chunk_size = chunk_size
        self.use_fused_kernels = use_fused_kernels
        self.activation = model_activation(config)
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"--linear-num-value-heads ({self.num_value_heads}) must be a multiple of --linear-num-key-heads "
                f"({self.num_key_heads})."
            )
        tp = get_tensor_model_parallel_size(pg)
        if self.num_key_heads % tp or self.num_value_heads % tp:
            raise ValueError(
                f"--linear-num-key-heads ({self.num_key_heads}) and --linear-num-value-heads ({self.num_value_heads}) "
                f"must be divisible by --tensor-model-parallel-size ({tp})."
            )
        tp_rank = get_tensor_model_parallel_rank(pg)
        # This rank's share: whole key heads and the value heads they serve.
        self.num_key_heads_local = self.num_key_heads // tp
        self.num_value_heads_local = self.num_value_heads // tp
        device = resolve_device(device)
        dtype = config.params_dtype

        sections = self._split_sizes()
        self.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(sections) * tp,
            config=config,
            init_method=sectioned_init(init_method_normal(config.hidden_init_std()), sections, tp),
            bias=False,
            gather_output=False,
            pg=pg,
            device=device,
        )
        self.in_proj.weight.partition_sizes = sections  # rank-local [q, k, v, z, beta, alpha] rows

        conv_sections = sections[:3]  # q, k, v
        self.conv1d = ConvWeights(sum(conv_sections), self.conv_kernel_dim, device=device, dtype=dtype, bias=False)
        full_conv = torch.empty(sum(conv_sections) * tp, 1, self.conv_kernel_dim, device=device, dtype=dtype)
        with torch.no_grad():
            if conv_init is not None:
                full_conv.uniform_(-conv_init, conv_init)
            else:
                torch.nn.init.kaiming_uniform_(full_conv, a=math.sqrt(5))
            self.conv1d.weight.copy_(section_shard(full_conv, conv_sections, tp, tp_rank))
            full_dt_bias = self._draw_dt_bias(device, dtype)
            assert 0 < A_init_range[0] <= A_init_range[1], A_init_range
            full_a = torch.empty(self._a_log_size(), device=device, dtype=dtype).uniform_(*A_init_range)
        self.dt_bias = torch.nn.Parameter(rank_slice(full_dt_bias, tp, tp_rank).clone())
        self.A_log = torch.nn.Parameter(torch.log(rank_slice(full_a, tp, tp_rank)))
        self.out_norm = build_norm(config, self.value_head_dim, device=device)
        self.out_proj = RowParallelLinear(
            self.num_value_heads * self.value_head_dim,
            config.hidden_size,
            config=config,
            init_method=init_method_normal(config.output_init_std()),
            bias=False,
            input_is_parallel=True,
            skip_bias_add=True,
            pg=pg,
            device=device,
        )
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            p.tensor_model_parallel = True
            p.partition_dim = 0
        self.conv1d.weight.partition_sizes = conv_sections
        if tp > 1:
            # Every head shares out_norm; this rank's gradient covers its own heads only.
            for p in self.out_norm.parameters():
                p.sequence_parallel = True

    def _split_sizes(self) -> list[int]:
        """Rank-local widths of ``q, k, v, z, beta, alpha`` in the in-projection output."""
        qk = self.num_key_heads_local * self.key_head_dim
        v = self.num_value_heads_local * self.value_head_dim
        nv = self.num_value_heads_local
        return [qk, qk, v, v, nv, nv]

    def _draw_dt_bias(self, device, dtype) -> torch.Tensor:
        """The one-process ``dt_bias``: ones, one per value head (Megatron's GDN init; draws nothing)."""
        return torch.ones(self.num_value_heads, device=device, dtype=dtype)

    def _a_log_size(self) -> int:
        """Entries of the one-process ``A_log``: one per value head."""
        return self.num_value_heads

    def _gates(self, beta: torch.Tensor, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
        """The rule's decay and write strength from the in-projection's ``beta, alpha`` sections (``[b, s, heads]``)."""
        g = -_at_least_fp32(self.A_log).exp() * F.softplus(_at_least_fp32(alpha) + _at_least_fp32(self.dt_bias))
        return {"g": g, "beta": _at_least_fp32(beta).sigmoid()}

    def _rule(self, q, k, v, gates: dict[str, torch.Tensor]) -> torch.Tensor:
        """The gated delta rule on the prepared inputs: ``[b, s, heads, V]``."""
        return gated_delta_rule(q, k, v, gates["g"], gates["beta"], self.chunk_size, use_fused=self.use_fused_kernels)

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, None]:
        """``[s, b, h] -> (out [s, b, h], None)``; ``rotary_pos_emb`` and ``attention_mask`` are accepted
        for a uniform call and unused (positions enter through the causal conv and the recurrence)."""
        sections = self._split_sizes()
        qk, v_width = sections[0], sections[2]
        projected, _ = self.in_proj(hidden_states)  # [s, b, local width]: the whole sequence
        projected = rearrange(projected, "s b d -> b s d")
        qkv, z, *gate_features = projected.split([2 * qk + v_width, v_width, *sections[4:]], dim=-1)
        qkv = self._conv(qkv)
        q, k, v = qkv.split([qk, qk, v_width], dim=-1)
        q = rearrange(q, "b s (h d) -> b s h d", d=self.key_head_dim)
        k = rearrange(k, "b s (h d) -> b s h d", d=self.key_head_dim)
        v = rearrange(v, "b s (h d) -> b s h d", d=self.value_head_dim)
        if self.use_qk_l2norm:
            q, k = l2norm(q), l2norm(k)
        repeat = self.num_value_heads // self.num_key_heads
        if repeat > 1:  # value head j reads key head j // repeat
            q, k = q.repeat_interleave(repeat, dim=2), k.repeat_interleave(repeat, dim=2)
        o = self._rule(q, k, v, self._gates(*gate_features))
        z = rearrange(z, "b s (h d) -> b s h d", d=self.value_head_dim)
        o = (_at_least_fp32(self.out_norm(o)) * self.activation(_at_least_fp32(z))).to(o.dtype)
        out, _ = self.out_proj(rearrange(o, "b s h d -> s b (h d)"))
        return out, None

    def _conv(self, qkv: torch.Tensor) -> torch.Tensor:
        """Causal depthwise conv and the activation: ``[b, s, channels] -> [b, s, channels]``."""
        silu = self.activation is F.silu
        y = causal_conv1d(
            rearrange(qkv, "b s d -> b d s"), self.conv1d.weight, None, activation="silu" if silu else None
        )
        if not silu:
            y = self.activation(y)
        return rearrange(y, "b d s -> b s d")

    def extra_repr(self) -> str:
        return (
            f"key_heads={self.num_key_heads} (local {self.num_key_heads_local}), value_heads={self.num_value_heads} "
            f"(local {self.num_value_heads_local}), key_dim={self.key_head_dim}, value_dim={self.value_head_dim}, "
            f"conv={self.conv_kernel_dim}, chunk={self.chunk_size}"
        )
