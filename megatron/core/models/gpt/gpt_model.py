"""The GPT model: embeddings -> TransformerBlock -> output layer (-> per-token loss).

Parameter names follow Megatron's local implementation (``embedding.word_embeddings``,
``decoder.layers.N.self_attention.linear_qkv``, ``output_layer`` ...). Activations
are ``[s, b, h]`` inside; the public interface is ``[b, s]``. Unusual here: the
embedding looks up the *transposed* ids so its output is already a contiguous
``[s, b, h]`` (no transpose copy), and without ``position_ids`` the learned position
table is sliced and broadcast instead of gathered. Loss masking is left to the caller
(``megatron.core.models.gpt.loss.masked_mean_loss``).

Tensor parallelism: the word embeddings and the output layer split the vocabulary;
the logits stay split and go straight into the vocab-parallel cross entropy. With
``--sequence-parallel`` the embedding output is cut along the sequence (a
reduce-scatter when there is no position table, else a scatter after adding it), the
layers run on ``s / TP`` rows outside their TP regions, and the output layer gathers
the sequence back. Parameters that then see only a sequence shard (norms, row-parallel
biases) are marked ``sequence_parallel`` so DDP sums their gradients over TP.
"""

import torch
import torch.nn.functional as F

from megatron.core.models.common.rotary import rotary_embedding
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
    resolve_device,
    tp_group,
    uses_sequence_parallel,
)
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.random import fork_if
from megatron.core.transformer.cuda_graphs.feed import feed
from megatron.core.transformer.cuda_graphs.regions import HeadRegion
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_block import TransformerBlock


def scale_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """muP's output multiplier (``--mup-output-mult``, 1 / m by default) applied to the logits."""
    if getattr(config, "use_mup", False) and config.mup_output_mult != 1.0:
        return logits * config.mup_output_mult
    return logits


class LanguageModelEmbedding(torch.nn.Module):
    """Word embeddings (+ learned absolute positions) + dropout, producing ``[s, b, h]``.

    Args:
        config: Finalized ``TransformerConfig``.
        vocab_size: Padded vocabulary size.
        max_sequence_length: Rows of the learned position table.
        position_embedding_type: ``learned_absolute``, ``rope`` or ``none`` (no table for the latter two).
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self, config, vocab_size: int, max_sequence_length: int, position_embedding_type: str, pg=None, device=None
    ):
        super().__init__()
        std = getattr(config, "embedding_init_method_std", None)
        init = init_method_normal(config.init_method_std if std is None else std)  # muP too: the base std
        self.embedding_mult = config.mup_embedding_mult if getattr(config, "use_mup", False) else 1.0
        self.embedding_dropout = config.hidden_dropout
        self.sequence_parallel = uses_sequence_parallel(pg)
        self.tp_group = tp_group(pg)
        # With a position table the word embeddings are summed over TP first (the table is
        # added to whole sequences), then cut; without one the sum is the cut (reduce-scatter).
        self.word_embeddings = VocabParallelEmbedding(
            vocab_size,
            config.hidden_size,
            config=config,
            init_method=init,
            pg=pg,
            reduce_scatter_embeddings=self.sequence_parallel and position_embedding_type != "learned_absolute",
            device=device,
        )
        if position_embedding_type == "learned_absolute":
            self.position_embeddings = torch.nn.Embedding(
                max_sequence_length, config.hidden_size, device=resolve_device(device), dtype=config.params_dtype
            )
            init(self.position_embeddings.weight)
        else:
            self.position_embeddings = None

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``input_ids [b, s]`` (and ``position_ids [b, s]``) -> ``[s, b, h]`` contiguous
        (``[s / TP, b, h]``, this rank's rows, with sequence parallelism)."""
        with feed(self):  # graphed: in the backward graphs' pool, idle at this time (cuda_graphs/feed.py)
            return self._embed(input_ids, position_ids)

    def _embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        embeddings = self.word_embeddings(input_ids.t())  # [s, b, h]: gather in the transposed order
        if self.position_embeddings is not None:
            if position_ids is None:
                seq_len = input_ids.shape[1]
                if seq_len > self.position_embeddings.num_embeddings:
                    raise ValueError(
                        f"sequence length {seq_len} exceeds --max-position-embeddings "
                        f"({self.position_embeddings.num_embeddings}); raise --max-position-embeddings."
                    )
                # Positions 0..s-1 for every sample: slice the table and broadcast over b.
                embeddings = embeddings + self.position_embeddings.weight[:seq_len].unsqueeze(1)
            else:
                embeddings = embeddings + self.position_embeddings(position_ids.t())
            if self.sequence_parallel:
                embeddings = scatter_to_sequence_parallel_region(embeddings, self.tp_group)
        if self.embedding_mult != 1.0:
            embeddings = embeddings * self.embedding_mult
        if self.training and self.embedding_dropout > 0.0:
            with fork_if(self.sequence_parallel):  # each rank drops on its own rows
                embeddings = F.dropout(embeddings, p=self.embedding_dropout, training=True)
        return embeddings


