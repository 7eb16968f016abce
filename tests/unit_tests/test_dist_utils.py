"""Tests of the multi-rank helper itself: results come back, and failures are loud."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.unit_tests.dist_utils import run_distributed


def _report(rank, world_size, offset):
    value = torch.tensor([float(rank + offset)])
    dist.all_reduce(value)
    env = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    return rank, world_size, dist.get_rank(), dist.get_backend(), value.item(), env


def _raise_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 would wait forever for rank 1


def _hang_on_rank0(rank, world_size):
    if rank == 0:
        time.sleep(1000)


def _die_on_rank1(rank, world_size):
    if rank == 1:
        os._exit(3)
    dist.barrier()


def test_results_are_indexed_by_rank_and_env_is_set():
    out = run_distributed(_report, 2, 10)
    for rank, (r, ws, dist_rank, backend, reduced, env) in enumerate(out):
        assert (r, ws, dist_rank, backend) == (rank, 2, rank, "gloo")
        assert reduced == 10.0 + 11.0
        assert env == {"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1"}


def test_raising_rank_fails_with_its_traceback():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception) as info:
        run_distributed(_raise_on_rank1, 2, timeout=600)
    message = str(info.value)
    assert "rank 1 raised" in message
    assert "ValueError: boom from rank one" in message
    assert "_raise_on_rank1" in message  # the traceback text, not just the message
    # The waiting rank is killed, not waited for: far less than the 600 s timeout, even
    # when a loaded machine takes a minute to spawn two ranks.
    assert time.monotonic() - start < 300


def test_hanging_rank_times_out():
    start = time.monotonic()
    # Under load rank 1 may still be in its rendezvous when the 2 s run out, so the
    # pending list is [0] or [0, 1]; the hanging rank 0 is always in it.
    with pytest.raises(pytest.fail.Exception, match=r"ranks \[0(, 1)?\] did not finish within timeout=2 s") as info:
        run_distributed(_hang_on_rank0, 2, timeout=2)
    assert "all ranks killed" in str(info.value)
    assert time.monotonic() - start < 30


def test_dead_rank_fails():
    with pytest.raises(pytest.fail.Exception, match="rank 1 exited with code 3"):
        run_distributed(_die_on_rank1, 2, timeout=60)


def test_unpicklable_function_fails_early():
    with pytest.raises(pytest.fail.Exception, match="module-level function"):
        run_distributed(lambda rank, world_size: None, 2)


def _state(rank, world_size, name):
    return os.environ.get(name), torch.get_default_dtype(), torch.get_num_threads()


def test_ranks_take_the_parents_environment_of_now_and_none_of_its_torch_state(monkeypatch):
    # Ranks are forked from a server started at the first multi-rank test: a variable the
    # parent sets later must still reach them, and the parent's torch settings must not.
    run_distributed(_state, 1, "DIST_UTILS_PROBE")  # the server runs from here on
    monkeypatch.setenv("DIST_UTILS_PROBE", "set after the fork server started")
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        out = run_distributed(_state, 2, "DIST_UTILS_PROBE")
    finally:
        torch.set_default_dtype(default)
    assert out == [("set after the fork server started", torch.float32, 1)] * 2
