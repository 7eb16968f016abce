"""Running one training job with a hard timeout and a hang check; killing what it started.

``run_commands`` starts the job's commands (one torchrun launcher, or one per "node" of a
multi-node job on this host) each in a session of its own, writes their stdout and
stderr to one log file, and watches the log: a job that prints its last iteration's
line (``iteration N/ N``) and has not exited (every command) ``hang_grace_s`` later is
reported as hung; one that printed an iteration line and no further one for
``stall_s`` as stalled; one still running at ``timeout_s`` as timed out; one whose
command exits non-zero as failed at once. Each way everything it started is killed.
``run_command`` is the one-command case. ``MemoryPoller`` records each GPU's peak
memory in use (NVML) while a job runs.

Unusual: torchrun starts each worker in a session of its own, so killing torchrun's
process group leaves the workers running (and holding their GPUs). The kill therefore
walks ``/proc`` for every descendant first and signals each one's process group too:
SIGTERM, then SIGKILL to whatever is left after a few seconds.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal
import subprocess
import threading
import time

_LAST_ITERATION = re.compile(rb"\biteration\s+(\d+)/\s*(\d+) \|")
_TERM_WAIT_S = 5.0


@dataclasses.dataclass
class Outcome:
    """How a command ended.

    Attributes:
        status: ``"ok"``, ``"failed"`` (non-zero exit), ``"timeout"`` (killed at the hard
            timeout), ``"hung"`` (printed its last iteration, then did not exit) or
            ``"stalled"`` (no new iteration line for ``stall_s`` before the last one).
        rc: Exit code (negative: killed by that signal); None if it had to be killed.
        wall_s: Seconds from start to exit (or to the kill).
        last_iteration: Highest iteration line seen in the log (0: none).
        final_after_s: Seconds from start to the last iteration's line, or None.
        pids: The process id of each command, in the order given.
    """

    status: str
    rc: int | None
    wall_s: float
    last_iteration: int
    final_after_s: float | None
    pids: list[int] = dataclasses.field(default_factory=list)


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (children first), read from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # The command name is in parentheses and may hold spaces: fields after its ")".
        ppid = int(stat[stat.rindex(b")") + 2 :].split()[1])
        children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a reused pid apart), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] == b"Z" else int(fields[19])


def _signal_groups(pids: list[int], sig: int) -> None:
    for pgid in {_pgid(p) for p in pids} - {None, os.getpgrp()}:
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            pass


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _still_ours(seen: dict[int, int]) -> list[int]:
    """The pids of ``seen`` (pid -> start time) that still run as the same process."""
    return [pid for pid, start in seen.items() if _start_time(pid) == start]


def kill_tree(proc: subprocess.Popen, seen: dict[int, int] | None = None) -> None:
    """SIGTERM to the process group of ``proc`` and of each descendant, then SIGKILL what is left.

    ``seen``: descendants recorded earlier (pid -> start time), which may have been
    re-parented away from ``proc`` since.
    """
    kill_all([(proc, seen or {})])


def kill_all(jobs: list[tuple[subprocess.Popen, dict[int, int]]]) -> None:
    """``kill_tree`` for several processes at once: one SIGTERM round, one wait, one SIGKILL round."""
    jobs = [(proc, dict(seen)) for proc, seen in jobs]
    for proc, seen in jobs:
        _remember(proc.pid, seen)
        _signal_groups([proc.pid, *_still_ours(seen)], signal.SIGTERM)
    deadline = time.monotonic() + _TERM_WAIT_S
    while time.monotonic() < deadline:
        if all(proc.poll() is not None and not _still_ours(seen) for proc, seen in jobs):
            break
        time.sleep(0.1)
    for proc, seen in jobs:
        _remember(proc.pid, seen)
        _signal_groups([proc.pid, *_still_ours(seen)], signal.SIGKILL)
    for proc, _ in jobs:
        try:
            proc.wait(timeout=_TERM_WAIT_S)
        except subprocess.TimeoutExpired:
            pass


def _remember(pid: int, seen: dict[int, int]) -> None:
    """Adds the live descendants of ``pid`` to ``seen`` (pid -> start time)."""
    for child in descendants(pid):
        start = _start_time(child)
        if start is not None:
            seen.setdefault(child, start)


def _scan(log_path: str, offset: int, last: int, final: bool) -> tuple[int, int, bool]:
    """New complete lines of the log since ``offset``: (new offset, highest iteration, last one seen)."""
    with open(log_path, "rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    for m in _LAST_ITERATION.finditer(chunk[:end]):
        it, total = int(m.group(1)), int(m.group(2))
        last = max(last, it)
        final = final or it == total
    return offset + end, last, final


def run_command(cmd: list[str], log_path: str, *, env: dict[str, str] | None = None, **kwargs) -> Outcome:
    """Runs ``cmd`` with stdout and stderr in ``log_path``; see the module docstring."""
    return run_commands([cmd], log_path, envs=[env], **kwargs)


def run_commands(
    cmds: list[list[str]],
    log_path: str,
    *,
    timeout_s: float,
    hang_grace_s: float,
    stall_s: float | None = None,
    envs: list[dict[str, str] | None] | None = None,
    cwd: str | None = None,
    poll_s: float = 0.25,
) -> Outcome:
    """Runs the commands of one job at once, all writing to ``log_path``; see the module docstring.

    Args:
        cmds: The commands, started in this order.
        envs: Each command's environment (None: this process's), or None for all.
    """
    start = time.monotonic()
    procs: list[subprocess.Popen] = []
    seen: list[dict[int, int]] = []  # per command, every descendant met: pid -> start time
    offset, last, final, final_at = 0, 0, False, None
    progress_at = None  # when the highest iteration line so far appeared
    status, rc = None, None
    try:
        with open(log_path, "ab") as log:
            for cmd, env in zip(cmds, envs or [None] * len(cmds), strict=True):
                procs.append(
                    subprocess.Popen(
                        cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
                    )
                )
                seen.append({})
        while True:
            for proc, met in zip(procs, seen):
                _remember(proc.pid, met)
            codes = [proc.poll() for proc in procs]
            before = last
            offset, last, final = _scan(log_path, offset, last, final)
            now = time.monotonic()
            if last > before:
                progress_at = now
            if final and final_at is None:
                final_at = now
            failed = next((code for code in codes if code not in (None, 0)), None)
            if failed is not None:  # the other launchers would wait for it until their timeouts
                status, rc = "failed", failed
                break
            if all(code == 0 for code in codes):
                status, rc = "ok", 0
                break
            if final_at is not None and now - final_at > hang_grace_s:
                status = "hung"
                break
            if final_at is None and progress_at is not None and stall_s is not None and now - progress_at > stall_s:
                status = "stalled"
                break
            if now - start > timeout_s:
                status = "timeout"
                break
            time.sleep(poll_s)
    finally:
        jobs = list(zip(procs, seen))
        if any(proc.poll() is None or _still_ours(met) for proc, met in jobs):
            kill_all(jobs)
    wall = time.monotonic() - start
    offset, last, final = _scan(log_path, offset, last, final)
    final_after = None if final_at is None else final_at - start
    return Outcome(status, rc, wall, last, final_after, [proc.pid for proc in procs])


def _gpu_index_map(visible: str | None) -> list[int] | None:
    """CUDA_VISIBLE_DEVICES as a list of GPU indices (None: unset, all GPUs in their order)."""
    if visible is None:
        return None
    return [int(d) for d in visible.split(",") if d.strip()]


def nvml_sampler():
    """A function returning each GPU's memory in use (NVML index -> MiB), or None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    except Exception:  # no nvidia-ml-py, no driver: nothing to poll
        return None
    return lambda: {i: pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20 for i, h in enumerate(handles)}


