"""The training loop: ``pretrain()`` from flags to a trained model.

The whole path of one run, in order: parse flags -> process groups -> tokenizer and
data -> model -> DDP (main_grad buffers) -> CUDA-graph manager -> optimizer and LR
schedule -> loop (``train_step`` per iteration, Megatron's log line, memory line,
metrics). The only host synchronisations in a step are the ones logging asks for
(fp16 loss scaling adds one for the overflow check). With CUDA graphs the step runs
on a stream of its own (``Trainer.on_stream``); the next step's first micro-batch is
fetched while the device runs the optimizer.

The NaN guard (on unless ``--no-check-for-nan-in-loss-and-grad``) keeps to that: a
non-finite loss or grad norm skips the update on the device and is counted there;
the host learns of it at the next log line or save (one read) and stops the run,
naming the iteration where it began. Saves refuse non-finite state, so the tracker
only ever points at finite weights. ``--save`` is locked for the run
(``checkpointing.SaveLock``); ``ExitConditions`` turns SIGTERM
(``--exit-signal-handler``) or ``--exit-duration-in-mins`` into save-and-exit-0.
"""

import atexit
import contextlib
import datetime
import math
import os
import signal
import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.optimizer.lr_scheduler import build_scheduler
from megatron.core.optimizer.optimizer import MixedPrecisionOptimizer
from megatron.core.transformer.cuda_graphs.manager import CudaGraphManager
from megatron.core.transformer.cuda_graphs.streams import side_stream
from megatron.training import checkpointing
from megatron.training import logging_utils as logs
from megatron.training.arguments import parse_args
from megatron.training.config import RunConfig
from megatron.training.data import build_data_iterators, setup_tokenizer


def _set_determinism(cfg: RunConfig, use_cuda: bool) -> None:
    if not cfg.training.deterministic_mode:
        return
    # cuBLAS reads this when its handle is created; setting it before the first matmul suffices.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    if use_cuda:
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False


