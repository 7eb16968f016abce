"""Pretrain a hybrid Mamba/attention model: ``torchrun --nproc-per-node N pretrain_hybrid.py <Megatron flags>``.

The layers come from ``--hybrid-layer-pattern`` (e.g. ``M*M-M*M-``: Mamba, attention,
Mamba, MLP, ...), which also sets the layer count. Without torchrun it runs as a world
of one; on a machine without CUDA it trains on the CPU.
"""

from collections.abc import Sequence

import torch

from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.core.models.hybrid.hybrid_model import build_hybrid_model, build_hybrid_stage_chunks, check_graph_scopes
from megatron.core.pipeline_parallel import layout
from megatron.training.training import pretrain


def model_provider(cfg, vocab_size, pg, device):
    """Builds the hybrid model (local layer specs) of this rank: with PP > 1 its stage, or
    its chunks (one per '|' segment of the pattern it holds)."""
    if cfg.mamba.hybrid_layer_pattern is None:
        raise ValueError(
            "pretrain_hybrid.py needs --hybrid-layer-pattern (e.g. M*M-M*M-); for GPT use pretrain_gpt.py."
        )
    if cfg.cuda_graph.enabled:  # before anything is built, as the session will resolve them
        check_graph_scopes(cfg.cuda_graph.cuda_graph_scope, cfg.mamba, cfg.model)
    if pg.pp_size == 1:
        return build_hybrid_model(cfg.model, cfg.mamba, vocab_size, pg=pg, device=device)
    rank_layers = None  # the '|' segments place the layers; without '|' they split over the ranks
    if cfg.mamba.parsed_pattern.num_segments == 1:  # evenly, or as --decoder-first/last-pipeline-num-layers say
        rank_layers = layout.rank_layer_counts(cfg.parallel, cfg.model.num_layers)
    chunks = build_hybrid_stage_chunks(cfg.model, cfg.mamba, vocab_size, pg, device=device, rank_layers=rank_layers)
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def forward_step(batch, model):
    """One micro-batch: ``(loss, metrics)``, the mean next-token loss over unmasked tokens and their count,
    which weighs micro-batches (``gpt_forward_step``; write your own here to change the loss)."""
    return gpt_forward_step(batch, model)


def providers(argv: Sequence[str]) -> dict:
    """``build_trainer``'s or ``pretrain``'s keyword arguments for a command line: this script's
    providers if it has ``--hybrid-layer-pattern``, else none (GPT's defaults)."""
    if "--hybrid-layer-pattern" not in argv:
        return {}
    return dict(model_provider=model_provider, forward_step=forward_step)


if __name__ == "__main__":
    pretrain(model_provider=model_provider, forward_step=forward_step)
