"""The trainer's checks of a step's result (a mixin of ``trainer.Trainer``).

``StepChecks`` holds result validation under ``--rerun-mode`` (check the loss before
the optimizer step; re-run the iteration from the same micro-batches, RNG and weights
when it fails; checkpoint and exit when the failure reproduces), the NaN guard's reads
of the loss window (``--check-for-nan-in-loss-and-grad``), the warning when a static fp16
loss scale overflows step after step, and saving only finite state. It reads the
trainer's ``cfg``, ``pg``, ``device``, ``rerun``, ``graphs``, ``iteration`` and the
checkpoint methods, and calls ``_gradients`` and ``_next_batch``.
"""

import os

import torch
import torch.distributed as dist

from megatron.core import rerun_state_machine as rerun
from megatron.core.tensor_parallel.random import get_rng_tracker
from megatron.training import checkpointing, dist_checkpointing
from megatron.training import logging_utils as logs
from megatron.training.finite_state import NonFiniteCheckpointError
from megatron.training.train_state import get_rng_state, set_rng_state

_STATIC_SCALE_WARN_AFTER = 10
"""Consecutive fp16 overflows with a static --loss-scale before the run warns."""


class StepChecks:
    """The ``Trainer``'s result checks (see the module docstring for what they read)."""

    def _load_rerun_state(self) -> None:
        """A validation the previous job left pending in the loaded checkpoint (``--rerun-mode``)."""
        if not self.cfg.checkpoint.load or self.iteration == 0:
            return
        folder = os.path.join(self.cfg.checkpoint.load, checkpointing.iteration_dir_name(self.iteration))
        pending = rerun.read_state(folder)
        if pending is not None and pending.get("iteration") == self.iteration + 1:
            self.rerun.load_pending(pending)
            logs.print_rank_0(
                f"> re-running iteration {self.iteration + 1} to validate its result ({pending['message']})"
            )

    def _rng_snapshot(self) -> dict:
        return {"global": get_rng_state(self.device.type == "cuda"), "tracker": get_rng_tracker().get_states()}

    def _restore_rng(self, snapshot: dict) -> None:
        set_rng_state(snapshot["global"], include_cuda=self.device.type == "cuda")
        get_rng_tracker().set_states(snapshot["tracker"])

    def _validated_gradients(self, data_iterator) -> torch.Tensor:
        """``_gradients`` under ``--rerun-mode``: the loss is checked before the optimizer step and the
        iteration re-run from the same state (micro-batches, RNG, weights) when it fails a check
        (``rerun_state_machine.py`` has the outcomes). Returns the loss to step with, or raises
        ``RerunExit``."""
        rr, iteration = self.rerun, self.iteration + 1
        snapshot, batches = self._rng_snapshot(), []

        def record():
            batches.append(self._next_batch(data_iterator))
            return batches[-1]

        loss, local = self._gradients(data_iterator, record, keep_local=True)

        def rerun_in_place():
            self.graphs.end_of_iteration()  # a captured replay order starts over
            self._restore_rng(snapshot)
            replay = iter(batches)
            return self._gradients(data_iterator, lambda: next(replay), keep_local=True)

        if rr.mode == "report_determinism_stats":
            initial = local.item()
            loss, local = rerun_in_place()
            rr.record_stats(iteration, initial, local.item(), self._world)
            return loss
        if rr.state is rerun.RerunState.RERUNNING_FROM_CHECKPOINT:
            code = rr.after_rerun_from_checkpoint(local.item(), self._world)
            if code == rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE:
                raise rerun.RerunExit(
                    code,
                    "Exiting now. Please resume the job from the same checkpoint to rerun the last iteration and "
                    "establish a diagnostic",
                )
            raise rerun.RerunExit(
                code, "Exiting now. A checkpoint at the last iteration already exists if further examination is needed"
            )
        message, initial = rr.first_failure(iteration, local, self._world)
        if message is None:
            return loss
        logs.print_rank_0(f"> iteration {iteration}: {message}; re-running it to check that the result reproduces")
        loss, local = rerun_in_place()
        decision = rr.after_rerun_in_place(iteration, message, initial, local.item(), self._world)
        if decision == "continue":
            logs.print_rank_0("> continuing normal execution because the failed validation was not fatal")
            return loss
        if decision == "exit" or not self.cfg.checkpoint.save:
            why = "" if decision == "exit" else " (the result reproduced, but there is no --save to checkpoint to)"
            raise rerun.RerunExit(
                rerun.EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                f"Exiting now{why}. The job can be resumed from a previous checkpoint",
            )
        # Reproducible: checkpoint the state before this iteration (its update never ran) and exit.
        self._restore_rng(snapshot)
        self._save_attempted = self.iteration
        self.save_checkpoint()
        dist_checkpointing.wait_for_pending_save()
        if self.pg.rank == 0:
            folder = os.path.join(self.cfg.checkpoint.save, checkpointing.iteration_dir_name(self.iteration))
            rerun.write_state(folder, rr.pending_state(iteration, message, initial))
        if self._world is not None:
            dist.barrier()
        raise rerun.RerunExit(
            rerun.EXIT_CODE_RESUME_TO_DISAMBIGUATE,
            "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic",
        )

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

    def _save_checked(self, non_persistent: bool = False) -> None:
        """Saves unless the NaN guard has something to report; never saves non-finite weights."""
        self._check_nan_window()
        if not non_persistent:  # the save at the end of training is a persistent one in any case
            self._save_attempted = self.iteration
        try:
            self.save_checkpoint(non_persistent)
        except NonFiniteCheckpointError as e:
            if self.cfg.ddp.check_for_nan_in_loss_and_grad:
                raise
            logs.print_rank_0(f"WARNING: {e}; training goes on (--no-check-for-nan-in-loss-and-grad).")
