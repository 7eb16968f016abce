"""Result validation by re-running an iteration (Megatron's ``--rerun-mode``).

An iteration whose loss fails a check (NaN or Inf with the NaN guard on; a spike with
``--check-for-spiky-loss``) is run again from the same state (the same micro-batches,
the same RNG streams, the same weights: the check runs before the optimizer step) to
tell a transient fault from a reproducible result. The outcomes follow Megatron:

- not reproducible, fatal check (NaN/Inf): "Possible transient error!", exit code 17
  (``EXIT_CODE_FAILED_ON_RESULT_VALIDATION``) without saving; resume from the last
  checkpoint.
- reproducible, fatal check: save a checkpoint of the state before the iteration
  (with the pending validation in it) and exit with 16
  (``EXIT_CODE_RESUME_TO_DISAMBIGUATE``); the job resumed from it on another device
  re-runs the iteration once more: the same result there means "correct result (but
  possible application error)", another one "possible persistent error", and both exit
  with 17. Resumed on the same node and device, it exits with 16 again.
- a non-fatal check (spiky loss): log the diagnosis and continue with the re-run's
  gradients.

``report_determinism_stats`` re-runs every iteration once and reports the relative
difference of the two losses every ``REPORTING_INTERVAL_ITERATIONS`` iterations.

Unlike Megatron, the validated value is this rank's micro-batch-mean loss of the whole
step (one check per step, not one per micro-batch), the gradient norms of the buckets
are not validated here (non-finite gradients stay the NaN guard's: the update is skipped
and the run stops at the next log line), and the pending state goes into a small JSON
file of the checkpoint folder, so it works with both ``--ckpt-format`` values. Error
injection (``--error-injection-rate``) draws from a generator of its own, seeded by
``--seed``, so it does not move Python's global stream. Validation costs one host read
of a device flag per iteration, before the optimizer step; ``--rerun-mode disabled``
has none.
"""

import enum
import json
import logging
import math
import os
import random
import socket
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16
"""Exit code: resume the job from the checkpoint just saved to re-run the iteration elsewhere."""

EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
"""Exit code: the job failed on result validation."""

STATE_FILENAME = "rerun_state_machine.json"
"""The pending validation, in the folder of the checkpoint saved before exiting with 16."""

MODES = ("disabled", "validate_results", "report_determinism_stats")
INJECTION_TYPES = ("correct_result", "transient_error", "persistent_error")
SPIKY_LOSS_FACTOR = 10
"""A loss at least this many times the largest of the first ``SPIKY_LOSS_SAMPLES`` is a spike."""
SPIKY_LOSS_SAMPLES = 100
REPORTING_INTERVAL_ITERATIONS = 2

NAN_MESSAGE = "found NaN in local forward loss calculation"
INF_MESSAGE = "found Inf in local forward loss calculation"
SPIKY_MESSAGE = "Spiky loss"
_FATAL = {NAN_MESSAGE: True, INF_MESSAGE: True, SPIKY_MESSAGE: False}


class RerunState(enum.Enum):
    """Where the machine is (Megatron's states, as far as one iteration's re-run needs)."""

    NOT_RUNNING_YET = "not_running_yet"
    WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"
    RERUNNING_FROM_CHECKPOINT = "rerunning_from_checkpoint"


class RerunExit(SystemExit):
    """Ends the run with Megatron's exit code after a failed validation (``code``)."""

    def __init__(self, code: int, message: str):
        super().__init__(code)
        self.message = message

    def __str__(self) -> str:
        return f"exit code {self.code}: {self.message}"


