"""Model configuration: the shape and numerics of a GPT-style transformer.

Field names follow Megatron's ``TransformerConfig`` so that flags generated from them
(``--num-layers``, ``--ffn-hidden-size``, ...) are the ones Megatron users type.
Derived fields (``ffn_hidden_size``, ``kv_channels``, ``num_query_groups``) are
filled by ``finalize()``; ``validate()`` raises ``ValueError`` naming the flag.
"""

import dataclasses

import torch

from megatron.core.config_utils import flag_field, require
from megatron.core.transformer.moe.moe_config import MoEConfig


@dataclasses.dataclass
class TransformerConfig:
    """Shape, initialisation and regularisation of the transformer."""

    num_layers: int = 2
    """Number of transformer layers."""

    hidden_size: int = 128
    """Transformer hidden size."""

    ffn_hidden_size: int | None = None
    """MLP hidden size. Defaults to 4 * hidden size, as in Megatron (also with --swiglu)."""

    num_attention_heads: int = 4
    """Number of attention heads."""

    group_query_attention: bool = False
    """Use grouped-query attention (set --num-query-groups)."""

    num_query_groups: int | None = None
    """Number of key/value groups for grouped-query attention. Defaults to the number of heads."""

    kv_channels: int | None = None
    """Projection size per attention head. Defaults to hidden size / heads."""

    seq_length: int = 128
    """Maximum sequence length to process."""

    max_position_embeddings: int | None = None
    """Size of the learned position table. Defaults to --seq-length."""

    position_embedding_type: str = flag_field("learned_absolute", choices=("learned_absolute", "rope", "none"))
    """Position embedding: learned absolute table, rotary (RoPE) or none (hybrid Mamba models)."""

    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    normalization: str = flag_field("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    """Normalization layer type."""

    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""

    gated_linear_unit: bool = flag_field(False, flag="--swiglu")
    """Use SwiGLU in the MLP (gated linear unit with SiLU)."""

    add_bias_linear: bool = flag_field(True, flag="--disable-bias-linear")
    """Linear layers carry biases; --disable-bias-linear removes them."""

    untie_embeddings_and_output_weights: bool = False
    """Use a separate output-layer weight instead of the input embedding."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""

    hidden_dropout: float = 0.1
    """Dropout probability on the residual branches."""

    attention_dropout: float = 0.1
    """Dropout probability on attention weights."""

    cross_entropy_loss_fusion: bool = flag_field(True, flag="--no-cross-entropy-loss-fusion")
    """Cross entropy as one fused Triton kernel each way on CUDA (fp32 math, no fp32 copy of
    the logits, the gradient written over them). Without CUDA or Triton, and with
    --no-cross-entropy-loss-fusion, torch's log_softmax + nll_loss. On by default here
    (Megatron's --cross-entropy-loss-fusion opts in; accepted)."""

    gradient_accumulation_fusion: bool = flag_field(True, flag="--no-gradient-accumulation-fusion")
    """Linear layers add their weight gradient into the fp32 main_grad inside the wgrad GEMM
    (bf16 inputs, fp32 accumulation) instead of producing a bf16 gradient that DDP adds
    later, as Megatron's default does with apex; here through torch.addmm(out_dtype=...).
    The word embedding adds its token gradients into main_grad the same way."""

    apply_query_key_layer_scaling: bool = False
    """Unsupported in this trainer (kept so Megatron command lines give a clear error)."""

    vocab_size: int | None = flag_field(None, no_flag=True)
    """Padded vocabulary size, set by the tokenizer setup (the --vocab-size flag lives in the data config)."""

    params_dtype: torch.dtype = flag_field(torch.float32, no_flag=True)
    """Parameter dtype, derived from --bf16/--fp16."""

    moe: MoEConfig = flag_field(default_factory=MoEConfig, no_flag=True)
    """The MoE flags (their own group, ``RunConfig.moe``; the model reads them here)."""

    def finalize(self) -> "TransformerConfig":
        """Fills derived fields. Idempotent; returns self."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if (
            self.kv_channels is None
            and self.num_attention_heads > 0
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention:
            self.num_query_groups = self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        self.moe.finalize(self)
        return self

    def validate(self) -> None:
        """Raises ``ValueError`` for inconsistent model flags."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
            require(getattr(self, name) > 0, f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}.")
        require(
            self.ffn_hidden_size is None or self.ffn_hidden_size > 0,
            f"--ffn-hidden-size must be positive, got {self.ffn_hidden_size}; drop it for 4 x --hidden-size.",
        )
        require(
            self.kv_channels is None or self.kv_channels > 0,
            f"--kv-channels must be positive, got {self.kv_channels}; drop it for --hidden-size / "
            "--num-attention-heads.",
        )
        require(
            self.kv_channels is not None,
            f"--hidden-size ({self.hidden_size}) must be divisible by --num-attention-heads "
            f"({self.num_attention_heads}); pick sizes that divide, or set --kv-channels explicitly.",
        )
        require(
            self.num_query_groups is not None,
            "--group-query-attention needs --num-query-groups N (N divides the head count).",
        )
        require(
            self.num_query_groups > 0 and self.num_attention_heads % self.num_query_groups == 0,
            f"--num-attention-heads ({self.num_attention_heads}) must be divisible by "
            f"--num-query-groups ({self.num_query_groups}).",
        )
        if self.position_embedding_type == "learned_absolute" and self.max_position_embeddings is not None:
            require(
                self.max_position_embeddings >= self.seq_length,
                f"--max-position-embeddings ({self.max_position_embeddings}) must be >= --seq-length "
                f"({self.seq_length}) with learned absolute positions.",
            )
        for name in ("hidden_dropout", "attention_dropout"):
            p = getattr(self, name)
            require(0.0 <= p < 1.0, f"--{name.replace('_', '-')} must be in [0, 1), got {p}.")
        require(0.0 < self.rotary_percent <= 1.0, f"--rotary-percent must be in (0, 1], got {self.rotary_percent}.")
        require(
            not self.apply_query_key_layer_scaling,
            "--apply-query-key-layer-scaling is not supported: attention runs through "
            "scaled_dot_product_attention, which scales by 1/sqrt(kv_channels). Drop the flag.",
        )
