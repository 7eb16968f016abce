"""The global batch size as a function of consumed samples (Megatron's micro-batch calculator).

Three kinds, all pure functions of the samples consumed before a step:

- constant: ``--global-batch-size`` throughout;
- ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``): ``START + k * INCREMENT``
  once ``k * SAMPLES / num_increments`` samples are consumed, where
  ``num_increments = (--global-batch-size - START) / INCREMENT``; past ``SAMPLES`` the
  batch is ``--global-batch-size``;
- step schedule (``--step-batch-size-schedule "0:384 200B:768"``): the batch of the last
  threshold at or below the consumed samples. Thresholds (and batch sizes) take the
  suffixes K, M, B, T (1e3 .. 1e12); thresholds count tokens and are divided by the
  sequence length into samples (``//``), as upstream passes ``--seq-length``.

Because the batch is a function of consumed samples, a run resumed from a checkpoint
(which stores them) continues with exactly the batch sizes of an uninterrupted run, and
the data sampler, which hands out micro-batches in index order, sees the same sample
order for any schedule.
"""

import dataclasses
import math

from megatron.core.config_utils import require

_SUFFIXES = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def parse_count(text: str, flag: str = "--step-batch-size-schedule") -> int:
    """``"200B"`` -> 200_000_000_000; a number with an optional K/M/B/T suffix (any case)."""
    s = text.strip().upper()
    scale = _SUFFIXES.get(s[-1:], 1)
    if scale != 1:
        s = s[:-1]
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a number (e.g. 768, 2.5K, 200B).") from None
    require(math.isfinite(value), f"{flag}: {text!r} is not a finite number.")
    return int(value * scale)


def parse_step_schedule(text: str | list[str], seq_length: int | None) -> list[tuple[int, int]]:
    """``"0:384 200B:768"`` -> ``[(0, 384), (200e9 // seq_length, 768)]``, sorted by threshold.

    Entries are separated by spaces or commas (a list: the flag's words, joined). With
    ``seq_length`` the thresholds are tokens, converted to samples; without, samples.
    """
    flag = "--step-batch-size-schedule"
    if not isinstance(text, str):
        text = " ".join(text)
    entries = text.replace(",", " ").split()
    require(entries, f'{flag} is empty; give "THRESHOLD:BATCH ..." pairs, e.g. "0:384 200B:768".')
    schedule = []
    for entry in entries:
        require(":" in entry, f'{flag}: entry {entry!r} is not THRESHOLD:BATCH_SIZE (e.g. "0:384 200B:768 400B:1152").')
        threshold_text, batch_text = entry.split(":", 1)
        threshold = parse_count(threshold_text, flag)
        batch = parse_count(batch_text, flag)
        require(threshold >= 0, f"{flag}: threshold {threshold_text!r} is negative.")
        if seq_length is not None:
            threshold //= seq_length
        require(batch > 0, f"{flag}: batch size {batch_text!r} in {entry!r} must be positive.")
        schedule.append((threshold, batch))
    schedule.sort(key=lambda e: e[0])
    require(
        schedule[0][0] == 0,
        f"{flag}: the first threshold must be 0 (the batch size to start with), got {schedule[0][0]} samples.",
    )
    for (a, _), (b, _) in zip(schedule, schedule[1:]):
        require(
            b > a,
            f"{flag}: thresholds must be strictly increasing (in samples, after dividing tokens by --seq-length), "
            f"got {a} twice.",
        )
    return schedule


