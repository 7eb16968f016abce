"""The trainer's checkpoints: what a checkpoint holds, saving into ``--save`` (or the non-persistent
folder), loading ``--load`` (``--ckpt-step``, the newer non-persistent checkpoint,
``--override-ckpt-iteration``), and the ``--save`` lock. The formats are ``checkpointing.py`` (torch) and
``dist_checkpointing.py`` (torch_dist); this mixin picks and drives them.
"""

import atexit
import os

import torch.distributed as dist

from megatron.training import checkpointing, dist_checkpointing, save_lock
from megatron.training import logging_utils as logs
from megatron.training.save_retention import non_persistent_dir


class RunCheckpoints:
    """Trainer mixin: checkpoints of the run (needs cfg, pg, model, optimizer, scheduler, state,
    retention, non_persistent_retention, non_persistent_dir)."""

    def _lock_save_dir(self) -> save_lock.SaveLock | None:
        """Rank 0 takes ``--save``'s lock; every rank raises if it could not."""
        if not self.cfg.checkpoint.save:
            return None
        lock, error = None, [None]
        if self.pg.rank == 0:
            try:
                lock = save_lock.SaveLock(self.cfg.checkpoint.save).acquire()
                atexit.register(lock.release)  # an exception that escapes pretrain()
            except ValueError as e:
                error = [str(e)]
        if self.pg.world_size > 1 and dist.is_available() and dist.is_initialized():
            dist.broadcast_object_list(error, src=0)
        if error[0] is not None:
            raise ValueError(error[0])
        return lock

    def checkpoint_state(self) -> dict[str, checkpointing.Stateful]:
        """What a checkpoint holds, by key (``checkpointing.save_checkpoint``'s mapping)."""
        return {
            checkpointing.MODEL: self.model,
            checkpointing.OPTIMIZER: self.optimizer,
            checkpointing.SCHEDULER: self.scheduler,
            checkpointing.TRAIN_STATE: self.state,
        }

    def save_checkpoint(self, non_persistent: bool = False) -> str | None:
        """Saves the run at the current iteration into ``--save`` (``--ckpt-format``), or into the
        non-persistent folder, where only the latest is kept."""
        save_dir = self.non_persistent_dir if non_persistent else None
        retention = self.non_persistent_retention if non_persistent else self.retention
        retention.before_save()
        if self.cfg.checkpoint.ckpt_format == "torch_dist":  # sharded: dist_checkpointing.py (refuses NaN too)
            dist_checkpointing.save(self, save_dir)
            retention.after_save(self.iteration)
            return None
        path = checkpointing.save_checkpoint(self.checkpoint_state(), self.cfg, self.pg, save_dir)
        self.last_checkpointed_iteration = self.iteration
        retention.after_save(self.iteration)
        return path

    def load_checkpoint(self) -> int:
        """Loads ``--load`` (``--ckpt-step``'s iteration, if given); returns the iteration training
        continues from (``--override-ckpt-iteration``'s, if given)."""
        self._load_either_format()
        n = self.cfg.checkpoint.override_ckpt_iteration
        if n is not None:  # Megatron's: the data position of iteration n at this run's global batch size
            self.iteration, self.consumed_samples = n, n * self.cfg.training.global_batch_size
            logs.print_rank_0(
                f"--override-ckpt-iteration: start at iteration {n} (consumed_train_samples {self.consumed_samples})"
            )
        return self.iteration

    def _load_dir(self) -> str:
        """``--load``, or its non-persistent folder when that holds a checkpoint as new or newer (Megatron's)."""
        ck = self.cfg.checkpoint
        if ck.non_persistent_ckpt_type != "global" or ck.ckpt_step is not None:
            return ck.load
        folder = non_persistent_dir(ck, ck.load)
        if not os.path.isfile(checkpointing.tracker_path(folder)):
            return ck.load
        newest = checkpointing.read_tracker(folder)[0]
        persistent = checkpointing.read_tracker(ck.load)[0] if checkpointing.has_checkpoint(ck.load) else -1
        if newest < persistent:
            return ck.load
        logs.print_rank_0(f"> loading the non-persistent checkpoint of iteration {newest} from {folder}")
        return folder

    def _load_either_format(self) -> None:
        load_dir = self._load_dir()
        if dist_checkpointing.maybe_load(self, load_dir) is not None:  # a torch_dist checkpoint
            self._load_rerun_state()
            return
        loaded = checkpointing.load_checkpoint(self.checkpoint_state(), self.cfg, self.pg, load_dir)
        if loaded is None:
            return
        if not {checkpointing.OPTIMIZER, checkpointing.MAIN_PARAMS} & loaded.loaded:
            self.optimizer.reload_model_params()  # fp32 main params from the loaded weights
        if checkpointing.SCHEDULER not in loaded.loaded:
            # The LR schedule stays at the loaded iteration (in samples when the batch changes).
            self.scheduler.num_steps = self.consumed_samples if self.batches.varies else self.iteration
            self.scheduler.step(0)
        self.last_checkpointed_iteration = None if loaded.weights_only else self.iteration
        self._load_rerun_state()
