"""ColumnParallelLinear / RowParallelLinear / VocabParallelEmbedding at TP = 1, cross entropy, seeding.

TP > 1: test_tensor_parallel.py (gloo processes)."""

import pytest
import torch
import torch.nn.functional as F

from megatron.core.parallel_state import ProcessGroups
from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron.core.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    init_method_normal,
)
from megatron.core.tensor_parallel.random import model_parallel_manual_seed
from megatron.core.transformer.transformer_config import TransformerConfig


def cfg(dtype=torch.float32):
    return TransformerConfig(params_dtype=dtype).finalize()


def test_column_linear_shapes_dtype_and_bias_handling():
    torch.manual_seed(0)
    layer = ColumnParallelLinear(8, 12, config=cfg(torch.float64), init_method=init_method_normal(0.02))
    assert layer.weight.shape == (12, 8) and layer.weight.dtype == torch.float64
    assert layer.bias.shape == (12,) and torch.count_nonzero(layer.bias) == 0
    with torch.no_grad():
        layer.bias.normal_()
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    out, bias = layer(x)
    assert bias is None
    torch.testing.assert_close(out, x @ layer.weight.t() + layer.bias)
    layer.skip_bias_add = True
    out2, bias2 = layer(x)
    assert bias2 is layer.bias
    torch.testing.assert_close(out2 + bias2, out)


def test_column_linear_without_weight_needs_one():
    layer = ColumnParallelLinear(
        4, 6, config=cfg(), init_method=init_method_normal(0.02), bias=False, skip_weight_param_allocation=True
    )
    assert layer.weight is None and list(layer.parameters()) == []
    w = torch.randn(6, 4)
    x = torch.randn(2, 4)
    out, _ = layer(x, weight=w)
    torch.testing.assert_close(out, x @ w.t())
    with pytest.raises(AssertionError):
        layer(x)


def test_row_linear_skip_bias_add():
    torch.manual_seed(0)
    layer = RowParallelLinear(8, 4, config=cfg(), init_method=init_method_normal(0.02), skip_bias_add=True)
    assert layer.weight.shape == (4, 8)
    x = torch.randn(3, 8)
    out, bias = layer(x)
    assert bias is layer.bias
    torch.testing.assert_close(out, x @ layer.weight.t())
    no_bias = RowParallelLinear(8, 4, config=cfg(), init_method=init_method_normal(0.02), bias=False)
    assert no_bias.bias is None and no_bias(x)[1] is None


def test_init_std_and_scaled_init():
    torch.manual_seed(0)
    w = torch.empty(400, 400)
    init_method_normal(0.02)(w)
    assert abs(w.std().item() - 0.02) < 5e-4 and abs(w.mean().item()) < 5e-4
    # Residual output projections: std / sqrt(2 L) (TransformerConfig.output_init_std).
    init_method_normal(TransformerConfig(num_layers=8, init_method_std=0.02).output_init_std())(w)
    assert abs(w.std().item() - 0.02 / 4.0) < 2e-4


def test_embedding_and_pg_single():
    torch.manual_seed(0)
    emb = VocabParallelEmbedding(10, 4, config=cfg(), init_method=init_method_normal(1.0), pg=ProcessGroups.single())
    assert (emb.vocab_start_index, emb.vocab_end_index) == (0, 10)
    ids = torch.tensor([[1, 9], [0, 3]])
    torch.testing.assert_close(emb(ids), emb.weight[ids])


def test_params_follow_default_device():
    with torch.device("meta"):
        layer = ColumnParallelLinear(4, 4, config=cfg(), init_method=lambda t: None)
    assert layer.weight.device.type == "meta"
    layer = ColumnParallelLinear(4, 4, config=cfg(), init_method=init_method_normal(0.02), device="cpu")
    assert layer.weight.device.type == "cpu"


