"""The trainer's per-step global batch: ramp-up and step schedules (a mixin of ``trainer.Trainer``).

``StepBatches`` reads the trainer's ``cfg``, ``pg``, ``batches`` (a ``BatchSchedule``),
``graphs``, ``iteration`` and ``consumed_samples``, and sets ``step_batch`` and
``step_microbatches``, which the schedule, the LR step and the log line read.
"""

from megatron.core.pipeline_parallel import layout, schedules
from megatron.training import logging_utils as logs


class StepBatches:
    """The ``Trainer``'s batch-size steps (see the module docstring for what they read)."""

    def _init_step_batch(self) -> None:
        """The first step's batch (from a loaded checkpoint's consumed samples); checks the rest."""
        self.step_batch = self.batches.global_batch_size_at(self.consumed_samples)
        self.step_microbatches = self.batches.num_microbatches_at(self.consumed_samples)
        if self.batches.varies:
            self._check_step_sizes()
            logs.print_rank_0(f"> {self.batches.describe()}")

    def _check_step_sizes(self) -> None:
        """Every global batch the rest of the run uses divides by micro batch x DP and suits the
        pipeline schedule; raises ``ValueError`` naming the batch-size flag otherwise."""
        cfg = self.cfg
        flag = "--step-batch-size-schedule" if self.batches.steps is not None else "--rampup-batch-size"
        chunks = layout.num_chunks(cfg.parallel)
        for consumed, batch in self.batches.sizes_between(
            self.consumed_samples, cfg.training.train_iters - self.iteration
        ):
            n = self.batches.num_microbatches_at(consumed)
            if self.pg.pp_size > 1 and chunks > 1:
                try:
                    schedules.interleaved_order(
                        n,
                        self.pg.pp_size,
                        self.pg.pp_rank,
                        chunks,
                        microbatch_group_size=cfg.parallel.microbatch_group_size_per_virtual_pipeline_stage,
                    )
                except ValueError as e:
                    raise ValueError(f"{flag}: the global batch size {batch} ({n} micro-batches): {e}") from None

    def _next_step_batch(self) -> None:
        """Sets the coming step's global batch and micro-batch count from the consumed samples.

        When the micro-batch count changes, a ``--save`` run first saves a checkpoint
        (Megatron does, so a resume lands on the boundary). Raises ``ValueError`` when the
        new batch is not a multiple of micro batch x data-parallel size.
        """
        previous = self.step_microbatches
        self.step_batch = self.batches.global_batch_size_at(self.consumed_samples)
        self.step_microbatches = self.batches.num_microbatches_at(self.consumed_samples)
        if self.step_microbatches == previous:
            return
        graphs = "; CUDA graphs replay the captured micro-batch's graphs that often" if self.graphs.captured else ""
        logs.print_rank_0(
            f"> iteration {self.iteration + 1}: global batch size {self.step_batch} "
            f"({self.step_microbatches} micro-batches per data-parallel rank, was {previous}){graphs}"
        )
        ck = self.cfg.checkpoint
        if ck.save and self._save_attempted != self.iteration and self.iteration > 0:
            self._save_checked()
