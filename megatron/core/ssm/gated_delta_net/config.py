"""Experimental attention variants: which layers are gated delta net (linear attention), and their sizes.

Field names, flags and defaults are Megatron's (upstream keeps them in
``TransformerConfig``; here they are their own concern, read by the model as
``TransformerConfig.linear_attention``). ``--experimental-attention-variant gdn``
(or its deprecated spelling ``gated_delta_net``) makes the layers that
``--linear-attention-freq`` picks gated delta net layers; the others keep softmax
attention; ``gdn2`` makes them GDN2 (Gated DeltaNet-2) layers instead. ``finalize()``
turns the flag into ``linear_attention_pattern`` (one 0/1 per layer); a list expression
such as ``([1]*3+[0]*1)*2`` is parsed with ``ast`` (list literals, integers, ``+`` and
``*`` only, no ``eval``), as ``--moe-layer-freq`` is. Without a variant the
``--linear-*`` flags are ignored, as in Megatron, except in a hybrid model: the ``G``
symbols of ``--hybrid-layer-pattern`` are gated delta net layers (GDN2 with ``gdn2``)
of these sizes. There ``--linear-attention-freq`` is unused, but, as in Megatron, still
required with ``gdn``.
"""

import dataclasses
import warnings

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.core.transformer.moe.moe_config import eval_list_expression

GDN = "gdn"
GDN2 = "gdn2"
_DEPRECATED_ALIASES = {"gated_delta_net": GDN}
_FREQ_FLAG = "--linear-attention-freq"


def parse_linear_attention_freq(value, num_layers: int) -> list[int]:
    """``--linear-attention-freq`` -> one 1 (gated delta net) or 0 (softmax attention) per layer.

    Args:
        value: An int N, its string, a list of 0/1, or a list expression string such as
            ``"([1]*3+[0]*1)*2"``. N means every N-th layer (1-based: layers N, 2N, ...)
            is softmax attention and the others are linear, N - 1 of every N; N = 1 means
            no linear layer.
        num_layers: Number of transformer layers; a pattern must have this length.

    Raises:
        ValueError: For anything else, naming the flag.
    """
    if isinstance(value, str):
        text = value.strip()
        if "[" in text:
            value = eval_list_expression(text, flag=_FREQ_FLAG)
        else:
            try:
                value = int(text)
            except ValueError:
                raise ValueError(
                    f"{_FREQ_FLAG} {value!r}: expected an int N (every N-th layer is softmax attention) or a list "
                    "expression such as ([1]*3+[0]*1)."
                ) from None
    if isinstance(value, bool) or not isinstance(value, int | list):
        raise ValueError(f"{_FREQ_FLAG} {value!r}: expected an int or a list of 0/1.")
    if isinstance(value, int):
        require(value >= 1, f"{_FREQ_FLAG} must be >= 1, got {value}.")
        return [0 if (i + 1) % value == 0 else 1 for i in range(num_layers)]
    require(
        all(isinstance(v, int) and not isinstance(v, bool) and v in (0, 1) for v in value),
        f"{_FREQ_FLAG} pattern {value} may only hold 1 (gated delta net layer) and 0 (softmax attention layer).",
    )
    require(
        len(value) == num_layers,
        f"{_FREQ_FLAG} pattern has {len(value)} entries but --num-layers is {num_layers}; give one 0/1 per layer.",
    )
    return list(value)


