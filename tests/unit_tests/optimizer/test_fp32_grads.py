"""Fp32GradCopies: per-step fp32 copies of bf16/fp16 main_grads, as views into one copy per buffer."""

import pytest
import torch

from megatron.core.optimizer.fp32_grads import Fp32GradCopies


def test_copies_are_exact_views_at_the_main_grad_offsets():
    buffer = torch.randn(40).to(torch.bfloat16)
    padding_only = torch.zeros(8, dtype=torch.bfloat16)  # a shard no gradient lies in
    inside = [buffer[3:15].view(3, 4), buffer[20:40]]
    outside = torch.randn(5).to(torch.float16)
    already = torch.randn(6)
    copies = Fp32GradCopies([*inside, outside, already], [buffer, padding_only])
    got = copies.make()
    assert all(g.dtype == torch.float32 for g in got)
    for g, src in zip(got, [*inside, outside]):
        assert g.shape == src.shape and torch.equal(g, src.float())  # the upcast is exact
    assert got[-1] is already  # an fp32 main_grad is used as it is
    flat = copies.of([buffer])[0]
    assert flat.data_ptr() == got[0].data_ptr() - 3 * 4  # a view of the buffer's one copy
    assert got[1].data_ptr() == flat.data_ptr() + 20 * 4
    assert torch.equal(copies.of([padding_only])[0], torch.zeros(8))
    assert copies.of([inside[1]])[0] is got[1]
    got[0].mul_(2.0)  # unscaling or clipping the copy leaves main_grad alone
    assert torch.equal(inside[0].float() * 2, got[0])
    copies.clear()
    with pytest.raises(KeyError):
        copies.of([buffer])


def test_each_step_copies_the_current_values():
    buffer = torch.zeros(16, dtype=torch.bfloat16)
    copies = Fp32GradCopies([buffer[:8]], [buffer])
    first = copies.make()[0]
    buffer.fill_(1.5)
    assert torch.equal(first, torch.zeros(8))
    assert torch.equal(copies.make()[0], torch.full((8,), 1.5))