class Trainer:
    """One training run. ``pretrain()`` builds it from flags and calls ``train()``.

    Args:
        cfg: The validated run configuration.
        pg: Process groups of this rank.
        model_provider: ``(cfg, vocab_size, pg, device) -> torch.nn.Module`` returning a
            model whose ``forward(tokens, position_ids, labels)`` gives per-token losses.
    """

    def __init__(self, cfg: RunConfig, pg: parallel_state.ProcessGroups, model_provider: Callable):
        self.start_time = time.monotonic()  # --exit-duration-in-mins counts from here, set-up included
        self.cfg = cfg
        self.pg = pg
        self.device = pg.device
        t = cfg.training
        torch.manual_seed(t.seed)
        if self.device.type == "cuda":
            torch.cuda.manual_seed_all(t.seed)
        self.tokenizer = setup_tokenizer(cfg, pg)
        model = model_provider(cfg, cfg.model.vocab_size, pg, self.device)
        self.model = DistributedDataParallel(model, config=cfg.ddp, pg=pg)
        self.graphs = CudaGraphManager(cfg.cuda_graph, on_wgrad_ready=self._wgrads_ready).apply(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = MixedPrecisionOptimizer(
            params,
            config=cfg.optimizer,
            precision=cfg.precision,
            preallocate_state=self.graphs.state != "off",
            grad_buffers=[self.model.grad_buffer.data],
            skip_non_finite=cfg.ddp.check_for_nan_in_loss_and_grad,
        )
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, t.train_iters)
        self.state = checkpointing.TrainState(include_cuda_rng=self.device.type == "cuda")
        self.last_checkpointed_iteration: int | None = None
        self.save_lock = self._lock_save_dir()
        try:
            if cfg.checkpoint.load:
                self.load_checkpoint()
            self.metrics = logs.MetricsWriter(
                cfg.logging.metrics_file, cfg.logging.tensorboard_dir, enabled_on_this_rank=pg.is_last_rank
            )
        except BaseException:
            self.close()
            raise
        self.num_params = sum(p.numel() for p in model.parameters())
        self._prefetched = None  # (iterator, batch) fetched at the end of the previous step
        # With graphs, training and evaluation run on a stream of their own: graphs cannot
        # be captured on the default stream, and when the eager parts share the capture
        # stream there is one set of per-stream cuBLAS workspaces (2 x 32 MiB on Hopper)
        # and one allocator cache. It is a driver-made stream, not one from torch's pool
        # (which would cost 70 MiB: see cuda_graphs/streams.py). Eager runs stay on the
        # default stream.
        use_stream = self.device.type == "cuda" and self.graphs.state != "off"
        self.stream = side_stream(self.device) if use_stream else None
        self.history: list[dict] = []
        self._consecutive_skips = 0  # fp16 overflows in a row
        self._save_attempted = self.last_checkpointed_iteration  # last iteration a save was tried at

    # ------------------------------------------------------------------ state
    def _lock_save_dir(self) -> checkpointing.SaveLock | None:
        """Rank 0 takes ``--save``'s lock; every rank raises if it could not."""
        if not self.cfg.checkpoint.save:
            return None
        lock, error = None, [None]
        if self.pg.rank == 0:
            try:
                lock = checkpointing.SaveLock(self.cfg.checkpoint.save).acquire()
                atexit.register(lock.release)  # an exception that escapes pretrain()
            except ValueError as e:
                error = [str(e)]
        if self.pg.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise ValueError(error[0])
        return lock

    def close(self) -> None:
        """Closes the metrics sinks and releases the ``--save`` lock. Safe to call twice."""
        metrics = getattr(self, "metrics", None)
        if metrics is not None:
            metrics.close()
        if self.save_lock is not None:
            self.save_lock.release()

    iteration = property(lambda self: self.state.iteration, lambda self, v: setattr(self.state, "iteration", v))
    consumed_samples = property(
        lambda self: self.state.consumed_samples, lambda self, v: setattr(self.state, "consumed_samples", v)
    )
    skipped_iters = property(
        lambda self: self.state.skipped_iters, lambda self, v: setattr(self.state, "skipped_iters", v)
    )
    nan_iters = property(lambda self: self.state.nan_iters, lambda self, v: setattr(self.state, "nan_iters", v))

    def checkpoint_state(self) -> dict[str, checkpointing.Stateful]:
        """What a checkpoint holds, by key (``checkpointing.save_checkpoint``'s mapping)."""
        return {
            checkpointing.MODEL: self.model,
            checkpointing.OPTIMIZER: self.optimizer,
            checkpointing.SCHEDULER: self.scheduler,
            checkpointing.TRAIN_STATE: self.state,
        }

    def save_checkpoint(self) -> str:
        """Saves the run at the current iteration into ``--save``."""
        path = checkpointing.save_checkpoint(self.checkpoint_state(), self.cfg, self.pg)
        self.last_checkpointed_iteration = self.iteration
        return path

    def load_checkpoint(self) -> int:
        """Loads ``--load``; returns the iteration training continues from."""
        loaded = checkpointing.load_checkpoint(self.checkpoint_state(), self.cfg, self.pg)
        if loaded is None:
            return 0
        if checkpointing.OPTIMIZER not in loaded.loaded:
            self.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        if checkpointing.SCHEDULER not in loaded.loaded:
            self.scheduler.num_steps = self.iteration  # the LR schedule stays at the loaded iteration
            self.scheduler.step(0)
        self.last_checkpointed_iteration = None if loaded.weights_only else self.iteration
        return self.iteration

    def _wgrads_ready(self, params, event, event_only=()) -> None:
        self.model.register_grads_ready(params, event)
        for p in event_only:
            self.model.add_grad_event(p, event)

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

    def forward_backward(self, data_iterator) -> torch.Tensor:
        """Runs every micro-batch of one global batch; returns their mean loss (device)."""
        n = self.cfg.num_microbatches
        loss_sum = None
        for mb in range(n):
            batch = self._next_batch(data_iterator)
            sync = contextlib.nullcontext() if mb == n - 1 else self.model.no_sync()
            with sync:
                per_token = self.model(batch["tokens"], batch["position_ids"], batch["labels"])
                loss, _ = masked_mean_loss(per_token, batch["loss_mask"])
                scaled = loss / n if n > 1 else loss  # x / 1 is x: one launch fewer
                if self.cfg.precision.fp16:
                    scaled = self.optimizer.scale_loss(scaled)
                scaled.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        return loss_sum / n if n > 1 else loss_sum

    @contextlib.contextmanager
    def on_stream(self):
        """Runs the block on the training stream, ordered after and before the caller's."""
        if self.stream is None:
            yield
            return
        caller = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(caller)
        with torch.cuda.stream(self.stream):
            yield
        caller.wait_stream(self.stream)

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
            self.model.zero_grad_buffer()
            loss = self.forward_backward(data_iterator)
            self.model.finish_grad_sync()
            # The mean loss before the step, so every rank's NaN guard sees the same value.
            if self.pg.dp is not None:
                dist.all_reduce(loss, group=self.pg.dp)
                loss = loss / self.pg.dp_size
            bad_loss = torch.logical_not(torch.isfinite(loss))
            success, grad_norm, num_zeros = self.optimizer.step(skip=bad_loss)
            self._prefetch(data_iterator)
            if success:
                self.scheduler.step(1)
            self.graphs.end_of_iteration()
            non_finite = self.optimizer.non_finite
            if non_finite is None:  # no guard: count what the log would show as nan
                non_finite = bad_loss if grad_norm is None else bad_loss | torch.logical_not(torch.isfinite(grad_norm))
        return self._hand_over(loss), self._hand_over(grad_norm), bool(success), self._hand_over(non_finite)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg = self.cfg
        t, lg = cfg.training, cfg.logging
        # Building the data touches no global RNG stream (data.py gives each DataLoader a
        # generator of its own); the fork keeps it so for anything dataset code may draw.
        with torch.random.fork_rng(devices=[]):
            train_iter, valid_iter = build_data_iterators(cfg, self.tokenizer, self.pg, self.consumed_samples)
        self.model.train()
        history = []
        self._window = _LossWindow(self.device)
        exits = ExitConditions(t, self.pg, start_time=self.start_time)
        last_time = self._sync_time()
        logs.print_rank_0(f"> training {self.num_params:,} parameters for {t.train_iters} iterations")
        first_iteration = self.iteration + 1  # 1, or the one after a loaded checkpoint
        with exits:
            while self.iteration < t.train_iters:
                loss, grad_norm, success, non_finite = self.train_step(train_iter)
                self.iteration += 1
                self.consumed_samples += t.global_batch_size
                if not success:
                    self.skipped_iters += 1
                    self._count_overflow()
                else:
                    self._consecutive_skips = 0
                self._window.add(loss, non_finite, self.iteration)
                if self.iteration == first_iteration and self.graphs.state == "captured":
                    self._log_capture()
                if self.iteration % lg.log_interval == 0 or self.iteration == t.train_iters:
                    now = self._sync_time()
                    elapsed_ms = (now - last_time) * 1000.0 / self._window.iterations
                    record = self._log_iteration(grad_norm, elapsed_ms)
                    history.append(record)
                    last_time = self._sync_time()
                if self.iteration == first_iteration or (
                    lg.log_memory_interval and self.iteration % lg.log_memory_interval == 0
                ):
                    self._log_memory()
                if valid_iter is not None and self.iteration % t.eval_interval == 0:
                    self.evaluate(valid_iter, f"iteration {self.iteration}")
                ck = cfg.checkpoint
                if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                    self._save_checked()
                if t.exit_interval and self.iteration % t.exit_interval == 0:
                    break
                reason = exits.reason()
                if reason is not None:
                    logs.print_rank_0(f"> exiting after iteration {self.iteration}: {reason}")
                    break
        self._check_nan_window()  # iterations since the last log line
        if valid_iter is not None and self.iteration % t.eval_interval != 0 and exits.reason() is None:
            self.evaluate(valid_iter, "the end of training for val data")
        if cfg.checkpoint.save and self.iteration > 0 and self._save_attempted != self.iteration:
            self._save_checked()  # Megatron also saves at the end of training
        self.close()
        return history

    def _count_overflow(self) -> None:
        """Warns when a static fp16 loss scale overflows step after step (nothing trains)."""
        self._consecutive_skips += 1
        p = self.cfg.precision
        if p.fp16 and p.loss_scale is not None and self._consecutive_skips == _STATIC_SCALE_WARN_AFTER:
            logs.print_rank_0(
                f"WARNING: the last {self._consecutive_skips} iterations all overflowed with the static loss "
                f"scale --loss-scale {p.loss_scale:g}, so no update was applied; lower --loss-scale or drop it "
                "for dynamic loss scaling."
            )

    def _check_nan_window(self) -> None:
        """Stops the run (NaN guard on) if an iteration since the last check was not finite.

        Reads the window's device flag: one host sync.
        """
        if not self.cfg.ddp.check_for_nan_in_loss_and_grad or not hasattr(self, "_window"):
            return
        count, first = self._window.read_nan()
        if count:
            raise self._nan_error(count, first)

    def _nan_error(self, count: int, first: int) -> RuntimeError:
        last = self.last_checkpointed_iteration
        saved = f"the last checkpoint is iteration {last}" if last is not None else "no checkpoint was saved"
        return RuntimeError(
            f"non-finite lm loss or grad norm at iteration {first} on rank {self.pg.rank} ({count} such "
            f"iteration(s) up to iteration {self.iteration}); their updates were skipped, so the weights are "
            f"those before iteration {first}, and {saved}. Lower --lr or check the data; pass "
            "--no-check-for-nan-in-loss-and-grad to keep training through it."
        )

    def _save_checked(self) -> None:
        """Saves unless the NaN guard has something to report; never saves non-finite weights."""
        self._check_nan_window()
        self._save_attempted = self.iteration
        try:
            self.save_checkpoint()
        except checkpointing.NonFiniteCheckpointError as e:
            if self.cfg.ddp.check_for_nan_in_loss_and_grad:
                raise
            logs.print_rank_0(f"WARNING: {e}; training goes on (--no-check-for-nan-in-loss-and-grad).")

    def evaluate(self, data_iterator, where: str) -> float:
        """Mean lm loss over --eval-iters global batches of validation data (no grad).

        Graphed regions run eagerly here (the manager routes eval and no-grad calls
        around the graphs), so evaluation never disturbs the replay order.
        """
        t = self.cfg.training
        steps = t.eval_iters * self.cfg.num_microbatches
        self.model.eval()
        with self.on_stream(), torch.no_grad():
            total = torch.zeros((), device=self.device)
            for _ in range(steps):
                batch = self._next_batch(data_iterator)
                per_token = self.model(batch["tokens"], batch["position_ids"], batch["labels"])
                total += masked_mean_loss(per_token, batch["loss_mask"])[0]
            if self.pg.dp is not None:
                dist.all_reduce(total, group=self.pg.dp)
            loss = total.item() / steps / self.pg.dp_size
        self.model.train()
        ppl = math.exp(min(20.0, loss))
        line = f" validation loss at {where} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        logs.print_last_rank("-" * len(line) + "\n" + line + "\n" + "-" * len(line))
        self.metrics.write(
            self.iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl}, samples=self.consumed_samples
        )
        return loss

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, grad_norm, elapsed_ms) -> dict:
        """Prints the iteration line for the window since the last one and records it.

        The loss is the mean over the window's finite iterations (nan when none was);
        with the NaN guard on, a window with a non-finite iteration ends the run after
        its line is printed.
        """
        cfg, t = self.cfg, self.cfg.training
        loss_value, nan_now, first_nan = self._window.read_and_reset()
        self.nan_iters += nan_now
        grad_value = None if grad_norm is None else float(grad_norm)
        lr = self.scheduler.get_lr(self.iteration)
        throughput = None
        if cfg.logging.log_throughput:
            flops = logs.num_floating_point_operations(
                cfg.model,
                batch_size=t.global_batch_size,
                seq_length=cfg.model.seq_length,
                vocab_size=cfg.model.vocab_size,
            )
            throughput = flops / (elapsed_ms / 1000.0) / 1e12 / self.pg.world_size
        loss_scale = float(self.optimizer.get_loss_scale())
        params_norm = None
        if cfg.logging.log_params_norm:
            norms = torch._foreach_norm([p.detach() for p in self.optimizer.main_params], 2)
            params_norm = torch.linalg.vector_norm(torch.stack(list(norms)), 2).item()
        line = logs.format_iteration_line(
            iteration=self.iteration,
            train_iters=t.train_iters,
            consumed_samples=self.consumed_samples,
            elapsed_ms=elapsed_ms,
            lr=lr,
            global_batch_size=t.global_batch_size,
            losses={"lm loss": loss_value},
            loss_scale=loss_scale,
            grad_norm=grad_value,
            skipped_iters=self.skipped_iters,
            nan_iters=self.nan_iters,
            throughput_tflops=throughput,
            params_norm=params_norm,
            timestamp=datetime.datetime.now(),
        )
        logs.print_last_rank(line)
        record = {
            "lm loss": loss_value,
            "learning-rate": lr,
            "grad-norm": grad_value,
            "loss-scale": loss_scale,
            "iteration-time": elapsed_ms / 1000.0,
            "batch-size": t.global_batch_size,
        }
        if throughput is not None:
            record["throughput"] = throughput
        if params_norm is not None:
            record["params-norm"] = params_norm
        if cfg.logging.log_memory_to_tensorboard:
            record.update(self._memory_record())
        self.metrics.write(self.iteration, record, samples=self.consumed_samples)
        if nan_now and cfg.ddp.check_for_nan_in_loss_and_grad:
            raise self._nan_error(nan_now, first_nan)
        return dict(record, iteration=self.iteration)

    def _memory_record(self) -> dict[str, float]:
        record = logs.memory_metrics(logs.memory_stats_mb(self.device))
        if self.graphs.state == "captured":
            s = self.graphs.stats()
            record["graph-pool-reserved-bytes"] = s["pool_reserved_bytes"]
            record["graph-pool-live-bytes"] = s["pool_live_bytes"]
        return record

    def _log_memory(self) -> None:
        if self.device.type != "cuda" or self.pg.dp_rank != 0:
            return
        mem = logs.memory_stats_mb(self.device)
        extra = {}
        if self.graphs.state == "captured":
            s = self.graphs.stats()
            extra = {
                "graph pool reserved": s["pool_reserved_bytes"] / 2**20,
                "graph pool live": s["pool_live_bytes"] / 2**20,
                "graph buffers held": s["strong_bytes"] / 2**20,
            }
        print(
            logs.format_memory_line(
                self.pg.rank,
                f"(after {self.iteration} iterations)",
                mem["allocated_mb"],
                mem["max_allocated_mb"],
                mem["reserved_mb"],
                mem["max_reserved_mb"],
                extra=extra,
            ),
            flush=True,
        )

    def _log_capture(self) -> None:
        if self.pg.dp_rank != 0:
            return
        print(f"> {self.graphs.pool.summary_line()}", flush=True)


