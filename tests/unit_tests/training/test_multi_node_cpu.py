"""Two torchrun agents as two "nodes" on localhost (gloo, CPU): static and c10d rendezvous.

Each agent launches one process; together they form one world of two ranks, as two hosts
with one GPU each would. The static rendezvous runs data parallel, the c10d one a
two-stage pipeline whose stages sit on different "nodes"; both follow the single-process
loss curve.
"""

import os
import socket
import subprocess
import sys

import pytest

from tests.unit_tests.training.test_data_parallel_cpu import FLAGS, ROOT, losses


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_agents(rendezvous: list[str], script_args: list[str], tmp_path) -> list[str]:
    """Starts both agents, waits for both; returns their outputs (node 0 first)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1"]
        cmd += [arg.format(node=node) for arg in rendezvous]
        cmd += ["pretrain_gpt.py", *script_args]
        log = open(tmp_path / f"node{node}.log", "w")
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    outputs = []
    try:
        for proc, _log in procs:
            proc.wait(timeout=300)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
            log.close()
    for node, (proc, _) in enumerate(procs):
        text = (tmp_path / f"node{node}.log").read_text()
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{text[-4000:]}"
        outputs.append(text)
    return outputs


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    """The reference loss curve: the same flags in one process."""
    path = tmp_path_factory.mktemp("single") / "single.jsonl"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    cmd = [sys.executable, "pretrain_gpt.py", *FLAGS, "--metrics-file", str(path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return losses(path)


def assert_follows(reference, got, what):
    assert len(reference) == len(got) == 20, (len(reference), len(got))
    for i, (x, y) in enumerate(zip(reference, got)):
        assert abs(x - y) <= 1e-5 * abs(x), f"{what}, iteration {i + 1}: single process {x} vs {y}"


@pytest.mark.slow
def test_two_agents_static_rendezvous_data_parallel(tmp_path, single_process):
    metrics = tmp_path / "dp2.jsonl"
    port = free_port()
    rendezvous = ["--node-rank", "{node}", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    outputs = launch_two_agents(rendezvous, [*FLAGS, "--metrics-file", str(metrics)], tmp_path)
    # One world of two ranks: node 1 holds rank 1, the last rank, which logs (Megatron's rule).
    assert "iteration       20/      20 |" in outputs[1] and "/      20 |" not in outputs[0]
    assert_follows(single_process, losses(metrics), "two nodes, DP=2")


@pytest.mark.slow
def test_two_agents_c10d_rendezvous_pipeline_across_nodes(tmp_path, single_process):
    metrics = tmp_path / "pp2.jsonl"
    port = free_port()
    rendezvous = ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "two-nodes"]
    pp = ["--pipeline-model-parallel-size", "2"]
    launch_two_agents(rendezvous, [*FLAGS, *pp, "--metrics-file", str(metrics)], tmp_path)
    # c10d assigns node ranks itself; the last pipeline stage (whichever node) logs the loss.
    assert_follows(single_process, losses(metrics), "two nodes, PP=2 (one stage per node)")
