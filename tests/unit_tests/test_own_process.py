"""The GPU tests' helpers in tests/conftest.py: a function run in a process of its own, tensor digests
that compare bits across processes, and the bitwise comparison of two runs."""

import os
import sys

import pytest
import torch

from tests.conftest import assert_bitwise_same, bitwise_record, report_to_parent, run_in_own_process, tensor_digest

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


def test_two_runs_compare_bit_for_bit_as_tensors_or_as_records():
    losses, grads = [torch.tensor(2.5), torch.tensor(1.25)], [torch.ones(3), torch.zeros(2)]
    nudged = [torch.ones(3), torch.tensor([0.0, 0.5])]
    assert_bitwise_same((losses, grads), (losses, [g.clone() for g in grads]), "same")
    record = bitwise_record(losses, grads)
    assert record["losses"] == [(2.5).hex(), (1.25).hex()]
    assert_bitwise_same((record["losses"], record["grads"]), (record["losses"], record["grads"]), "same")
    with pytest.raises(AssertionError, match=r"main_grad of parameters \[1\] \(max diff of the first: 0.5\) differ"):
        assert_bitwise_same((losses, grads), (losses, nudged), "tensors")
    other = bitwise_record(losses, nudged)
    with pytest.raises(AssertionError, match=r"records: main_grad of parameters \[1\] differ after iteration 3"):
        assert_bitwise_same((record["losses"], record["grads"]), (other["losses"], other["grads"]), "records")
    later = bitwise_record([losses[0], torch.tensor(1.5)], grads)
    with pytest.raises(AssertionError, match="lm loss differs at iteration 2: eager 1.25 graphed 1.5"):
        assert_bitwise_same((record["losses"], record["grads"]), (later["losses"], later["grads"]), "loss")
    with pytest.raises(AssertionError, match="short: 2 eager losses, 1 graphed"):
        assert_bitwise_same((losses, grads), (losses[:1], grads), "short")
    with pytest.raises(AssertionError, match="fewer: 2 eager main_grads, 1 graphed"):
        assert_bitwise_same((losses, grads), (losses, grads[:1]), "fewer")
