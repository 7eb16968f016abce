"""Analytic activation memory: what eager keeps for backward, per graph region, from the shapes.

For every region kind (``attn``, ``mlp``, ``layer``, ``postprocess``, ``moe_router``,
``moe_preprocess``, ``moe_postprocess``, ``moe``, ``mamba``) the bytes of the tensors autograd saves between
the region's forward and its backward are a sum of shape products (tokens ``T = s * b``,
hidden ``h``, heads, FFN width, vocabulary, experts ...). These budgets are what a graph
region legitimately puts into the graph pool; the memory report prints them beside what
the pool holds, and the GPU memory-regression tests derive their limits from them.

What is unusual here:

* **A few kernel facts decide which tensors exist**, and they differ between devices
  (:class:`Kernels`): LayerNorm statistics are fp32 on CUDA and the input dtype on the
  CPU; ``F.rms_norm`` is one fused kernel on CUDA (saves the input) but a composite on
  the CPU (saves fp32 copies); CUDA flash attention returns ``[b, s, n, d]``, so the
  ``[s, b, n * d]`` re-layout of the context is a copy, the CPU kernel's is a view; the
  loss head's fused cross entropy saves the logits, torch's saves fp32 log-probabilities.
  :meth:`Kernels.probe` measures the device-dependent ones on tiny tensors of the device
  at hand, so the formulas stay pure arithmetic.
* **Counted once per storage**: views (q, k, v of the fused QKV output) share one
  buffer. Parameters are not activations and are never counted.
* Mamba's PyTorch path keeps the scan's and the gated norm's inputs (both recompute in
  backward), so its formula is exact. With the fused mamba-ssm kernels it is an estimate
  (what those kernels keep is theirs).
* Small integer tensors of the MoE router (top-k indices, routing map) are counted
  too: they are what keeps router-only graphs honest when the hidden size is small.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

__all__ = [
    "Kernels",
    "Shapes",
    "region_activation_bytes",
    "region_transient_bytes",
    "layer_part_kinds",
    "flash_dq_accumulator_bytes",
    "KINDS",
]

KINDS = ("attn", "mlp", "layer", "postprocess", "moe_router", "moe_preprocess", "moe_postprocess", "moe", "mamba")
_I64, _F32 = 8, 4


@dataclasses.dataclass(frozen=True)
class Kernels:
    """Device facts the activation formulas need (see the module docstring)."""

    norm_stats_fp32: bool = True
    """LayerNorm's statistics (mean, rstd) are fp32 (CUDA); otherwise the input dtype (CPU)."""

    fused_rms_norm: bool = True
    """``F.rms_norm`` saves its input and rstd (CUDA); otherwise fp32 copies (CPU)."""

    sdpa_context_copy: bool = True
    """The attention output's re-layout to ``[s, b, n * d]`` is a copy (CUDA flash)."""

    fused_cross_entropy: bool = True
    """The loss head saves the logits (fused kernel) instead of fp32 log-probabilities."""

    fused_mamba: bool = False
    """The mixer runs mamba-ssm's fused kernels."""

    dropout_mask_bytes: int = 1
    """Bytes per element of a dropout mask: bool on CUDA, the input dtype on the CPU."""

    @classmethod
    def probe(cls, device: torch.device | str, *, cross_entropy_fusion: bool = True, fused_mamba: bool = False):
        """Measures the device-dependent facts with tiny tensors on ``device``."""
        device = torch.device(device)
        dtype = torch.bfloat16
        x = torch.randn(4, 2, 8, device=device, dtype=dtype, requires_grad=True)
        stats = []

        def pack(t):
            stats.append(t)
            return t

        w = torch.ones(8, device=device, dtype=dtype, requires_grad=True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.layer_norm(x, (8,), w, w)
        small = [t for t in stats if t.dim() == x.dim() and t.shape[-1] == 1]
        norm_stats = not small or small[0].dtype == torch.float32
        stats.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.rms_norm(x, (8,), w)
        fused_rms = not any(t.dtype == torch.float32 and t.shape == x.shape for t in stats)
        # [b, n, s, d] attention on views of a [s, b, n, 3, d] buffer, as attention.py calls it.
        qkv = torch.randn(16, 2, 2, 3, 8, device=device, dtype=dtype)
        q, k, v = (t.permute(1, 2, 0, 3) for t in qkv.unbind(3))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        copy = not out.permute(2, 0, 1, 3).is_contiguous()
        fused_ce = bool(cross_entropy_fusion and device.type == "cuda")
        stats.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            torch.nn.functional.dropout(x, p=0.5, training=True)
        masks = [t for t in stats if t.shape == x.shape]
        mask_bytes = masks[0].element_size() if masks else 1
        return cls(norm_stats, fused_rms, copy, fused_ce, fused_mamba, mask_bytes)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """The shape numbers of one micro-batch on one rank (feature dims already split by TP)."""

    seq: int
    micro_batch: int
    hidden: int
    heads: int
    groups: int
    kv_channels: int
    ffn: int
    vocab: int
    element_bytes: int
    normalization: str = "LayerNorm"
    gated: bool = False
    squared_relu: bool = False
    rope: bool = False
    hidden_dropout: float = 0.0
    final_norm: bool = True
    # MoE
    experts: int = 0
    topk: int = 0
    moe_ffn: int = 0
    shared_ffn: int = 0
    capacity_factor: float | None = None
    drop_and_pad: bool = False
    # Mamba
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 0
    mamba_state: int = 0
    mamba_conv: int = 4

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch

    @classmethod
    def from_config(cls, cfg: Any) -> Shapes:
        """From a validated ``RunConfig`` (``model.vocab_size`` set, padded)."""
        m, par = cfg.model, cfg.parallel
        tp = par.tensor_model_parallel_size
        cp = getattr(par, "context_parallel_size", 1) or 1
        dtype = m.params_dtype
        e = torch.empty((), dtype=dtype).element_size()
        groups = m.num_query_groups if (m.group_query_attention and m.num_query_groups) else m.num_attention_heads
        moe = cfg.moe
        kw = {}
        if moe.enabled:
            kw = dict(
                experts=moe.num_moe_experts,
                topk=moe.moe_router_topk,
                moe_ffn=(moe.moe_ffn_hidden_size or m.ffn_hidden_size) // (par.expert_tensor_parallel_size or tp),
                shared_ffn=(moe.moe_shared_expert_intermediate_size or 0) // tp,
                capacity_factor=moe.moe_expert_capacity_factor,
                drop_and_pad=moe.drop_and_pad,
            )
        mamba = cfg.mamba
        if mamba.hybrid_layer_pattern is not None:
            kw.update(
                mamba_heads=mamba.num_heads(m.hidden_size) // tp,
                mamba_head_dim=mamba.mamba_head_dim,
                mamba_groups=mamba.mamba_num_groups // tp,
                mamba_state=mamba.mamba_state_dim,
            )
        return cls(
            seq=m.seq_length // cp,
            micro_batch=cfg.training.micro_batch_size,
            hidden=m.hidden_size,
            heads=m.num_attention_heads // tp,
            groups=groups // tp,
            kv_channels=m.kv_channels or m.hidden_size // m.num_attention_heads,
            ffn=(m.ffn_hidden_size or 4 * m.hidden_size) // tp,
            vocab=m.vocab_size // tp,
            element_bytes=e,
            normalization=m.normalization,
            gated=m.gated_linear_unit,
            squared_relu=getattr(m, "squared_relu", False),
            rope=m.position_embedding_type == "rope",
            hidden_dropout=m.hidden_dropout,
            **kw,
        )


def _norm(sh: Shapes, k: Kernels) -> int:
    """A pre-norm: what it saves of its input, plus its output (the next GEMM's input)."""
    t, h, e = sh.tokens, sh.hidden, sh.element_bytes
    if sh.normalization == "RMSNorm":
        saved = t * h * e + t * _F32 if k.fused_rms_norm else 2 * t * h * _F32 + t * _F32
    else:
        saved = t * h * e + 2 * t * (_F32 if k.norm_stats_fp32 else e)
    return saved + t * h * e


def _dropout_mask(sh: Shapes, k: Kernels) -> int:
    return sh.tokens * sh.hidden * k.dropout_mask_bytes if sh.hidden_dropout > 0.0 else 0


def _attention(sh: Shapes, k: Kernels) -> int:
    t, e, n, g, d = sh.tokens, sh.element_bytes, sh.heads, sh.groups, sh.kv_channels
    total = _norm(sh, k)
    if n == g:  # q, k, v are views of the QKV output (RoPE: rotated q and k are new)
        total += t * (n + 2 * g) * d * e
        if sh.rope:
            total += t * (n + g) * d * e + 2 * sh.seq * d * e  # + the cos/sin of the rotation
    else:  # GQA: the [s, b, n, d] reshapes of q and of the expanded k, v are copies
        total += 3 * t * n * d * e
        if sh.rope:
            total += 2 * sh.seq * d * e
    total += t * n * d * e + t * n * _F32  # attention output + logsumexp (flash)
    if k.sdpa_context_copy:
        total += t * n * d * e  # the [s, b, n * d] context the output projection reads
    return total + _dropout_mask(sh, k)


def _mlp_activation(tokens: int, ffn: int, sh: Shapes, prob_scaled: bool = False) -> int:
    """fc1 output and the activation's saved tensors (fc2's input included)."""
    e = sh.element_bytes
    if sh.gated:  # fc1 out [.., 2f], silu(gate), silu(gate) * up
        total = tokens * 3 * ffn * e + tokens * ffn * e
    else:  # fc1 out (gelu's or relu's input/output) and the activation output
        total = 2 * tokens * ffn * e
    if prob_scaled:  # experts: act * prob is a new tensor (fc2's input)
        total += tokens * ffn * e + tokens * e
    return total


def _mlp(sh: Shapes, k: Kernels) -> int:
    return _norm(sh, k) + _mlp_activation(sh.tokens, sh.ffn, sh) + _dropout_mask(sh, k)


def _head(sh: Shapes, k: Kernels) -> int:
    t, e = sh.tokens, sh.element_bytes
    total = _norm(sh, k) if sh.final_norm else t * sh.hidden * e
    if k.fused_cross_entropy:  # logits (the gradient is written over them) + lse + target
        total += t * sh.vocab * e + t * _F32 + t * _I64
    else:  # fp32 log-probabilities + target + the loss's weight total
        total += t * sh.vocab * _F32 + t * _I64 + _F32
    return total


def num_slots(sh: Shapes) -> int:
    """Rows the experts see: ``E * capacity`` with drop-and-pad, else ``T * k``."""
    if sh.drop_and_pad:
        return sh.experts * capacity(sh)
    return sh.tokens * sh.topk


def capacity(sh: Shapes) -> int:
    return math.ceil(sh.tokens * sh.topk / sh.experts * sh.capacity_factor) if sh.capacity_factor else 0


def _router(sh: Shapes, k: Kernels) -> int:
    t = sh.tokens
    total = _norm(sh, k)
    total += t * sh.topk * (_F32 + _I64)  # top-k scores and indices
    if sh.capacity_factor is not None:  # token dropping: the routing map (the top-capacity pick is detached)
        total += t * sh.experts
    if sh.shared_ffn:
        total += _mlp_activation(t, sh.shared_ffn, sh)
    return total


def _preprocess(sh: Shapes, k: Kernels) -> int:
    return 2 * num_slots(sh) * _I64  # each slot's token and expert index (index_select, probs[token, expert])


def _postprocess_moe(sh: Shapes, k: Kernels) -> int:
    """Unpermute, shared-expert add, bias-dropout-add: only the dropout mask is its own (the
    unpermute's backward reads the preprocess's token indices, counted there)."""
    return _dropout_mask(sh, k)


def _experts(sh: Shapes, k: Kernels) -> int:
    """Dispatch, experts, combine, unpermute (the eager middle of the MoE block)."""
    m, e = num_slots(sh), sh.element_bytes
    return 2 * m * sh.hidden * e + _mlp_activation(m, sh.moe_ffn, sh, prob_scaled=True)


def _mamba(sh: Shapes, k: Kernels) -> int:
    b, s, e = sh.micro_batch, sh.seq, sh.element_bytes
    heads, p, g, n = sh.mamba_heads, sh.mamba_head_dim, sh.mamba_groups, sh.mamba_state
    d_in = heads * p
    conv = d_in + 2 * g * n
    total = _norm(sh, k) + _dropout_mask(sh, k)
    total += b * s * d_in * e  # the out-projection's input
    if k.fused_mamba:  # in-projection output, conv output, scan output, gated norm input
        width = 2 * d_in + 2 * g * n + heads
        return total + b * s * (width + conv + 2 * d_in) * e + b * s * heads * _F32
    total += b * conv * (s + sh.mamba_conv - 1) * e + b * conv * s * e  # conv input (padded), output
    total += b * conv * s * e  # its SiLU: x, B and C, which the scan keeps (GroupSlicedScan keeps its inputs)
    total += 2 * b * s * heads * _F32  # dt before and after the softplus
    total += 3 * heads * _F32  # exp(A_log), A = -exp(A_log) and D in float32
    total += 2 * b * s * d_in * e + b * s * g * _F32  # the gated norm: scan output, a copy of z, 1/rms per group
    return total


_FORMULAS = {
    "attn": _attention,
    "mlp": _mlp,
    "postprocess": _head,
    "moe_router": _router,
    "moe_preprocess": _preprocess,
    "moe_postprocess": _postprocess_moe,
    "mamba": _mamba,
}


def region_activation_bytes(kind: str, sh: Shapes, k: Kernels) -> int:
    """Bytes eager keeps for the backward of one ``kind`` region of one micro-batch.

    ``layer`` is attention + MLP; ``moe`` is the whole MoE block (router, permutation,
    experts and unpermute); the experts' part alone is ``moe_experts``.
    """
    if kind == "layer":
        return _attention(sh, k) + _mlp(sh, k)
    if kind == "moe":
        return _router(sh, k) + _preprocess(sh, k) + _experts(sh, k) + _dropout_mask(sh, k)
    if kind == "moe_experts":
        return _experts(sh, k) + _dropout_mask(sh, k)
    if kind not in _FORMULAS:
        raise ValueError(f"no activation formula for region kind {kind!r}; known: {' '.join(KINDS)}")
    return _FORMULAS[kind](sh, k)


def region_transient_bytes(kinds: tuple[str, ...], sh: Shapes, k: Kernels) -> int:
    """The largest working memory one backward of a region made of ``kinds`` allocates beyond
    the gradients of its saved tensors.

    Only the Mamba scan has one worth naming: its backward recomputes a slice of groups and takes
    its gradients by hand (``ssd.GroupSlicedScan``), two ``[b, heads, chunks, chunk, chunk]``
    float32 matrices of the slice at once and a few of the inputs' size (on its Triton kernels,
    ``ssd_kernels``, the slice's chunk states and their gradients), traced exactly by
    ``ssd_trace.captured_backward_peak_bytes``. Every other kind's temporaries are within its
    activations (``budgets.TEMPORARIES_FACTOR``); with the fused mamba-ssm kernels, theirs.
    """
    if "mamba" not in kinds or k.fused_mamba:
        return 0
    from megatron.core.ssm import ssd_trace
    from megatron.core.ssm.mamba_mixer import SCAN_CHUNK

    # fp16 and bf16 both compute in float32: the bytes are the same.
    dtype = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}[sh.element_bytes]
    return ssd_trace.captured_backward_peak_bytes(
        sh.micro_batch, sh.seq, sh.mamba_heads, sh.mamba_head_dim, sh.mamba_groups, sh.mamba_state, SCAN_CHUNK, dtype
    )