def build_output_layer(
    config, vocab_size: int, pg, pre_process: bool, post_process: bool, share_embeddings: bool, device
) -> ColumnParallelLinear | None:
    """The output layer of a language model's last stage (None on other stages).

    Tied on the first stage it borrows the embedding weight at forward time; tied on a
    later pipeline stage it owns a copy, marked for the pipeline code to sync.
    """
    if not post_process:
        return None
    layer = ColumnParallelLinear(
        config.hidden_size,
        vocab_size,
        config=config,
        init_method=init_method_normal(config.init_method_std),
        bias=False,
        gather_output=False,
        pg=pg,
        skip_weight_param_allocation=share_embeddings and pre_process,
        device=device,
    )
    if share_embeddings and not pre_process:
        layer.weight.shared_embedding = True
    return layer


def _tied_head_params(model: "LanguageModel") -> list[torch.nn.Parameter]:
    # The tied embedding weight gets gradient from the head and from the eager embedding
    # lookup; autograd must sum both in the parameter's dtype, as in eager.
    shared = model.shared_embedding_or_output_weight() if model.pre_process else None
    return [shared] if shared is not None else []


class LanguageModel(torch.nn.Module):
    """What the GPT and hybrid models share: the embedding (first pipeline stage) before a
    decoder stack, the output layer and loss head (last stage) after it, and the pipeline
    stage's input. A subclass builds ``self.decoder`` between :meth:`_build_embedding` and
    :meth:`_build_output_layer` (construction order is initialisation order).

    Graph head: ``_postprocess`` (final norm, output layer, cross entropy) on the stage
    that has it.
    """

    graph_head = HeadRegion("_postprocess", shared_params=_tied_head_params, present=lambda model: model.post_process)

    def _build_embedding(
        self,
        config,
        vocab_size: int,
        max_sequence_length: int,
        pg,
        *,
        pre_process: bool,
        post_process: bool,
        share_embeddings_and_output_weights: bool,
        position_embedding_type: str,
        device,
    ) -> torch.device:
        """Checks the position embedding, keeps the arguments, builds the embedding (first stage) and
        the rotary table (RoPE); returns the device the parameters go on."""
        if position_embedding_type not in ("learned_absolute", "rope", "none"):
            raise ValueError(
                f"--position-embedding-type {position_embedding_type!r} is unknown; use learned_absolute, rope or none."
            )
        if position_embedding_type == "rope" and config.position_embedding_type != "rope":
            # The layers read the config to decide whether rotary embeddings are required.
            raise ValueError("position_embedding_type='rope' needs config.position_embedding_type == 'rope'.")
        self.config = config
        self.pg = pg
        self.vocab_size = vocab_size
        self.max_sequence_length = max_sequence_length
        self.pre_process = pre_process
        self.post_process = post_process
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.input_tensor: torch.Tensor | None = None  # a later pipeline stage's input (set_input_tensor)
        device = resolve_device(device)
        self.embedding = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type, pg=pg, device=device
            )
        self.rotary_pos_emb = rotary_embedding(config) if position_embedding_type == "rope" else None
        return device

    def _build_output_layer(self, device: torch.device) -> None:
        """The output layer (last stage; a tied one elsewhere too, see :func:`build_output_layer`), after
        the decoder; with sequence parallelism, marks the decoder's replicated parameters."""
        self.output_layer = build_output_layer(
            self.config,
            self.vocab_size,
            self.pg,
            self.pre_process,
            self.post_process,
            self.share_embeddings_and_output_weights,
            device,
        )
        if uses_sequence_parallel(self.pg):
            # Replicated decoder parameters (norms, row-parallel biases, routers) see one
            # sequence shard per TP rank: their gradients are partial sums over TP.
            for param in self.decoder.parameters():
                if not getattr(param, "tensor_model_parallel", False):
                    param.sequence_parallel = True

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The weight shared by the embedding and the output layer on this stage, if any."""
        if not self.share_embeddings_and_output_weights:
            return None
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        return self.output_layer.weight if self.post_process else None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        """The activation a later pipeline stage starts from (``[s, b, h]``, received from
        the previous stage); the schedule sets it before each forward (Megatron's name)."""
        self.input_tensor = input_tensor

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Runs the model (or this pipeline stage of it).

        Args:
            input_ids: ``[b, s]`` token ids (after the first stage only their length is read).
            position_ids: ``[b, s]`` positions for the learned table (default ``0..s-1``);
                ignored by RoPE, which always uses ``0..s-1``.
            labels: ``[b, s]`` next-token targets, or None.
            attention_mask: bool ``[b, 1, s, s]``, True where query i may attend key j
                (``--reset-attention-mask``'s document mask), or None: causal.

        Returns:
            ``logits [b, s, vocab]`` when ``labels`` is None, else the unreduced fp32
            per-token loss ``[b, s]`` (mask it with ``masked_mean_loss``); on a stage
            before the last, its hidden states ``[s, b, h]`` for the next stage.
        """
        seq_len = input_ids.shape[1]
        if self.pre_process:
            hidden_states = self.embedding(input_ids, position_ids)  # [s, b, h]
        else:
            assert self.input_tensor is not None, "a later pipeline stage runs on the schedule's set_input_tensor"
            hidden_states = self.input_tensor
        rotary_pos_emb = None
        if self.rotary_pos_emb is not None:
            rotary_pos_emb = self.rotary_pos_emb(seq_len, hidden_states.device)  # cached: same tensor every step
        hidden_states = self.decoder(
            hidden_states, rotary_pos_emb=rotary_pos_emb, final_norm=False, attention_mask=attention_mask
        )
        if not self.post_process:
            return hidden_states
        return self._postprocess(hidden_states, labels)

    def _postprocess(self, hidden_states: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Loss head: final norm -> output layer -> per-token cross entropy.

        ``hidden_states [s, b, h]`` from the last layer; returns the fp32 loss ``[b, s]``,
        or ``logits [b, s, v]`` when ``labels`` is None. One graphable region (``graph_head``).
        """
        if self.decoder.final_norm_layer is not None:
            hidden_states = self.decoder.final_norm_layer(hidden_states)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden_states, weight=weight)  # [s, b, v]
        logits = scale_logits(logits, self.config)
        if labels is None:
            logits = gather_from_tensor_model_parallel_region(logits, tp_group(self.pg))
            return logits.transpose(0, 1).contiguous()  # [b, s, v]
        # The logits are ours alone: the fused kernel may write their gradient over them.
        loss = vocab_parallel_cross_entropy(
            logits, labels.t(), pg=self.pg, fused=self.config.cross_entropy_loss_fusion
        )  # [s, b] fp32
        return loss.t().contiguous()  # [b, s]; the caller masks and reduces it

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of unique parameters (a tied weight counts once).

        Args:
            exclude_embeddings: Leave out the word and position tables and an untied output weight.
        """
        excluded = set()
        if exclude_embeddings:
            if self.embedding is not None:
                excluded.update(id(p) for p in self.embedding.parameters())
            if self.output_layer is not None and self.output_layer.weight is not None:
                excluded.add(id(self.output_layer.weight))
        return sum(p.numel() for p in self.parameters() if id(p) not in excluded)


class GPTModel(LanguageModel):
    """Decoder-only transformer language model.

    Args:
        config: Finalized ``TransformerConfig``.
        layer_spec: Spec of one transformer layer (e.g. ``get_gpt_layer_local_spec()``).
        vocab_size: Padded vocabulary size.
        max_sequence_length: Rows of the learned position table.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        pre_process: Holds the embeddings (first pipeline stage).
        post_process: Holds the final norm and output layer (last pipeline stage).
        share_embeddings_and_output_weights: Output layer reuses the word-embedding weight.
        position_embedding_type: ``learned_absolute``, ``rope`` or ``none``.
        device: Device for the parameters (default: torch's default device).
    """

    def __init__(
        self,
        config,
        layer_spec,
        vocab_size: int,
        max_sequence_length: int,
        pg=None,
        *,
        pre_process: bool = True,
        post_process: bool = True,
        share_embeddings_and_output_weights: bool = True,
        position_embedding_type: str = "learned_absolute",
        device=None,
        num_layers: int | None = None,
        layer_offset: int = 0,
    ):
        super().__init__()
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
        self.decoder = TransformerBlock(
            config,
            layer_spec,
            pg,
            num_layers=num_layers,
            layer_offset=layer_offset,
            pre_process=pre_process,
            post_process=post_process,
            device=device,
        )
        self._build_output_layer(device)


def build_gpt_model(config, vocab_size: int, pg=None, device=None) -> GPTModel:
    """Builds the GPT model a (finalized) config describes, with the local layer specs
    (dense, or dense and MoE layers as ``config.moe`` says).

    Args:
        config: Finalized ``TransformerConfig``.
        vocab_size: Padded vocabulary size.
        pg: ``ProcessGroups`` (or ``None`` for a world of one).
        device: Device for the parameters (default: torch's default device).
    """
    if config.max_position_embeddings is None or config.kv_channels is None:
        config.finalize()
    return GPTModel(config, get_gpt_decoder_layer_specs(config), vocab_size, config.max_position_embeddings, pg,
                    **_gpt_options(config), device=device)  # fmt: skip


def _gpt_options(config) -> dict:
    return dict(
        share_embeddings_and_output_weights=not config.untie_embeddings_and_output_weights,
        position_embedding_type=config.position_embedding_type,
    )


def build_gpt_stage_chunks(config, vocab_size: int, pg, chunk_layers, device=None) -> list[GPTModel]:
    """This pipeline rank's model chunks (one per virtual stage) of the GPT model.

    Initialisation does not depend on the layout: the chunks are built in model order and
    every part another rank holds (embedding, layers, an untied output layer) is drawn and
    dropped in its place, so the default generator hands each part the numbers a single
    process would. A tied output layer on a last stage that lacks the embedding starts as
    a copy of the embedding weight (``parallel_state``'s ``embd`` group keeps it in step).

    Args:
        config: Finalized ``TransformerConfig``.
        vocab_size: Padded vocabulary size.
        pg: ``ProcessGroups`` of this rank (``pp_rank``, ``pp_size``).
        chunk_layers: ``(layer offset, layer count)`` of each chunk (``layout.chunk_layers``).
        device: Device for the parameters.
    """
    if config.max_position_embeddings is None or config.kv_channels is None:
        config.finalize()
    specs = get_gpt_decoder_layer_specs(config)
    specs = list(specs) if isinstance(specs, list | tuple) else [specs] * config.num_layers
    options = _gpt_options(config)
    device = resolve_device(device)
    num_chunks, pp, rank = len(chunk_layers), pg.pp_size, pg.pp_rank
    last_stage = pp * num_chunks - 1
    chunks, next_layer, embedding_copy = [], 0, None
    for c, (offset, count) in enumerate(chunk_layers):
        stage = c * pp + rank
        if c == 0 and stage != 0:  # the embedding is rank 0's: draw it in its place
            skipped = LanguageModelEmbedding(
                config, vocab_size, config.max_position_embeddings, options["position_embedding_type"], pg=pg,
                device=device,
            )  # fmt: skip
            if stage + (num_chunks - 1) * pp == last_stage and options["share_embeddings_and_output_weights"]:
                embedding_copy = skipped.word_embeddings.weight.detach()
            del skipped
        for layer in range(next_layer, offset):  # other ranks' layers before this chunk
            build_module(specs[layer], config=config, layer_number=layer + 1, pg=pg, device=device)
        chunk = GPTModel(
            config, specs, vocab_size, config.max_position_embeddings, pg, pre_process=stage == 0,
            post_process=stage == last_stage, num_layers=count, layer_offset=offset, device=device, **options,
        )  # fmt: skip
        if embedding_copy is not None and chunk.post_process:
            with torch.no_grad():
                chunk.output_layer.weight.copy_(embedding_copy)
        chunks.append(chunk)
        next_layer = offset + count
    return chunks
