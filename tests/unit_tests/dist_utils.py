"""Multi-rank test helper: run a function on N gloo CPU processes and fail loudly.

``run_distributed(fn, world_size, *args)`` starts one process per rank, points them at a
free local port, initialises a gloo process group in each, runs ``fn(rank, world_size,
*args)`` and returns the per-rank return values.

Ranks come from a fork server that imported torch (and torch.distributed, torch._dynamo,
megatron.core) once: a rank then starts in milliseconds instead of the seconds a fresh
interpreter takes to import torch. The server is a clean interpreter, not the pytest process, so ranks still
never inherit the parent's torch state; each rank takes the parent's current environment.

Unusual on purpose: a rank that raises, dies, or hangs becomes a ``pytest.fail`` in
the parent with the rank's traceback, and every other rank is killed at once, since
they are usually stuck in a collective waiting for the dead one. The timeout clock
starts when every rank's interpreter is up (imports are slow on a loaded laptop and
are not what we test); interpreter start-up has its own, generous allowance.
"""

import datetime
import multiprocessing
import os
import pickle
import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import pytest

# Seconds a rank may take to start its interpreter and import the test module.
_STARTUP_TIMEOUT_S = 120.0
# Seconds to keep reading the queue after a rank exits, for messages still in the pipe.
_DRAIN_S = 1.0
# Seconds to keep collecting other ranks' reports after the first failure.
_GRACE_S = 2.0


