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
    """One spec per layer: MoE where ``--moe-layer-freq`` says so (with ``--num-experts``), dense elsewhere."""
    moe = config.moe
    if not moe.enabled:
        return [get_gpt_layer_local_spec()] * config.num_layers
    moe.finalize(config)
    dense, sparse = get_gpt_layer_local_spec(), get_gpt_moe_layer_local_spec()
    return [sparse if flag else dense for flag in moe.moe_layer_pattern]
