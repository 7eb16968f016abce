"""The trainer's iteration logging: Megatron's log line, TensorBoard scalars, memory line.

``IterationLogging`` is a mixin of ``trainer.Trainer``: its methods read the trainer's
``cfg``, ``pg``, ``device``, ``model``, ``optimizer``, ``scheduler``, ``graphs``,
``metrics``, counters (``iteration``, ``consumed_samples``, ``nan_iters``) and the loss
window ``_window``. ``LossWindow`` keeps the window's sums on the device, so adding an
iteration needs no host sync; the log line reads it once.
"""

import datetime
import math

import torch

from megatron.core.transformer.moe import moe_layer as moe_hooks
from megatron.training import logging_utils as logs


def graph_stats(trainer) -> dict | None:
    """The trainer's captured graphs' memory and count (partial or full-iteration), or None."""
    if trainer.graphs.captured:
        return trainer.graphs.stats()
    full = getattr(trainer, "full_graph", None)
    return full.stats() if full is not None and full.num_graphs else None


class IterationLogging:
    """The ``Trainer``'s log methods (see the module docstring for what they read)."""

    def _logged_lr(self) -> float:
        """The learning rate the schedule is at (its steps count samples when the global batch changes);
        behind the iteration after --iterations-to-skip or --override-ckpt-iteration, as Megatron logs it."""
        return self.scheduler.get_lr(self.scheduler.num_steps)

    def _log_tensorboard_iteration(self, loss, grad_norm, reports=None) -> None:
        """Megatron's per-iteration TensorBoard (and W&B) scalars (every --tensorboard-log-interval);
        ``reports``: the losses forward_step reported, written instead of the loss when given."""
        lg = self.cfg.logging
        if not self.metrics.has_scalar_sink or self.iteration % lg.tensorboard_log_interval != 0:
            return
        record = {
            "learning-rate": self._logged_lr(),
            "batch-size": self.step_batch,
            **({k: float(v) for k, v in reports.items()} if reports else {"lm loss": float(loss)}),
        }
        if lg.log_loss_scale_to_tensorboard:
            record["loss-scale"] = float(self.optimizer.get_loss_scale())
        if self.state.skipped_train_samples:  # --iterations-to-skip
            record["skipped-train-samples"] = self.state.skipped_train_samples
        if lg.log_world_size_to_tensorboard:
            record["world-size"] = self.pg.world_size
        if grad_norm is not None:
            record["grad-norm"] = float(grad_norm)
        self.metrics.write(self.iteration, record, samples=self.consumed_samples, jsonl=False)

    def _log_iteration(self, grad_norm, elapsed_ms, *, skipped_count: int = 0) -> dict:
        """Prints the iteration line for the window since the last one and records it.

        The loss is the mean over the window's finite iterations (nan when none was);
        with the NaN guard on, a window with a non-finite iteration ends the run after
        its line is printed.
        """
        cfg, t = self.cfg, self.cfg.training
        moe_losses, moe_per_layer = {}, {}
        if self.has_moe:  # Megatron's names (load_balancing_loss, z_loss, ...), mean per micro-batch
            micro_batches = self._window_microbatches
            if cfg.moe.moe_per_layer_logging:  # before collect_moe_metrics resets the sums
                per_layer = moe_hooks.per_layer_moe_metrics(
                    self.model,
                    cfg.model.num_layers,
                    micro_batches,
                    self.pg.dp,
                    pp_group=self.pg.pp,
                    names=cfg.moe.metric_names(),
                )
                moe_per_layer = {k: v.item() for k, v in per_layer.items()}
            metrics = moe_hooks.collect_moe_metrics(
                self.model, micro_batches, self.pg.dp, pp_group=self.pg.pp, names=cfg.moe.metric_names()
            )
            moe_losses = {k: v.item() for k, v in metrics.items()}
        loss_value, nan_now, first_nan = self._window.read_and_reset()
        losses = self._window.report_means or {"lm loss": loss_value}  # forward_step's reported losses, if any
        self._window_microbatches = 0
        self.nan_iters += nan_now
        grad_value = None if grad_norm is None else float(grad_norm)
        lr = self._logged_lr()
        throughput = None
        if cfg.logging.log_throughput:
            flops = logs.num_floating_point_operations(
                cfg.model,
                batch_size=self.step_batch,
                seq_length=cfg.model.seq_length,
                vocab_size=cfg.model.vocab_size,
            )
            throughput = logs.throughput_tflops_per_gpu(flops, elapsed_ms / 1000.0, self.pg.world_size)
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
            global_batch_size=self.step_batch,
            losses={**losses, **moe_losses},
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
            **losses,
            "learning-rate": lr,
            "grad-norm": grad_value,
            "loss-scale": loss_scale,
            "iteration-time": elapsed_ms / 1000.0,
            "batch-size": self.step_batch,
            **moe_losses,
        }
        if throughput is not None:
            record["throughput"] = throughput
        if params_norm is not None:
            record["params-norm"] = params_norm
        if num_zeros is not None:
            record["num-zeros"] = num_zeros
        if cfg.logging.log_memory_to_tensorboard:
            record.update(self._memory_record())
        per_iteration = ("lm loss", *losses, "learning-rate", "grad-norm", "loss-scale", "batch-size")
        self.metrics.write(self.iteration, record, samples=self.consumed_samples, tensorboard=False)
        tb_extra = {k: v for k, v in record.items() if k not in per_iteration and k != "iteration-time"}
        if cfg.logging.log_timers_to_tensorboard:
            tb_extra["iteration-time"] = record["iteration-time"]
        tb_extra.update(moe_per_layer)  # TensorBoard / W&B only, as in Megatron
        self.metrics.write(self.iteration, tb_extra, samples=self.consumed_samples, jsonl=False)
        if nan_now and cfg.ddp.check_for_nan_in_loss_and_grad:
            raise self._nan_error(nan_now, first_nan)
        return dict(record, iteration=self.iteration)

    def _memory_record(self) -> dict[str, float]:
        record = logs.memory_metrics(logs.memory_stats_mb(self.device))
        s = graph_stats(self)
        if s is not None:
            record["graph-pool-reserved-bytes"] = s["pool_reserved_bytes"]
            record["graph-pool-live-bytes"] = s["pool_live_bytes"]
            record["graph-count"] = s["graphs"]  # the memory line's count, for ranks that print none
        return record

    def _log_memory(self) -> None:
        if self.device.type != "cuda" or self.pg.dp_rank != 0:
            return
        mem = logs.memory_stats_mb(self.device)
        extra = {}
        if self.cfg.logging.log_device_memory_used:  # every process's, as the driver counts it
            free, total = torch.cuda.mem_get_info(self.device)
            extra["total device memory used"] = (total - free) / 2**20
        s = graph_stats(self)
        if s is not None:
            extra |= {
                "graph pool reserved": s["pool_reserved_bytes"] / 2**20,
                "graph pool live": s["pool_live_bytes"] / 2**20,
                "graph buffers held": s["strong_bytes"] / 2**20,
                "graphs": s["graphs"],
                "graph capture (s)": s["capture_seconds"],
            }
            if self.pg.pp_size > 1:
                extra["pipeline rank"] = self.pg.pp_rank
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
        print(f"> {self.graphs.summary_line(stage=(self.pg.pp_rank, self.pg.pp_size))}", flush=True)


class LossWindow:
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
        self._report_sums: dict[str, torch.Tensor] = {}
        self.report_means: dict[str, float] = {}
        """Means of the reported losses over the finite iterations of the window last read."""

    def add(self, loss: torch.Tensor, non_finite: torch.Tensor, iteration: int, reports=None) -> None:
        """One iteration: its loss, whether it was not finite, and forward_step's reported losses."""
        finite = torch.isfinite(loss)
        bad = non_finite.to(torch.float64)
        self._acc += torch.stack([torch.where(finite, loss, 0.0).double(), finite.double(), bad])
        for name, value in (reports or {}).items():
            kept = torch.where(finite, value, 0.0).double()
            self._report_sums[name] = kept if name not in self._report_sums else self._report_sums[name] + kept
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
        sums = torch.stack(list(self._report_sums.values())).tolist() if self._report_sums else []
        self.report_means = {k: (v / finite if finite else float("nan")) for k, v in zip(self._report_sums, sums)}
        self._report_sums = {}
        return (loss_sum / finite if finite else float("nan")), nan, first