@dataclasses.dataclass(frozen=True)
class BatchSchedule:
    """The global batch size per step, from consumed samples.

    Args:
        global_batch_size: ``--global-batch-size`` (the batch after ramp-up, or the last
            entry of a step schedule).
        micro_batch_size: ``--micro-batch-size``.
        data_parallel_size: Data-parallel ranks.
        rampup: ``(START, INCREMENT, SAMPLES)`` of ``--rampup-batch-size``, or None.
        steps: ``[(threshold_samples, batch), ...]`` of ``--step-batch-size-schedule``, or None.
    """

    global_batch_size: int
    micro_batch_size: int
    data_parallel_size: int
    rampup: tuple[int, int, int] | None = None
    steps: tuple[tuple[int, int], ...] | None = None

    @classmethod
    def from_config(cls, training, data_parallel_size: int, seq_length: int | None) -> "BatchSchedule":
        """From a ``TrainingConfig`` whose ``global_batch_size`` is resolved."""
        steps = None
        if training.step_batch_size_schedule is not None:
            steps = tuple(parse_step_schedule(training.step_batch_size_schedule, seq_length))
        rampup = tuple(int(v) for v in training.rampup_batch_size) if training.rampup_batch_size else None
        return cls(training.global_batch_size, training.micro_batch_size, data_parallel_size, rampup, steps)

    @property
    def varies(self) -> bool:
        """Whether the batch size may change during training."""
        return self.rampup is not None or self.steps is not None

    @property
    def unit(self) -> int:
        """Samples of one micro-batch over every data-parallel rank."""
        return self.micro_batch_size * self.data_parallel_size

    def validate(self) -> None:
        """Checks the ramp-up's shape (divisibility of each size is checked as it is reached)."""
        if self.rampup is None:
            return
        start, increment, samples = self.rampup
        flag = "--rampup-batch-size START INCREMENT SAMPLES"
        require(start > 0, f"{flag}: START must be positive, got {start}.")
        require(increment > 0, f"{flag}: INCREMENT must be positive, got {increment}.")
        require(samples >= 0, f"{flag}: SAMPLES must be >= 0, got {samples}.")
        diff = self.global_batch_size - start
        require(
            diff >= 0,
            f"{flag}: --global-batch-size ({self.global_batch_size}) must be >= START ({start}): the ramp grows "
            "the batch up to --global-batch-size.",
        )
        require(
            diff % increment == 0,
            f"{flag}: --global-batch-size - START ({diff}) must be divisible by INCREMENT ({increment}).",
        )

    def _rampup_size(self, consumed: int) -> int:
        start, increment, samples = self.rampup
        increments = (self.global_batch_size - start) // increment
        if consumed > samples or increments == 0:
            return self.global_batch_size
        per_increment = samples / increments
        steps = int(consumed / per_increment)
        return min(start + steps * increment, self.global_batch_size)

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the step that starts after ``consumed_samples`` samples."""
        if self.steps is not None:
            batch = self.steps[0][1]
            for threshold, size in self.steps:
                if consumed_samples < threshold:
                    break
                batch = size
            return batch
        if self.rampup is not None:
            return self._rampup_size(consumed_samples)
        return self.global_batch_size

    def num_microbatches_at(self, consumed_samples: int) -> int:
        """Micro-batches per data-parallel rank of the step after ``consumed_samples``.

        Raises:
            ValueError: The batch size there is not a multiple of micro batch x DP.
        """
        batch = self.global_batch_size_at(consumed_samples)
        if batch % self.unit:
            flag = "--step-batch-size-schedule" if self.steps is not None else "--rampup-batch-size"
            raise ValueError(
                f"{flag}: the global batch size {batch} (after {consumed_samples} consumed samples) must be "
                f"divisible by --micro-batch-size ({self.micro_batch_size}) x data-parallel size "
                f"({self.data_parallel_size}); change the schedule or --micro-batch-size."
            )
        return batch // self.unit

    def _next_change(self, consumed: int) -> int | None:
        """The least sample count above ``consumed`` where the batch may differ (None: never)."""
        if self.steps is not None:
            return next((t for t, _ in self.steps if t > consumed), None)
        if self.rampup is not None and consumed <= self.rampup[2]:
            return consumed + 1  # the ramp is short: walk it step by step, exactly as the formula
        return None

    def samples_after(self, consumed: int, iterations: int) -> int:
        """Consumed samples after ``iterations`` more steps starting at ``consumed``."""
        left = iterations
        while left > 0:
            batch = self.global_batch_size_at(consumed)
            change = self._next_change(consumed)
            if change is None:
                return consumed + left * batch
            steps = min(left, max(1, -(-(change - consumed) // batch)))  # steps until at/after the change
            consumed += steps * batch
            left -= steps
        return consumed

    def iterations_for(self, train_samples: int) -> int:
        """Megatron's iteration count for ``--train-samples``.

        Constant: ``train_samples // batch``. Step schedule: steps until at least
        ``train_samples`` are consumed (the last one may pass it). Ramp-up: the ramp's
        steps while ``consumed <= SAMPLES`` and ``<= train_samples``, then whole batches.
        """
        if self.steps is not None:
            consumed = iterations = 0
            while consumed < train_samples:
                batch = self.global_batch_size_at(consumed)
                change = self._next_change(consumed)
                target = train_samples if change is None else min(change, train_samples)
                steps = max(1, -(-(target - consumed) // batch))
                consumed += steps * batch
                iterations += steps
            return iterations
        if self.rampup is not None:
            consumed = iterations = 0
            while consumed <= self.rampup[2] and consumed <= train_samples:
                consumed += self.global_batch_size_at(consumed)
                iterations += 1
            if train_samples > consumed:
                iterations += (train_samples - consumed) // self.global_batch_size
            return iterations
        return train_samples // self.global_batch_size

    def sizes_between(self, consumed: int, iterations: int) -> list[tuple[int, int]]:
        """``(consumed_samples, batch)`` where each distinct batch of the next ``iterations`` steps starts."""
        out: list[tuple[int, int]] = []
        left = iterations
        while left > 0:
            batch = self.global_batch_size_at(consumed)
            if not out or out[-1][1] != batch:
                out.append((consumed, batch))
            change = self._next_change(consumed)
            if change is None:
                break
            steps = min(left, max(1, -(-(change - consumed) // batch)))
            consumed += steps * batch
            left -= steps
        return out

    def describe(self) -> str:
        """One line for the start-up log."""
        if self.steps is not None:
            body = ", ".join(f">= {t:,} samples: {b}" for t, b in self.steps)
            return f"step batch size schedule: {body}"
        if self.rampup is not None:
            start, increment, samples = self.rampup
            return (
                f"batch size ramp-up from {start} by {increment} over {samples:,} samples to {self.global_batch_size}"
            )
        return f"constant global batch size {self.global_batch_size}"
