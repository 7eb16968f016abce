"""Layer specs of hybrid models built from plain PyTorch modules (``--transformer-impl local``)."""

from megatron.core.models.hybrid.hybrid_block import HybridStackSubmodules
from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, GDNLayer, MLPLayer, MoEOnlyLayer, absent
from megatron.core.ssm.gated_delta_net.gated_delta_net import GatedDeltaNet
from megatron.core.ssm.mamba_layer import MambaLayer, MambaLayerSubmodules
from megatron.core.ssm.mamba_mixer import MambaMixer
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.mlp import MLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import TransformerLayerSubmodules


def get_hybrid_stack_local_spec() -> HybridStackSubmodules:
    """Specs per pattern symbol: Mamba (norm + mixer), gated delta net, attention-only, MLP-only and MoE-only
    layers (the gated delta net layer is an attention-only layer with ``GatedDeltaNet`` attention)."""
    return HybridStackSubmodules(
        mamba_layer=ModuleSpec(module=MambaLayer, submodules=MambaLayerSubmodules(norm=build_norm, mixer=MambaMixer)),
        gdn_layer=ModuleSpec(
            module=GDNLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=build_norm, self_attention=GatedDeltaNet, pre_mlp_layernorm=absent, mlp=absent
            ),
        ),
        attention_layer=ModuleSpec(
            module=AttentionLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=build_norm, self_attention=SelfAttention, pre_mlp_layernorm=absent, mlp=absent
            ),
        ),
        mlp_layer=ModuleSpec(
            module=MLPLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=absent, self_attention=absent, pre_mlp_layernorm=build_norm, mlp=MLP
            ),
        ),
        moe_layer=ModuleSpec(
            module=MoEOnlyLayer,
            submodules=TransformerLayerSubmodules(
                input_layernorm=absent, self_attention=absent, pre_mlp_layernorm=build_norm, mlp=MoELayer
            ),
        ),
    )
