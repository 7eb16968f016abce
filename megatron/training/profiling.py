"""Megatron's profiling flags: nsys capture ranges, the PyTorch profiler, memory snapshots.

``StepProfiler`` does what Megatron's training loop does with ``--profile``, on the ranks
of ``--profile-ranks`` (empty: every rank). Iterations are counted as the loop counts
them: ``before_iteration(n)`` runs with ``n`` iterations done, ``after_iteration(n)``
once iteration ``n`` is done, so iterations ``--profile-step-start + 1`` to
``--profile-step-end`` are profiled.

- nsys (``--profile`` alone; CUDA): ``cudaProfilerStart`` before iteration
  start + 1 and ``cudaProfilerStop`` after iteration end, for an nsys run launched with
  ``--capture-range=cudaProfilerApi``; ``--record-shapes`` adds ``emit_nvtx`` ranges with
  input shapes.
- ``--use-pytorch-profiler``: a ``torch.profiler`` schedule of ``wait = start - 1``, one
  warm-up step and ``end - start`` active steps, stepped at the top of every iteration;
  the trace goes to ``<--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz`` (as
  Megatron; ``./torch_profile`` without a TensorBoard folder), with
  ``--pytorch-profiler-collect-shapes`` / ``-callstack`` / ``-chakra`` (an execution trace
  in ``../chakra``).
- ``--nvtx-ranges``: NVTX ranges named after the step's phases while profiling.
- ``--record-memory-history`` (CUDA): the caching allocator records its history from
  start-up (before the model is built); a snapshot is written at the first iteration and at
  every log line to ``<base>_<rank><ext>`` of ``--memory-snapshot-path``, and to
  ``<base>_oom_rank_<rank><ext>`` on an out-of-memory error.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os

import torch

from megatron.core.config_utils import Freezable, flag_field, require
from megatron.training import logging_utils as logs


@dataclasses.dataclass
class ProfilingConfig(Freezable):
    """Profiling (``profiling.StepProfiler``)."""

    profile: bool = False
    """Profile iterations --profile-step-start + 1 to --profile-step-end: an nsys capture range
    (cudaProfilerStart/Stop; run under nsys profile --capture-range=cudaProfilerApi
    --capture-range-end=stop), or torch.profiler with --use-pytorch-profiler."""

    profile_step_start: int = 10
    """Iterations done when profiling starts."""

    profile_step_end: int = 12
    """Iteration after which profiling stops."""

    use_pytorch_profiler: bool = False
    """Profile with torch.profiler; the trace goes to <--tensorboard-dir>/../torch_profile/rank-<rank>.json.gz."""

    pytorch_profiler_collect_shapes: bool = False
    """Record tensor shapes in the torch.profiler trace."""

    pytorch_profiler_collect_callstack: bool = False
    """Record Python call stacks in the torch.profiler trace."""

    pytorch_profiler_collect_chakra: bool = False
    """Also write a Chakra execution trace (<--tensorboard-dir>/../chakra/rank-<rank>.json.gz)."""

    profile_ranks: list[int] = flag_field(default_factory=list, nargs="+")
    """Global ranks that profile (default: every rank)."""

    record_memory_history: bool = False
    """Record the CUDA caching allocator's history from start-up and write snapshots (at the first
    iteration and every log line, and on out-of-memory) on the --profile-ranks."""

    memory_snapshot_path: str = "snapshot.pickle"
    """Where --record-memory-history writes its snapshots (the rank is added to the name)."""

    record_shapes: bool = False
    """Record input shapes in the NVTX ranges of an nsys profile (torch.autograd.profiler.emit_nvtx)."""

    nvtx_ranges: bool = False
    """Mark the step's phases (forward-backward, optimizer) with NVTX ranges while profiling."""

    def validate(self) -> None:
        """The profiling flags' own checks; raises ``ValueError``."""
        if not self.profile:
            return
        require(self.profile_step_start >= 0, f"--profile-step-start must be >= 0, got {self.profile_step_start}.")
        require(
            self.profile_step_end > self.profile_step_start,
            f"--profile-step-end ({self.profile_step_end}) must be greater than --profile-step-start "
            f"({self.profile_step_start}): iterations start + 1 to end are profiled.",
        )


def _nsys_start() -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStart())


def _nsys_stop() -> None:
    torch.cuda.check_error(torch.cuda.cudart().cudaProfilerStop())


