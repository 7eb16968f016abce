"""Router: every score function, group-limited routing, expert bias, dropping, every
load-balancing loss and the z-loss, against per-token references in float64."""

import math

import pytest
import torch

from megatron.core.transformer.moe import moe_utils
from megatron.core.transformer.moe.router import TopKRouter
from tests.unit_tests.transformer.moe.moe_helpers import make_config


def _router(**kw):
    torch.manual_seed(0)
    cfg = make_config(**kw)
    return TopKRouter(cfg), cfg


def _reference_route(logits, k, score, pre_softmax=False, scale=None, bias=None):
    """Per token: the k chosen experts and their probabilities (Megatron's semantics)."""
    probs = torch.zeros_like(logits)
    for t, row in enumerate(logits):
        if score == "softmax":
            if pre_softmax:
                s = torch.softmax(row, -1)
                idx = sorted(range(len(row)), key=lambda e: -float(s[e].detach()))[:k]
                vals = s[idx]
            else:
                idx = sorted(range(len(row)), key=lambda e: -float(row[e].detach()))[:k]
                vals = torch.softmax(row[idx], -1)
        else:
            s = torch.sigmoid(row) if score == "sigmoid" else torch.nn.functional.softplus(row).sqrt()
            key = s if bias is None else s + bias
            idx = sorted(range(len(row)), key=lambda e: -float(key[e].detach()))[:k]
            vals = s[idx]
            if k > 1:
                vals = vals / vals.sum()
        if scale:
            vals = vals * scale
        probs[t, idx] = vals
    return probs


@pytest.mark.parametrize(
    "score, pre_softmax, k, scale",
    [
        ("softmax", False, 2, None),
        ("softmax", True, 2, None),
        ("softmax", True, 1, None),
        ("sigmoid", False, 2, 2.5),
        ("sigmoid", False, 1, None),
        ("sqrtsoftplus", False, 3, None),
    ],
)
def test_score_functions_match_reference(score, pre_softmax, k, scale):
    router, _ = _router(
        num_moe_experts=6,
        moe_router_topk=k,
        moe_router_score_function=score,
        moe_router_pre_softmax=pre_softmax,
        moe_router_topk_scaling_factor=scale,
    )
    x = torch.randn(5, 3, 8, dtype=torch.float64)
    probs, routing_map, stats = router(x)
    logits = x.reshape(-1, 8) @ router.weight.t()
    ref = _reference_route(logits, k, score, pre_softmax, scale)
    torch.testing.assert_close(probs, ref, rtol=1e-12, atol=1e-12)
    assert torch.equal(routing_map, ref != 0)
    assert routing_map.sum(1).eq(k).all()
    assert torch.equal(stats, routing_map.sum(0).double().float())  # no losses configured: counts only


def test_router_dtype_fp64_and_fp32():
    router, _ = _router(dtype=torch.float32, moe_router_dtype="fp64")
    probs, _, _ = router(torch.randn(4, 2, 8))
    assert probs.dtype == torch.float64
    router, _ = _router(dtype=torch.bfloat16, moe_router_dtype="fp32")
    probs, _, _ = router(torch.randn(4, 2, 8, dtype=torch.bfloat16))
    assert probs.dtype == torch.float32
    router, _ = _router(dtype=torch.bfloat16)
    assert router(torch.randn(4, 2, 8, dtype=torch.bfloat16))[0].dtype == torch.bfloat16


def test_group_limited_routing_picks_only_from_the_best_groups():
    router, _ = _router(num_moe_experts=8, moe_router_topk=2, moe_router_num_groups=4, moe_router_group_topk=1)
    x = torch.randn(16, 1, 8, dtype=torch.float64)
    probs, routing_map, _ = router(x)
    logits = x.reshape(-1, 8) @ router.weight.t()
    for t in range(16):
        groups = logits[t].view(4, 2)
        best = int(groups.topk(2, dim=-1).values.sum(-1).argmax())  # group score: its top-(k / group_topk) sum
        chosen = routing_map[t].nonzero().flatten().tolist()
        assert chosen == [2 * best, 2 * best + 1]
        torch.testing.assert_close(probs[t, chosen], torch.softmax(logits[t, chosen], -1))


def test_expert_bias_shifts_selection_not_probabilities():
    router, _ = _router(
        num_moe_experts=4, moe_router_topk=1, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True
    )
    x = torch.randn(6, 1, 8, dtype=torch.float64)
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.0, 10.0]))
    probs, routing_map, _ = router(x)
    assert routing_map[:, 3].all()  # the bias wins the selection
    logits = x.reshape(-1, 8) @ router.weight.t()
    torch.testing.assert_close(probs[:, 3], torch.sigmoid(logits[:, 3]))  # k = 1: the raw score, no bias


