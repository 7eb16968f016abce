"""Batch sampler and data loader for pretraining, in Megatron's sample order.

Samples are consumed in index order (datasets shuffle internally); ``--dataloader-type
cyclic`` draws them in a new random order each epoch instead
(``MegatronPretrainingRandomSampler``). One global step of ``micro_batch_size *
data_parallel_size`` consecutive indices is cut into contiguous slices, rank r taking ``[r * mbs, (r + 1) * mbs)``. Starting at ``consumed_samples``
lets a resumed run continue exactly where it stopped.

Unusual here, both for a host-bound GPU step:

* Batches made by worker processes travel to the training process as numpy arrays,
  pickled by value, and become tensors again there (no copy). As tensors they would
  travel through shared memory, each one's file descriptor handed over a socket on
  the training thread, which costs the trainer's fetch of a four-tensor GPT batch
  (receive, pin, copy to the device) more than twice the time numpy arrays take.
* Memory is not pinned here: the DataLoader would pin in a thread of the training
  process, which competes for the GIL and slows the whole step. The trainer
  pins each batch itself when it copies it to the device.

Workers end as soon as the training process does, however it dies (``kill -9``
included). Left to torch, a worker whose parent died leaves its loop and exits
normally, and Python's exit joins the result queue's feeder thread; with batches
larger than the pipe's buffer that thread is blocked writing into a pipe nobody
reads, and the write never fails, since every worker holds the pipe's read end
itself. So each worker watches its parent (``end_with_parent``) and leaves with
``os._exit``: through ``PR_SET_PDEATHSIG`` on Linux, and by polling ``os.getppid()``
everywhere.
"""

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import numpy as np
import torch
from torch.utils.data import default_collate

Batch = dict[str, torch.Tensor | np.ndarray]


def _check_micro_batch_and_rank(micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int) -> None:
    """The samplers' shared argument checks; raises ``ValueError``."""
    if micro_batch_size < 1:
        raise ValueError(f"--micro-batch-size must be >= 1, got {micro_batch_size}.")
    if data_parallel_size < 1 or not 0 <= data_parallel_rank < data_parallel_size:
        raise ValueError(f"data-parallel rank {data_parallel_rank} is not in a group of size {data_parallel_size}.")