_STATIC_SCALE_WARN_AFTER = 10
"""Consecutive fp16 overflows with a static --loss-scale before the run warns."""


class _LossWindow:
    """Device-side sums of the iterations since the last log line (no host sync to add).

    Holds the sum and count of finite losses and the count of non-finite iterations of
    the window, and the first non-finite iteration since the run started; one host read
    fetches them.
    """

    def __init__(self, device: torch.device):
        # float64: counts and iteration numbers stay exact.
        self._acc = torch.zeros(3, dtype=torch.float64, device=device)  # [finite sum, finite count, nan count]
        self._first_nan = torch.full((), math.inf, dtype=torch.float64, device=device)
        self.iterations = 0

    def add(self, loss: torch.Tensor, non_finite: torch.Tensor, iteration: int) -> None:
        finite = torch.isfinite(loss)
        bad = non_finite.to(torch.float64)
        self._acc += torch.stack([torch.where(finite, loss, 0.0).double(), finite.double(), bad])
        # Scalars reach the kernels as arguments: no host-to-device copy, no sync.
        candidate = torch.minimum(self._first_nan, torch.full_like(self._first_nan, float(iteration)))
        torch.where(bad > 0, candidate, self._first_nan, out=self._first_nan)
        self.iterations += 1

    def _read(self) -> tuple[float, int, int, int]:
        loss_sum, finite, nan, first = torch.cat([self._acc, self._first_nan.reshape(1)]).tolist()
        return loss_sum, int(finite), int(nan), int(first) if math.isfinite(first) else 0

    def read_nan(self) -> tuple[int, int]:
        """(non-finite iterations of this window, first non-finite iteration or 0)."""
        _, _, nan, first = self._read()
        return nan, first

    def read_and_reset(self) -> tuple[float, int, int]:
        """(mean finite loss, nan if none; non-finite iterations; first non-finite iteration or 0)."""
        loss_sum, finite, nan, first = self._read()
        self._acc.zero_()
        self.iterations = 0
        return (loss_sum / finite if finite else float("nan")), nan, first


