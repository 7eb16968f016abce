"""Layer specs for GPT models built from plain PyTorch modules (``--transformer-impl local``)."""

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules


def get_gpt_layer_local_spec() -> ModuleSpec:
    """Spec of a dense GPT layer: norms (LayerNorm/RMSNorm from the config), SelfAttention, MLP."""
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=SelfAttention,
            pre_mlp_layernorm=build_norm,
            mlp=MLP,
        ),
    )


def get_gpt_moe_layer_local_spec() -> ModuleSpec:
    """Spec of an MoE GPT layer: as the dense one with an ``MoELayer`` in place of the MLP."""
    from megatron.core.transformer.moe.moe_layer import MoELayer, MoETransformerLayer

    return ModuleSpec(
        module=MoETransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=build_norm,
            self_attention=SelfAttention,
            pre_mlp_layernorm=build_norm,
            mlp=MoELayer,
        ),
    )


def get_gpt_decoder_layer_specs(config) -> list[ModuleSpec]:
    """One spec per layer: MoE where ``--moe-layer-freq`` says so (with ``--num-experts``), dense elsewhere;
    gated delta net attention where ``--linear-attention-freq`` says so (with ``--experimental-attention-variant
    gdn``; GDN2 with ``gdn2``), softmax attention elsewhere."""
    moe, linear = config.moe, config.linear_attention
    if not moe.enabled and not linear.enabled:
        return [get_gpt_layer_local_spec()] * config.num_layers
    moe.finalize(config)
    linear.finalize(config)
    linear.validate(config)  # names a missing --linear-attention-freq
    moe_pattern = moe.moe_layer_pattern if moe.enabled else [0] * config.num_layers
    specs = {(False, False): get_gpt_layer_local_spec()}
    if moe.enabled:
        specs[(False, True)] = get_gpt_moe_layer_local_spec()
    if linear.enabled:
        from megatron.core.ssm.gated_delta_net.layers import get_gdn_layer_local_spec

        specs[(True, False)] = get_gdn_layer_local_spec(moe=False, gdn2=linear.is_gdn2)
        specs[(True, True)] = get_gdn_layer_local_spec(moe=True, gdn2=linear.is_gdn2)
    return [specs[(linear.is_linear(i), bool(moe_pattern[i]))] for i in range(config.num_layers)]