def _free_port() -> int:
    """Returns a TCP port that was free a moment ago (the usual small race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# Imported once by the fork server, so that ranks forked from it start with them loaded.
_PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "megatron.core.parallel_state"]


def _context() -> multiprocessing.context.BaseContext:
    """The fork server's context where the platform has one, else spawn.

    Spawn too while ``TRITON_INTERPRET`` is set: triton, which torch._dynamo imports,
    reads it when its own kernels are defined, so ranks forked from a server that
    imported triton without it would mix compiled and interpreted functions.
    """
    if "forkserver" not in multiprocessing.get_all_start_methods() or os.environ.get("TRITON_INTERPRET"):
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _worker(
    fn: Callable, rank: int, world_size: int, port: int, timeout: float, args: tuple, environ: dict, results
) -> None:
    """Child entry point: set the torchrun-style environment, init gloo, run ``fn``, report."""
    results.put(("ready", rank, None))
    # The parent's environment as it is now (the fork server's is from when it started).
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
    )
    try:
        import torch
        import torch.distributed as dist

        # Two ranks on two cores: one intra-op thread each avoids oversubscription.
        torch.set_num_threads(1)
        # As parallel_state.initialize does: torch._dynamo (imported by torch.optim),
        # imported after the group exists, keeps it alive past destroy_process_group, and
        # gloo's threads then abort at interpreter exit now and then.
        import torch._dynamo  # noqa: F401

        dist.init_process_group(
            "gloo",
            init_method="env://",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=max(timeout, 1.0)),
        )
        value = fn(rank, world_size, *args)
    except BaseException:  # noqa: BLE001 - everything goes back to the parent as text
        # Report before anything else: peers stuck in a collective will fail next, and
        # the parent should see the cause first. No destroy: it could wait on peers.
        results.put(("error", rank, traceback.format_exc()))
        return
    try:
        # By value: the queue's own pickler would share tensor storage through a file
        # descriptor that dies with this process, which may exit before the parent reads it.
        results.put(("ok", rank, pickle.dumps(value)))
    except Exception:  # noqa: BLE001 - an unpicklable return value
        results.put(("error", rank, "return value could not be sent:\n" + traceback.format_exc()))
    # Tear gloo down only once every rank is done: destroying it while a peer is still in
    # its last collective aborts that peer ("terminate called without an active exception").
    dist.barrier()
    dist.destroy_process_group()


def _kill_all(procs: list[multiprocessing.Process]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120) -> list[Any]:
    """Runs ``fn(rank, world_size, *args)`` on ``world_size`` gloo CPU processes.

    Args:
        fn: A module-level (picklable) function. The process group is initialised
            before it runs and destroyed after it returns.
        world_size: Number of ranks.
        *args: Picklable arguments passed to every rank after ``rank, world_size``.
        timeout: Seconds allowed, once all ranks are up, for process-group setup and
            ``fn`` on every rank; past it all ranks are killed and the test fails.

    Returns:
        The return values of ``fn``, indexed by rank.
    """
    assert world_size >= 1, world_size
    try:
        pickle.dumps((fn, args))
    except Exception as exc:  # noqa: BLE001
        pytest.fail(f"run_distributed needs a module-level function and picklable args: {exc!r}")

    ctx = _context()
    messages = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, rank, world_size, port, timeout, args, dict(os.environ), messages),
            name=f"rank{rank}",
            daemon=True,
        )
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()

    results: list[Any] = [None] * world_size
    ready: set = set()
    done: set = set()
    failures: dict = {}  # rank -> text
    exited_at: dict = {}  # rank -> when its process was first seen dead without reporting
    started = time.monotonic()
    deadline: float | None = None  # set once every rank is up
    give_up: float | None = None  # set at the first failure: collect the others' reports briefly
    timed_out: str | None = None
    try:
        while len(done) + len(failures) < world_size:
            try:
                kind, rank, payload = messages.get(timeout=0.05)
            except queue.Empty:
                kind = None
            if kind == "ready":
                ready.add(rank)
                if len(ready) == world_size:
                    deadline = time.monotonic() + timeout
            elif kind == "ok":
                results[rank] = pickle.loads(payload)
                done.add(rank)
            elif kind == "error":
                failures.setdefault(rank, f"rank {rank} raised:\n{payload}")
            now = time.monotonic()
            for rank, proc in enumerate(procs):
                if rank in done or rank in failures or proc.exitcode is None:
                    continue
                # Dead without a report so far: messages already in the pipe get a moment.
                if now - exited_at.setdefault(rank, now) > _DRAIN_S:
                    failures[rank] = (
                        f"rank {rank} exited with code {proc.exitcode} without returning "
                        "(a crash, os._exit, or a failure while unpickling fn; see captured stderr)."
                    )
            if failures and give_up is None:
                give_up = now + _GRACE_S
            if give_up is not None and now > give_up:
                break
            if deadline is None and now - started > _STARTUP_TIMEOUT_S:
                timed_out = (
                    f"ranks {sorted(set(range(world_size)) - ready)} did not start within {_STARTUP_TIMEOUT_S:.0f} s."
                )
                break
            if deadline is not None and now > deadline:
                pending = sorted(set(range(world_size)) - done - set(failures))
                timed_out = f"ranks {pending} did not finish within timeout={timeout} s (hang?); all ranks killed."
                break
    finally:
        if failures or timed_out:
            _kill_all(procs)
        else:
            for proc in procs:
                proc.join(timeout=30)
            _kill_all(procs)
        messages.close()
    if failures or timed_out:
        # Deaths first: a dead rank is the usual cause of its peers' connection errors.
        ordered = sorted(failures, key=lambda r: ("exited with code" not in failures[r], r))
        parts = ([timed_out] if timed_out else []) + [failures[r] for r in ordered]
        pytest.fail("\n\n".join(parts), pytrace=False)
    for rank, proc in enumerate(procs):
        if proc.exitcode not in (0, None):
            pytest.fail(f"rank {rank} returned but exited with code {proc.exitcode}.", pytrace=False)
    return results


def cpu_process_groups():
    """``ProcessGroups`` for the current gloo world, with the world as data-parallel group.

    Call inside a function run by ``run_distributed``.
    """
    import torch
    import torch.distributed as dist

    from megatron.core.parallel_state import ProcessGroups

    world = dist.get_world_size()
    dp = dist.group.WORLD if world > 1 else None
    return ProcessGroups(rank=dist.get_rank(), world_size=world, device=torch.device("cpu"), dp=dp)


def train_curves(rank: int, world_size: int, argvs: dict, hybrid: bool = False) -> dict:
    """For ``run_distributed``: trains each command line of ``argvs`` (name -> argv) in turn
    through the trainer (``pretrain_hybrid.py``'s model with ``hybrid``) and returns
    ``{name: [(lm loss, grad-norm) of each logged iteration]}``."""
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    providers = ()
    if hybrid:
        import pretrain_hybrid

        providers = (pretrain_hybrid.model_provider, pretrain_hybrid.forward_step)
    out = {}
    for name, argv in argvs.items():
        trainer = build_trainer(argv, *providers)
        history = trainer.train()
        parallel_state.destroy(trainer.pg)
        out[name] = [(r["lm loss"], r["grad-norm"]) for r in history]
    return out
