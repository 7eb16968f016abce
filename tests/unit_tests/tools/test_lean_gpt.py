"""The lean plain-PyTorch yardstick of the benchmark trains (CPU, tiny shapes)."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import lean_gpt  # noqa: E402


def test_lean_gpt_trains_with_tied_output_layer():
    torch.manual_seed(0)
    cfg = SimpleNamespace(
        num_layers=2, hidden_size=32, ffn_hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16
    )
    model, optimizer = lean_gpt.build(cfg, torch.device("cpu"))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(n.startswith("output") for n, _ in model.named_parameters())  # tied to the embedding
    tokens = torch.randint(cfg.vocab_size, (2, cfg.seq_length + 1))
    losses = [lean_gpt.train_step(model, optimizer, tokens[:, :-1], tokens[:, 1:]).item() for _ in range(30)]
    # Default init (N(0, 1) embeddings, tied) starts high, as the anchor's peer did; it still learns.
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0] - 0.2
