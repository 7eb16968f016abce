"""The GPU memory tests' helpers in tests/conftest.py: a function run in a process of its own, and
tensor digests that compare bits across processes."""

import os
import sys

import pytest
import torch

from tests.conftest import report_to_parent, run_in_own_process, tensor_digest

MODULE = "tests.unit_tests.test_own_process"


def _child() -> None:
    report_to_parent({"args": sys.argv[1:], "digest": tensor_digest(torch.arange(4.0)), "pid": os.getpid()})


def _failing_child() -> None:
    raise ValueError("the child's own error")


def test_a_function_runs_in_a_process_of_its_own_and_reports_back():
    result = run_in_own_process(MODULE, "_child", "a", "b c", timeout=120)
    assert result["args"] == ["a", "b c"]
    assert result["digest"] == tensor_digest(torch.arange(4.0))
    assert result["pid"] != os.getpid()


def test_a_failing_child_fails_the_test_with_its_error():
    with pytest.raises(AssertionError, match="the child's own error"):
        run_in_own_process(MODULE, "_failing_child", timeout=120)


def test_digests_tell_bits_apart():
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))
    assert tensor_digest(torch.tensor([1.0, 2.0])[1:]) == tensor_digest(torch.tensor([2.0]))
