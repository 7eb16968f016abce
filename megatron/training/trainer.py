"""The ``Trainer``: one run's state and its loop, built from a resolved ``RunConfig``.

What it holds, in build order: process groups -> tokenizer and data -> model -> DDP
(main_grad buffers) -> CUDA-graph manager -> optimizer and LR schedule; then the loop
(``train_step`` per iteration, Megatron's log line, memory line, metrics). The only host
synchronisations in a step are the ones logging asks for (fp16 loss scaling adds one for
the overflow check). With CUDA graphs the step runs on a stream of its own
(``Trainer.on_stream``); the next step's first micro-batch is fetched while the device
runs the optimizer.

The NaN guard (on unless ``--no-check-for-nan-in-loss-and-grad``) keeps to that: a
non-finite loss or grad norm skips the update on the device and is counted there;
the host learns of it at the next log line or save (one read) and stops the run,
naming the iteration where it began. Saves refuse non-finite state, so the tracker
only ever points at finite weights. ``--save`` is locked for the run
(``save_lock.SaveLock``); ``exit_conditions.ExitConditions`` turns SIGTERM
(``--exit-signal-handler``) or ``--exit-duration-in-mins`` into save-and-exit-0.
The log line, TensorBoard scalars and memory line are ``training_log.py``'s; evaluation
is ``evaluation.py``'s, checkpoints ``run_checkpoints.py``'s.
"""

import contextlib
import functools
import gc
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core import rerun_state_machine as rerun
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.core.optimizer.distrib_optimizer import build_optimizer
from megatron.core.optimizer.lr_scheduler import build_scheduler
from megatron.core.pipeline_parallel import embedding_grads as pipeline_grads
from megatron.core.pipeline_parallel import layout, p2p_communication, schedules
from megatron.core.tensor_parallel.random import model_parallel_manual_seed
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs.streams import running_on, side_stream, warm_blas
from megatron.core.transformer.moe import moe_layer as moe_hooks
from megatron.training import (
    checkpoint_config,
    dist_checkpointing,
    distillation,
    full_iteration,
    tensor_dumps,
)
from megatron.training import logging_utils as logs
from megatron.training.batch_steps import StepBatches
from megatron.training.data import build_data_iterators, evaluations_until, setup_tokenizer
from megatron.training.evaluation import Evaluation
from megatron.training.exit_conditions import ExitConditions
from megatron.training.profiling import StepProfiler
from megatron.training.run_checkpoints import RunCheckpoints
from megatron.training.run_config import RunConfig
from megatron.training.save_retention import SaveRetention, non_persistent_dir
from megatron.training.step_checks import StepChecks
from megatron.training.train_state import TrainState
from megatron.training.training_log import IterationLogging, LossWindow