@dataclasses.dataclass
class LinearAttentionConfig(Freezable):
    """Experimental attention variants: gated delta net layers and their sizes."""

    experimental_attention_variant: str | None = flag_field(None, choices=("gdn", "gated_delta_net", "gdn2", "dsa"))
    """Attention variant of the layers --linear-attention-freq picks and of the G layers of
    --hybrid-layer-pattern: gdn (gated delta net linear attention; gated_delta_net is its deprecated
    spelling) or gdn2 (Gated DeltaNet-2: channel-wise decay, erase and write gates). dsa is not
    supported here."""

    linear_attention_freq: str | None = None
    """Which layers are linear attention: an int N (every N-th layer is softmax attention, the
    other N-1 of every N are linear) or a list expression with one 1 (linear) / 0 (softmax) per
    layer, e.g. ([1]*3+[0]*1)*2. Required with --experimental-attention-variant gdn, and with gdn2
    outside hybrid models."""

    linear_conv_kernel_dim: int = 4
    """Taps of the gated delta net's causal convolution over q, k and v."""

    linear_key_head_dim: int = 128
    """Query and key head dimension of the gated delta net."""

    linear_value_head_dim: int = 128
    """Value and output-gate head dimension of the gated delta net."""

    linear_num_key_heads: int = 16
    """Number of query and key heads of the gated delta net."""

    linear_num_value_heads: int = 32
    """Number of value and output-gate heads of the gated delta net (a multiple of the key heads)."""

    linear_attention_pattern: list[int] | None = flag_field(None, no_flag=True)
    """Derived from --linear-attention-freq: 1 for a gated delta net layer, 0 for softmax attention."""

    @property
    def enabled(self) -> bool:
        """Gated delta net layers are asked for (``gdn``, its deprecated spelling, or ``gdn2``)."""
        return self.experimental_attention_variant in (GDN, GDN2, *_DEPRECATED_ALIASES)

    @property
    def is_gdn2(self) -> bool:
        """The gated delta net layers are GDN2 layers."""
        return self.experimental_attention_variant == GDN2

    def is_linear(self, layer_index: int) -> bool:
        """Whether the layer with this 0-based global index is a gated delta net layer."""
        return bool(self.linear_attention_pattern) and self.linear_attention_pattern[layer_index] == 1

    def finalize(self, model) -> "LinearAttentionConfig":
        """Takes the deprecated spelling and fills ``linear_attention_pattern``. Idempotent; returns self.

        Args:
            model: The ``TransformerConfig`` (its ``num_layers``).
        """
        canonical = _DEPRECATED_ALIASES.get(self.experimental_attention_variant)
        if canonical is not None:
            warnings.warn(
                f"--experimental-attention-variant {self.experimental_attention_variant} is deprecated; "
                f"use {canonical}.",
                stacklevel=2,
            )
            self.experimental_attention_variant = canonical
        if not self.enabled or self.linear_attention_freq is None:
            return self  # validate() names a missing --linear-attention-freq
        pattern = parse_linear_attention_freq(self.linear_attention_freq, model.num_layers)
        if self.linear_attention_pattern != pattern:  # a second call writes nothing (the config may be frozen)
            self.linear_attention_pattern = pattern
        return self

    def validate(self, model=None, parallel=None, *, hybrid_pattern: str | None = None) -> None:
        """Checks the variant and the gated delta net sizes (after ``finalize``; reads only).

        Args:
            model: The run's ``TransformerConfig`` (a pattern must match its layer count).
            parallel: The run's ``ParallelConfig``: the TP size must divide both head counts.
            hybrid_pattern: The ``--hybrid-layer-pattern`` of a hybrid model (None: a GPT model). Its
                ``G`` layers need valid sizes with or without a variant; ``gdn2`` needs no
                ``--linear-attention-freq`` there.

        Raises:
            ValueError: Naming the flag.
        """
        variant = self.experimental_attention_variant
        require(
            variant != "dsa",
            "--experimental-attention-variant dsa is not supported: this trainer does not do multi-latent "
            "attention, which DSA sparse attention builds on; drop the flag.",
        )
        gdn_layers = hybrid_pattern is not None and "G" in hybrid_pattern
        if not self.enabled and not gdn_layers:
            return
        freq_needed = self.enabled and not (hybrid_pattern is not None and self.is_gdn2)
        require(
            self.linear_attention_freq is not None or not freq_needed,
            f"--experimental-attention-variant {variant} needs {_FREQ_FLAG}: an int N (every N-th layer is "
            "softmax attention, the others gated delta net) or a 0/1 list expression such as ([1]*3+[0]*1).",
        )
        if model is not None and self.enabled and self.linear_attention_freq is not None:
            pattern = self.linear_attention_pattern
            assert pattern is not None and len(pattern) == model.num_layers, "validate() needs finalize() first"
        for name in (
            "linear_conv_kernel_dim",
            "linear_key_head_dim",
            "linear_value_head_dim",
            "linear_num_key_heads",
            "linear_num_value_heads",
        ):
            value = getattr(self, name)
            require(value >= 1, f"--{name.replace('_', '-')} must be >= 1, got {value}.")
        k, v = self.linear_num_key_heads, self.linear_num_value_heads
        require(
            v % k == 0,
            f"--linear-num-value-heads ({v}) must be a multiple of --linear-num-key-heads ({k}): each key head "
            "serves the same number of value heads.",
        )
        tp = 1 if parallel is None else parallel.tensor_model_parallel_size
        require(
            k % tp == 0 and v % tp == 0,
            f"--linear-num-key-heads ({k}) and --linear-num-value-heads ({v}) must be divisible by "
            f"--tensor-model-parallel-size ({tp}): the gated delta net splits its heads across TP ranks.",
        )