class StepProfiler:
    """Profiling of one rank's training loop (see the module docstring).

    Args:
        cfg: The run's ``ProfilingConfig``.
        rank: This process's global rank.
        tensorboard_dir: ``--tensorboard-dir`` (the PyTorch profiler writes next to it), or None.
        cuda: Whether the run is on CUDA (nsys capture ranges and memory history need it).
            Memory history starts at construction: build the profiler before the model.

    Raises:
        ValueError: A CUDA-only profiling flag on a run without CUDA, naming the flag.
    """

    def __init__(self, cfg, rank: int, tensorboard_dir: str | None, cuda: bool):
        self.cfg = cfg
        self.rank = rank
        self.on_this_rank = not cfg.profile_ranks or rank in cfg.profile_ranks
        self.active = cfg.profile and self.on_this_rank
        self._torch_profiler = None
        self._nvtx_shapes = None
        self._nsys_started = False
        self._capturing = False
        if cfg.profile and not cfg.use_pytorch_profiler and not cuda:
            raise ValueError(
                "--profile without --use-pytorch-profiler marks an nsys capture range (cudaProfilerStart), which "
                "needs CUDA; add --use-pytorch-profiler to profile this run with torch.profiler."
            )
        if cfg.record_memory_history and not cuda:
            raise ValueError("--record-memory-history records the CUDA caching allocator; it needs a CUDA run.")
        self.memory_history = cfg.record_memory_history and self.on_this_rank
        if self.memory_history:
            self._start_memory_history()
        self._tensorboard_dir = tensorboard_dir

    # ------------------------------------------------------------------ the loop's calls
    def start(self) -> None:
        """Right before the training loop: starts the PyTorch profiler's schedule."""
        if self.active and self.cfg.use_pytorch_profiler and self._torch_profiler is None:
            self._torch_profiler = self._build_torch_profiler(self._tensorboard_dir)
            self._torch_profiler.start()

    def before_iteration(self, done: int) -> None:
        """At the top of the loop, ``done`` iterations finished."""
        if not self.active:
            return
        if self._torch_profiler is not None:
            self._torch_profiler.step()
        elif done == self.cfg.profile_step_start:
            _nsys_start()
            self._nsys_started = True
            if self.cfg.record_shapes:
                self._nvtx_shapes = torch.autograd.profiler.emit_nvtx(record_shapes=True)
                self._nvtx_shapes.__enter__()
        if done == self.cfg.profile_step_start:
            self._capturing = True

    def after_iteration(self, done: int) -> None:
        """After iteration ``done`` finished."""
        if self.active and done == self.cfg.profile_step_end:
            self.stop()

    def stop(self) -> None:
        """Ends profiling (at --profile-step-end, or when training ends before it). Safe to call twice."""
        if self._torch_profiler is not None:
            self._torch_profiler.stop()
            observer = self._torch_profiler.execution_trace_observer
            if observer is not None:
                observer.unregister_callback()
            self._torch_profiler = None
        if self._nvtx_shapes is not None:
            self._nvtx_shapes.__exit__(None, None, None)
            self._nvtx_shapes = None
        if self._nsys_started:
            _nsys_stop()
            self._nsys_started = False
        self._capturing = False
        self.active = False

    def range(self, name: str):
        """An NVTX range named ``name`` while profiling with --nvtx-ranges; a no-op otherwise."""
        if self._capturing and self.cfg.nvtx_ranges and torch.cuda.is_available():
            return torch.cuda.nvtx.range(name)
        return contextlib.nullcontext()

    def dump_memory_snapshot(self) -> str | None:
        """Writes the allocator snapshot (``--record-memory-history``); returns its path."""
        if not self.memory_history:
            return None
        base, ext = os.path.splitext(self.cfg.memory_snapshot_path)
        path = f"{base}_{self.rank}{ext}"
        torch.cuda.memory._dump_snapshot(path)
        return path

    # ------------------------------------------------------------------ set-up
    def _build_torch_profiler(self, tensorboard_dir: str | None):
        cfg = self.cfg
        profile_dir = os.path.join(tensorboard_dir, "..", "torch_profile") if tensorboard_dir else "torch_profile"
        observer = None
        if cfg.pytorch_profiler_collect_chakra:
            chakra_dir = os.path.join(tensorboard_dir, "..", "chakra") if tensorboard_dir else "chakra"
            os.makedirs(chakra_dir, exist_ok=True)
            observer = torch.profiler.ExecutionTraceObserver().register_callback(
                os.path.join(chakra_dir, f"rank-{self.rank}.json.gz")
            )
        rank = self.rank

        def write_trace(prof) -> None:
            os.makedirs(profile_dir, exist_ok=True)
            path = os.path.join(profile_dir, f"rank-{rank}.json.gz")
            prof.export_chrome_trace(path)
            logs.print_rank_0(
                f"> torch.profiler trace of iterations {cfg.profile_step_start + 1}-{cfg.profile_step_end}: {path}"
            )

        return torch.profiler.profile(
            schedule=torch.profiler.schedule(
                wait=max(cfg.profile_step_start - 1, 0),
                warmup=1 if cfg.profile_step_start > 0 else 0,
                active=cfg.profile_step_end - cfg.profile_step_start,
                repeat=1,
            ),
            on_trace_ready=write_trace,
            record_shapes=cfg.pytorch_profiler_collect_shapes,
            with_stack=cfg.pytorch_profiler_collect_callstack,
            execution_trace_observer=observer,
        )

    def _start_memory_history(self) -> None:
        torch.cuda.memory._record_memory_history(True, trace_alloc_max_entries=100_000, trace_alloc_record_context=True)
        base, ext = os.path.splitext(self.cfg.memory_snapshot_path)
        oom_path = f"{base}_oom_rank_{self.rank}{ext}"

        def on_oom(device, alloc, device_alloc, device_free) -> None:
            torch.cuda.memory._dump_snapshot(oom_path)
            print(f"[OOM] rank {self.rank} saved a memory snapshot to {oom_path}", flush=True)

        torch._C._cuda_attach_out_of_memory_observer(on_oom)
        logs.print_rank_0(f"> recording the CUDA allocator's history; snapshots go to {self.cfg.memory_snapshot_path}")
