"""``--save-retain-interval``: which older checkpoints a save deletes (Megatron's rule); and the folder of
non-persistent checkpoints, where a save deletes every older one.

Once a new checkpoint is in place (the tracker names it), the one the tracker named
before is deleted unless its iteration is a multiple of ``--save-retain-interval`` (or
it is a symbolic link): the run keeps its latest checkpoint and every retained one.
With ``--async-save`` the tracker moves when the background write ends, so the deletion
waits for it: it happens at the next save or at the end of training.
"""

import os
import shutil

from megatron.training import checkpointing
from megatron.training.logging_utils import print_rank_0

NON_PERSISTENT_SUBDIR = "non_persistent"
"""Megatron's folder of global non-persistent checkpoints inside --save (and --load)."""


def non_persistent_dir(checkpoint_config, checkpoints_dir: str) -> str:
    """Where global non-persistent checkpoints of ``checkpoints_dir`` (--save or --load) are."""
    return checkpoint_config.non_persistent_global_ckpt_dir or os.path.join(checkpoints_dir, NON_PERSISTENT_SUBDIR)


class SaveRetention:
    """Deletes superseded checkpoints of ``save_dir`` on the rank that manages the folder.

    Args:
        save_dir: The ``--save`` folder (or the non-persistent checkpoints' folder).
        retain_interval: ``--save-retain-interval`` (None: keep every checkpoint).
        is_writer: Whether this rank deletes (global rank 0, which writes the tracker).
        latest_only: Keep the latest checkpoint alone, whatever the interval (non-persistent ones).
    """

    def __init__(self, save_dir: str | None, retain_interval: int | None, is_writer: bool, latest_only: bool = False):
        self.save_dir = save_dir
        self.retain_interval = None if latest_only else retain_interval
        self.enabled = bool(save_dir) and (retain_interval is not None or latest_only) and is_writer
        self._last: int | None = None  # the newest iteration saved (or found in the folder)
        self._pending: list[tuple[int, int]] = []  # (superseded iteration, the iteration superseding it)

    def _tracker(self) -> int | None:
        if not os.path.exists(checkpointing.tracker_path(self.save_dir)):
            return None
        iteration, release = checkpointing.read_tracker(self.save_dir)
        return None if release else iteration

    def before_save(self) -> None:
        """Notes the folder's latest checkpoint before this run's first save."""
        if self.enabled and self._last is None:
            self._last = self._tracker()

    def after_save(self, iteration: int) -> None:
        """Queues the checkpoint this save supersedes and deletes what is no longer the latest.

        The superseded one is the previous save's, not what the tracker says now: with
        ``--async-save`` the tracker lags behind the saves."""
        if not self.enabled:
            return
        if self._last is not None and self._last != iteration:
            self._pending.append((self._last, iteration))
        self._last = iteration
        self.retire()

    def retire(self) -> None:
        """Deletes each queued checkpoint once its successor, or a later one, is in place."""
        if not self.enabled:
            return
        latest = self._tracker()
        keep = []
        for old, new in self._pending:
            if latest is None or latest < new:
                keep.append((old, new))  # the new one is not in place yet
            elif old > 0 and (self.retain_interval is None or old % self.retain_interval != 0):
                self._delete(old)
        self._pending = keep

    def _delete(self, iteration: int) -> None:
        path = os.path.join(self.save_dir, checkpointing.iteration_dir_name(iteration))
        if os.path.islink(path):
            print_rank_0(f"  skipping deleting checkpoint from iteration {iteration:7d} at {self.save_dir} (a link)")
            return
        if os.path.isdir(path):
            shutil.rmtree(path)
            print_rank_0(f"  deleted checkpoint from iteration {iteration:7d} at {self.save_dir}")