def test_expert_bias_update_direction():
    router, _ = _router(
        num_moe_experts=4, moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.5,
    )  # fmt: skip
    router.update_expert_bias(torch.tensor([10.0, 2.0, 2.0, 6.0]))
    assert router.expert_bias.tolist() == [-0.5, 0.5, 0.5, -0.5]


@pytest.mark.parametrize("policy", ["probs", "position"])
@pytest.mark.parametrize("pad", [False, True])
def test_capacity_dropping(policy, pad):
    router, _ = _router(
        num_moe_experts=4,
        moe_router_topk=2,
        moe_expert_capacity_factor=0.5,
        moe_token_drop_policy=policy,
        moe_pad_expert_input_to_capacity=pad,
    )
    x = torch.randn(12, 1, 8, dtype=torch.float64)
    probs, routing_map, _ = router(x)
    cap = math.ceil(12 * 2 / 4 * 0.5)
    full = _reference_route(x.reshape(-1, 8) @ router.weight.t(), 2, "softmax")
    if pad:
        assert routing_map.sum(0).eq(cap).all()  # exactly the capacity per expert: static shapes
    else:
        assert routing_map.sum(0).le(cap).all()
        assert (routing_map <= (full != 0)).all()  # only routed slots survive
    for e in range(4):
        routed = (full[:, e] != 0).nonzero().flatten().tolist()
        if policy == "probs":
            keep = sorted(routed, key=lambda t: -float(full[t, e].detach()))[:cap]
        else:
            keep = routed[:cap]
        assert set(keep) <= set(routing_map[:, e].nonzero().flatten().tolist())
    torch.testing.assert_close(probs, full * routing_map)


def _aux_reference(scores, routing_map, k):
    t, e = scores.shape
    f = routing_map.double().sum(0) / (t * k)
    p = scores.sum(0) / t
    return e * (f * p).sum()


def _run_with_losses(**kw):
    router, cfg = _router(num_moe_experts=4, moe_router_topk=2, **kw)
    router.train()
    x = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    probs, routing_map, stats = router(x)
    logits = x.reshape(-1, 8) @ router.weight.t()
    return router, x, probs, routing_map, stats, logits


def test_aux_loss_value_and_gradient():
    coeff = 0.1
    router, x, probs, routing_map, stats, logits = _run_with_losses(moe_aux_loss_coeff=[coeff])
    assert router.metric_names() == ["load_balancing_loss"]
    scores = torch.softmax(logits, -1)
    aux_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, scores.topk(2, -1).indices, True)
    ref = _aux_reference(scores, aux_map, 2)
    torch.testing.assert_close(stats[0].double(), ref, rtol=1e-6, atol=0)
    # The loss joins the objective through backward, scaled by aux_loss_scale.
    with torch.no_grad():
        router.aux_loss_scale.fill_(0.5)
    w = torch.randn_like(probs)
    (probs * w).sum().backward()
    got = router.weight.grad.clone()
    router.weight.grad = None
    x2 = x.detach().requires_grad_()
    logits2 = x2.reshape(-1, 8) @ router.weight.t()
    probs2 = _reference_route(logits2, 2, "softmax")
    s2 = torch.softmax(logits2, -1)
    objective = (probs2 * w).sum() + 0.5 * coeff * _aux_reference(s2, aux_map, 2)
    objective.backward()
    torch.testing.assert_close(got, router.weight.grad, rtol=1e-10, atol=1e-12)


def test_seq_aux_loss_is_the_mean_over_sequences():
    router, x, probs, routing_map, stats, logits = _run_with_losses(
        moe_router_load_balancing_type=["seq_aux_loss"], moe_aux_loss_coeff=[1.0]
    )
    assert router.metric_names() == ["seq_load_balancing_loss"]
    scores = torch.softmax(logits, -1).view(6, 2, 4)  # [s, b, E]
    per_seq = []
    for b in range(2):
        s = scores[:, b]
        m = torch.zeros_like(s, dtype=torch.bool).scatter(1, s.topk(2, -1).indices, True)
        per_seq.append(_aux_reference(s, m, 2))
    torch.testing.assert_close(stats[0].double(), sum(per_seq) / 2, rtol=1e-6, atol=0)