class MegatronPretrainingSampler:
    """Yields this data-parallel rank's index lists, one per micro-batch.

    Args:
        total_samples: Length of the dataset.
        consumed_samples: Samples already consumed by all ranks (resume point).
        micro_batch_size: ``--micro-batch-size``.
        data_parallel_rank: This rank's index in the data-parallel group.
        data_parallel_size: Size of the data-parallel group.
        drop_last: Drop a final global step that is not full (Megatron's default).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"the dataset has no samples (total_samples={total_samples}).")
        if not 0 <= consumed_samples < total_samples:
            raise ValueError(
                f"consumed samples ({consumed_samples}) must be in [0, {total_samples}): the run has used "
                "up its dataset; build it with more samples (e.g. raise --train-iters before resuming)."
            )
        _check_micro_batch_and_rank(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self._step = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._step)
        if self.drop_last or rest == 0:
            return full
        # A partial last step yields a batch only to ranks whose slice is not empty.
        return full + (1 if rest > self.data_parallel_rank * self.micro_batch_size else 0)

    def _slice(self, batch: list[int]) -> list[int]:
        start = self.data_parallel_rank * self.micro_batch_size
        return batch[start : start + self.micro_batch_size]

    def __iter__(self) -> Iterator[list[int]]:
        for begin in range(self.consumed_samples, self.total_samples - self._step + 1, self._step):
            yield self._slice(list(range(begin, begin + self._step)))
        if not self.drop_last:
            begin = self.consumed_samples + ((self.total_samples - self.consumed_samples) // self._step) * self._step
            tail = self._slice(list(range(begin, self.total_samples)))
            if tail:
                yield tail


class MegatronPretrainingRandomSampler:
    """``--dataloader-type cyclic``: epochs over the dataset, each in a new random order (Megatron's).

    Epoch ``e`` shuffles with a ``torch.Generator`` seeded ``e``. With data sharding (the
    default; ``--no-data-sharding`` turns it off) each data-parallel rank owns a contiguous
    bucket of ``total // (mbs * dp) * mbs`` indices and walks a permutation of it; without,
    one permutation of the whole dataset (cut to whole micro-batches) is dealt out to the
    ranks in turn. The part of the dataset that fills no whole global step is never drawn.
    ``consumed_samples`` (all ranks') says the epoch and the place in it, so a resumed run
    continues the same order; each pass over the sampler continues where the last stopped.

    Args:
        total_samples, consumed_samples, micro_batch_size, data_parallel_rank,
        data_parallel_size: As for ``MegatronPretrainingSampler``.
        data_sharding: Per-rank buckets (see above).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        data_sharding: bool = True,
    ):
        _check_micro_batch_and_rank(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.step = micro_batch_size * data_parallel_size
        if total_samples < self.step:
            raise ValueError(
                f"the dataset has {total_samples} samples, fewer than one global step of {self.step}; "
                "--dataloader-type cyclic needs at least one."
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.data_sharding = data_sharding

    def __len__(self) -> int:
        return self.total_samples

    def __iter__(self) -> Iterator[list[int]]:
        per_epoch = self.total_samples - self.total_samples % self.step  # whole global steps only
        epoch, done = divmod(self.consumed_samples, per_epoch)
        assert done % self.step == 0, (done, self.step)
        generator = torch.Generator()
        generator.manual_seed(epoch)
        if self.data_sharding:
            bucket = self.total_samples // self.step * self.micro_batch_size
            start = self.data_parallel_rank * bucket
            order = [start + i for i in torch.randperm(bucket, generator=generator).tolist()]
            mine = order[done // self.data_parallel_size :]
        else:
            whole = self.total_samples // self.micro_batch_size * self.micro_batch_size
            order = torch.randperm(whole, generator=generator).tolist()[done:]
            mine = order[self.data_parallel_rank :: self.data_parallel_size]
        for begin in range(0, len(mine) - self.micro_batch_size + 1, self.micro_batch_size):
            self.consumed_samples += self.step
            yield mine[begin : begin + self.micro_batch_size]


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    dataloader_type: str = "single",
    data_sharding: bool = True,
    workers_ignore: int | None = None,
) -> Iterable[Batch] | None:
    """A DataLoader over ``dataset`` driven by ``MegatronPretrainingSampler`` (``--dataloader-type
    single``) or ``MegatronPretrainingRandomSampler`` (``cyclic``: iterate it again for the next epoch).

    Batches are dicts of stacked tensors ([micro_batch_size, seq_length] for GPT data),
    in pageable memory (module docstring). Workers persist across epochs when
    ``num_workers > 0`` (``--num-workers``; 0 loads in the main process). ``workers_ignore``: a
    signal the workers ignore (the trainer's --exit-signal, so that a signal sent to the whole
    process group leaves them to serve the rest of the iteration).

    Returns None for a None dataset (a split that was not built); with workers, an
    iterable over the DataLoader that turns the workers' numpy arrays back into tensors.
    """
    if dataset is None:
        return None
    if num_workers < 0:
        raise ValueError(f"--num-workers must be >= 0, got {num_workers}.")
    where = dict(
        total_samples=len(dataset),
        consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    if dataloader_type == "cyclic":
        sampler = MegatronPretrainingRandomSampler(**where, data_sharding=data_sharding)
    else:
        sampler = MegatronPretrainingSampler(**where)
    if num_workers == 0:
        return torch.utils.data.DataLoader(dataset, batch_sampler=sampler)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        persistent_workers=True,
        collate_fn=collate_to_numpy,
        worker_init_fn=EndWithTrainer(ignored_signal=workers_ignore),
    )
    return WorkerBatches(loader)


def collate_to_numpy(samples) -> Batch:
    """Worker side: ``default_collate``, then each tensor of a dict batch as a numpy array."""
    batch = default_collate(samples)
    if not isinstance(batch, dict):
        return batch  # travels as tensors: correct, only slower
    return {k: v.numpy() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


class WorkerBatches:
    """Iterates a worker DataLoader, turning numpy arrays back into tensors (``from_numpy``)."""

    def __init__(self, loader: torch.utils.data.DataLoader):
        self.loader = loader

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Batch]:
        init = self.loader.worker_init_fn
        if isinstance(init, EndWithTrainer):
            # The first iteration starts the (persistent) workers, from this process and thread.
            init.trainer_pid = os.getpid()
            init.started_on_main_thread = threading.current_thread() is threading.main_thread()
        for batch in self.loader:
            if isinstance(batch, dict):
                batch = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in batch.items()}
            yield batch


# Seconds between two checks of a worker's parent; bounds how long a worker outlives the
# training process where PR_SET_PDEATHSIG is not available.
PARENT_POLL_S = 0.5


class EndWithTrainer:
    """``worker_init_fn`` of the worker DataLoader: ``end_with_parent`` in each worker.

    ``WorkerBatches`` sets ``trainer_pid`` and ``started_on_main_thread`` just before the
    workers start; the object reaches them by fork or by pickle (spawn), so it is plain.
    """

    def __init__(self, poll_s: float = PARENT_POLL_S, ignored_signal: int | None = None):
        self.trainer_pid = os.getpid()
        self.started_on_main_thread = True
        self.poll_s = poll_s
        self.ignored_signal = ignored_signal

    def __call__(self, worker_id: int) -> None:
        if self.ignored_signal is not None:
            signal.signal(self.ignored_signal, signal.SIG_IGN)
        # PR_SET_PDEATHSIG fires when the *thread* that started the worker ends; only the
        # main thread lives as long as the process, so other threads rely on the poll alone.
        end_with_parent(self.trainer_pid, self.poll_s, use_pdeathsig=self.started_on_main_thread)


def end_with_parent(trainer_pid: int, poll_s: float = PARENT_POLL_S, use_pdeathsig: bool = True) -> bool:
    """Makes the calling (worker) process end with ``os._exit`` once ``trainer_pid`` is gone.

    On Linux the kernel kills it (``PR_SET_PDEATHSIG``, SIGKILL) when its parent dies.
    Everywhere a daemon thread checks every ``poll_s`` seconds that the parent is still
    the one the worker started with: a dead parent's children are handed to another
    process (init, launchd or a subreaper), so ``os.getppid()`` changes. ``os._exit``
    runs no exit handlers, so a thread blocked on a full pipe cannot hold the exit up.
    Returns whether PR_SET_PDEATHSIG was set.
    """
    first_ppid = os.getppid()
    pdeathsig = use_pdeathsig and _set_pdeathsig()
    if _parent_gone(trainer_pid, first_ppid):  # died before the signal was armed
        os._exit(1)
    watcher = threading.Thread(
        target=_watch_parent, args=(trainer_pid, first_ppid, poll_s), name="parent_watch", daemon=True
    )
    watcher.start()
    return pdeathsig


def _set_pdeathsig() -> bool:
    """Asks Linux to SIGKILL this process when its parent dies; False where that is not possible."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return False
    pr_set_pdeathsig = 1  # <linux/prctl.h>
    zero = ctypes.c_ulong(0)
    return prctl(pr_set_pdeathsig, ctypes.c_ulong(signal.SIGKILL), zero, zero, zero) == 0


def _parent_gone(trainer_pid: int, first_ppid: int) -> bool:
    ppid = os.getppid()
    if ppid == trainer_pid:
        return False
    if ppid != first_ppid:
        return True  # handed over to another process: the parent died
    # Started through another process (a forkserver), or by a trainer that died before
    # this worker looked: ask about the trainer itself.
    try:
        os.kill(trainer_pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # the pid exists (someone else's, at worst)
    return False


def _watch_parent(trainer_pid: int, first_ppid: int, poll_s: float) -> None:
    while not _parent_gone(trainer_pid, first_ppid):
        time.sleep(poll_s)
    os._exit(1)
