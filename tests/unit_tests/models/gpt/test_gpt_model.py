"""GPTModel: shapes, closed-form parameter counts, initialisation, determinism, tying, masking."""

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.models.gpt.gpt_model import GPTModel, build_gpt_model
from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.transformer.transformer_config import TransformerConfig

VOCAB = 50


def config(**kw):
    base = dict(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0
    )
    base.update(kw)
    cfg = TransformerConfig(**base).finalize()
    cfg.validate()
    return cfg


def model_for(cfg, seed=0):
    torch.manual_seed(seed)
    return build_gpt_model(cfg, VOCAB, device="cpu")


def expected_params(cfg, vocab):
    """Closed form: embeddings + L * (2 norms + QKV + proj + fc1 + fc2) + final norm (+ output)."""
    h, f, L = cfg.hidden_size, cfg.ffn_hidden_size, cfg.num_layers
    n, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    b = 1 if cfg.add_bias_linear else 0
    norm = 2 * h if cfg.normalization == "LayerNorm" else h
    fc1_out = 2 * f if cfg.gated_linear_unit else f
    qkv_out = (n + 2 * g) * d
    layer = 2 * norm + (h * qkv_out + b * qkv_out) + (n * d * h + b * h) + (h * fc1_out + b * fc1_out) + (f * h + b * h)
    total = vocab * h + L * layer + norm
    if cfg.position_embedding_type == "learned_absolute":
        total += cfg.max_position_embeddings * h
    if cfg.untie_embeddings_and_output_weights:
        total += vocab * h
    return total


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"untie_embeddings_and_output_weights": True},
        {"add_bias_linear": False},
        {"gated_linear_unit": True, "ffn_hidden_size": 48},
        {"group_query_attention": True, "num_query_groups": 2},
        {
            "position_embedding_type": "rope",
            "normalization": "RMSNorm",
            "add_bias_linear": False,
            "gated_linear_unit": True,
            "group_query_attention": True,
            "num_query_groups": 1,
        },
        {"kv_channels": 12, "max_position_embeddings": 20},
    ],
)
def test_parameter_count_matches_closed_form(kw):
    cfg = config(**kw)
    model = model_for(cfg)
    assert model.num_parameters() == expected_params(cfg, VOCAB)
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_megatron_reference_size():
    """The 8-layer h=1024 benchmark model has 135,636,992 parameters in upstream Megatron."""
    cfg = config(num_layers=8, hidden_size=1024, ffn_hidden_size=4096, num_attention_heads=16, seq_length=2048)
    with torch.device("meta"):
        model = build_gpt_model(cfg, 32000)
    assert model.num_parameters() == 135_636_992 == expected_params(cfg, 32000)


def test_tied_and_untied_output():
    tied = model_for(config())
    assert tied.output_layer.weight is None
    assert tied.shared_embedding_or_output_weight() is tied.embedding.word_embeddings.weight
    untied = model_for(config(untie_embeddings_and_output_weights=True))
    assert untied.output_layer.weight.shape == (VOCAB, 32)
    assert untied.shared_embedding_or_output_weight() is None
    emb = VOCAB * 32 + 8 * 32
    assert tied.num_parameters() - tied.num_parameters(exclude_embeddings=True) == emb
    assert untied.num_parameters() - untied.num_parameters(exclude_embeddings=True) == emb + VOCAB * 32
    # Tied logits are hidden @ embedding^T.
    ids = torch.randint(0, VOCAB, (2, 8))
    hidden = tied.decoder(tied.embedding(ids))
    torch.testing.assert_close(tied(ids), (hidden @ tied.embedding.word_embeddings.weight.t()).transpose(0, 1))


@pytest.mark.parametrize("rope", [False, True])
def test_output_shapes_and_loss(rope):
    cfg = config(position_embedding_type="rope" if rope else "learned_absolute")
    model = model_for(cfg)
    assert (model.rotary_pos_emb is not None) == rope
    assert (model.embedding.position_embeddings is None) == rope
    ids = torch.randint(0, VOCAB, (3, 8))
    labels = torch.randint(0, VOCAB, (3, 8))
    logits = model(ids)
    assert logits.shape == (3, 8, VOCAB) and logits.is_contiguous()
    loss = model(ids, labels=labels)
    assert loss.shape == (3, 8) and loss.dtype == torch.float32
    ref = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(loss, ref.view(3, 8))
    # Shorter sequences than the table work too.
    assert model(ids[:, :5]).shape == (3, 5, VOCAB)