@pytest.mark.parametrize("layout", ["sbv", "bsv"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_matches_fp32_reference(layout, dtype):
    torch.manual_seed(0)
    logits = (3 * torch.randn(5, 3, 17)).to(dtype).requires_grad_()
    target = torch.randint(0, 17, (5, 3))
    loss = vocab_parallel_cross_entropy(logits, target)
    assert loss.dtype == torch.float32 and loss.shape == (5, 3)
    lf = logits.detach().double()
    ref = torch.logsumexp(lf, -1) - lf.gather(-1, target.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)
    grad_w = torch.randn(5, 3)
    (loss * grad_w).sum().backward()
    assert logits.grad.dtype == dtype
    ref_grad = (torch.softmax(lf, -1) - F.one_hot(target, 17).double()) * grad_w.double().unsqueeze(-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(logits.grad.double(), ref_grad, rtol=tol, atol=tol)


def test_cross_entropy_accepts_transposed_target():
    logits = torch.randn(4, 2, 7)
    labels = torch.randint(0, 7, (2, 4))
    loss = vocab_parallel_cross_entropy(logits, labels.t())
    ref = F.cross_entropy(logits.reshape(-1, 7), labels.t().reshape(-1), reduction="none").view(4, 2)
    torch.testing.assert_close(loss, ref)


def test_manual_seed_is_repeatable():
    model_parallel_manual_seed(7)
    a = torch.randn(5)
    model_parallel_manual_seed(7)
    assert torch.equal(a, torch.randn(5))


# ---------------------------------------------------------------- gradient-accumulation fusion
def _with_main_grad(layer):
    for p in layer.parameters():
        p.main_grad = torch.zeros(p.shape, dtype=torch.float32)
    return layer


@pytest.mark.parametrize("kind", ["column", "row"])
def test_fused_wgrad_goes_to_main_grad_and_accumulates(kind):
    torch.manual_seed(0)
    cls = ColumnParallelLinear if kind == "column" else RowParallelLinear
    layer = _with_main_grad(cls(8, 12, config=cfg(), init_method=init_method_normal(0.5)))
    x = torch.randn(5, 3, 8, requires_grad=True)
    g = torch.randn(5, 3, 12)
    for _ in range(2):  # two micro-batches accumulate
        out, bias = layer(x)
        (out if bias is None else out + bias).backward(g)
    x2 = x.detach().requires_grad_()
    F.linear(x2, layer.weight.detach()).backward(g)
    wgrad = g.reshape(-1, 12).t() @ x.detach().reshape(-1, 8)
    assert layer.weight.grad is None, "the fused path gives autograd no weight gradient"
    torch.testing.assert_close(layer.weight.main_grad, 2 * wgrad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(layer.bias.grad, 2 * g.sum((0, 1)))
    torch.testing.assert_close(x.grad, 2 * x2.grad)


def test_fusion_needs_main_grad_and_can_be_turned_off():
    torch.manual_seed(0)
    plain = ColumnParallelLinear(4, 6, config=cfg(), init_method=init_method_normal(0.5))
    plain(torch.randn(3, 4))[0].sum().backward()
    assert plain.weight.grad is not None  # no main_grad yet (not wrapped in DDP): F.linear
    off = TransformerConfig(params_dtype=torch.float32, gradient_accumulation_fusion=False).finalize()
    layer = _with_main_grad(ColumnParallelLinear(4, 6, config=off, init_method=init_method_normal(0.5)))
    layer(torch.randn(3, 4))[0].sum().backward()
    assert layer.weight.grad is not None and torch.count_nonzero(layer.weight.main_grad) == 0


def test_bf16_activations_accumulate_in_fp32_on_cpu():
    torch.manual_seed(0)
    layer = _with_main_grad(
        ColumnParallelLinear(16, 8, config=cfg(torch.bfloat16), init_method=init_method_normal(0.5))
    )
    x = torch.randn(32, 16, dtype=torch.bfloat16)
    g = torch.randn(32, 8, dtype=torch.bfloat16)
    layer(x)[0].backward(g)
    assert layer.weight.main_grad.dtype == torch.float32
    torch.testing.assert_close(layer.weight.main_grad, (g.t() @ x).float())


def test_fused_embedding_wgrad_goes_to_main_grad():
    torch.manual_seed(0)
    emb = _with_main_grad(VocabParallelEmbedding(10, 4, config=cfg(), init_method=init_method_normal(0.5)))
    ids = torch.tensor([[1, 3, 1], [9, 1, 0]])  # repeated ids accumulate
    g = torch.randn(2, 3, 4)
    for _ in range(2):
        emb(ids).backward(g)
    ref = torch.nn.Parameter(emb.weight.detach().clone())
    F.embedding(ids, ref).backward(g)
    assert emb.weight.grad is None
    torch.testing.assert_close(emb.weight.main_grad, 2 * ref.grad, rtol=1e-6, atol=1e-6)
    off = TransformerConfig(params_dtype=torch.float32, gradient_accumulation_fusion=False).finalize()
    plain = _with_main_grad(VocabParallelEmbedding(10, 4, config=off, init_method=init_method_normal(0.5)))
    plain(ids).backward(g)
    assert plain.weight.grad is not None and torch.count_nonzero(plain.weight.main_grad) == 0


def test_a_tied_unfused_output_layer_hands_autograd_its_wgrad_made_outside_a_turn(monkeypatch):
    """A weight passed in (the output layer tied to the word embeddings) without fusion: the weight
    gradient goes to autograd, which sums it with the embedding's part in the weight's dtype; it is
    made under turn.outside_turn (out of a CUDA graph eager turn's memory, which the next backward
    graph overwrites). The same values as F.linear's."""
    from megatron.core.tensor_parallel import layers

    entered = []
    real = layers.outside_turn

    def spy():
        entered.append(True)
        return real()

    monkeypatch.setattr(layers, "outside_turn", spy)
    torch.manual_seed(0)
    off = TransformerConfig(params_dtype=torch.float32, gradient_accumulation_fusion=False).finalize()
    head = ColumnParallelLinear(
        8, 12, config=off, init_method=init_method_normal(0.5), skip_weight_param_allocation=True
    )
    embedding = torch.nn.Parameter(torch.randn(12, 8))
    ids = torch.tensor([[1, 3], [11, 1], [0, 5]])
    g = torch.randn(3, 2, 12)
    x = F.embedding(ids, embedding)
    out, _ = head(x, weight=embedding)
    assert type(out.grad_fn).__name__ == "LinearWithHeldWgradBackward"
    out.backward(g)
    assert entered == [True]
    ref = torch.nn.Parameter(embedding.detach().clone())
    ref_bias = torch.nn.Parameter(head.bias.detach().clone())
    F.linear(F.embedding(ids, ref), ref, ref_bias).backward(g)
    torch.testing.assert_close(embedding.grad, ref.grad, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(head.bias.grad, ref_bias.grad)
    held = []
    monkeypatch.setattr(layers.LinearWithHeldWgrad, "apply", lambda *args: held.append(args) or F.linear(*args))
    with torch.no_grad():  # no gradient wanted: the plain linear
        head(x, weight=embedding)
    head(x.detach(), weight=embedding.detach())  # a frozen weight (a distillation teacher's)
    own = ColumnParallelLinear(8, 12, config=off, init_method=init_method_normal(0.5))
    own(x)  # its own weight: autograd hands its gradient on at once
    own(x, weight=own.weight)  # passed, but its own (a last pipeline stage's copy)
    assert held == []
    head(x, weight=embedding)
    assert len(held) == 1