class Trainer(IterationLogging, StepBatches, StepChecks, Evaluation, RunCheckpoints):
    """One training run. ``pretrain()`` builds it from flags and calls ``train()``.

    Args:
        cfg: The resolved and validated run configuration; frozen once the tokenizer
            has set the vocabulary size.
        pg: Process groups of this rank.
        model_provider: ``(cfg, vocab_size, pg, device) -> torch.nn.Module``.
        forward_step: ``(batch, model) -> (loss, metrics)``: the micro-batch's mean loss
            and extra values to log (the model family's; see ``schedules.py``).
        teacher_cfg: With ``--export-kd-teacher-load``: the teacher's resolved config
            (``distillation.teacher_run_config``).
    """

    def __init__(
        self,
        cfg: RunConfig,
        pg: parallel_state.ProcessGroups,
        model_provider: Callable,
        forward_step: schedules.ForwardStep = gpt_forward_step,
        *,
        teacher_cfg: RunConfig | None = None,
    ):
        self.start_time = time.monotonic()  # --exit-duration-in-mins counts from here, set-up included
        self.cfg = cfg
        self.pg = pg
        self.device = pg.device
        self.forward_step = forward_step
        t = cfg.training
        self.schedule = self._schedule(cfg, pg, t.micro_batch_size)
        same = t.eval_micro_batch_size == t.micro_batch_size
        self.eval_schedule = self.schedule if same else self._schedule(cfg, pg, t.eval_micro_batch_size)
        # Before the model: --record-memory-history sees every allocation.
        self.profiler = StepProfiler(
            cfg.profiling, pg.rank, cfg.logging.tensorboard_dir, cuda=self.device.type == "cuda"
        )
        # The same seed on every rank (layers draw full weights and keep their shard);
        # the tracker's per-TP-rank streams serve dropout inside TP regions.
        model_parallel_manual_seed(t.seed, tp_rank=pg.tp_rank, device=self.device)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(t.seed)
        self.tokenizer = setup_tokenizer(cfg, pg)  # the padded vocabulary size: the last derived value
        cfg.freeze()  # from here on the config is read-only
        # Graphed runs train on a stream of their own (below), and the model, its gradient buffers
        # and the optimizer's state are made on it too: the allocator keeps segments per stream, so
        # this gives the run one set, as eager has, instead of two, each with a partly used tail.
        captures = self.device.type == "cuda" and cfg.cuda_graph.captures
        build_stream = side_stream(self.device) if captures else None
        with running_on(build_stream):
            model = model_provider(cfg, cfg.model.vocab_size, pg, self.device)
            if pg.dp_rank == 0:  # Megatron's line, from every model-parallel rank: the count is this rank's share
                count = sum(p.numel() for p in model.parameters())
                print(
                    f" > number of parameters on (tensor, pipeline) model parallel rank ({pg.tp_rank}, {pg.pp_rank}): "
                    f"{count}",
                    flush=True,
                )
            if t.data_parallel_random_init and pg.dp_rank > 0:  # DP rank 0 keeps the stream it drew the weights from
                model_parallel_manual_seed(t.seed + 10 * pg.dp_rank, tp_rank=pg.tp_rank, device=self.device)
                if self.device.type == "cuda":
                    torch.cuda.manual_seed_all(t.seed + 10 * pg.dp_rank)
            self.model = DistributedDataParallel(
                model, config=cfg.ddp, pg=pg, grad_reduce_in_fp32=cfg.precision.grad_reduce_in_fp32
            )
            self.tied_embedding = pipeline_grads.TiedEmbeddingGrads(model, pg)
            if cfg.distill.enabled:  # a frozen teacher beside the model; forward_step returns the distillation loss
                distiller = distillation.build(cfg, teacher_cfg, model_provider, model, pg, self.device)
                self.forward_step = distiller.wrap(forward_step)
            # Every stage when the model has experts: the MoE log values are reduced over the stages.
            self.has_moe = cfg.moe.enabled or bool(moe_hooks.moe_layers(model))
            # With PP > 1 the scopes are checked against every stage's layers (a stage may lack some).
            self.graphs = cuda_graphs.attach(
                model,
                cfg.cuda_graph,
                model_config=cfg.model,
                grad_sinks=[self.model],
                scope_group=pg.pp if pg.pp_size > 1 else None,
            )
            overlapped = self.model.config.overlap_grad_reduce and pg.dp_size > 1
            alone = pg.pp_size == 1 and pg.tp_size == 1 and not overlapped  # no collective inside a turn
            # Eager Mamba layers keep their scan's forward working memory in the turns' pool too
            # (cuda_graphs/scratch.py), so their forward no longer sets the eager cache's high-water mark.
            self.graphs.eager_turn_allowed = not self.has_moe and alone
            if self.graphs.active and self.graphs.eager_turn_allowed and cuda_graphs.eager_turn_enabled():
                self.model.fold_grads_on_arrival()  # the graphs' eager turn leaves no param.grad waiting
            self.full_graph = full_iteration.build(cfg.cuda_graph, self.device, logs.print_rank_0)
            if pg.pp_size > 1 and self.graphs.active:  # graph slots sized by what each chunk keeps
                self.schedule = functools.partial(self.schedule, slot_weights=self._slot_weights(model))
            self.optimizer = build_optimizer(
                self.model,
                pg=pg,
                config=cfg.optimizer,
                precision=cfg.precision,
                preallocate_state=self.graphs.active,
                skip_non_finite=cfg.ddp.check_for_nan_in_loss_and_grad,
            )
        self.batches = cfg.batch_schedule  # the global batch per step, from consumed samples
        samples = t.global_batch_size if t.train_samples is not None else None  # schedule in samples
        sample_steps = (t.global_batch_size, t.train_samples) if self.batches.varies else None
        self.scheduler = build_scheduler(
            self.optimizer, cfg.optimizer, t.train_iters, samples_per_iteration=samples, sample_steps=sample_steps
        )
        self.state = TrainState(include_cuda_rng=self.device.type == "cuda")
        self.rerun = rerun.RerunStateMachine(
            t.rerun_mode,
            check_nan=cfg.ddp.check_for_nan_in_loss_and_grad,
            check_spiky=t.check_for_spiky_loss,
            error_injection_rate=t.error_injection_rate,
            error_injection_type=t.error_injection_type,
            seed=t.seed,
            rank=pg.rank,
            device=self.device,
        )
        self._world = dist.group.WORLD if pg.world_size > 1 else None  # the re-run decisions span every rank
        self.last_checkpointed_iteration: int | None = None
        ck = cfg.checkpoint
        self.retention = SaveRetention(ck.save, ck.save_retain_interval, is_writer=pg.rank == 0)
        self.non_persistent_dir = non_persistent_dir(ck, ck.save) if ck.non_persistent_save_interval else None
        self.non_persistent_retention = SaveRetention(
            self.non_persistent_dir, None, is_writer=pg.rank == 0, latest_only=True
        )
        self.save_lock = self._lock_save_dir()
        try:
            if cfg.checkpoint.load:
                self.load_checkpoint()
            self.metrics = logs.MetricsWriter(
                cfg.logging.metrics_file,
                cfg.logging.tensorboard_dir,
                enabled_on_this_rank=pg.is_last_rank,
                wandb=logs.wandb_settings(cfg, checkpoint_config.config_to_dict(cfg)),
            )
        except BaseException:
            self.close()
            raise
        self._prefetched = None  # (iterator, batch) fetched at the end of the previous step
        self._reports: dict[str, torch.Tensor] = {}  # forward_step's reported losses of the last step
        # With graphs, training and evaluation run on a stream of their own: graphs cannot
        # be captured on the default stream, and when the eager parts share the capture
        # stream there is one set of per-stream cuBLAS workspaces and one allocator cache.
        # It is a driver-made stream, not one from torch's pool (see cuda_graphs/streams.py).
        # Eager runs stay on the default stream.
        use_stream = self.device.type == "cuda" and (self.graphs.active or self.full_graph is not None)
        self.stream = build_stream if use_stream else None
        if self.stream is not None:  # before any activation is made on it
            warm_blas(self.stream, cfg.model.params_dtype)
        self.history: list[dict] = []
        self._consecutive_skips = 0  # fp16 overflows in a row
        self._save_attempted = self.last_checkpointed_iteration  # last iteration a save was tried at
        self._init_step_batch()

    def _slot_weights(self, model: torch.nn.Module) -> list[int] | None:
        """Per model chunk of this pipeline rank: the analytic activation bytes of its graphed
        regions, by which the pipelined schedule sizes its CUDA-graph slots (``slots.py``).
        None for layers without an activation model (a model family's own): the schedule
        then weighs chunks by their layers."""
        from megatron.core.transformer.cuda_graphs.activations import Kernels
        from megatron.core.transformer.cuda_graphs.report import chunk_activation_bytes

        kernels = Kernels.probe(self.device, cross_entropy_fusion=self.cfg.model.cross_entropy_loss_fusion)
        try:
            return chunk_activation_bytes(self.graphs, schedules.model_chunks(model), self.cfg, kernels)
        except ValueError:  # "no activation model for layer class ..."
            return None

    @staticmethod
    def _schedule(cfg: RunConfig, pg: parallel_state.ProcessGroups, micro_batch_size: int) -> Callable:
        """The schedule of this layout; a pipelined one knows its exchange shape (at ``micro_batch_size``)
        and dtype."""
        chunks = layout.num_chunks(cfg.parallel)
        schedule = schedules.get_forward_backward_func(pg.pp_size, chunks)
        if pg.pp_size == 1:
            return schedule
        p2p_communication.warm_up_group(pg)
        shape = p2p_communication.tensor_shape(
            seq_length=cfg.model.seq_length,
            micro_batch_size=micro_batch_size,
            hidden_size=cfg.model.hidden_size,
            pg=pg,
        )
        return functools.partial(
            schedule,
            pg=pg,
            tensor_shape=shape,
            dtype=cfg.model.params_dtype,
            microbatch_group_size=cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage,
        )

    # ------------------------------------------------------------------ state
    def close(self) -> None:
        """Stops profiling, closes the metrics sinks and releases the ``--save`` lock. Safe to call twice."""
        profiler = getattr(self, "profiler", None)
        if profiler is not None:
            profiler.stop()
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        if self.save_lock is not None:
            self.save_lock.release()
        if getattr(self, "full_graph", None) is not None:
            self.full_graph.close()

    iteration = property(lambda self: self.state.iteration, lambda self, v: setattr(self.state, "iteration", v))
    consumed_samples = property(
        lambda self: self.state.consumed_samples, lambda self, v: setattr(self.state, "consumed_samples", v)
    )
    consumed_valid_samples = property(
        lambda self: self.state.consumed_valid_samples,
        lambda self, v: setattr(self.state, "consumed_valid_samples", v),
    )
    skipped_iters = property(
        lambda self: self.state.skipped_iters, lambda self, v: setattr(self.state, "skipped_iters", v)
    )
    nan_iters = property(lambda self: self.state.nan_iters, lambda self, v: setattr(self.state, "nan_iters", v))

    # ------------------------------------------------------------------ one step
    def _next_batch(self, data_iterator) -> dict[str, torch.Tensor]:
        """The next micro-batch, on this rank's device (the one prefetched, if any)."""
        if self._prefetched is not None and self._prefetched[0] is data_iterator:
            batch, self._prefetched = self._prefetched[1], None
            return batch
        batch = next(data_iterator)
        if self.device.type != "cuda":
            return batch
        # Pinned, the copy is asynchronous (data_samplers.py says why we pin here).
        return {k: (v if v.is_cuda else v.pin_memory()).to(self.device, non_blocking=True) for k, v in batch.items()}

    def _prefetch(self, data_iterator) -> None:
        """Fetches the next step's first micro-batch while the device runs the optimizer,
        so the host's data work is off the critical path (same order, same batches)."""
        try:
            self._prefetched = (data_iterator, self._next_batch(data_iterator))
        except StopIteration:
            self._prefetched = None  # the next fetch raises it again

    def forward_backward(self, data_iterator, next_batch: Callable | None = None) -> torch.Tensor:
        """Runs every micro-batch of one global batch through the schedule; returns their
        mean loss (on the device), or with --calculate-per-token-loss the token-summed
        loss (``train_step`` divides it and the gradients by the global token count)."""
        per_token_loss = self.cfg.training.calculate_per_token_loss
        fetch = next_batch or (lambda: self._next_batch(data_iterator))

        def step(next_batch):
            return self.schedule(
                forward_step=self.forward_step,
                next_batch=next_batch,
                model=self.model,
                num_microbatches=self.step_microbatches,
                scale_loss=self.optimizer.scale_loss if self.cfg.precision.fp16 else None,
                no_sync=self.model.no_sync,
                graphs=self.graphs,
                per_token_loss=per_token_loss,
            )

        if self.full_graph is None:
            loss, metrics = step(fetch)
        else:
            batches = [fetch() for _ in range(self.step_microbatches)]
            loss, metrics = self.full_graph.run(step, batches, then=self.model.accumulate_grads)
        if per_token_loss:
            self._loss_tokens = metrics[schedules.NUM_TOKENS]
        # Losses forward_step reports besides the objective (distillation's), logged under their names.
        self._reports = {k: v for k, v in metrics.items() if k != schedules.NUM_TOKENS}
        return loss

    def _divide_by_global_tokens(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """--calculate-per-token-loss: gradients and loss over every loss token of the global batch.

        DDP averaged the token-summed gradients over DP; times DP / global tokens makes
        them the per-token mean. Returns this rank's share of the mean loss, so the DP
        average of the returned values is sum(loss) / global tokens.
        """
        tokens = self._loss_tokens.to(torch.float32)
        if self.pg.dp is not None:
            dist.all_reduce(tokens, group=self.pg.dp)
        factor = self.pg.dp_size / tokens.clamp(min=1.0)
        self.model.scale_grads(factor)
        self._reports = {k: v * factor for k, v in self._reports.items()}
        return loss_sum * factor

    def on_stream(self) -> contextlib.AbstractContextManager:
        """Runs the block on the training stream, ordered after and before the caller's."""
        return running_on(self.stream)

    def _hand_over(self, t):
        """Marks a tensor made on the training stream as used by the caller's stream too."""
        if self.stream is not None and isinstance(t, torch.Tensor) and t.is_cuda:
            t.record_stream(torch.cuda.current_stream(self.device))
        return t

    def train_step(self, data_iterator):
        """One global batch: forward/backward, gradient reduction, optimizer step.

        Returns:
            ``(loss, grad_norm, success, non_finite)``: the data-parallel mean loss and
            the grad norm (device tensors), whether the step was applied as far as the
            host knows (False: an fp16 overflow), and a device flag that is 1 when the
            loss or the grad norm is not finite (the NaN guard skipped that update).
        """
        with self.on_stream():
            with self.profiler.range("forward-backward"):
                if self.rerun.active:
                    loss = self._validated_gradients(data_iterator)
                else:
                    loss, _ = self._gradients(data_iterator)
            bad_loss = torch.logical_not(torch.isfinite(loss))
            ck, n = self.cfg.checkpoint, self.iteration + 1
            if ck.save_wgrads_interval and n % ck.save_wgrads_interval == 0:  # reduced, before the step
                tensor_dumps.dump(self.model, self.pg, ck.save, tensor_dumps.WGRADS, n)
            with self.profiler.range("optimizer"):
                success, grad_norm, num_zeros = self.optimizer.step(skip=bad_loss)
            if ck.save_params_interval and n % ck.save_params_interval == 0:
                tensor_dumps.dump(self.model, self.pg, ck.save, tensor_dumps.PARAMS, n)
            if self.has_moe:  # expert-bias update from this step's token counts
                moe_hooks.moe_after_optimizer_step(self.model, self.pg.dp)
            self._prefetch(data_iterator)
            if success:  # Megatron's samples when the batch changes during training
                self.scheduler.step(self.step_batch if self.batches.varies else 1)
            self.graphs.end_of_iteration()
            non_finite = self.optimizer.non_finite
            if non_finite is None:  # no guard: count what the log would show as nan
                non_finite = bad_loss if grad_norm is None else bad_loss | torch.logical_not(torch.isfinite(grad_norm))
        self.rerun.first_iteration_complete = True
        return self._hand_over(loss), self._hand_over(grad_norm), bool(success), self._hand_over(non_finite)

    def _gradients(self, data_iterator, next_batch: Callable | None = None, keep_local: bool = False):
        """Forward/backward of one global batch and the gradient reduction.

        Returns:
            ``(loss, local)``: the data-parallel mean loss and, with ``keep_local``, this
            rank's loss before the data-parallel mean (else None).
        """
        self.model.zero_grad_buffer()
        if self.has_moe:  # d(objective)/d(aux loss), as the schedule scales the lm loss
            moe_hooks.set_aux_loss_scale(self.model, self.optimizer.get_loss_scale() / self.step_microbatches)
        loss = self.forward_backward(data_iterator, next_batch)
        self.model.finish_grad_sync()
        self.tied_embedding.allreduce(self.model)  # PP > 1: first and last stage sum their copies' grads
        if self.cfg.training.calculate_per_token_loss:
            loss = self._divide_by_global_tokens(loss)
        local = loss.detach().clone() if keep_local else None
        # The mean loss before the step, so every rank's NaN guard sees the same value.
        if self.pg.dp is not None and self._reports:  # the reported losses' means too, in the same reduction
            packed = torch.stack([loss.float(), *(v.float() for v in self._reports.values())])
            dist.all_reduce(packed, group=self.pg.dp)
            packed = packed / self.pg.dp_size
            loss, self._reports = packed[0], dict(zip(self._reports, packed[1:]))
        elif self.pg.dp is not None:
            dist.all_reduce(loss, group=self.pg.dp)
            loss = loss / self.pg.dp_size
        return loss, local

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg = self.cfg
        t, lg = cfg.training, cfg.logging
        if self.iteration > 0 and self.consumed_valid_samples == 0 and t.train_samples is None:
            # A checkpoint without the count (an older one): as Megatron, the validations up to its iteration.
            per_run = t.eval_iters * t.eval_global_batch_size
            self.consumed_valid_samples = evaluations_until(t, self.iteration) * per_run
        start_eval = t.start_eval_at_iter or 0
        phase_ends = set(t.phase_transitions())
        # Building the data touches no global RNG stream (data.py gives each DataLoader a
        # generator of its own); the fork keeps it so for anything dataset code may draw.
        with torch.random.fork_rng(devices=[]):
            train_iter, valid_iter, test_iter = build_data_iterators(
                cfg, self.tokenizer, self.pg, self.consumed_samples, self.consumed_valid_samples
            )
        self.model.train()
        if t.skip_train:
            logs.print_rank_0("skipping training (--skip-train is on) ...")
            self.evaluate_at_end(valid_iter, test_iter)
            self.close()
            return []
        history = []
        self._window = LossWindow(self.device)
        exits = ExitConditions(t, self.pg, start_time=self.start_time)
        last_time = self._sync_time()
        window_skipped = 0
        self._window_microbatches = 0  # micro-batches since the last log line (MoE metrics)
        logs.print_rank_0(f"> training for {t.train_iters} iterations")
        if t.manual_gc:  # --manual-gc: collections only where the loop asks for them
            gc.collect()
            gc.disable()
        first_iteration = self.iteration + 1  # 1, or the one after a loaded checkpoint
        stopped = None  # why the loop ended before --train-iters, if it did
        self.profiler.start()
        with exits:
            while self.iteration < t.train_iters:
                self._next_step_batch()
                if self.iteration + 1 in t.iterations_to_skip:  # Megatron's: its batch read and dropped
                    for _ in range(self.step_microbatches):
                        self._next_batch(train_iter)
                    self.iteration += 1
                    self.consumed_samples += self.step_batch
                    self.state.skipped_train_samples += self.step_batch
                    first_iteration = max(first_iteration, self.iteration + 1)
                    continue
                self.profiler.before_iteration(self.iteration)
                try:
                    loss, grad_norm, success, non_finite = self.train_step(train_iter)
                except rerun.RerunExit as e:
                    logs.print_rank_0(f"> result validation at iteration {self.iteration + 1}: {e}")
                    dist_checkpointing.wait_for_pending_save()
                    self.close()
                    raise
                self.iteration += 1
                self.profiler.after_iteration(self.iteration)
                self.consumed_samples += self.step_batch
                self._window_microbatches += self.step_microbatches
                if not success:
                    self.skipped_iters += 1
                    window_skipped += 1
                    self._count_overflow()
                else:
                    self._consecutive_skips = 0
                self._window.add(loss, non_finite, self.iteration, self._reports)
                self._log_tensorboard_iteration(loss, grad_norm, self._reports)
                if self.iteration == first_iteration and self.graphs.captured:
                    self._log_capture()
                if self.iteration == 1 or self.iteration % lg.log_interval == 0:  # Megatron's: after 1, then every N
                    self.profiler.dump_memory_snapshot()
                    now = self._sync_time()
                    elapsed_ms = (now - last_time) * 1000.0 / self._window.iterations
                    record = self._log_iteration(grad_norm, elapsed_ms, skipped_count=window_skipped)
                    history.append(record)
                    window_skipped = 0
                    last_time = self._sync_time()
                if self.iteration == first_iteration or (
                    lg.log_memory_interval and self.iteration % lg.log_memory_interval == 0
                ):
                    self._log_memory()
                if valid_iter is not None and self.iteration % t.eval_interval == 0 and self.iteration >= start_eval:
                    self.evaluate(valid_iter, f"iteration {self.iteration}")
                ck = cfg.checkpoint
                if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                    self._save_checked()
                elif self.non_persistent_dir and self.iteration % ck.non_persistent_save_interval == 0:
                    self._save_checked(non_persistent=True)
                if t.exit_interval and self.iteration % t.exit_interval == 0:
                    stopped = "--exit-interval"
                    break
                if self.iteration in phase_ends:  # Megatron saves and exits: the next phase is a new launch
                    stopped = "--phase-transition-iterations"
                    logs.print_rank_0(f"> exiting at iteration {self.iteration}: the end of a data phase")
                    break
                if t.manual_gc and t.manual_gc_interval and self.iteration % t.manual_gc_interval == 0:
                    gc.collect()
                stopped = exits.reason()
                if stopped is not None:
                    logs.print_rank_0(f"> exiting after iteration {self.iteration}: {stopped}")
                    break
        self._check_nan_window()  # iterations since the last log line
        if cfg.checkpoint.save and self.iteration > 0 and self._save_attempted != self.iteration:
            self._save_checked()  # Megatron also saves at the end of training
        if stopped is None:  # as Megatron, which exits the process when the loop stops early
            self.evaluate_at_end(valid_iter, test_iter)
        dist_checkpointing.wait_for_pending_save()  # an --async-save in flight is on disk when train() returns
        self.retention.retire()  # what an --async-save in flight superseded
        self.non_persistent_retention.retire()
        if t.manual_gc:
            gc.enable()
        self.close()
        return history

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()
