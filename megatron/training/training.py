"""The training loop: ``pretrain()`` from flags to a trained model.

The whole path of one run, in order: parse flags -> process groups -> tokenizer and
data -> model -> DDP (main_grad buffers) -> CUDA-graph manager -> optimizer and LR
schedule -> loop (``train_step`` per iteration, Megatron's log line, memory line,
metrics). The only host synchronisations in a step are the ones logging asks for
(fp16 loss scaling adds one for the overflow check). With CUDA graphs the step runs
on a stream of its own (``Trainer.on_stream``); the next step's first micro-batch is
fetched while the device runs the optimizer.
"""

import contextlib
import datetime
import gc
import math
import os
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
from megatron.training import checkpointing, dist_checkpointing
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
        )
        samples = t.global_batch_size if t.train_samples is not None else None  # schedule in samples
        self.scheduler = build_scheduler(self.optimizer, cfg.optimizer, t.train_iters, samples_per_iteration=samples)
        self.iteration = 0
        self.consumed_samples = 0
        self.skipped_iters = 0
        self.nan_iters = 0
        self.last_checkpointed_iteration: int | None = None
        if cfg.checkpoint.load:
            checkpointing.load_checkpoint(self)  # sets iteration/consumed_samples; copies in place
        self.metrics = logs.MetricsWriter(
            cfg.logging.metrics_file, cfg.logging.tensorboard_dir, enabled_on_this_rank=pg.is_last_rank
        )
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
        per_token_loss = self.cfg.training.calculate_per_token_loss
        loss_sum = tokens = None
        for mb in range(n):
            batch = self._next_batch(data_iterator)
            sync = contextlib.nullcontext() if mb == n - 1 else self.model.no_sync()
            with sync:
                per_token = self.model(batch["tokens"], batch["position_ids"], batch["labels"])
                loss, num_tokens = masked_mean_loss(per_token, batch["loss_mask"])
                if per_token_loss:  # token sums; train_step divides the gradients by the global count
                    loss = loss * num_tokens
                    tokens = num_tokens if tokens is None else tokens + num_tokens
                scaled = loss / n if n > 1 and not per_token_loss else loss  # x / 1 is x: one launch fewer
                if self.cfg.precision.fp16:
                    scaled = self.optimizer.scale_loss(scaled)
                scaled.backward()
            loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
        if per_token_loss:
            self._loss_tokens = tokens
            return loss_sum
        return loss_sum / n if n > 1 else loss_sum

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
        self.model.grad_buffer.data.mul_(factor)
        return loss_sum * factor

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
        with self.on_stream():
            self.model.zero_grad_buffer()
            loss = self.forward_backward(data_iterator)
            self.model.finish_grad_sync()
            if self.cfg.training.calculate_per_token_loss:
                loss = self._divide_by_global_tokens(loss)
            success, grad_norm, num_zeros = self.optimizer.step()
            self._prefetch(data_iterator)
            if success:
                self.scheduler.step(1)
            self.graphs.end_of_iteration()
            if self.pg.dp is not None:
                dist.all_reduce(loss, group=self.pg.dp)
                loss = loss / self.pg.dp_size
        return self._hand_over(loss), self._hand_over(grad_norm), bool(success)

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        cfg = self.cfg
        t, lg = cfg.training, cfg.logging
        # The DataLoader draws its base seed from torch's CPU generator; fork it so a run
        # resumed from a checkpoint (RNG restored) continues the same random stream.
        with torch.random.fork_rng(devices=[]):
            train_iter, valid_iter = build_data_iterators(cfg, self.tokenizer, self.pg, self.consumed_samples)
        self.model.train()
        history = []
        window_loss = torch.zeros((), device=self.device)
        window_nan = torch.zeros((), device=self.device, dtype=torch.int32)
        window_iters = window_skipped = 0
        last_time = start_time = self._sync_time()
        logs.print_rank_0(f"> training {self.num_params:,} parameters for {t.train_iters} iterations")
        if t.manual_gc:  # --manual-gc: collections only where the loop asks for them
            gc.collect()
            gc.disable()
        first_iteration = self.iteration + 1  # 1, or the one after a loaded checkpoint
        while self.iteration < t.train_iters:
            loss, grad_norm, success = self.train_step(train_iter)
            self.iteration += 1
            self.consumed_samples += t.global_batch_size
            if not success:
                self.skipped_iters += 1
                window_skipped += 1
            is_nan = torch.isnan(loss) | torch.isinf(loss)
            window_nan += is_nan.int()
            if success:  # Megatron averages the loss over the iterations that stepped
                window_loss += torch.where(is_nan, torch.zeros_like(loss), loss)
            window_iters += 1
            self._log_tensorboard_iteration(loss, grad_norm)
            if self.iteration == first_iteration and self.graphs.state == "captured":
                self._log_capture()
            if self.iteration == 1 or self.iteration % lg.log_interval == 0:  # Megatron's: after 1, then every N
                now = self._sync_time()
                elapsed_ms = (now - last_time) * 1000.0 / window_iters
                last_time = now
                stepped = max(window_iters - window_skipped, 1)
                record = self._log_iteration(
                    window_loss / stepped, grad_norm, window_nan, elapsed_ms, skipped_count=window_skipped
                )
                history.append(record)
                window_loss.zero_()
                window_nan.zero_()
                window_iters = window_skipped = 0
                last_time = self._sync_time()
            if self.iteration == first_iteration or (
                lg.log_memory_interval and self.iteration % lg.log_memory_interval == 0
            ):
                self._log_memory()
            if valid_iter is not None and self.iteration % t.eval_interval == 0:
                self.evaluate(valid_iter, f"iteration {self.iteration}")
            ck = cfg.checkpoint
            if ck.save and ck.save_interval and self.iteration % ck.save_interval == 0:
                checkpointing.save_checkpoint(self)
            if t.exit_interval and self.iteration % t.exit_interval == 0:
                break
            if t.manual_gc and t.manual_gc_interval and self.iteration % t.manual_gc_interval == 0:
                gc.collect()
            if t.exit_duration_in_mins and self._past_duration(start_time, t.exit_duration_in_mins):
                logs.print_rank_0(f"> exiting after {t.exit_duration_in_mins} minutes (--exit-duration-in-mins)")
                break
        if valid_iter is not None and self.iteration % t.eval_interval != 0:
            self.evaluate(valid_iter, "the end of training for val data")
        if cfg.checkpoint.save and self.iteration > 0 and self.last_checkpointed_iteration != self.iteration:
            checkpointing.save_checkpoint(self)  # Megatron also saves at the end of training
        dist_checkpointing.wait_for_pending_save()  # an --async-save in flight is on disk when train() returns
        if t.manual_gc:
            gc.enable()
        self.metrics.close()
        return history

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
            self.iteration, {"lm loss validation": loss, "lm loss validation ppl": ppl}, samples=self.consumed_samples,
            tensorboard=False,
        )  # fmt: skip
        tb = {"lm loss validation": loss}
        if self.cfg.logging.log_validation_ppl_to_tensorboard:
            tb["lm loss validation ppl"] = ppl
        self.metrics.write(self.iteration, tb, samples=self.consumed_samples, jsonl=False)
        return loss

    def _past_duration(self, start_time: float, minutes: int) -> bool:
        """True on every rank once any rank has trained ``minutes`` (one all-reduce)."""
        past = torch.tensor(float(time.perf_counter() - start_time > 60.0 * minutes), device=self.device)
        if self.pg.world_size > 1 and dist.is_initialized():
            dist.all_reduce(past, op=dist.ReduceOp.MAX)
        return bool(past.item())

    def _log_tensorboard_iteration(self, loss, grad_norm) -> None:
        """Megatron's per-iteration TensorBoard scalars (every --tensorboard-log-interval)."""
        lg = self.cfg.logging
        if lg.tensorboard_dir is None or self.iteration % lg.tensorboard_log_interval != 0:
            return
        record = {
            "learning-rate": self.scheduler.get_lr(self.iteration),
            "batch-size": self.cfg.training.global_batch_size,
            "lm loss": float(loss),
            "loss-scale": float(self.optimizer.get_loss_scale()),
        }
        if grad_norm is not None:
            record["grad-norm"] = float(grad_norm)
        self.metrics.write(self.iteration, record, samples=self.consumed_samples, jsonl=False)

    def _sync_time(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    # ------------------------------------------------------------------ logging
    def _log_iteration(self, loss, grad_norm, nan_count, elapsed_ms, *, skipped_count: int = 0) -> dict:
        cfg, t = self.cfg, self.cfg.training
        nan_now = int(nan_count.item())
        self.nan_iters += nan_now
        if nan_now and cfg.ddp.check_for_nan_in_loss_and_grad:
            raise RuntimeError(
                f"NaN or Inf lm loss at iteration {self.iteration} on rank {self.pg.rank}. "
                "Pass --no-check-for-nan-in-loss-and-grad to keep training through it."
            )
        loss_value = loss.item()
        grad_value = None if grad_norm is None else float(grad_norm)
        if grad_value is not None and not math.isfinite(grad_value) and cfg.ddp.check_for_nan_in_loss_and_grad:
            raise RuntimeError(
                f"grad norm is {grad_value} at iteration {self.iteration} on rank {self.pg.rank}. "
                "Pass --no-check-for-nan-in-loss-and-grad to keep training through it."
            )
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
        num_zeros = None
        if cfg.logging.log_num_zeros_in_grad:
            num_zeros = logs.count_zeros(getattr(p, "main_grad", p.grad) for p in self.model.parameters())
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
            skipped_iters=skipped_count,
            nan_iters=nan_now,
            num_zeros=num_zeros,
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
        if num_zeros is not None:
            record["num-zeros"] = num_zeros
        if cfg.logging.log_memory_to_tensorboard:
            record.update(self._memory_record())
        per_iteration = ("lm loss", "learning-rate", "grad-norm", "loss-scale", "batch-size")
        self.metrics.write(self.iteration, record, samples=self.consumed_samples, tensorboard=False)
        tb_extra = {k: v for k, v in record.items() if k not in per_iteration and k != "iteration-time"}
        if cfg.logging.log_timers_to_tensorboard:
            tb_extra["iteration-time"] = record["iteration-time"]
        self.metrics.write(self.iteration, tb_extra, samples=self.consumed_samples, jsonl=False)
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
        for line in logs.startup_lines(cfg):
            logs.print_rank_0(line)
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
        parallel_state.destroy(trainer.pg, failed=True)
        raise
    parallel_state.destroy(trainer.pg)
    return trainer
