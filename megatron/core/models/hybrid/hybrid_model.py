"""The hybrid language model: embeddings -> HybridStack (Mamba/attention/MLP layers) -> output layer.

The GPT model's interface and conventions (``forward(input_ids, position_ids, labels)``
gives the unreduced per-token loss; ``[s, b, h]`` inside; the loss head is one
graphable region), with the decoder built from ``--hybrid-layer-pattern``. Parameter
names follow Megatron's hybrid model (``embedding.word_embeddings``,
``decoder.layers.N.mixer.in_proj``, ``decoder.final_norm``, ``output_layer``).
The class defaults to no position embeddings, as Megatron's ``HybridModel`` (the Mamba
layers carry position); the flags default to ``learned_absolute``, as Megatron's command
line does (its hybrid examples pass ``--position-embedding-type none``); ``rope`` works
as in GPT.
"""

import torch

from megatron.core.models.gpt.gpt_model import LanguageModel, LanguageModelEmbedding
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    parse_hybrid_pattern,
    select_pipeline_segment,
    virtual_pipeline_size,
)
from megatron.core.tensor_parallel.layers import resolve_device
from megatron.core.transformer.cuda_graphs import regions
from megatron.core.transformer.spec_utils import ModuleSpec


class HybridModel(LanguageModel):
    """Decoder-only hybrid Mamba/attention language model (one pipeline chunk of it).

    Graph head: ``_postprocess`` (final norm, output layer, cross entropy) on the stage
    that has it.

    Args:
        config: Finalized ``TransformerConfig``.
        mamba_config: ``MambaConfig``; its ``hybrid_layer_pattern`` chooses the layers.
        vocab_size: Padded vocabulary size.
        max_sequence_length: Rows of the learned position table (``learned_absolute`` only).
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        stack_submodules: Layer specs per pattern symbol (default: the local hybrid spec).
        pre_process: Holds the embeddings (first pipeline stage).
        post_process: Holds the final norm and output layer (last pipeline stage).
        share_embeddings_and_output_weights: Output layer reuses the word-embedding weight.
        position_embedding_type: ``none``, ``learned_absolute`` or ``rope``.
        vp_stage: Virtual pipeline stage of this chunk (None without a virtual pipeline).
        rank_layers: Layers of each pipeline rank for a pattern without '|' (None: an even split).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        config,
        mamba_config,
        vocab_size: int,
        max_sequence_length: int,
        pg=None,
        *,
        stack_submodules=None,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = True,
        position_embedding_type: str = "none",
        vp_stage: int | None = None,
        rank_layers: list[int] | None = None,
        device=None,
    ):
        super().__init__()
        if mamba_config.hybrid_layer_pattern is None:
            raise ValueError("a hybrid model needs --hybrid-layer-pattern (e.g. M*M-M*M-).")
        self.pattern = parse_hybrid_pattern(mamba_config.hybrid_layer_pattern)
        pp_size = getattr(pg, "pp_size", 1) if pg is not None else 1
        pp_rank = getattr(pg, "pp_rank", 0) if pg is not None else 0
        self.layer_types, layer_offset = select_pipeline_segment(self.pattern, pp_rank, pp_size, vp_stage, rank_layers)
        device = self._build_embedding(
            config,
            vocab_size,
            max_sequence_length,
            pg,
            pre_process=pre_process,
            post_process=post_process,
            share_embeddings_and_output_weights=share_embeddings_and_output_weights,
            position_embedding_type=position_embedding_type,
            device=device,
        )
        self.decoder = HybridStack(
            config,
            mamba_config,
            self.layer_types,
            pg,
            submodules=stack_submodules,
            layer_offset=layer_offset,
            pre_process=pre_process,
            post_process=post_process,
            device=device,
        )
        self._build_output_layer(device)


def pattern_layer_classes(mamba_config, stack_submodules=None) -> list[type]:
    """The layer classes the whole ``--hybrid-layer-pattern`` builds (every pipeline chunk), in order."""
    if stack_submodules is None:
        from megatron.core.models.hybrid.hybrid_layer_specs import get_hybrid_stack_local_spec

        stack_submodules = get_hybrid_stack_local_spec()
    spec_names = {
        Symbols.MAMBA: "mamba_layer",
        Symbols.GDN: "gdn_layer",
        Symbols.ATTENTION: "attention_layer",
        Symbols.MLP: "mlp_layer",
        Symbols.MOE: "moe_layer",
    }
    classes = []
    for symbol in parse_hybrid_pattern(mamba_config.hybrid_layer_pattern).layers:
        spec = getattr(stack_submodules, spec_names[symbol], None) if symbol in spec_names else None
        if spec is not None:  # a symbol without a spec: building the stack says so
            classes.append(spec.module if isinstance(spec, ModuleSpec) else spec)
    return classes


def check_graph_scopes(scopes, mamba_config, model_config=None, stack_submodules=None) -> None:
    """Checks ``--cuda-graph-scope`` against the pattern's layers, before anything is built.

    The rules are the resolver's (``cuda_graphs/regions.py``); a violation names both
    flags, e.g. ``mamba`` on a pattern without ``M`` layers.
    """
    pattern = mamba_config.hybrid_layer_pattern
    try:
        regions.resolve(scopes, pattern_layer_classes(mamba_config, stack_submodules), model_config)
    except ValueError as error:
        missing = [
            " or ".join(f"{symbol} ({Symbols.NAMES[symbol]})" for symbol in symbols)
            for scope, symbols in (
                ("mamba", (Symbols.MAMBA,)),
                ("attn", (Symbols.ATTENTION, Symbols.GDN)),
                ("mlp", (Symbols.MLP,)),
            )
            if scope in scopes and not any(symbol in pattern for symbol in symbols)
        ]
        missing = [f"no {symbols} layers" for symbols in missing]
        hint = f": it has {', '.join(missing)}" if missing else ""
        raise ValueError(f"{error} The layers come from --hybrid-layer-pattern {pattern!r}{hint}.") from None


def build_hybrid_model(config, mamba_config, vocab_size: int, pg=None, device=None, vp_stage=None) -> HybridModel:
    """Builds the hybrid model the (validated) configs describe, with the local layer specs."""
    if config.max_position_embeddings is None or config.kv_channels is None:
        config.finalize()
    return HybridModel(
        config,
        mamba_config,
        vocab_size,
        config.max_position_embeddings,
        pg,
        share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
        position_embedding_type=config.position_embedding_type,
        vp_stage=vp_stage,
        device=device,
    )


def build_hybrid_stage_chunks(
    config, mamba_config, vocab_size: int, pg, device=None, rank_layers: list[int] | None = None
) -> list[HybridModel]:
    """This pipeline rank's model chunks of the hybrid model (one per virtual stage).

    As ``gpt_model.build_gpt_stage_chunks``: parts other ranks hold are drawn and dropped
    in model order, so the weights do not depend on the layout, and a tied output layer
    on the last stage starts as a copy of the embedding. ``rank_layers``: the layers of each
    pipeline rank for a pattern without '|' (``layout.rank_layer_counts``; None: an even split).
    """
    if config.max_position_embeddings is None or config.kv_channels is None:
        config.finalize()
    pattern = parse_hybrid_pattern(mamba_config.hybrid_layer_pattern)
    pp, rank = pg.pp_size, pg.pp_rank
    vpp = virtual_pipeline_size(pattern, pp) or 1
    device = resolve_device(device)
    tied = not config.untie_embeddings_and_output_weights
    position = config.position_embedding_type

    def segment(stage: int) -> tuple[str, int]:
        return select_pipeline_segment(pattern, stage % pp, pp, stage // pp if vpp > 1 else None, rank_layers)

    chunks, next_stage, embedding_copy = [], 0, None
    for c in range(vpp):
        stage = c * pp + rank
        if c == 0 and stage != 0:  # rank 0's embedding, drawn in its place
            skipped = LanguageModelEmbedding(config, vocab_size, config.max_position_embeddings, position, pg=pg,
                                             device=device)  # fmt: skip
            if rank == pp - 1 and tied:
                embedding_copy = skipped.word_embeddings.weight.detach()
            del skipped
        for other in range(next_stage, stage):  # other ranks' layers before this chunk
            layer_types, offset = segment(other)
            HybridStack(config, mamba_config, layer_types, pg, layer_offset=offset, pre_process=False,
                        post_process=False, device=device)  # fmt: skip
        chunk = HybridModel(
            config, mamba_config, vocab_size, config.max_position_embeddings, pg, pre_process=stage == 0,
            post_process=stage == pp * vpp - 1, share_embeddings_and_output_weights=tied,
            position_embedding_type=position, vp_stage=c if vpp > 1 else None, rank_layers=rank_layers,
            device=device,
        )  # fmt: skip
        if embedding_copy is not None and chunk.post_process:
            with torch.no_grad():
                chunk.output_layer.weight.copy_(embedding_copy)
        chunks.append(chunk)
        next_stage = stage + 1
    return chunks


def gdn_layer_flops(config, tokens: int) -> float:
    """Forward FLOPs of one ``G`` layer over ``tokens`` (Megatron's ``gdn_layer_flops``; GDN2's wider in-projection
    under ``gdn2``)."""
    la = config.linear_attention
    qk = la.linear_key_head_dim * la.linear_num_key_heads
    v = la.linear_value_head_dim * la.linear_num_value_heads
    in_proj = 4 * qk + 3 * v if la.is_gdn2 else 2 * qk + 2 * v + 2 * la.linear_num_value_heads
    h = config.hidden_size
    return (
        2
        * tokens
        * (
            h * in_proj
            + la.linear_conv_kernel_dim * (2 * qk + v)
            + la.linear_num_value_heads * la.linear_value_head_dim**2 * 4
            + h * v
        )
    )


def num_floating_point_operations(config, mamba_config, batch_size: int, seq_length: int, vocab_size: int) -> float:
    """Model FLOPs of one forward + backward (3 x forward) over ``batch_size`` sequences.

    Megatron's hybrid accounting (``hybrid_flops`` in its training.py): per layer kind,
    GEMMs at 2 FLOPs per multiply-add, causal attention counted at half the square,
    the scan at ``7 * tokens * d_in * state``, a gated delta net layer at its projections,
    conv and ``4 * value heads * value head dim^2`` for the rule, plus the logits.
    """
    pattern = parse_hybrid_pattern(mamba_config.hybrid_layer_pattern)
    tokens = batch_size * seq_length
    h = config.hidden_size
    # Attention: QKV + output projections, then the core (QK^T and PV, causal).
    p = config.kv_channels * config.num_attention_heads / h
    groups = config.num_query_groups / config.num_attention_heads
    attn = 4 * tokens * h * p * (h + h * groups) + 2 * batch_size * seq_length**2 * h * p
    mlp = 4 * (config.ffn_hidden_size / h) * (1.5 if config.gated_linear_unit else 1.0) * tokens * h**2
    d_in = 2 * h  # Megatron's formula uses the default expansion here
    heads = mamba_config.num_heads(h)
    n, g = mamba_config.mamba_state_dim, mamba_config.mamba_num_groups
    mamba = 2 * tokens * h * (2 * d_in + 2 * g * n + heads) + 7 * tokens * d_in * n + 2 * tokens * d_in * h
    forward = (
        pattern.count(Symbols.GDN) * gdn_layer_flops(config, tokens)
        + pattern.count(Symbols.ATTENTION) * attn
        + pattern.count(Symbols.MLP) * mlp
        + pattern.count(Symbols.MAMBA) * mamba
        + 2 * tokens * h * vocab_size
    )
    return 3.0 * forward
