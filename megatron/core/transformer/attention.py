"""Causal self-attention with a fused QKV projection, grouped-query attention and RoPE.

Layout is Megatron's: activations are ``[s, b, h]``; the fused QKV output is laid out
per query group, ``[s, b, groups, (heads_per_group + 2) * d]`` = for each group its
query heads, then its key head, then its value head, so checkpoints and TP splits
match upstream. ``--attention-output-gate`` adds a gate head per query head after the
group's query heads (``[q..., gate..., k, v]``, Megatron's layout); the context is
multiplied by ``sigmoid(gate)`` (in at least float32) before the output projection. The core
is ``F.scaled_dot_product_attention`` (flash / memory-efficient kernels on GPU) on
``[b, n, s, d]`` *views*: q/k/v are never made contiguous here; the one copy is the
``[b, n, s, d] -> [s, b, n*d]`` re-layout of the context before the output projection.
No host syncs: everything is shape arithmetic on Python ints.

Tensor parallelism splits the query groups across TP ranks (each rank gets whole
groups: its query heads with their key/value heads, a contiguous block of the fused
QKV rows), so attention needs no communication between its two linears. Attention
dropout on this rank's heads draws from the per-TP-rank RNG state at TP > 1.

``--attention-backend`` restricts SDPA's kernel choice: flash -> flash attention, fused
-> cuDNN or memory-efficient attention, unfused / local -> the math kernel, auto -> SDPA
picks. On the CPU, where SDPA has no cuDNN or memory-efficient kernel, fused allows
the flash (CPU) and math kernels. ``--qk-layernorm`` normalizes each query and key head
(before RoPE, as Megatron); it takes the general split path. Sliding windows
(``--window-size``) and softmax sinks (``--softmax-type``) are in ``attention_variants``.
"""

import contextlib
import math

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from megatron.core.models.common.rotary import apply_rotary_pos_emb, apply_rotary_pos_emb_interleaved
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_size,
    init_method_normal,
)
from megatron.core.tensor_parallel.random import fork_if
from megatron.core.transformer.attention_variants import SoftmaxOffset, sink_attention, window_mask
from megatron.core.transformer.norm import L2Norm, build_norm
from megatron.core.transformer.offload import offloader_for
from megatron.core.transformer.recompute import recomputes

# --attention-backend -> SDPA kernels allowed (CUDA; see the module docstring for the CPU).
_SDPA_BACKENDS = {
    "flash": (SDPBackend.FLASH_ATTENTION,),
    "fused": (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION),
    "unfused": (SDPBackend.MATH,),
    "local": (SDPBackend.MATH,),
}
_SDPA_BACKENDS_CPU = dict(_SDPA_BACKENDS, fused=(SDPBackend.FLASH_ATTENTION, SDPBackend.MATH))


def sdpa_backends(attention_backend: str, device_type: str) -> tuple | None:
    """SDPA kernels for ``--attention-backend`` on a device type; None = SDPA's own choice."""
    table = _SDPA_BACKENDS if device_type == "cuda" else _SDPA_BACKENDS_CPU
    return table.get(attention_backend)


