"""Test-wide setup: the ``gpu`` marker skips without CUDA; shared tiny models and tools."""

import importlib.util
import os

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY_GPT_FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --vocab-size 64 --tokenizer-type NullTokenizer --mock-data "
    "--lr 1e-3 --attention-dropout 0 --hidden-dropout 0 --num-workers 0 --log-interval 1000 --seed 3"
)
"""A GPT small enough to train in well under a second per iteration on one CPU core."""


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