class MemoryPoller:
    """Records each GPU's peak memory in use while a job runs, polled by a thread of this process.

    The driver's figure is device-wide (the CUDA context, NCCL's buffers and the
    allocator's reserve of every process on the GPU) and sampled every ``interval_s``: a
    peak shorter than that may be missed. The thread only waits on NVML, and the job
    runs in other processes. Use as a context manager around the job; ``peaks`` is
    empty when ``sample`` is None (no NVML).

    Args:
        sample: () -> {GPU index: MiB in use}, or None.
        interval_s: Seconds between samples.
    """

    def __init__(self, sample, interval_s: float = 0.05):
        self.sample, self.interval_s = sample, interval_s
        self.peaks: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _poll(self) -> None:
        while True:
            for index, used in self.sample().items():
                self.peaks[index] = max(self.peaks.get(index, 0.0), used)
            if self._stop.wait(self.interval_s):
                return

    def __enter__(self) -> MemoryPoller:
        if self.sample is not None:
            self._thread = threading.Thread(target=self._poll, name="gpu-memory-poller", daemon=True)
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()


def rank_gpus(nproc: int, visible: str | None, node_pids: list[int] | None = None) -> list[int]:
    """The GPU index (NVML's) of each rank of a job of ``nproc`` processes.

    Each launcher's local rank ``i`` takes the ``i``-th GPU it sees. Launcher ``n`` of a
    multi-node job (``node_pids``: each launcher's process id, in node order) sees the
    GPUs ``node_devices`` gives it; torchrun's c10d rendezvous ignores ``--node-rank``
    and numbers the launchers in the order of their (address, process id), so with one
    address the lowest process id holds the first ranks. Assumes CUDA and NVML number
    the GPUs alike (they do for GPUs of one model; CUDA_DEVICE_ORDER=PCI_BUS_ID makes it
    sure).
    """
    devices = _gpu_index_map(visible)
    if devices is None:
        devices = list(range(nproc))
    if not node_pids or len(node_pids) == 1:
        return devices[:nproc]
    per_node = nproc // len(node_pids)
    out = []
    for node in sorted(range(len(node_pids)), key=lambda n: node_pids[n]):
        out += devices[node * per_node : (node + 1) * per_node]
    return out


def node_devices(node: int, per_node: int, visible: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of launcher ``node`` (``per_node`` GPUs each) of a multi-node job."""
    devices = _gpu_index_map(visible)
    if devices is None:
        devices = list(range((node + 1) * per_node))
    return ",".join(str(d) for d in devices[node * per_node : (node + 1) * per_node])
