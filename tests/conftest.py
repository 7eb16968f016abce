"""Test-wide setup: the ``gpu`` marker skips without CUDA; determinism settings restored after each
test; shared tiny models and tools."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_GPT_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --vocab-size 64 --tokenizer-type NullTokenizer --mock-data "
    "--lr 1e-3 --attention-dropout 0 --hidden-dropout 0 --num-workers 0 --log-interval 1000 --seed 3"
)
"""A GPT small enough to train in well under a second per iteration on one CPU core."""


def run_config(extra: str, world_size: int = 1):
    """The resolved (not validated) ``RunConfig`` of a 4-layer toy GPT's flags plus ``extra``."""
    from megatron.training.arguments import parse_args

    flags = "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    flags += "--micro-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    return parse_args((flags + extra).split()).resolve(world_size=world_size)


def run_in_own_process(module: str, function: str, *args: str, timeout: int = 600) -> dict:
    """``module.function()`` in a fresh Python process started in the repository root (``args`` in its
    ``sys.argv[1:]``); returns what it passed to :func:`report_to_parent`. For GPU memory tests: a
    training process runs one trainer, and in one process the cache an earlier run leaves is reused
    by a later eager run but not by graph pools."""
    code = f"import sys; sys.path.insert(0, {REPO!r}); from {module} import {function}; {function}()"
    done = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line.removeprefix("RESULT "))


def report_to_parent(result: dict) -> None:
    """The child's side of :func:`run_in_own_process` (``result`` must be JSON)."""
    print("RESULT " + json.dumps(result), flush=True)


def tensor_digest(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes: equal digests, equal tensors bit for bit (across processes)."""
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(autouse=True)
def _restore_determinism():
    """Every test starts with the process's determinism settings (and cuBLAS's bf16 reduction setting) as
    the previous one found them: ``--deterministic-mode`` (``--disable-bf16-reduced-precision-matmul``)
    switches them for the process (as in Megatron), and a later test's kernels, and so its memory, would
    otherwise depend on which tests ran before it."""
    cudnn = torch.backends.cudnn
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn.deterministic,
        cudnn.benchmark,
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
    )
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    cudnn.deterministic, cudnn.benchmark = saved[2], saved[3]
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = saved[4]


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture
def tiny_argv():
    """``tiny_argv(**overrides)``: the tiny GPT's flags as argv, ``--train-iters`` etc. added."""

    def make(*extra: str) -> list[str]:
        return TINY_GPT_FLAGS.split() + [a for e in extra for a in e.split()]

    return make


def _load_tool(name: str):
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def load_tool():
    """``load_tool("graph_bench")``: a script under tools/ as a module."""
    return _load_tool
