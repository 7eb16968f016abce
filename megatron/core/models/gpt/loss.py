"""Masked mean of per-token losses, without host syncs.

The model returns an unreduced fp32 loss per token; which tokens count (padding,
end-of-document, prompt) is the data's business, expressed as a 0/1 ``loss_mask``.
"""

import torch


def masked_mean_loss(per_token_loss: torch.Tensor, loss_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean loss over the tokens whose mask is 1.

    Args:
        per_token_loss: ``[b, s]`` loss per token.
        loss_mask: ``[b, s]`` 0/1 mask (any dtype).

    Returns:
        ``(loss, num_tokens)``: the fp32 scalar ``sum(loss * mask) / sum(mask)`` (0 when no
        token counts, never NaN) and the int64 number of counted tokens, both on the
        loss's device, computed without a host sync.
    """
    assert per_token_loss.shape == loss_mask.shape, f"{tuple(per_token_loss.shape)} vs {tuple(loss_mask.shape)}"
    mask = loss_mask.to(torch.float32)
    denominator = mask.sum()
    loss = (per_token_loss.float() * mask).sum() / denominator.clamp(min=1.0)
    num_tokens = torch.count_nonzero(loss_mask)
    return loss, num_tokens


def mask_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{"attention_mask": ...}`` when the batch holds one (``--reset-attention-mask``), else nothing, so
    forward callables without the argument (a user's model, the one-process pipeline simulation's last
    chunk) are called as before."""
    return {"attention_mask": batch["attention_mask"]} if "attention_mask" in batch else {}


def gpt_forward_step(batch: dict[str, torch.Tensor], model: torch.nn.Module) -> tuple[torch.Tensor, dict]:
    """The GPT family's ``forward_step``: mean next-token loss over the unmasked tokens."""
    per_token = model(batch["tokens"], batch["position_ids"], batch["labels"], **mask_kwargs(batch))
    loss, num_tokens = masked_mean_loss(per_token, batch["loss_mask"])
    return loss, {"num_tokens": num_tokens}
