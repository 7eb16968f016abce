"""Sinkhorn load balancing (``--moe-router-load-balancing-type sinkhorn``) against a float64
reference written from the algorithm: Sinkhorn-Knopp scales ``exp(logits)`` by rows and
columns until every row sums to 1/T and every column to 1/E; training routes each token
to the top-k experts of that balanced matrix, with the unbalanced scores as weights."""

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.moe_layer import MoELayer
from tests.unit_tests.transformer.moe.moe_helpers import make_config, reference_moe


def reference_sinkhorn(logits: torch.Tensor, iters: int = 5000) -> torch.Tensor:
    """Alternate row and column normalisation of exp(logits) in float64, to convergence."""
    p = torch.exp(logits.double())
    t, e = p.shape
    for _ in range(iters):
        p = p / p.sum(dim=1, keepdim=True) / t
        p = p / p.sum(dim=0, keepdim=True) / e
        if (p.sum(dim=1) * t - 1).abs().max() < 1e-13:
            break
    return p


def _logits(t=32, e=8, seed=0, scale=2.0):
    gen = torch.Generator().manual_seed(seed)
    # One expert is favoured by every token: plain top-k would overload it.
    bias = torch.zeros(e)
    bias[0] = 2.5
    return torch.randn(t, e, generator=gen, dtype=torch.float64) * scale + bias


def _topk_map(scores, k):
    return torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(k, dim=-1).indices, True)


def test_sinkhorn_balances_rows_and_columns_like_the_reference():
    logits = _logits()
    got = moe_utils.sinkhorn(logits.float())
    want = reference_sinkhorn(logits)
    t, e = logits.shape
    # Megatron's stopping rule (mean change of the column scalings <= 1e-4) leaves the
    # rows within about that much of 1/T; the columns are exact after the last step.
    torch.testing.assert_close(
        got.double().sum(dim=0), torch.full((e,), 1.0 / e, dtype=torch.float64), rtol=1e-5, atol=0
    )
    torch.testing.assert_close(
        got.double().sum(dim=1), torch.full((t,), 1.0 / t, dtype=torch.float64), rtol=2e-3, atol=0
    )
    torch.testing.assert_close(got.double(), want, rtol=5e-3, atol=0)


@pytest.mark.parametrize("topk, seed", [(1, 0), (2, 3)])
def test_sinkhorn_routing_selects_from_the_balanced_matrix(topk, seed):
    logits = _logits(seed=seed)
    want_map = _topk_map(reference_sinkhorn(logits), topk)
    # The reference's k-th and (k+1)-th entries are well apart: no tie to break differently.
    sorted_ref = reference_sinkhorn(logits).sort(dim=-1, descending=True).values
    assert (sorted_ref[:, topk - 1] / sorted_ref[:, topk] - 1).min() > 2e-2
    probs, routing_map = moe_utils.sinkhorn_routing(logits.float(), topk, training=True)
    assert torch.equal(routing_map, want_map)
    scores = torch.sigmoid(logits) if topk == 1 else torch.softmax(logits, dim=-1)
    torch.testing.assert_close(probs.double(), scores * want_map, rtol=1e-6, atol=1e-7)
    # Balancing changes the choice: plain top-k of the scores overloads expert 0.
    plain = _topk_map(scores, topk)
    assert not torch.equal(plain, want_map)
    assert want_map.sum(dim=0).max() < plain.sum(dim=0).max()
    # Evaluation selects from the scores themselves.
    probs_eval, map_eval = moe_utils.sinkhorn_routing(logits.float(), topk, training=False)
    assert torch.equal(map_eval, plain)
    torch.testing.assert_close(probs_eval.double(), scores * plain, rtol=1e-6, atol=1e-7)


def test_moe_layer_with_sinkhorn_matches_the_reference_and_trains_the_router():
    cfg = make_config(moe_router_load_balancing_type=["sinkhorn"], moe_router_topk=2, num_moe_experts=4)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    layer.train()
    assert layer.router.metric_names() == []
    x = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    out, stats = layer(x)
    x2d = x.detach().reshape(-1, 8)
    logits = x2d @ layer.router.weight.detach().t() + layer.router.bias.detach()
    routing_map = _topk_map(reference_sinkhorn(logits), 2)
    probs = torch.softmax(logits, dim=-1) * routing_map
    torch.testing.assert_close(
        out.reshape(-1, 8), reference_moe(layer, x2d, probs, routing_map), rtol=1e-10, atol=1e-12
    )
    assert torch.equal(stats, routing_map.sum(dim=0).float())  # token counts, no loss entries
    out.square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0  # through the softmax scores


def test_sinkhorn_config_rules_and_no_router_graph():
    from megatron.core.transformer.moe.moe_layer import _block_graphable, _router_graphable

    cfg = make_config(moe_router_load_balancing_type=["sinkhorn"], moe_router_topk=1)  # no pre-softmax needed
    assert cfg.moe.sinkhorn and cfg.moe.aux_loss_coeffs() == {}
    # The iteration reads its error on the host: no region may hold the router.
    assert "sinkhorn" in _router_graphable(cfg)
    assert _block_graphable(cfg) is not None
    assert _router_graphable(make_config()) is None
