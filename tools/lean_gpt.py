"""A lean plain-PyTorch GPT step: the yardstick for our eager step on the same machine.

What a user might write instead of a framework:
pre-norm layers (LayerNorm, fused QKV linear, causal SDPA, GeLU MLP, all with biases),
learned positions, tied embedding and output layer, bf16 parameters trained directly by
fused AdamW. No fp32 main params, no DDP buffer, no clipping, no loss scaling. Host
speed differs a lot between machine starts, so ``graph_bench.py --modes lean ...`` runs
it in the same invocation as our modes and the table shows our eager step against it.
"""

import torch
import torch.nn.functional as F


class LeanLayer(torch.nn.Module):
    def __init__(self, hidden: int, ffn: int, heads: int, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.heads = heads
        self.norm1 = torch.nn.LayerNorm(hidden, **kw)
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, **kw)
        self.proj = torch.nn.Linear(hidden, hidden, **kw)
        self.norm2 = torch.nn.LayerNorm(hidden, **kw)
        self.fc1 = torch.nn.Linear(hidden, ffn, **kw)
        self.fc2 = torch.nn.Linear(ffn, hidden, **kw)

    def forward(self, x):  # [b, s, h]
        b, s, h = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        context = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(context.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.norm2(x))))


class LeanGPT(torch.nn.Module):
    def __init__(self, layers: int, hidden: int, ffn: int, heads: int, vocab: int, seq: int, device, dtype):
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.embed = torch.nn.Embedding(vocab, hidden, **kw)
        self.pos = torch.nn.Embedding(seq, hidden, **kw)
        self.layers = torch.nn.ModuleList(LeanLayer(hidden, ffn, heads, device, dtype) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(hidden, **kw)

    def forward(self, tokens, labels):
        x = self.embed(tokens) + self.pos.weight[: tokens.shape[1]]
        for layer in self.layers:
            x = layer(x)
        logits = self.norm(x) @ self.embed.weight.t()
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1))


def build(model_cfg, device):
    """The lean model and its fused AdamW for our ``TransformerConfig``-like sizes."""
    model = LeanGPT(
        model_cfg.num_layers,
        model_cfg.hidden_size,
        model_cfg.ffn_hidden_size,
        model_cfg.num_attention_heads,
        model_cfg.vocab_size,
        model_cfg.seq_length,
        device,
        torch.bfloat16,
    )
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def train_step(model, optimizer, tokens, labels) -> torch.Tensor:
    optimizer.zero_grad(set_to_none=True)
    loss = model(tokens, labels)
    loss.backward()
    optimizer.step()
    return loss.detach()
