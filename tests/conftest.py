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


def bitwise_record(losses, grads) -> dict:
    """A run's losses as exact float hex and its ``main_grad``s as digests: what runs in two processes
    compare bit for bit (:func:`assert_bitwise_same`)."""
    return {"losses": [loss.item().hex() for loss in losses], "grads": [tensor_digest(g) for g in grads]}


def _bits_equal(a, b) -> bool:
    return a == b if isinstance(a, str) else torch.equal(a, b)


def assert_bitwise_same(eager: tuple, graphed: tuple, what: str, grads_after: int = 3) -> None:
    """Two runs' ``(losses, main_grads)`` equal bit for bit: tensors, or :func:`bitwise_record`'s hex
    and digests. ``grads_after``: the iteration the gradients were taken after (for the message)."""
    (e_losses, e_grads), (g_losses, g_grads) = eager, graphed
    assert len(e_losses) == len(g_losses), f"{what}: {len(e_losses)} eager losses, {len(g_losses)} graphed"
    assert len(e_grads) == len(g_grads), f"{what}: {len(e_grads)} eager main_grads, {len(g_grads)} graphed"
    for i, (a, b) in enumerate(zip(e_losses, g_losses)):
        value = float.fromhex if isinstance(a, str) else torch.Tensor.item
        assert _bits_equal(a, b), (
            f"{what}: lm loss differs at iteration {i + 1}: eager {value(a)!r} graphed {value(b)!r}"
        )
    differ = [k for k, (a, b) in enumerate(zip(e_grads, g_grads)) if not _bits_equal(a, b)]
    if differ and isinstance(e_grads[differ[0]], torch.Tensor):
        first = (e_grads[differ[0]] - g_grads[differ[0]]).abs().max().item()
        differ_text = f"{differ} (max diff of the first: {first})"
    else:
        differ_text = str(differ)
    assert not differ, f"{what}: main_grad of parameters {differ_text} differ after iteration {grads_after}"


def count_forwards(modules) -> list[int]:
    """A list that counts the forward calls begun on each of ``modules`` from now on (pre-hooks: a
    recompute stops once the saved tensors are back, so its forward may never return)."""
    count = [0] * len(modules)
    for i, module in enumerate(modules):
        module.register_forward_pre_hook(lambda *_, i=i: count.__setitem__(i, count[i] + 1))
    return count


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
