"""Shared builders for the MoE tests: tiny configs and a float64 reference MoE."""

import torch
import torch.nn.functional as F

from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.transformer_config import TransformerConfig


def make_config(dtype=torch.float64, *, num_layers=2, hidden=8, ffn=12, heads=2, **moe_kwargs) -> TransformerConfig:
    """A finalized tiny config with MoE flags ``moe_kwargs`` (dropout off)."""
    moe_kwargs.setdefault("num_moe_experts", 4)
    dense = {k: moe_kwargs.pop(k) for k in ("gated_linear_unit", "add_bias_linear") if k in moe_kwargs}
    cfg = TransformerConfig(
        num_layers=num_layers,
        hidden_size=hidden,
        ffn_hidden_size=ffn,
        num_attention_heads=heads,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=dtype,
        moe=MoEConfig(**moe_kwargs),
        **dense,
    )
    cfg.finalize()
    cfg.moe.validate(cfg)
    return cfg


def _act(x, gated):
    if gated:
        a, b = torch.chunk(x, 2, dim=-1)
        return F.silu(a) * b
    return F.gelu(x)


def expert_weights(experts, e):
    """``(w1, b1, w2, b2)`` of local expert ``e`` of a SequentialMLP or GroupedMLP."""
    if hasattr(experts, "local_experts"):
        mlp = experts.local_experts[e]
        return mlp.linear_fc1.weight, mlp.linear_fc1.bias, mlp.linear_fc2.weight, mlp.linear_fc2.bias
    fc1, fc2 = experts.linear_fc1, experts.linear_fc2
    return (
        fc1.weight[e],
        None if fc1.bias is None else fc1.bias[e],
        fc2.weight[e],
        None if fc2.bias is None else fc2.bias[e],
    )


def reference_moe(layer, x2d, probs, routing_map):
    """Token-by-token MoE output: ``sum_e fc2_e(act(fc1_e(x)) * p_e)`` over the routed experts
    (``fc2_e(act(fc1_e(p_e x)))`` with --moe-apply-probs-on-input) (+ shared experts), written as plain
    loops in float64."""
    gated = layer.config.gated_linear_unit
    on_input = layer.config.moe.moe_apply_probs_on_input
    out = torch.zeros_like(x2d, dtype=torch.float64)
    for t in range(x2d.shape[0]):
        for e in range(routing_map.shape[1]):
            if not bool(routing_map[t, e]):
                continue
            w1, b1, w2, b2 = (None if w is None else w.double() for w in expert_weights(layer.experts, e))
            p = probs[t, e].double()
            h = (x2d[t].double() * (p if on_input else 1.0)) @ w1.t() + (0 if b1 is None else b1)
            h = _act(h, gated) * (1.0 if on_input else p)
            out[t] += h @ w2.t() + (0 if b2 is None else b2)
    if layer.shared_experts is not None:
        se = layer.shared_experts
        h = x2d.double() @ se.linear_fc1.weight.double().t()
        if se.linear_fc1.bias is not None:
            h = h + se.linear_fc1.bias.double()
        s = _act(h, gated) @ se.linear_fc2.weight.double().t()
        if se.linear_fc2.bias is not None:
            s = s + se.linear_fc2.bias.double()
        if se.gate_weight is not None:
            s = s * torch.sigmoid(x2d.double() @ se.gate_weight.double().t())
        out = out + s
    return out