def compare_floats(a: float, b: float) -> float:
    """Relative difference of two results; 0 for a match (NaN matches NaN), inf for a kind change."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return 0.0
    if math.isnan(a) or math.isnan(b) or math.isinf(a) or math.isinf(b):
        return math.inf
    return math.fabs((a - b) / (a + b) * 2)


def device_identity(device: torch.device) -> tuple[str, str]:
    """(node, device) the result came from; a resumed job compares its own with it."""
    index = torch.cuda.current_device() if device.type == "cuda" else -1
    return socket.gethostname(), f"{device.type}:{index}"


class RerunStateMachine:
    """Decides, once per iteration, whether to re-run it, and what to do after the re-run.

    Args:
        mode: One of ``MODES``.
        check_nan: Validate NaN/Inf losses (``--check-for-nan-in-loss-and-grad``).
        check_spiky: Validate spiky losses (``--check-for-spiky-loss``).
        error_injection_rate: Inject a rejected result once in this many checks (0: never).
        error_injection_type: What an injected result turns out to be: ``transient_error``
            (the re-run differs), ``persistent_error`` (the re-run on the same device
            matches, the one on another device differs), ``correct_result`` (all match).
        seed: Seed of the injection generator.
        rank: This process's global rank (logs; the injection draws depend on it as in
            Megatron).
        device: The training device.
    """

    def __init__(
        self,
        mode: str = "disabled",
        *,
        check_nan: bool = True,
        check_spiky: bool = False,
        error_injection_rate: int = 0,
        error_injection_type: str = "transient_error",
        seed: int = 0,
        rank: int = 0,
        device: torch.device | None = None,
    ):
        assert mode in MODES and error_injection_type in INJECTION_TYPES, (mode, error_injection_type)
        self.mode = mode
        self.checks = [
            m for m, on in ((NAN_MESSAGE, check_nan), (INF_MESSAGE, check_nan), (SPIKY_MESSAGE, check_spiky)) if on
        ]
        self.injection_rate = error_injection_rate
        self.injection_type = error_injection_type
        self._inject_rng = random.Random(seed)
        self.injected: str | None = None  # the injected kind while its validation is pending
        self.rank = rank
        self.device = device or torch.device("cpu")
        self.state = RerunState.NOT_RUNNING_YET
        self.first_iteration_complete = False
        self.max_loss: torch.Tensor | None = None  # largest |loss| of the first SPIKY_LOSS_SAMPLES
        self.loss_samples = 0
        self.pending: dict[str, Any] | None = None  # a validation resumed from a checkpoint
        self.stats: list[float] = []
        self.diagnoses: list[str] = []  # what each re-run concluded (tests read it)

    @property
    def active(self) -> bool:
        """Whether iterations are validated at all (a disabled machine changes nothing)."""
        if self.mode == "report_determinism_stats":
            return True
        return self.mode == "validate_results" and bool(self.checks)

    # ------------------------------------------------------------------ checks
    def rejections(self, loss: torch.Tensor) -> torch.Tensor:
        """One device flag per check of ``self.checks`` (1: the loss fails it). No host read."""
        loss = loss.detach().float().reshape(())
        flags = []
        for message in self.checks:
            if message == NAN_MESSAGE:
                flags.append(torch.isnan(loss))
            elif message == INF_MESSAGE:
                flags.append(torch.isinf(loss))
            else:
                flags.append(self._spiky(loss))
        return torch.stack(flags) if flags else torch.zeros(0, dtype=torch.bool, device=loss.device)

    def _spiky(self, loss: torch.Tensor) -> torch.Tensor:
        value = loss.abs()
        finite = torch.isfinite(value)
        if self.loss_samples < SPIKY_LOSS_SAMPLES:  # Megatron's: the first samples set the scale
            self.loss_samples += 1
            sample = torch.where(finite, value, torch.zeros_like(value))
            self.max_loss = sample if self.max_loss is None else torch.maximum(self.max_loss, sample)
            return torch.zeros((), dtype=torch.bool, device=loss.device)
        return finite & (value >= self.max_loss * SPIKY_LOSS_FACTOR)

    def _maybe_inject(self) -> str | None:
        """The check an error is injected into this iteration, if any (host only)."""
        if self.injection_rate <= 0 or self.injected is not None:
            return None
        for message in self.checks:
            draw = (self._inject_rng.randint(0, self.injection_rate - 1) + self.rank) % self.injection_rate
            if draw == 0:
                self.injected = self.injection_type
                logger.warning("Injecting error type %s", self.injection_type)
                return message
        return None

    def first_failure(self, iteration: int, loss: torch.Tensor, group) -> tuple[str | None, float]:
        """The check the initial run of ``iteration`` failed on any rank (None: all passed).

        One host read: the flags of every rank are combined over ``group`` (the world).
        Returns the failed check's message and this rank's loss.
        """
        flags = self.rejections(loss).float()
        injected = self._maybe_inject() if self.first_iteration_complete else None
        if injected is not None:
            flags[self.checks.index(injected)] = 1.0
        if group is not None:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
        values = torch.cat([flags, loss.detach().float().reshape(1).to(flags.device)]).tolist()  # the host read
        local = values[-1]
        if not self.first_iteration_complete:  # Megatron: no checkpoint can be taken before a step
            return None, local
        for message, failed in zip(self.checks, values[:-1]):
            if failed:
                logger.error(
                    "Unexpected result %s on rank %d at iteration #%d (message='%s')",
                    local,
                    self.rank,
                    iteration,
                    message,
                )
                return message, local
        return None, local

    def compare(self, message: str, initial: float, result: float, in_place: bool) -> float:
        """The difference of a re-run's result to the initial one (injected errors decide it)."""
        kind = self.injected
        if kind is None:
            return compare_floats(initial, result)
        if in_place:
            if kind == "transient_error":
                self.injected = None
                return math.inf
            return 0.0
        self.injected = None
        return math.inf if kind == "persistent_error" else 0.0

    # ------------------------------------------------------------------ decisions
    def after_rerun_in_place(self, iteration: int, message: str, initial: float, result: float, group) -> str:
        """What to do after the in-place re-run: ``continue``, ``checkpoint_and_exit`` or ``exit``.

        Every rank takes the same decision (combined over ``group``).
        """
        fatal = _FATAL[message]
        reproducible = self.compare(message, initial, result, in_place=True) <= 0.0
        where = f"Rank {self.rank}, node {socket.gethostname()}, iteration #{iteration}"
        if not reproducible:
            self._log(fatal, f"{where}: First rerun: unexpected result is not reproducible ({result} != {initial})!")
            self._log(fatal, f"{where}: Possible transient error!")
            self.diagnoses.append("transient_error")
        else:
            self._log(
                fatal,
                f"{where}: First rerun: unexpected result is reproducible ({result} = {initial}). "
                "Need to rerun on a different GPU to verify correctness.",
            )
            self.diagnoses.append("reproducible")
        decision = 0 if not fatal else (1 if reproducible else 2)  # continue < checkpoint < exit
        if group is not None:
            t = torch.tensor([decision], dtype=torch.int32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            decision = int(t.item())
        return ("continue", "checkpoint_and_exit", "exit")[decision]

    def pending_state(self, iteration: int, message: str, initial: float) -> dict[str, Any]:
        """What the checkpoint saved before exiting with 16 holds for the resumed job."""
        node, device = device_identity(self.device)
        return {
            "mode": self.mode,
            "state": RerunState.WILL_RERUN_FROM_CHECKPOINT.value,
            "iteration": iteration,
            "message": message,
            "initial_result": initial,
            "suspicious_node": node,
            "suspicious_device": device,
            "injected_error_type": self.injected,
        }

    def load_pending(self, state: dict[str, Any]) -> None:
        """Resumes a validation the previous job left in its checkpoint."""
        if self.mode == "disabled":
            logger.warning("RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint")
            return
        logger.warning("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        self.pending = dict(state)
        self.injected = state.get("injected_error_type")
        self.state = RerunState.RERUNNING_FROM_CHECKPOINT

    def after_rerun_from_checkpoint(self, result: float, group) -> int:
        """The exit code of the resumed job after its re-run of the pending iteration."""
        p = self.pending
        assert p is not None
        node, device = device_identity(self.device)
        same = int(node == p["suspicious_node"] and device == p["suspicious_device"])
        where = f"Rank {self.rank}, node {node}, iteration #{p['iteration']}"
        if same:
            logger.error(
                "Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                f"(node: {node}, gpu: {device})"
            )
            self.diagnoses.append("same_device")
        elif self.compare(p["message"], p["initial_result"], result, in_place=False) > 0.0:
            logger.warning(
                "Second rerun: unexpected result is not reproducible on a different GPU, therefore was likely "
                f"incorrect ({result} != {p['initial_result']})"
            )
            logger.error(f"{where}: Possible persistent error!")
            self.diagnoses.append("persistent_error")
        else:
            logger.warning(
                "Second rerun: unexpected result is reproducible on a different GPU, therefore it was likely "
                f"correct ({result} = {p['initial_result']})"
            )
            logger.error(f"{where}: Correct result (but possible Application error) ({p['message']})")
            self.diagnoses.append("correct_result")
        if group is not None:
            t = torch.tensor([same], dtype=torch.int32, device=self.device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            same = int(t.item())
        self.pending = None
        self.state = RerunState.NOT_RUNNING_YET
        return EXIT_CODE_RESUME_TO_DISAMBIGUATE if same else EXIT_CODE_FAILED_ON_RESULT_VALIDATION

    def record_stats(self, iteration: int, initial: float, result: float, group) -> None:
        """report_determinism_stats: one sample per iteration; a summary every few iterations."""
        self.stats.append(compare_floats(initial, result))
        if iteration % REPORTING_INTERVAL_ITERATIONS != 0:
            return
        samples = self.stats
        if group is not None:
            gathered = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, samples, group=group)
            samples = [s for part in gathered for s in part]
        if self.rank == 0:
            logger.info("Stats on computation determinism in validation calls")
            logger.info("  From validation call 'loss': %s", summarize(samples))

    @staticmethod
    def _log(fatal: bool, text: str) -> None:
        (logger.error if fatal else logger.warning)(text)


def summarize(samples: list[float]) -> str:
    """Megatron's one-line summary of relative differences (identical ones counted apart)."""
    zeros = sum(1 for s in samples if s == 0.0)
    rest = sorted(s for s in samples if s != 0.0)
    if not rest:
        return f"{zeros:,} samples, all identical"
    total = zeros + len(rest)
    parts = []
    for p in (0.5, 0.9, 0.99, 0.999):
        i = int(total * p) - zeros
        parts.append(f"p{p * 100:g}= {rest[i]:.3E}" if i >= 0 else f"p{p * 100:g}= 0.0")
    return (
        f"{total:,}/{zeros:,} total/identical samples, rel. variability: avg= {sum(rest) / total:.3E}, "
        + ", ".join(parts)
        + f", max: {max(rest):.3E}"
    )


def write_state(folder: str, state: dict[str, Any]) -> None:
    """Writes the pending validation into a checkpoint folder."""
    path = os.path.join(folder, STATE_FILENAME)
    with open(path + ".tmp", "w") as f:
        json.dump(state, f)
    os.replace(path + ".tmp", path)


def read_state(folder: str) -> dict[str, Any] | None:
    """The pending validation a checkpoint folder holds, or None."""
    path = os.path.join(folder, STATE_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)
