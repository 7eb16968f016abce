"""Expert parallelism over gloo: EP = 2 against EP = 1, both dispatchers.

Each rank routes its own tokens. The EP = 1 reference runs the same tokens through a
layer holding every expert; the EP = 2 layer holds half of them and moves tokens
between the ranks. Outputs, input and router gradients must match per rank; an expert's
gradient at EP = 2 collects the tokens of both ranks, so it must match the reference
gradients summed over the ranks.
"""

import torch

from tests.unit_tests.dist_utils import run_distributed

CASES = {
    "dropless": dict(),
    "drop": dict(moe_expert_capacity_factor=0.75),
    "drop-and-pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "grouped-shared-sigmoid": dict(
        moe_grouped_gemm=True,
        moe_shared_expert_intermediate_size=6,
        moe_router_score_function="sigmoid",
        moe_aux_loss_coeff=[0.01],
    ),
}


def _pair(cfg, group):
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from tests.unit_tests.transformer.moe.moe_helpers import expert_weights

    torch.manual_seed(0)
    ref = MoELayer(cfg)
    ep = MoELayer(cfg, ep_group=group)
    ref_params = dict(ref.named_parameters())
    with torch.no_grad():
        for name, p in ep.named_parameters():
            if not name.startswith("experts."):
                p.copy_(ref_params[name])
        n_local = ep.token_dispatcher.num_local_experts
        offset = ep.token_dispatcher.local_expert_indices.start
        for i in range(n_local):
            for dst, src in zip(expert_weights(ep.experts, i), expert_weights(ref.experts, offset + i)):
                if dst is not None:
                    dst.copy_(src)
    return ref, ep


def _check_parity(rank, world, dispatcher, case):
    import torch.distributed as dist

    from tests.unit_tests.transformer.moe.moe_helpers import expert_weights, make_config

    group = dist.group.WORLD
    cfg = make_config(moe_token_dispatcher_type=dispatcher, **CASES[case])
    ref, ep = _pair(cfg, group)
    ref.train(), ep.train()
    gen = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(6, 2, 8, dtype=torch.float64, generator=gen)
    g = torch.randn(6, 2, 8, dtype=torch.float64, generator=gen)
    xr, xe = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_r, stats_r = ref(xr)
    out_e, stats_e = ep(xe)
    torch.testing.assert_close(out_e, out_r, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats_e, stats_r, rtol=0, atol=0)
    out_r.backward(g)
    out_e.backward(g)
    torch.testing.assert_close(xe.grad, xr.grad, rtol=1e-12, atol=1e-12)
    ref_params = dict(ref.named_parameters())
    for name, p in ep.named_parameters():
        if not name.startswith("experts."):
            torch.testing.assert_close(p.grad, ref_params[name].grad, rtol=1e-12, atol=1e-12, msg=name)
    # Every expert's reference gradient summed over the ranks (the same collectives on each rank).
    summed = {}
    for e in range(cfg.moe.num_moe_experts):
        for j, src in enumerate(expert_weights(ref.experts, e)):
            if src is not None:
                total = _grad_of(ref.experts, src).clone()
                dist.all_reduce(total, group=group)
                summed[e, j] = total
    offset = ep.token_dispatcher.local_expert_indices.start
    for i in range(ep.token_dispatcher.num_local_experts):
        for j, dst in enumerate(expert_weights(ep.experts, i)):
            if dst is not None:
                d = _grad_of(ep.experts, dst)
                torch.testing.assert_close(d, summed[offset + i, j], rtol=1e-12, atol=1e-12)
    return True


def _grad_view(experts, view):
    for p in experts.parameters():
        if view._base is p:
            index = (view.data_ptr() - p.data_ptr()) // (view.numel() * view.element_size())
            return p.grad[index]
    raise AssertionError("not a view of an expert parameter")


def _grad_of(experts, weight):
    """The gradient of an expert weight (a parameter, or a view of a grouped one)."""
    return weight.grad if weight._base is None else _grad_view(experts, weight)


def _all_cases(rank, world):
    for dispatcher in ("alltoall", "allgather"):
        for case in CASES:
            try:
                _check_parity(rank, world, dispatcher, case)
            except AssertionError as exc:
                raise AssertionError(f"{dispatcher} / {case}: {exc}") from exc
    return True


def _train(rank, world, dispatcher, iters):
    """SGD steps in fp32: EP = 2 over 2 data-parallel ranks against EP = 1 on all the data.

    Gradient rule the data-parallel wrapper must follow: dense gradients averaged over DP,
    expert gradients summed over the expert-DP group (here each rank alone) and divided by DP.
    The aux loss enters with d(objective)/d(aux) = 1 / DP in the reference, which sees both
    ranks' micro-batches, and 1 on each EP rank (the DP average supplies the 1 / DP).
    """
    import torch.distributed as dist

    from megatron.core.transformer.moe.moe_layer import set_aux_loss_scale
    from tests.unit_tests.transformer.moe.moe_helpers import make_config

    group = dist.group.WORLD
    cfg = make_config(dtype=torch.float32, moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=[0.01])
    ref, ep = _pair(cfg, group)
    ref.train(), ep.train()
    set_aux_loss_scale(ref, 1.0 / world)
    lr, losses = 0.05, []
    data = []  # each rank's batch, the same every step: the loss must fall
    for r in range(world):
        gen = torch.Generator().manual_seed(r)
        data.append((torch.randn(6, 2, 8, generator=gen), torch.randn(6, 2, 8, generator=gen)))
    for _ in range(iters):
        # Reference: one process sees both ranks' data; objective = mean of the ranks' losses.
        ref.zero_grad()
        ref_loss = sum((ref(x)[0] - y).square().mean() for x, y in data) / world
        ref_loss.backward()
        ep.zero_grad()
        x, y = data[rank]
        loss = (ep(x)[0] - y).square().mean()
        loss.backward()
        with torch.no_grad():
            for name, p in ep.named_parameters():
                if not name.startswith("experts."):
                    dist.all_reduce(p.grad, group=group)
                p.grad /= world
            for p in list(ref.parameters()) + list(ep.parameters()):
                p -= lr * p.grad
        total = loss.detach().clone()
        dist.all_reduce(total, group=group)
        losses.append((total.item() / world, ref_loss.item()))
    return losses


def _train_both(rank, world, iters):
    return {d: _train(rank, world, d, iters) for d in ("alltoall", "allgather")}


def _parity_and_training(rank, world, iters):
    _all_cases(rank, world)
    return _train_both(rank, world, iters)


def test_ep2_matches_ep1_and_ep2_times_dp_trains_like_ep1():
    """One spawn (start-up dominates): the forward/backward parity of every case, then 20
    fp32 SGD steps at EP = 2 x DP = 2 within 1e-5 relative of EP = 1."""
    results = run_distributed(_parity_and_training, 2, 20)
    assert results[0] == results[1]
    for dispatcher, losses in results[0].items():
        assert losses[-1][1] < losses[0][1]  # it learns
        for ep_loss, ref_loss in losses:
            assert abs(ep_loss - ref_loss) <= 1e-5 * abs(ref_loss), (dispatcher, ep_loss, ref_loss)
