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