def flash_dq_accumulator_bytes(sh: Shapes, *, deterministic: bool, sm_count: int) -> int:
    """The fp32 dQ accumulator one flash-attention backward allocates (a temporary).

    Deterministic mode (``torch.use_deterministic_algorithms``) makes flash attention's
    backward keep one accumulator per split of the key sequence over the SMs instead of
    one shared by atomic adds: ``ceil(sm_count / (b * heads))`` copies of
    ``[b, s rounded to 128, heads, head dim rounded to 32 (64 above 128)]`` in fp32.
    """
    b, n, d = sh.micro_batch, sh.heads, sh.kv_channels
    s_rounded = math.ceil(sh.seq / 128) * 128
    multiple = 32 if d <= 128 else 64
    d_rounded = math.ceil(d / multiple) * multiple
    splits = (sm_count + b * n - 1) // (b * n) if deterministic else 1
    return splits * b * s_rounded * n * d_rounded * _F32


def layer_part_kinds(layer_class: type) -> tuple[str, ...]:
    """The region kinds that together make up ``layer_class``'s forward (for eager totals)."""
    names = [c.__name__ for c in layer_class.__mro__]
    own = layer_class.__name__
    if own == "MambaLayer":
        return ("mamba",)
    if own in ("AttentionLayer", "GDNLayer"):  # a G layer's attention is estimated as softmax attention's
        return ("attn",)
    if own == "MLPLayer":
        return ("mlp",)
    if own == "MoEOnlyLayer":
        return ("moe",)
    if "MoETransformerLayer" in names:
        return ("attn", "moe")
    if "TransformerLayer" in names:
        return ("attn", "mlp")
    raise ValueError(f"no activation model for layer class {own}")
