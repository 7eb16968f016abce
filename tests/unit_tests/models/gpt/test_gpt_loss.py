"""masked_mean_loss: masked mean in fp32, token count, no NaN for an empty mask."""

import torch

from megatron.core.models.gpt.loss import masked_mean_loss


def test_masked_mean_and_count():
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=torch.bfloat16)
    mask = torch.tensor([[1, 0, 1], [0, 0, 1]])
    value, num = masked_mean_loss(loss, mask)
    assert value.dtype == torch.float32 and value.dim() == 0
    assert abs(value.item() - 10.0 / 3) < 1e-6
    assert num.dtype == torch.int64 and num.item() == 3


def test_empty_mask_gives_zero_not_nan():
    value, num = masked_mean_loss(torch.ones(2, 2), torch.zeros(2, 2))
    assert value.item() == 0.0 and num.item() == 0


def test_grad_is_zero_on_masked_tokens():
    loss = torch.rand(2, 4, requires_grad=True)
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    masked_mean_loss(loss, mask)[0].backward()
    torch.testing.assert_close(loss.grad, mask / 3)
