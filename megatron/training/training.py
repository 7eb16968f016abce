"""Megatron's entry points: ``pretrain()`` from flags to a trained model, ``build_trainer()``
(flags to a ``Trainer`` that has not trained, for tests and tools) and the GPT model provider.

Set-up order matters here: the determinism environment and the NCCL graph-registration
setting are fixed before any communicator or cuBLAS handle exists, then the process
groups, then the allocator's expandable segments (when graphs capture), then the
``Trainer`` (``trainer.py``), which holds the run and its loop.
"""

import os
from collections.abc import Callable, Sequence

import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.core.pipeline_parallel import layout, schedules
from megatron.training import determinism, distillation
from megatron.training import logging_utils as logs
from megatron.training.arguments import parse_args
from megatron.training.exit_conditions import orderly_shutdown
from megatron.training.run_config import RunConfig
from megatron.training.trainer import Trainer

__all__ = ["Trainer", "build_trainer", "default_model_provider", "pretrain"]


def default_model_provider(cfg: RunConfig, vocab_size: int, pg, device) -> torch.nn.Module:
    """The GPT model (``pretrain_gpt.py``'s provider)."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model, build_gpt_stage_chunks

    if cfg.mamba.hybrid_layer_pattern is not None:
        raise ValueError(
            "--hybrid-layer-pattern describes a hybrid Mamba model, which pretrain_gpt.py does not build; "
            "run pretrain_hybrid.py with the same flags."
        )
    if pg.pp_size == 1:
        return build_gpt_model(cfg.model, vocab_size, pg=pg, device=device)
    chunks = build_gpt_stage_chunks(
        cfg.model, vocab_size, pg, layout.chunk_layers(cfg.parallel, cfg.model.num_layers, pg.pp_rank), device
    )
    return chunks[0] if len(chunks) == 1 else torch.nn.ModuleList(chunks)


def _configure_nccl_for_graphs(cfg: RunConfig) -> None:
    """NCCL_GRAPH_REGISTER=0 when graphs capture collectives under expandable segments
    (``cuda_graphs/nccl_env.py``); logged once, by the process that will be rank 0."""
    from megatron.core.transformer.cuda_graphs.nccl_env import configure_nccl_for_graphs

    par = cfg.parallel
    line = configure_nccl_for_graphs(
        cfg.cuda_graph,
        tensor_parallel=par.tensor_model_parallel_size,
        expert_parallel=par.expert_model_parallel_size,
        expert_tensor_parallel=par.expert_tensor_parallel_size,
    )
    if line is not None and os.environ.get("RANK", "0") == "0":
        print(f"> {line}", flush=True)


def build_trainer(
    argv: Sequence[str] | None = None,
    model_provider: Callable = default_model_provider,
    forward_step: schedules.ForwardStep = gpt_forward_step,
) -> Trainer:
    """Parses flags and builds a ``Trainer`` without training (tests, tools).

    The caller ends it: ``trainer.graphs.close()``, then ``parallel_state.destroy(trainer.pg)``.
    """
    return _build(parse_args(argv), model_provider, forward_step)


def _build(given: RunConfig, model_provider: Callable, forward_step: schedules.ForwardStep) -> Trainer:
    cfg = given.resolve(parallel_state.world_size_from_env())
    cfg.validate()
    teacher_cfg = None
    if cfg.distill.enabled:  # the teacher: the student's flags with its own model config
        teacher_cfg = distillation.teacher_run_config(given, parallel_state.world_size_from_env())
        teacher_cfg.validate()
    use_cuda = torch.cuda.is_available() and not cfg.training.use_cpu
    if cfg.training.deterministic_mode:
        determinism.apply_determinism_env(os.environ)  # before any NCCL communicator or cuBLAS handle exists
    if use_cuda:
        _configure_nccl_for_graphs(cfg)  # before any NCCL communicator exists
    pg = parallel_state.initialize(cfg.parallel, use_cuda=use_cuda)
    try:
        for line in logs.startup_lines(cfg):
            logs.print_rank_0(line)
        determinism.set_determinism(cfg, use_cuda)
        if use_cuda and cfg.cuda_graph.captures and cfg.cuda_graph.cuda_graph_expandable_segments:
            from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments

            use_expandable_segments()
        return Trainer(cfg, pg, model_provider, forward_step, teacher_cfg=teacher_cfg)
    except BaseException:
        parallel_state.destroy(pg, failed=True)
        raise


def pretrain(
    argv: Sequence[str] | None = None,
    model_provider: Callable = default_model_provider,
    forward_step: schedules.ForwardStep = gpt_forward_step,
) -> Trainer:
    """Parses flags, builds everything and trains. Returns the finished ``Trainer``."""
    given = parse_args(argv)
    with orderly_shutdown(given.training.exit_signal_handler_for_training, logs.print_rank_0):
        trainer = _build(given, model_provider, forward_step)
        try:
            trainer.history = trainer.train()
        except BaseException:
            trainer.close()
            trainer.graphs.close()
            parallel_state.destroy(trainer.pg, failed=True)
            raise
        trainer.graphs.close()  # first: a collective captured in a graph must not outlive its communicator
        parallel_state.destroy(trainer.pg)
    return trainer