class ExitConditions:
    """``--exit-signal-handler`` and ``--exit-duration-in-mins``: when the loop should stop.

    Inside the context, SIGTERM (Megatron's default ``--exit-signal``) only sets a flag;
    the loop asks ``reason()`` after each iteration, saves and returns, so the process
    exits 0. With several ranks the decision is taken together (one all-reduce per
    iteration, only when one of the flags is set), so every rank stops at the same
    iteration.
    """

    def __init__(self, training_config, pg: parallel_state.ProcessGroups, *, start_time: float):
        self.handle_signal = training_config.exit_signal_handler
        self.duration_s = (
            None if training_config.exit_duration_in_mins is None else training_config.exit_duration_in_mins * 60.0
        )
        self.pg = pg
        self._start = start_time  # time.monotonic() when the run began
        self._received = False
        self._previous = None
        self._decided: str | None = None

    def __enter__(self) -> "ExitConditions":
        if self.handle_signal:
            self._previous = signal.signal(signal.SIGTERM, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.handle_signal and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def _on_signal(self, signum, frame) -> None:
        self._received = True

    def reason(self) -> str | None:
        """Why the run should stop now (None: go on); the same answer on every rank."""
        if self._decided is not None or (not self.handle_signal and self.duration_s is None):
            return self._decided
        signalled = self._received
        timed_out = self.duration_s is not None and time.monotonic() - self._start > self.duration_s
        if self.pg.world_size > 1 and dist.is_available() and dist.is_initialized():
            flags = torch.tensor([int(signalled), int(timed_out)], dtype=torch.int32, device=self.pg.device)
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
            signalled, timed_out = (bool(v) for v in flags.tolist())
        if signalled:
            self._decided = "SIGTERM received (--exit-signal-handler)"
        elif timed_out:
            self._decided = f"--exit-duration-in-mins {self.duration_s / 60.0:g} reached"
        return self._decided


def default_model_provider(cfg: RunConfig, vocab_size: int, pg, device) -> torch.nn.Module:
    from megatron.core.models.gpt.gpt_model import build_gpt_model

    return build_gpt_model(cfg.model, vocab_size, pg=pg, device=device)


def build_trainer(argv: Sequence[str] | None = None, model_provider: Callable = default_model_provider) -> Trainer:
    """Parses flags and builds a ``Trainer`` without training (tests, tools).

    The caller owns the process groups: ``parallel_state.destroy(trainer.pg)`` at the end.
    """
    cfg = parse_args(argv)
    use_cuda = torch.cuda.is_available() and not cfg.training.use_cpu
    # Process groups first: the world size is needed to validate the batch sizes.
    pg = parallel_state.initialize(cfg.parallel, use_cuda=use_cuda)
    try:
        cfg.validate()
        _set_determinism(cfg, use_cuda)
        if use_cuda and cfg.cuda_graph.enabled and cfg.cuda_graph.cuda_graph_expandable_segments:
            from megatron.core.transformer.cuda_graphs.mempool import use_expandable_segments

            use_expandable_segments()
        return Trainer(cfg, pg, model_provider)
    except BaseException:
        parallel_state.destroy(pg, failed=True)
        raise


def pretrain(argv: Sequence[str] | None = None, model_provider: Callable = default_model_provider) -> Trainer:
    """Parses flags, builds everything and trains. Returns the finished ``Trainer``."""
    trainer = build_trainer(argv, model_provider)
    try:
        trainer.history = trainer.train()
    except BaseException:
        trainer.close()
        parallel_state.destroy(trainer.pg, failed=True)
        raise
    parallel_state.destroy(trainer.pg)
    return trainer