def test_global_aux_loss_balances_over_the_step_and_resets():
    router, x, probs, routing_map, stats, logits = _run_with_losses(
        moe_router_load_balancing_type=["global_aux_loss"], moe_aux_loss_coeff=[1.0]
    )
    assert router.metric_names() == ["global_load_balancing_loss"]
    x_b = torch.randn(6, 2, 8, dtype=torch.float64)
    _, _, stats_b = router(x_b)
    s_a = torch.softmax(logits.detach(), -1)
    s_b = torch.softmax(x_b.reshape(-1, 8) @ router.weight.detach().t(), -1)
    m = [torch.zeros_like(s, dtype=torch.bool).scatter(1, s.topk(2, -1).indices, True) for s in (s_a, s_b)]
    mean_counts = (m[0].double().sum(0) + m[1].double().sum(0)) / 2
    ref_b = 4 * (s_b.sum(0) * mean_counts).sum() / (2 * 12 * 12)
    torch.testing.assert_close(stats_b[0].double(), ref_b, rtol=1e-6, atol=0)
    assert router.global_aux_steps.item() == 2
    router.reset_global_aux_loss()
    assert router.global_aux_steps.item() == 0 and router.global_tokens_per_expert.sum() == 0


def test_combined_losses_and_z_loss():
    router, x, probs, routing_map, stats, logits = _run_with_losses(
        moe_router_load_balancing_type=["aux_loss", "seq_aux_loss"],
        moe_aux_loss_coeff=[0.1, 0.2],
        moe_z_loss_coeff=0.01,
    )
    assert router.metric_names() == ["load_balancing_loss", "seq_load_balancing_loss", "z_loss"]
    z_ref = torch.logsumexp(logits, -1).square().mean()
    torch.testing.assert_close(stats[2].double(), z_ref, rtol=1e-6, atol=0)
    assert stats.shape == (3 + 4,)
    assert torch.equal(stats[3:], routing_map.sum(0).float())


def test_no_losses_outside_training():
    router, _ = _router(num_moe_experts=4, moe_aux_loss_coeff=[0.5], moe_z_loss_coeff=0.1)
    router.eval()
    _, _, stats = router(torch.randn(4, 1, 8, dtype=torch.float64))
    assert stats[:2].eq(0).all()


def test_aux_loss_scaler_is_identity_forward():
    a = torch.randn(3, requires_grad=True)
    loss = (a * 2).sum()
    out = moe_utils.AuxLossAutoScaler.apply(a * 1.0, loss, torch.tensor(0.25))
    assert torch.equal(out, a)
    out.sum().backward()
    torch.testing.assert_close(a.grad, torch.ones(3) + 0.25 * 2)


def test_force_load_balancing_routes_by_random_logits_straight_through():
    """--moe-router-force-load-balancing: the route of standard normal logits drawn from the
    default generator; the router's weight gets the gradient those logits would pass on."""
    router, _ = _router(num_moe_experts=8, moe_router_topk=2, moe_router_force_load_balancing=True)
    x = torch.randn(512, 2, 8, dtype=torch.float64)
    torch.manual_seed(7)
    probs, routing_map, stats = router(x)
    torch.manual_seed(7)
    noise = torch.randn(1024, 8, dtype=torch.float64)
    torch.testing.assert_close(probs, _reference_route(noise, 2, "softmax"), rtol=1e-12, atol=1e-12)
    counts = routing_map.sum(0)
    assert torch.equal(stats, counts.float())
    assert (counts - 256).abs().max() < 0.15 * 256  # about T * k / E each
    target = torch.randn_like(probs)
    (probs * target).sum().backward()
    logits = x.reshape(-1, 8) @ router.weight.t()
    chosen = routing_map.nonzero()[:, 1].view(-1, 2)  # each token's two experts
    straight = (logits + (noise - logits).detach()).gather(1, chosen)
    loss = (torch.softmax(straight, -1) * target.gather(1, chosen)).sum()
    torch.testing.assert_close(router.weight.grad, torch.autograd.grad(loss, router.weight)[0], rtol=1e-12, atol=1e-12)


def test_input_jitter_multiplies_the_router_input_by_uniform_noise():
    """--moe-input-jitter-eps: the route of ``x * u``, u drawn uniformly from [1 - eps, 1 + eps] by the
    default generator (Megatron's Switch-Transformer jitter)."""
    router, _ = _router(num_moe_experts=8, moe_router_topk=2, moe_input_jitter_eps=0.1)
    plain, _ = _router(num_moe_experts=8, moe_router_topk=2)
    x = torch.randn(16, 2, 8, dtype=torch.float64)
    torch.manual_seed(3)
    probs, routing_map, _ = router(x)
    torch.manual_seed(3)
    noise = torch.empty_like(x).uniform_(0.9, 1.1)
    want_probs, want_map, _ = plain(x * noise)
    assert torch.equal(probs, want_probs) and torch.equal(routing_map, want_map)
    assert 0.9 <= float(noise.min()) and float(noise.max()) <= 1.1 and not torch.equal(probs, plain(x)[0])
    with pytest.raises(ValueError, match=r"--moe-input-jitter-eps must be in \[0, 1\), got 1.5"):
        make_config(num_moe_experts=8, moe_input_jitter_eps=1.5).moe.validate(make_config())
