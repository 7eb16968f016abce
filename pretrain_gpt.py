"""Pretrain a GPT model: ``torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>``.

Without torchrun it runs as a world of one. On a machine without CUDA it trains on the
CPU (gloo for several processes).
"""

from megatron.core.models.gpt.loss import gpt_forward_step
from megatron.training.training import default_model_provider, pretrain


def model_provider(cfg, vocab_size, pg, device):
    """Builds the GPT model (dense, local layer spec)."""
    return default_model_provider(cfg, vocab_size, pg, device)


def forward_step(batch, model):
    """One micro-batch: ``(loss, metrics)``, the mean next-token loss over unmasked tokens and their count,
    which weighs micro-batches (``gpt_forward_step``; write your own here to change the loss)."""
    return gpt_forward_step(batch, model)


if __name__ == "__main__":
    pretrain(model_provider=model_provider, forward_step=forward_step)
