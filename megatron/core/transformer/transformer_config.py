"""Model configuration: the shape and numerics of a GPT-style transformer.

Field names follow Megatron's ``TransformerConfig`` so that flags generated from them
(``--num-layers``, ``--ffn-hidden-size``, ...) are the ones Megatron users type.
Derived fields (``ffn_hidden_size``, ``kv_channels``, ``num_query_groups``) are
filled by ``finalize()``; ``validate()`` raises ``ValueError`` naming the flag.
"""

import dataclasses
import math
import warnings

import torch

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.ssm.gated_delta_net.config import LinearAttentionConfig
from megatron.core.transformer.moe.moe_config import MoEConfig, eval_list_expression
from megatron.core.transformer.offload import OFFLOAD_MODULES
from megatron.core.transformer.recompute import SELECTIVE_MODULES


@dataclasses.dataclass
class TransformerConfig(Freezable):
    """Shape, initialisation and regularisation of the transformer."""

    num_layers: int = flag_field(2, aliases=("--encoder-num-layers",))
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
    """Number of key/value groups with --group-query-attention (default 1, as Megatron); without it,
    every head is its own group."""

    kv_channels: int | None = None
    """Projection size per attention head. Defaults to hidden size / heads."""

    seq_length: int = 128
    """Maximum sequence length to process."""

    max_position_embeddings: int | None = None
    """Size of the learned position table. Defaults to --seq-length."""

    position_embedding_type: str = flag_field("learned_absolute", choices=("learned_absolute", "rope", "none"))
    """Position embedding: learned absolute table, rotary (RoPE) or none (hybrid Mamba models)."""

    rotary_interleaved: bool = False
    """Rotate interleaved channel pairs (x0, x1), (x2, x3), ... instead of the two halves of each head."""

    rotary_base: int = 10000
    """Base of the rotary embedding frequencies."""

    rotary_seq_len_interpolation_factor: int | None = None
    """Divide the rotary positions by this factor (linear position interpolation for longer sequences)."""

    use_rope_scaling: bool = False
    """Scale the rotary frequencies as Llama 3.x does (long wavelengths divided by --rope-scaling-factor)."""

    rope_scaling_factor: float = 8.0
    """The factor of --use-rope-scaling."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that rotary embeddings rotate."""

    normalization: str = flag_field("LayerNorm", choices=("LayerNorm", "RMSNorm"))
    """Normalization layer type."""

    norm_epsilon: float = flag_field(1e-5, aliases=("--layernorm-epsilon",))
    """Epsilon of the normalization layers (--layernorm-epsilon is accepted as an alias)."""

    apply_layernorm_1p: bool = False
    """Zero-centred norm weights: the layer norm scales by (1 + weight), weight starting at 0."""

    qk_layernorm: bool = False
    """Normalize each query and key head (the --normalization type) before attention."""

    qk_l2_norm: bool = False
    """Llama 4's query-key L2 norm: each query and key head scaled to a mean square of 1 (no weight) before
    RoPE, instead of --qk-layernorm."""

    no_rope_freq: str | None = None
    """Layers that skip RoPE (Llama 4): N skips every N-th layer (N, 2N, ...), or a list expression with one
    1 (skip) or 0 (apply) per layer, e.g. "([0]*3+[1])*2"."""

    no_rope_layers: list[int] | None = flag_field(None, no_flag=True)
    """``--no-rope-freq`` as one 0/1 per layer (set by ``finalize``)."""

    attention_output_gate: bool = False
    """Gate each softmax attention head's output by the sigmoid of a learned projection of the layer input
    (a fourth part of the fused QKV projection), before the output projection."""

    squared_relu: bool = False
    """Use squared ReLU, relu(x)**2, as the MLP activation instead of GeLU."""

    gated_linear_unit: bool = flag_field(False, flag="--swiglu")
    """Use SwiGLU in the MLP (gated linear unit with SiLU)."""

    quick_geglu: bool = False
    """Use quick-GEGLU in the MLP: a gated linear unit with quick GeLU, x * sigmoid(1.702 x), on the gate half."""

    glu_linear_offset: float = 0.0
    """Offset added to the linear half of a gated activation: act(gate) * (up + offset)."""

    activation_func_clamp_value: float | None = None
    """Clamp of a gated activation's inputs: the gate half from above at C, the linear half to [-C, C]
    (with --quick-geglu; with --swiglu in MoE models only, as in Megatron)."""

    activation_flags: list[str] = flag_field(default_factory=list, no_flag=True)
    """With --quick-geglu: the MLP activation switches given (--quick-geglu, --swiglu, --squared-relu), recorded
    by ``finalize`` before it turns on the gated fc1 (for validate() to name a conflict)."""

    add_bias_linear: bool = flag_field(True, flag="--disable-bias-linear")
    """Linear layers carry biases; --disable-bias-linear removes them."""

    add_qkv_bias: bool = False
    """Give the query-key-value projection a bias even with --disable-bias-linear (Qwen's layout)."""

    untie_embeddings_and_output_weights: bool = False
    """Use a separate output-layer weight instead of the input embedding."""

    init_method_std: float = 0.02
    """Standard deviation of the normal initialisation of weights."""

    embedding_init_method_std: float | None = None
    """Standard deviation of the word (and position) embeddings' initialisation; default --init-method-std."""

    hidden_dropout: float = 0.1
    """Dropout probability on the residual branches."""

    attention_dropout: float = 0.1
    """Dropout probability on attention weights."""

    softmax_type: str = flag_field("vanilla", choices=("vanilla", "off-by-one", "learnable"))
    """Attention softmax: vanilla, off-by-one (a sink logit of 0 in every softmax denominator) or learnable
    (a learned sink logit per head, ``self_attention.core_attention.softmax_offset``)."""

    window_size: str | None = None
    """Sliding-window attention "LEFT,RIGHT": each token attends to itself and the LEFT tokens before it
    (-1: all of them); the model is causal, so RIGHT is taken as 0. Unset: full causal attention."""

    window_attn_skip_freq: str | None = None
    """Which layers use --window-size: N makes every N-th layer (N, 2N, ...) attend fully and the others
    through the window; a list expression gives 1 (window) or 0 (full) per layer, e.g. "([1]*3+[0])*2".
    Unset: every layer uses the window."""

    window: list[int] | None = flag_field(None, no_flag=True)
    """--window-size as ``[left, right]`` (derived)."""

    window_layer_pattern: list[int] | None = flag_field(None, no_flag=True)
    """One 1 (sliding window) or 0 (full attention) per layer (derived from --window-attn-skip-freq)."""

    add_position_embedding: bool = flag_field(True, flag="--no-position-embedding")
    """Megatron's deprecated switch for no position embedding: accepted with --position-embedding-type rope
    (where it changes nothing), refused otherwise."""

    cross_entropy_loss_fusion: bool = flag_field(True, flag="--no-cross-entropy-loss-fusion")
    """Cross entropy as one fused Triton kernel each way on CUDA (fp32 math, no fp32 copy of
    the logits, the gradient written over them). Without CUDA or Triton, and with
    --no-cross-entropy-loss-fusion, torch's log_softmax + nll_loss. On by default here
    (Megatron's --cross-entropy-loss-fusion opts in; accepted)."""

    gradient_accumulation_fusion: bool = flag_field(True, flag="--no-gradient-accumulation-fusion")
    """Linear layers add their weight gradient into main_grad inside the wgrad GEMM (bf16
    inputs, fp32 accumulation, rounded once to main_grad's dtype: fp32, or bf16 with
    --grad-reduce-in-bf16) instead of producing a bf16 gradient that DDP adds later, as
    Megatron's default does with apex; here through torch.addmm(out_dtype=...).
    The word embedding adds its token gradients into main_grad the same way."""

    apply_query_key_layer_scaling: bool = False
    """Scale Q K^T by 1/layer-number and the softmax input back up (an fp16 overflow guard). The
    softmax here always runs in fp32 (SDPA), where the two scalings cancel: accepted, same values."""

    attention_backend: str = flag_field("auto", choices=("auto", "flash", "fused", "unfused", "local"))
    """Attention kernel, mapped to SDPA backends: flash -> flash attention, fused -> cuDNN /
    memory-efficient, unfused and local -> the math kernel, auto -> SDPA chooses."""

    transformer_impl: str = flag_field(
        "transformer_engine", choices=("local", "transformer_engine", "inference_optimized")
    )
    """Layer implementation. Layers here are plain PyTorch (Megatron's local spec); transformer_engine
    (Megatron's default) runs them with one line saying so."""

    recompute_granularity: str | None = flag_field(None, choices=("full", "selective"))
    """Activation recompute: full recomputes whole layers in backward, selective the parts --recompute-modules
    names."""

    recompute_activations: bool = False
    """Megatron's older switch for --recompute-granularity selective (it sets that, whatever else is given)."""

    recompute_method: str | None = flag_field(None, choices=("uniform", "block"))
    """With --recompute-granularity full: uniform recomputes chunks of --recompute-num-layers layers
    keeping only each chunk's input; block recomputes the first --recompute-num-layers layers."""

    recompute_num_layers: int | None = None
    """Layers per recompute chunk (uniform) or recomputed layers (block)."""

    recompute_modules: list[str] | None = flag_field(None, nargs="*")
    """What --recompute-granularity selective recomputes (unset: core_attn, Megatron's default): core_attn (core attention),
    mlp (dense MLPs), moe (MoE layers), shared_experts, layernorm (the two norms' outputs) and moe_act
    (the experts' activation, with --moe-grouped-gemm); the last two are not kept but recomputed for
    the backward of the ops that read them."""

    use_mup: bool = False
    """Maximal Update Parametrization (muP): hidden weights initialised with std / sqrt(m) (output
    projections std / (sqrt(2 L) sqrt(m)); sqrt(L) for 2 L in hybrid models), hidden matrices trained
    with lr / m (Adam: eps / m too; SGD: vector-like params with lr * m instead), attention scaled by
    1 / d_head and logits by --mup-output-mult, where m = --hidden-size / --mup-base-hidden-size."""

    mup_base_hidden_size: int | None = None
    """Hidden size of the muP base (proxy) model; defaults to --hidden-size (m = 1)."""

    mup_embedding_mult: float = 1.0
    """muP: multiplier of the embedding output."""

    mup_output_mult: float = 1.0
    """muP: multiplier of the output logits; left at 1.0 it becomes 1 / m."""

    mup_base_head_dim: float | None = None
    """muP: the attention scale becomes sqrt(this) / kv_channels ** --mup-attn-scale-power (default numerator 1)."""

    mup_attn_scale_power: float = 1.0
    """muP: power of kv_channels in the attention scale (1.0: 1 / d_head, 0.5: standard 1 / sqrt(d_head))."""

    is_hybrid_model: bool = flag_field(False, no_flag=True)
    """A hybrid model (derived: set from --hybrid-layer-pattern). As in Megatron, its residual output
    projections are initialised with std / sqrt(L), not std / sqrt(2 L)."""

    mup_width_mult: float = flag_field(1.0, no_flag=True)
    """muP width multiplier m = --hidden-size / --mup-base-hidden-size (derived; 1.0 without muP)."""

    softmax_scale: float | None = flag_field(None, no_flag=True)
    """Scale of Q K^T before the softmax (derived: set by muP; None means 1 / sqrt(kv_channels))."""

    fine_grained_activation_offloading: bool = False
    """Offload what the --offload-modules parts save for backward to host memory (pinned with CUDA),
    copied back for their backward: the same results, less device memory."""

    offload_modules: list[str] = flag_field(default_factory=list, nargs="*")
    """Parts whose saved tensors are offloaded: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm,
    expert_fc1, moe_act (the last two with --moe-grouped-gemm)."""

    min_offloaded_tensor_size: int = 1024 * 1024
    """Saved tensors smaller than this many bytes stay on the device."""

    vocab_size: int | None = flag_field(None, no_flag=True)
    """Padded vocabulary size, set by the tokenizer setup (the --vocab-size flag lives in the data config)."""

    params_dtype: torch.dtype = flag_field(torch.float32, no_flag=True)
    """Parameter dtype, derived from --bf16/--fp16."""

    moe: MoEConfig = flag_field(default_factory=MoEConfig, no_flag=True)
    """The MoE flags (their own group, ``RunConfig.moe``; the model reads them here)."""

    linear_attention: LinearAttentionConfig = flag_field(default_factory=LinearAttentionConfig, no_flag=True)
    """The experimental attention variant flags (their own group, ``RunConfig.linear_attention``; the model
    reads them here)."""

    def finalize(self) -> "TransformerConfig":
        """Fills derived fields. Idempotent (a second call writes nothing); returns self."""
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if (
            self.kv_channels is None
            and self.num_attention_heads > 0
            and self.hidden_size % self.num_attention_heads == 0
        ):
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if not self.group_query_attention and self.num_query_groups != self.num_attention_heads:
            self.num_query_groups = self.num_attention_heads
        elif self.num_query_groups is None:
            self.num_query_groups = 1  # Megatron's default: --group-query-attention alone is multi-query
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.recompute_activations and self.recompute_granularity != "selective":
            self.recompute_granularity = "selective"  # Megatron's rule: the old switch wins
        self._finalize_activation()
        self._finalize_window()
        if self.no_rope_freq is not None and self.no_rope_layers is None:
            self.no_rope_layers = self._no_rope_pattern()
        if self.use_mup:
            self._finalize_mup()
        self.moe.finalize(self)
        self.linear_attention.finalize(self)
        return self

    def _given_activation_flags(self) -> list[str]:
        """The activation switches given: recorded by ``finalize`` with --quick-geglu, else read off."""
        if self.activation_flags:
            return self.activation_flags
        return [f for f, on in (("--swiglu", self.gated_linear_unit), ("--squared-relu", self.squared_relu)) if on]

    def _finalize_activation(self) -> None:
        if self.quick_geglu and not self.activation_flags:  # once: a second call finds them recorded
            self.activation_flags = ["--quick-geglu", *self._given_activation_flags()]
            self.gated_linear_unit = True  # fc1 holds the gate and the linear half, as with SwiGLU

    def _finalize_window(self) -> None:
        """--window-size and --window-attn-skip-freq -> ``window`` and ``window_layer_pattern``
        (ValueError naming the flag for text that does not parse)."""
        if self.window_size is None or self.window is not None:
            return
        text = self.window_size.strip().strip("()")
        try:
            window = [int(v) for v in text.split(",")]
        except ValueError:
            window = []
        require(
            len(window) == 2,
            f"--window-size {self.window_size!r}: expected two integers LEFT,RIGHT (e.g. 127,0; -1 for no limit).",
        )
        if window[1] != 0:
            warnings.warn(
                f"--window-size {self.window_size}: the model is causal, so RIGHT is taken as 0 (as Transformer "
                "Engine does).",
                stacklevel=4,
            )
        freq = self.window_attn_skip_freq
        if freq is None:
            pattern = [1] * self.num_layers
        elif "[" in freq:
            pattern = eval_list_expression(freq, "--window-attn-skip-freq")
        else:
            try:
                n = int(freq)
            except ValueError:
                raise ValueError(
                    f"--window-attn-skip-freq {freq!r}: expected an int N or a list expression such as ([1]*3+[0])."
                ) from None
            require(n >= 1, f"--window-attn-skip-freq must be >= 1, got {n}.")
            pattern = [0 if layer % n == 0 else 1 for layer in range(1, self.num_layers + 1)]
        self.window, self.window_layer_pattern = window, pattern

    def _no_rope_pattern(self) -> list[int] | None:
        """--no-rope-freq as one 0/1 per layer (Megatron's forms; ValueError naming the flag otherwise)."""
        text = str(self.no_rope_freq).strip()
        if "[" in text:
            pattern = eval_list_expression(text, "--no-rope-freq")
            require(
                len(pattern) == self.num_layers,
                f"--no-rope-freq {text!r} gives {len(pattern)} layers; the model has {self.num_layers}.",
            )
            return pattern
        try:
            n = int(text)
        except ValueError:
            raise ValueError(
                f"--no-rope-freq {text!r}: expected an int N or a list expression such as ([0]*3+[1])."
            ) from None
        if n == 0:
            return None  # Megatron: 0 skips nothing
        require(
            n > 0 and self.num_layers % n == 0,
            f"--no-rope-freq {n} must divide --num-layers ({self.num_layers}): every {n}-th layer skips RoPE.",
        )
        return ([0] * (n - 1) + [1]) * (self.num_layers // n)

    def skips_rope(self, layer_number: int) -> bool:
        """Whether 1-based layer ``layer_number`` attends without RoPE (--no-rope-freq, after ``finalize``)."""
        return self.no_rope_layers is not None and bool(self.no_rope_layers[layer_number - 1])

    def uses_window(self, layer_number: int) -> bool:
        """Whether the attention of 1-based layer ``layer_number`` is a sliding window (after ``finalize``)."""
        return self.window is not None and bool(self.window_layer_pattern[layer_number - 1])

    def _finalize_mup(self) -> None:
        # Megatron's order: width multiplier, attention scale, then the output multiplier's default.
        if self.mup_base_hidden_size is None:
            self.mup_base_hidden_size = self.hidden_size
        if self.mup_base_hidden_size <= 0:
            return  # validate() names the flag
        self.mup_width_mult = self.hidden_size / self.mup_base_hidden_size
        if self.softmax_scale is None and self.kv_channels is not None:
            numerator = 1.0 if self.mup_base_head_dim is None else self.mup_base_head_dim**0.5
            self.softmax_scale = numerator / (self.kv_channels**self.mup_attn_scale_power)
        if self.mup_output_mult == 1.0 and self.mup_width_mult != 1.0:
            self.mup_output_mult = 1.0 / self.mup_width_mult

    def hidden_init_std(self) -> float:
        """Std of the normal init of hidden weights: --init-method-std, over sqrt(m) with muP.

        The embeddings (and an untied output layer) keep --init-method-std; residual output
        projections use ``output_init_std``.
        """
        return self.init_method_std / math.sqrt(self.mup_width_mult) if self.use_mup else self.init_method_std

    def output_init_std(self) -> float:
        """Std of the residual output projections (attention, MLP, Mamba and GDN ``out_proj``):
        ``hidden_init_std`` over sqrt(2 L), or over sqrt(L) in a hybrid model (Megatron's
        multiplier 1 there), L = --num-layers."""
        multiplier = 1.0 if self.is_hybrid_model else 2.0
        return self.hidden_init_std() / math.sqrt(multiplier * self.num_layers)

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
        require(self.norm_epsilon > 0, f"--norm-epsilon must be positive, got {self.norm_epsilon}.")
        given = self._given_activation_flags()
        require(len(given) <= 1, f"{' and '.join(given)} each set the MLP activation; pick one.")
        for flag, value in (
            ("--rotary-seq-len-interpolation-factor", self.rotary_seq_len_interpolation_factor),
            ("--rope-scaling-factor", self.rope_scaling_factor),
        ):
            require(value is None or value > 0, f"{flag} must be > 0, got {value}.")
        self._validate_activation()
        self._validate_attention_variant()
        require(
            self.transformer_impl != "inference_optimized",
            "--transformer-impl inference_optimized is not supported: this trainer does not do inference; "
            "use --transformer-impl local or transformer_engine.",
        )
        if self.use_mup:
            require(
                self.mup_base_hidden_size is None or self.mup_base_hidden_size > 0,
                f"--mup-base-hidden-size must be positive, got {self.mup_base_hidden_size}.",
            )
        self._validate_recompute()
        self._validate_offloading()

    def _validate_activation(self) -> None:
        clamp = self.activation_func_clamp_value
        if clamp is None:
            return
        require(
            math.isfinite(clamp) and clamp > 0,
            f"--activation-func-clamp-value must be finite and > 0, got {clamp}.",
        )
        if self.gated_linear_unit and not self.quick_geglu:  # SwiGLU: Megatron's rules
            require(
                self.moe.enabled,
                "--activation-func-clamp-value with --swiglu is only supported in MoE models (as in Megatron); "
                "add --num-experts or drop the clamp.",
            )
            require(
                self.glu_linear_offset == 0.0,
                "--glu-linear-offset must be 0 when --activation-func-clamp-value is set with --swiglu (as in "
                "Megatron).",
            )

    def _validate_attention_variant(self) -> None:
        if not self.add_position_embedding:
            require(
                self.position_embedding_type == "rope",
                "--no-position-embedding is deprecated (Megatron refuses it without rope); use "
                "--position-embedding-type none for no position embedding, or rope.",
            )
        if self.window is None:
            return
        left, right = self.window
        require(
            left >= -1 and right >= -1,
            f"--window-size {self.window_size}: LEFT and RIGHT must be >= -1 (-1: no limit).",
        )
        pattern = self.window_layer_pattern
        require(
            all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1) for v in pattern),
            f"--window-attn-skip-freq pattern {pattern} may only hold 1 (sliding window) and 0 (full attention).",
        )
        require(
            len(pattern) == self.num_layers,
            f"--window-attn-skip-freq pattern has {len(pattern)} entries but --num-layers is {self.num_layers}; "
            "give one 1/0 per layer.",
        )

    def _validate_recompute(self) -> None:
        g, m, n = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if g is None:  # Megatron ignores --recompute-method / --recompute-num-layers then (resolve warns)
            return
        if g == "selective":
            require(
                n is None,
                "--recompute-num-layers applies to --recompute-granularity full only; drop it with selective.",
            )
            self._validate_recompute_modules()
            return
        require(m is not None, "--recompute-granularity full needs --recompute-method uniform or block.")
        require(n is not None and n >= 1, "--recompute-granularity full needs --recompute-num-layers N (N >= 1).")
        if m == "block":
            require(
                n <= self.num_layers,
                f"--recompute-num-layers ({n}) exceeds --num-layers ({self.num_layers}) with --recompute-method block.",
            )

    def _validate_recompute_modules(self) -> None:
        modules = ["core_attn"] if self.recompute_modules is None else self.recompute_modules
        elsewhere = {
            "mla_up_proj": "multi-latent attention is not supported by this trainer",
            "mhc": "hyper-connections (--enable-mhc-connections) are not supported by this trainer",
            "gdp_in_proj": "GatedDeltaProduct (--experimental-attention-variant gdn2) is not supported yet",
            "gdp_qkv": "GatedDeltaProduct (--experimental-attention-variant gdn2) is not supported yet",
            "gdn_norm_out": "recomputing the GatedDeltaNet output norm is not supported yet",
        }
        for name in modules:
            if name in elsewhere:
                raise ValueError(f"--recompute-modules {name}: {elsewhere[name]}; drop {name}.")
            require(
                name in SELECTIVE_MODULES,
                f"--recompute-modules: invalid choice {name!r}; choose from {' '.join(SELECTIVE_MODULES)}.",
            )
        require(
            "moe_act" not in modules or self.moe.moe_grouped_gemm,
            "--recompute-modules moe_act is only supported with --moe-grouped-gemm (as in Megatron); "
            "add --moe-grouped-gemm or drop moe_act.",
        )

    def _validate_offloading(self) -> None:
        if not self.fine_grained_activation_offloading:
            return
        modules = set(self.offload_modules)
        flag = "--fine-grained-activation-offloading"
        require(bool(modules), f"{flag} needs --offload-modules NAME ... ({' '.join(OFFLOAD_MODULES)}).")
        for name in sorted(modules - set(OFFLOAD_MODULES)):
            if name == "fused_group_mlp":
                raise ValueError(
                    "--offload-modules fused_group_mlp needs Transformer Engine's op fuser, which this trainer "
                    "does not use; offload expert_fc1 and moe_act instead."
                )
            if name == "gdp_qkv":
                raise ValueError(
                    "--offload-modules gdp_qkv: GatedDeltaProduct (--experimental-attention-variant gdn2) is not "
                    "supported yet; drop gdp_qkv."
                )
            raise ValueError(f"--offload-modules: invalid choice {name!r}; choose from {' '.join(OFFLOAD_MODULES)}.")
        require(
            "attn_proj" not in modules or "core_attn" in modules,
            "--offload-modules attn_proj needs core_attn too: attn_proj's input is core attention's output, which "
            "core attention's backward needs (as in Megatron).",
        )
        inside_moe = sorted(modules & {"expert_fc1", "moe_act"})
        if inside_moe and self.moe.enabled:
            require(
                self.moe.moe_grouped_gemm,
                f"--offload-modules {' '.join(inside_moe)} needs --moe-grouped-gemm here (the expert loop without it "
                "is one autograd function); add --moe-grouped-gemm or drop them.",
            )
        require(
            not (inside_moe and self.recompute_granularity == "selective" and "moe" in (self.recompute_modules or ())),
            f"--offload-modules {' '.join(inside_moe)} inside MoE layers that --recompute-modules moe recomputes "
            "keeps nothing to offload (as in Megatron); drop moe from --recompute-modules or those from "
            "--offload-modules.",
        )
        require(
            self.min_offloaded_tensor_size >= 0,
            f"--min-offloaded-tensor-size must be >= 0, got {self.min_offloaded_tensor_size}.",
        )
