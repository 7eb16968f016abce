"""Running one training command with a hard timeout and a hang check; killing what it started.

``run_command`` starts a command in a session of its own, writes its stdout and stderr
to a log file, and watches the log: a run that prints its last iteration's line
(``iteration N/ N``) and has not exited ``hang_grace_s`` later is reported as hung; one
that printed an iteration line and no further one for ``stall_s`` as stalled; one still
running at ``timeout_s`` as timed out. Each way everything it started is killed.

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
    """

    status: str
    rc: int | None
    wall_s: float
    last_iteration: int
    final_after_s: float | None


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
    seen = dict(seen or {})
    _remember(proc.pid, seen)
    _signal_groups([proc.pid, *_still_ours(seen)], signal.SIGTERM)
    deadline = time.monotonic() + _TERM_WAIT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None and not _still_ours(seen):
            break
        time.sleep(0.1)
    _remember(proc.pid, seen)
    _signal_groups([proc.pid, *_still_ours(seen)], signal.SIGKILL)
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


def run_command(
    cmd: list[str],
    log_path: str,
    *,
    timeout_s: float,
    hang_grace_s: float,
    stall_s: float | None = None,
    env: dict[str, str] | None = None,
    cwd: str | None = None,
    poll_s: float = 0.25,
) -> Outcome:
    """Runs ``cmd`` with stdout and stderr in ``log_path``; see the module docstring."""
    start = time.monotonic()
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True)
    offset, last, final, final_at = 0, 0, False, None
    progress_at = None  # when the highest iteration line so far appeared
    status = None
    seen: dict[int, int] = {}  # every descendant met: pid -> start time
    try:
        while True:
            _remember(proc.pid, seen)
            rc = proc.poll()
            before = last
            offset, last, final = _scan(log_path, offset, last, final)
            now = time.monotonic()
            if last > before:
                progress_at = now
            if final and final_at is None:
                final_at = now
            if rc is not None:
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
        if proc.poll() is None or _still_ours(seen):
            kill_tree(proc, seen)
    wall = time.monotonic() - start
    offset, last, final = _scan(log_path, offset, last, final)
    if status is None:
        status = "ok" if proc.returncode == 0 else "failed"
        rc = proc.returncode
    else:
        rc = None
    return Outcome(status, rc, wall, last, None if final_at is None else final_at - start)
