"""When the training loop stops early: ``--exit-signal-handler`` and ``--exit-duration-in-mins``; and
``--exit-signal-handler-for-training``'s orderly end on SIGINT / SIGTERM."""

import contextlib
import signal
import time

import torch
import torch.distributed as dist

from megatron.core import parallel_state


class ExitConditions:
    """``--exit-signal-handler`` and ``--exit-duration-in-mins``: when the loop should stop.

    Inside the context, ``--exit-signal`` (SIGTERM by default) only sets a flag;
    the loop asks ``reason()`` after each iteration, saves and returns, so the process
    exits 0. With several ranks the decision is taken together (one all-reduce per
    iteration, only when one of the flags is set), so every rank stops at the same
    iteration.
    """

    def __init__(self, training_config, pg: parallel_state.ProcessGroups, *, start_time: float):
        self.handle_signal = training_config.exit_signal_handler
        self.signal = signal.Signals[training_config.exit_signal]
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
            self._previous = signal.signal(self.signal, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self.handle_signal and self._previous is not None:
            signal.signal(self.signal, self._previous)
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
            self._decided = f"{self.signal.name} received (--exit-signal-handler)"
        elif timed_out:
            self._decided = f"--exit-duration-in-mins {self.duration_s / 60.0:g} reached"
        return self._decided


@contextlib.contextmanager
def orderly_shutdown(enabled: bool, print_fn):
    """``--exit-signal-handler-for-training``: inside the context SIGINT and SIGTERM print Megatron's line
    and raise ``SystemExit(0)``, which ends the run the way any exception does (checkpoint lock and
    process groups released) with status 0. ``ExitConditions`` replaces its own signal while the loop
    runs, so ``--exit-signal-handler`` still saves first."""
    if not enabled:
        yield
        return

    def stop(signum, frame):
        print_fn("\nTermination requested. Performing orderly shutdown.")
        raise SystemExit(0)

    previous = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