def test_position_ids_default_is_arange():
    model = model_for(config())
    ids = torch.randint(0, VOCAB, (2, 8))
    pos = torch.arange(8).expand(2, 8)
    torch.testing.assert_close(model(ids), model(ids, position_ids=pos))
    assert not torch.allclose(model(ids), model(ids, position_ids=pos.flip(-1)))


def test_initialisation_follows_megatron():
    cfg = config(num_layers=8, hidden_size=128, init_method_std=0.05)
    model = model_for(cfg)
    scaled = 0.05 / 4.0
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.count_nonzero(p) == 0, name
        elif "layernorm" in name:
            assert torch.equal(p, torch.ones_like(p)), name
        elif name.endswith(("linear_proj.weight", "linear_fc2.weight")):
            assert abs(p.std().item() - scaled) < 0.1 * scaled, name
        else:
            assert abs(p.std().item() - 0.05) < 0.1 * 0.05, name


def test_same_seed_same_params():
    cfg = config(untie_embeddings_and_output_weights=True)
    a, b, c = model_for(cfg, 3), model_for(cfg, 3), model_for(cfg, 4)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
    assert not torch.equal(a.embedding.word_embeddings.weight, c.embedding.word_embeddings.weight)


def test_masked_tokens_do_not_affect_loss_or_grads():
    cfg = config()
    model = model_for(cfg)
    ids = torch.randint(0, VOCAB, (2, 8))
    labels = torch.randint(0, VOCAB, (2, 8))
    mask = torch.ones(2, 8)
    mask[0, 5:] = 0
    mask[1, :2] = 0

    def loss_and_grads(lbl):
        model.zero_grad(set_to_none=True)
        loss, num = masked_mean_loss(model(ids, labels=lbl), mask)
        loss.backward()
        return loss.detach(), num, [p.grad.clone() for p in model.parameters()]

    loss1, num1, grads1 = loss_and_grads(labels)
    other = labels.clone()
    other[mask == 0] = (other[mask == 0] + 7) % VOCAB  # change only masked targets
    loss2, num2, grads2 = loss_and_grads(other)
    assert num1.item() == num2.item() == 11
    assert torch.equal(loss1, loss2)
    for g1, g2 in zip(grads1, grads2):
        assert torch.equal(g1, g2)
    per_token = model(ids, labels=labels).detach()
    torch.testing.assert_close(loss1, per_token[mask.bool()].mean())


def test_dropout_only_in_training():
    cfg = config(hidden_dropout=0.3, attention_dropout=0.3)
    model = model_for(cfg)
    ids = torch.randint(0, VOCAB, (2, 8))
    model.eval()
    assert torch.equal(model(ids), model(ids))
    model.train()
    assert not torch.equal(model(ids), model(ids))


def test_gpt_model_direct_construction_and_bad_position_type():
    cfg = config()
    model = GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 8, device="cpu", share_embeddings_and_output_weights=False)
    assert model.output_layer.weight is not None
    with pytest.raises(ValueError, match="position-embedding-type"):
        GPTModel(cfg, get_gpt_layer_local_spec(), VOCAB, 8, position_embedding_type="alibi")
    with pytest.raises(ValueError, match="max-position-embeddings"):
        model(torch.randint(0, VOCAB, (1, 9)))


@pytest.mark.gpu
def test_builds_on_cuda_and_runs_bf16():
    cfg = config(params_dtype=torch.bfloat16, position_embedding_type="rope")
    torch.manual_seed(0)
    model = build_gpt_model(cfg, VOCAB, device="cuda")
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in model.parameters())
    ids = torch.randint(0, VOCAB, (2, 8), device="cuda")
    loss, _ = masked_mean_loss(model(ids, labels=ids), torch.ones(2, 8, device="cuda"))
    loss.backward()
    assert torch.isfinite(loss)
    assert model.rotary_pos_emb(8, "cuda") is model.rotary_pos_emb(8, torch.device("cuda"))