class SelfAttention(torch.nn.Module):
    """Multi-head / grouped-query causal self-attention.

    Args:
        config: Finalized ``TransformerConfig``.
        layer_number: 1-based global layer number.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(self, config, layer_number: int, pg=None, *, device=None):
        super().__init__()
        self.config = config
        self.layer_number = layer_number
        tp_size = get_tensor_model_parallel_size(pg)
        self.tp_size = tp_size
        heads, groups, kv = config.num_attention_heads, config.num_query_groups, config.kv_channels
        if heads % tp_size or groups % tp_size:
            raise ValueError(
                f"--num-attention-heads ({heads}) and --num-query-groups ({groups}) must be divisible by "
                f"--tensor-model-parallel-size ({tp_size})."
            )
        self.kv_channels = kv
        self.num_heads = heads // tp_size  # local to this TP rank
        self.num_groups = groups // tp_size
        self.heads_per_group = heads // groups
        scale = getattr(config, "softmax_scale", None)  # set by muP
        self.softmax_scale = scale if scale is not None else 1.0 / math.sqrt(kv)
        self.attention_dropout = config.attention_dropout
        self.attention_backend = getattr(config, "attention_backend", "auto")
        self.recompute_core_attention = recomputes(config, "core_attn")
        self.offload = offloader_for(config)  # --offload-modules qkv_linear core_attn attn_proj
        self.rope = apply_rotary_pos_emb_interleaved if getattr(config, "rotary_interleaved", False) else None
        self.output_gate = getattr(config, "attention_output_gate", False)
        window = getattr(config, "window", None)
        # Keys i - left .. i on the layers --window-attn-skip-freq picks; -1 is no limit (plain causal).
        self.window_left = window[0] if window is not None and config.uses_window(layer_number) else None
        self.skips_rope = config.skips_rope(layer_number)  # --no-rope-freq
        if self.window_left == -1:
            self.window_left = None
        self._masks: dict = {}  # (seq, device) -> window mask
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        if self.softmax_type == "learnable":  # Megatron's parameter name: core_attention.softmax_offset
            self.core_attention = SoftmaxOffset(
                heads,
                std=config.hidden_init_std(),
                tp_size=tp_size,
                tp_rank=get_tensor_model_parallel_rank(pg),
                device=device,
                dtype=config.params_dtype,
            )
        self.q_layernorm = self.k_layernorm = None
        if getattr(config, "qk_l2_norm", False):  # wins over --qk-layernorm, as in Megatron's layer spec
            self.q_layernorm, self.k_layernorm = L2Norm(), L2Norm()
        elif getattr(config, "qk_layernorm", False):
            self.q_layernorm = build_norm(config, kv, device=device)
            self.k_layernorm = build_norm(config, kv, device=device)
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size,
            ((2 if self.output_gate else 1) * heads + 2 * groups) * kv,
            config=config,
            init_method=init_method_normal(config.hidden_init_std()),
            bias=config.add_bias_linear or getattr(config, "add_qkv_bias", False),
            gather_output=False,
            pg=pg,
            device=device,
        )
        self.linear_proj = RowParallelLinear(
            heads * kv,
            config.hidden_size,
            config=config,
            init_method=init_method_normal(config.output_init_std()),
            bias=config.add_bias_linear,
            input_is_parallel=True,
            skip_bias_add=False,  # in the GEMM: no fused bias-dropout-add kernel to defer it to
            pg=pg,
            device=device,
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        rotary_pos_emb: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Attends causally over the sequence (or where ``attention_mask`` allows).

        Args:
            hidden_states: ``[s, b, h]``.
            rotary_pos_emb: ``freqs [s, 1, 1, rot_dim]`` from ``RotaryEmbedding`` or None.
            attention_mask: bool ``[b, 1, s, s]``, True where query i may attend key j (the
                document mask of ``--reset-attention-mask``), or None: causal.

        Returns:
            ``(output [s, b, h], None)``: the output projection adds its bias in the
            GEMM, so the layer's bias-dropout-add gets none.
        """
        g, hpg, d = self.num_groups, self.heads_per_group, self.kv_channels
        n = self.num_heads
        if self.skips_rope:
            rotary_pos_emb = None
        with self.offload.scope("qkv_linear", self.training):
            qkv, _ = self.linear_qkv(hidden_states)  # [s, b, g * parts * d]: local groups, whole sequence
        s, b = qkv.shape[0], qkv.shape[1]  # with sequence parallelism the input held s / TP rows
        parts = (2 * hpg if self.output_gate else hpg) + 2  # heads of a group in the fused projection
        gate = None
        if hpg == 1 and rotary_pos_emb is None and self.q_layernorm is None:
            # MHA without RoPE: the same views as the general path in two ops instead of
            # five (each op is also an autograd node, and eager steps are host-bound).
            # Backward stacks straight into the qkv gradient, as the split's cat does.
            if self.output_gate:
                q, gate, k, v = qkv.view(s, b, n, parts, d).unbind(3)
            else:
                q, k, v = qkv.view(s, b, n, parts, d).unbind(3)
        else:
            q, k, v, gate = self._split_qkv(qkv.view(s, b, g, parts, d), rotary_pos_emb)
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)  # [b, n, s, d] views
        if self.recompute_core_attention and self.training and torch.is_grad_enabled():
            # Selective recompute: keep q, k, v, recompute the attention in backward (same RNG state).
            context = torch.utils.checkpoint.checkpoint(
                self._core_attention, q, k, v, attention_mask, use_reentrant=False
            )
        else:
            with self.offload.scope("core_attn", self.training):
                context = self._core_attention(q, k, v, attention_mask)  # [b, n, s, d]
        context = context.permute(2, 0, 1, 3)  # [s, b, n, d]
        if gate is not None:
            fp32 = torch.promote_types(context.dtype, torch.float32)  # at least float32
            context = (context.to(fp32) * torch.sigmoid(gate.to(fp32))).to(context.dtype)
        with self.offload.scope("attn_proj", self.training):
            return self.linear_proj(context.reshape(s, b, n * d))

    def _core_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attention_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """SDPA on ``[b, n, s, d]`` q, k, v with the kernels --attention-backend allows, causal or
        where ``attention_mask`` (bool ``[b, 1, s, s]``) allows.

        Dropout on this rank's heads draws from the per-TP-rank RNG state at TP > 1.
        """
        backends = None if self.attention_backend == "auto" else sdpa_backends(self.attention_backend, q.device.type)
        dropout_p = self.attention_dropout if self.training else 0.0
        if self.softmax_type != "vanilla":
            with fork_if(dropout_p > 0.0 and self.tp_size > 1):
                return sink_attention(
                    q,
                    k,
                    v,
                    self._sink(q),
                    scale=self.softmax_scale,
                    window_left=self.window_left,
                    dropout_p=dropout_p,
                    attention_mask=attention_mask,
                )
        mask = attention_mask
        if self.window_left is not None:
            window = self._window_mask(q.shape[2], q.device)
            mask = window if mask is None else mask & window
        if mask is not None and backends is not None:  # flash kernels take no mask: the others, else math
            backends = tuple(b for b in backends if b != SDPBackend.FLASH_ATTENTION) or (SDPBackend.MATH,)
        with (
            contextlib.nullcontext() if backends is None else sdpa_kernel(list(backends)),
            fork_if(dropout_p > 0.0 and self.tp_size > 1),
        ):
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=mask is None, scale=self.softmax_scale
            )

    def _sink(self, q: torch.Tensor) -> torch.Tensor:
        """The sink logit of each local head: learned, or 0 for off-by-one."""
        if self.softmax_type == "learnable":
            return self.core_attention.softmax_offset
        return q.new_zeros(self.num_heads)

    def _window_mask(self, seq: int, device: torch.device) -> torch.Tensor:
        key = (seq, device)
        if key not in self._masks:
            self._masks[key] = window_mask(seq, self.window_left, device)
        return self._masks[key]

    def _split_qkv(self, qkv: torch.Tensor, rotary_pos_emb: torch.Tensor | None):
        """``[s, b, g, parts, d]`` -> ``q, k, v, gate`` as ``[s, b, n, d]`` views (RoPE applied; gate None
        without ``--attention-output-gate``)."""
        s, b, g, _, d = qkv.shape
        hpg, n = self.heads_per_group, self.num_heads
        gate = None
        # torch.split (not indexing) so backward is one cat instead of zero-filled slices summed.
        if self.output_gate:
            q, gate, k, v = torch.split(qkv, [hpg, hpg, 1, 1], dim=3)
            gate = gate.reshape(s, b, n, d)
        elif rotary_pos_emb is not None and self.q_layernorm is None and self.rope is None:
            # Rotate the query and key heads of each group in one call: they are adjacent.
            qk, v = torch.split(qkv, [hpg + 1, 1], dim=3)
            qk = apply_rotary_pos_emb(qk, rotary_pos_emb)
            q, k = torch.split(qk, [hpg, 1], dim=3)
            rotary_pos_emb = None  # applied
        else:
            q, k, v = torch.split(qkv, [hpg, 1, 1], dim=3)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if rotary_pos_emb is not None:
            rope = self.rope or apply_rotary_pos_emb
            q, k = rope(q, rotary_pos_emb), rope(k, rotary_pos_emb)
        if hpg > 1:
            # GQA: every query head of a group reads its group's key/value head.
            k = k.expand(s, b, g, hpg, d)
            v = v.expand(s, b, g, hpg, d)
        # [s, b, g, hpg, d] -> [s, b, n, d]: a view for MHA (hpg == 1) and MQA (g == 1).
        return q.reshape(s, b, n, d), k.reshape(s, b, n, d), v.reshape(s, b, n, d), gate
