"""Data-loader workers end with their training process, however it dies (issue 21).

The runs use sequences of 1024 tokens and micro-batches of 4, so that the batches the
workers prefetch do not fit in a pipe's buffer: the case where, left to torch, workers
outlived a ``kill -9``'d trainer forever. Processes are found through ``/proc`` (``ps``
elsewhere); a zombie counts as gone, since it holds no memory and only waits to be
reaped by whatever process inherited it.
"""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
FLAGS = (
    "--num-layers 1 --hidden-size 64 --num-attention-heads 2 --seq-length 1024 --max-position-embeddings 1024 "
    "--micro-batch-size 4 --global-batch-size 4 --train-iters 100000 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 256 --num-workers 2 --log-interval 1 --eval-iters 0"
).split()
# Seconds a run may take to reach its second iteration (start-up and imports on a loaded machine).
START_S = 150.0
# Seconds every worker has to end after its trainer is killed.
END_S = 15.0

pytestmark = pytest.mark.skipif(not hasattr(os, "killpg"), reason="POSIX process groups")


def process_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state letter) of every process on the machine."""
    table = {}
    if os.path.isdir("/proc/self"):
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # ended while we looked
            table[int(name)] = (int(fields[1]), fields[0])
        return table
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid=,stat="], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
        pid, ppid, stat = line.split()[:3]
        table[int(pid)] = (int(ppid), stat[0])
    return table


def children(pid: int, table=None) -> list[int]:
    table = process_table() if table is None else table
    return sorted(p for p, (ppid, state) in table.items() if ppid == pid and state != "Z")


def alive(pids) -> list[int]:
    table = process_table()
    return [p for p in pids if p in table and table[p][1] != "Z"]


def describe(pids) -> str:
    """State and kernel wait channel of each pid, for failure messages."""
    table, parts = process_table(), []
    for p in pids:
        wchan = ""
        try:
            with open(f"/proc/{p}/wchan") as f:
                wchan = " in " + f.read().strip()
        except OSError:
            pass
        ppid, state = table.get(p, (None, "gone"))
        parts.append(f"pid {p} (parent {ppid}, state {state}{wchan})")
    return "; ".join(parts)


def start(cmd, log_path):
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    log = open(log_path, "w")
    # A session of its own: the cleanup can end the whole group, survivors included.
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    return proc


def wait_for(predicate, timeout_s: float, poll_s: float = 0.2):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    return predicate()


def wait_for_iteration(proc, log_path, iteration: int):
    mark = f"iteration {iteration:8d}/"

    def reached():
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit code {proc.returncode}) before iteration {iteration}:\n{tail(log_path)}")
        with open(log_path) as f:
            return mark in f.read()

    if not wait_for(reached, START_S, poll_s=0.5):
        pytest.fail(f"no iteration {iteration} within {START_S:.0f} s:\n{tail(log_path)}")


def tail(log_path, chars: int = 3000) -> str:
    with open(log_path) as f:
        return f.read()[-chars:]


def assert_all_end(workers, what: str):
    wait_for(lambda: not alive(workers), END_S)
    left = alive(workers)
    assert not left, f"{what}: workers still alive {END_S:.0f} s later: {describe(left)}"


def kill_groups(*pgids):
    for pgid in pgids:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def test_workers_end_with_a_killed_trainer(tmp_path):
    log_path = tmp_path / "train.log"
    trainer = start([sys.executable, "pretrain_gpt.py", *FLAGS], log_path)
    try:
        wait_for_iteration(trainer, log_path, 2)
        workers = children(trainer.pid)
        assert len(workers) == 2, f"expected the 2 workers of --num-workers 2, found {describe(workers)}"
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait(timeout=30)
        assert_all_end(workers, "trainer killed with SIGKILL")
    finally:
        kill_groups(trainer.pid)
        if trainer.poll() is None:
            trainer.wait(timeout=30)


def test_workers_of_both_ranks_end_when_one_dp_rank_is_killed(tmp_path):
    log_path = tmp_path / "torchrun.log"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    flags = [*FLAGS, "--distributed-timeout-minutes", "1"]
    flags[flags.index("--global-batch-size") + 1] = "8"  # one micro-batch of 4 per rank
    run = start([*cmd, "pretrain_gpt.py", *flags], log_path)
    ranks = []
    try:
        wait_for_iteration(run, log_path, 2)
        table = process_table()
        ranks = children(run.pid, table)
        assert len(ranks) == 2, f"expected 2 ranks under torchrun, found {describe(ranks)}"
        workers = {rank: children(rank, table) for rank in ranks}
        assert all(len(w) == 2 for w in workers.values()), f"expected 2 workers per rank: {workers}"
        os.kill(ranks[1], signal.SIGKILL)
        everyone = [w for ws in workers.values() for w in ws]
        assert_all_end(everyone, f"rank pid {ranks[1]} killed with SIGKILL (workers by rank: {workers})")
        try:
            run.wait(timeout=60)  # torchrun tears the other rank down and reports the failure
        except subprocess.TimeoutExpired:
            pytest.fail(f"torchrun still running 60 s after its workers ended:\n{tail(log_path)}")
        assert run.returncode != 0, f"torchrun should report the killed rank:\n{tail(log_path)}"
    finally:
        kill_groups(run.pid, *ranks)  # each rank runs in a session of its own under torchrun
        if run.poll() is None:
            run.wait(timeout=30)


_FALLBACK_PROBE = textwrap.dedent(
    """
    import sys, time
    import torch
    import megatron.core.datasets.data_samplers as samplers
    from megatron.core.datasets.data_samplers import build_pretraining_data_loader

    samplers._set_pdeathsig = lambda: False  # as on macOS: the poll alone

    class Batches(torch.utils.data.Dataset):
        def __len__(self):
            return 10**6

        def __getitem__(self, i):
            return {"tokens": torch.full((1024,), i), "loss_mask": torch.ones(1024)}

    if __name__ == "__main__":  # spawned workers import this file too
        it = iter(build_pretraining_data_loader(Batches(), 0, 4, 0, 1, num_workers=2))
        next(it)
        print("ready", flush=True)
        time.sleep(600)
    """
)


def test_workers_end_without_pdeathsig(tmp_path):
    """The portable path alone (no PR_SET_PDEATHSIG): the parent poll ends the workers."""
    probe, log_path = tmp_path / "probe.py", tmp_path / "probe.log"
    probe.write_text(_FALLBACK_PROBE)
    parent = start([sys.executable, str(probe)], log_path)
    try:
        if not wait_for(lambda: parent.poll() is not None or "ready" in log_path.read_text(), START_S):
            pytest.fail(f"the probe did not start its workers within {START_S:.0f} s:\n{tail(log_path)}")
        assert parent.poll() is None, tail(log_path)
        workers = children(parent.pid)
        assert len(workers) == 2, f"expected 2 workers, found {describe(workers)}"
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert_all_end(workers, "parent killed with SIGKILL, no PR_SET_PDEATHSIG")
    finally:
        kill_groups(parent.pid)
        if parent.poll() is None:
            parent.wait(timeout=30)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_workers_started_without_fork_keep_working(method):
    """Spawned workers (macOS's default) get the watcher by pickle; a forkserver's workers
    have the forkserver as parent and must not take the trainer for dead."""
    import multiprocessing

    import torch

    from megatron.core.datasets.data_samplers import EndWithTrainer, WorkerBatches

    if method not in multiprocessing.get_all_start_methods():
        pytest.skip(f"no {method} start method here")
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.arange(12)),
        batch_size=3,
        num_workers=1,
        persistent_workers=True,
        worker_init_fn=EndWithTrainer(),
        multiprocessing_context=method,
    )
    batches = WorkerBatches(loader)
    for _ in range(2):  # the second epoch reuses the same worker
        assert [b[0].tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]


class _SignalDisposition:
    """Each item: whether this (worker) process ignores SIGUSR1."""

    def __len__(self):
        return 2

    def __getitem__(self, i):
        return int(signal.getsignal(signal.SIGUSR1) == signal.SIG_IGN)


@pytest.mark.parametrize("ignored", [signal.SIGUSR1, None])
def test_spawned_workers_ignore_the_trainers_exit_signal(ignored):
    """With --exit-signal-handler the workers ignore --exit-signal, also when they are spawned (no handler
    is inherited then), so a signal sent to the whole process group does not end them mid-iteration."""
    import torch

    from megatron.core.datasets.data_samplers import EndWithTrainer, WorkerBatches

    loader = torch.utils.data.DataLoader(
        _SignalDisposition(),
        batch_size=2,
        num_workers=1,
        persistent_workers=True,
        worker_init_fn=EndWithTrainer(ignored_signal=ignored),
        multiprocessing_context="spawn",
    )
    (batch,) = list(WorkerBatches(loader))
    assert batch.tolist() == ([1, 1] if ignored else [0, 0])
