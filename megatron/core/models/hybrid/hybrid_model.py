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

from megatron.core.models.common.rotary import rotary_embedding
from megatron.core.models.gpt.gpt_model import GPTModel, LanguageModelEmbedding, build_output_layer, scale_logits
from megatron.core.models.hybrid.hybrid_block import HybridStack
from megatron.core.models.hybrid.hybrid_layer_allocation import (
    Symbols,
    parse_hybrid_pattern,
    select_pipeline_segment,
    virtual_pipeline_size,
)
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import resolve_device, uses_sequence_parallel
from megatron.core.transformer.cuda_graphs import regions
from megatron.core.transformer.spec_utils import ModuleSpec


def _tied_head_params(model: "HybridModel") -> list[torch.nn.Parameter]:
    # The tied embedding weight gets gradient from the head and from the eager embedding
    # lookup; autograd must sum both in the parameter's dtype, as in eager.
    shared = model.shared_embedding_or_output_weight() if model.pre_process else None
    return [shared] if shared is not None else []


class HybridModel(torch.nn.Module):
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
        device: Device for the parameters (default: torch's default device).
    """

    graph_head = regions.HeadRegion(
        "_postprocess", shared_params=_tied_head_params, present=lambda model: model.post_process
    )

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
        device=None,
    ):
        super().__init__()
        if mamba_config.hybrid_layer_pattern is None:
            raise ValueError("a hybrid model needs --hybrid-layer-pattern (e.g. M*M-M*M-).")
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"--position-embedding-type {position_embedding_type!r} is unknown; use none, learned_absolute or rope."
            )
        if position_embedding_type == "rope" and config.position_embedding_type != "rope":
            raise ValueError("position_embedding_type='rope' needs config.position_embedding_type == 'rope'.")
        self.config = config
        self.pg = pg
        self.vocab_size = vocab_size
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        device = resolve_device(device)
        self.pattern = parse_hybrid_pattern(mamba_config.hybrid_layer_pattern)
        pp_size = getattr(pg, "pp_size", 1) if pg is not None else 1
        pp_rank = getattr(pg, "pp_rank", 0) if pg is not None else 0
        self.layer_types, layer_offset = select_pipeline_segment(self.pattern, pp_rank, pp_size, vp_stage)

        # Construction order = initialisation order (the default generator is consumed in it).
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type, pg=pg, device=device
            )
        else:
            self.embedding = None
        if position_embedding_type == "rope":
            self.rotary_pos_emb = rotary_embedding(config)
        else:
            self.rotary_pos_emb = None
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
        self.output_layer = build_output_layer(
            config, vocab_size, pg, pre_process, post_process, share_embeddings_and_output_weights, device
        )
        self.input_tensor: torch.Tensor | None = None  # a later pipeline stage's input (set_input_tensor)
        if uses_sequence_parallel(pg):
            # As in the GPT model: replicated decoder parameters (norms) see one sequence
            # shard per TP rank, so their gradients are partial sums over TP.
            for param in self.decoder.parameters():
                if not getattr(param, "tensor_model_parallel", False):
                    param.sequence_parallel = True

    shared_embedding_or_output_weight = GPTModel.shared_embedding_or_output_weight
    set_input_tensor = GPTModel.set_input_tensor
    # input_ids [b, s] -> per-token loss [b, s] (fp32), logits [b, s, v] without labels, or a
    # stage's hidden states [s, b, h] before the last pipeline stage: the GPT model's path.
    forward = GPTModel.forward

    def _postprocess(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Loss head: final norm -> output layer -> per-token cross entropy (one graphable region, ``graph_head``)."""
        if self.decoder.final_norm is not None:
            hidden_states = self.decoder.final_norm(hidden_states)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, v]
        logits = scale_logits(logits, self.config)
        if labels is None:
            return logits.transpose(0, 1).contiguous()
        loss = vocab_parallel_cross_entropy(logits, labels.t(), pg=self.pg, fused=self.config.cross_entropy_loss_fusion)
        return loss.t().contiguous()  # [b, s]

    num_parameters = GPTModel.num_parameters


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


def build_hybrid_stage_chunks(config, mamba_config, vocab_size: int, pg, device=None) -> list[HybridModel]:
    """This pipeline rank's model chunks of the hybrid model (one per virtual stage).

    As ``gpt_model.build_gpt_stage_chunks``: parts other ranks hold are drawn and dropped
    in model order, so the weights do not depend on the layout, and a tied output layer
    on the last stage starts as a copy of the embedding.
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
        return select_pipeline_segment(pattern, stage % pp, pp, stage // pp if vpp > 1 else None)

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
            position_embedding_type=position, vp_stage=c if vpp > 1 else None, device=device,
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
