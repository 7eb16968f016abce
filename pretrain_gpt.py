"""Pretrain a GPT model: ``torchrun --nproc-per-node N pretrain_gpt.py <Megatron flags>``.

Without torchrun it runs as a world of one. On a machine without CUDA it trains on the
CPU (gloo for several processes).
"""

from megatron.training.training import default_model_provider, pretrain


def model_provider(cfg, vocab_size, pg, device):
    """Builds the GPT model (dense, local layer spec)."""
    return default_model_provider(cfg, vocab_size, pg, device)


if __name__ == "__main__":
    pretrain(model_provider=model_provider)
