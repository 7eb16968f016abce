"""Expert tensor parallelism over gloo: the MoE layer at TP = 2 (ETP = 2), TP = 2 with ETP = 1,
and TP = 2 x EP = 2 (4 ranks) against one process, both dispatchers.

The TP ranks hold sequence shards (sequence parallelism), so each routes its own tokens.
The single-process reference runs each data-parallel replica's whole sequence (per
shard with drop-and-pad, whose capacity counts each rank's own tokens, as in Megatron).
Both are built from the same seed: the parallel layer's weights must be exact shards
of the reference's (layout-independent init). Gradients follow Megatron's reduction
rule: a parameter's gradient summed over the ranks holding the same copy (router and
shared-expert gate: TP and DP; shared experts: DP; routed experts: expert DP) equals the
reference gradient summed over the replicas, cut to the shard.
"""

import re

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

LAYOUTS = {
    "tp2": (2, dict(tensor_model_parallel_size=2)),
    "tp2_etp1": (2, dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)),
    "tp2_ep2": (4, dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)),
}
CASES = {
    "dropless": dict(),
    "drop-and-pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "grouped-swiglu-shared-gate-aux": dict(
        moe_grouped_gemm=True,
        gated_linear_unit=True,
        moe_shared_expert_intermediate_size=6,
        moe_shared_expert_gate=True,
        moe_router_score_function="sigmoid",
        moe_aux_loss_coeff=[0.01],
        moe_z_loss_coeff=1e-3,
    ),
}
SEQ, BATCH, HIDDEN = 8, 2, 8


def _groups(world, sizes):
    from megatron.core import parallel_state
    from megatron.core.parallel_config import ParallelConfig

    cfg = ParallelConfig(world_size=world, sequence_parallel=True, **sizes).resolve()
    cfg.validate()
    import torch.distributed as dist

    return parallel_state.build_groups(cfg, rank=dist.get_rank(), world_size=world, device=torch.device("cpu"))


def _sum(x, *groups):
    import torch.distributed as dist

    x = x.clone()
    for g in groups:
        if g is not None:
            dist.all_reduce(x, group=g)
    return x


def _sum_each(tensors: dict, groups_of: dict, pg) -> dict:
    """``_sum`` of every tensor over the groups ``pg.<name>`` that ``groups_of`` names, one
    all-reduce per distinct tuple of names (called alike on every rank)."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    out, by_groups = {}, {}
    for name in tensors:
        by_groups.setdefault(groups_of[name], []).append(name)
    for groups in sorted(by_groups):
        names = by_groups[groups]
        flat = _sum(_flatten_dense_tensors([tensors[n] for n in names]), *(getattr(pg, g) for g in groups))
        out.update(zip(names, _unflatten_dense_tensors(flat, [tensors[n] for n in names])))
    return out


class _Spec:
    """How a parallel parameter relates to the reference: the reference parameter's name
    (``key``; rows of experts picked), the shard, and the groups its copies are spread over."""

    def __init__(self, name, layer, pg):
        gated = layer.config.gated_linear_unit
        disp = layer.token_dispatcher
        offset, el = disp.local_expert_indices.start, disp.num_local_experts
        self.etp, self.etp_rank = disp.etp_size, disp.etp_rank
        self.dim, self.stride, self.size, self.rank, self.rows = None, 1, 1, 0, None
        m = re.match(r"experts\.local_experts\.(\d+)\.(.*)", name)
        if m:  # SequentialMLP
            self.key = f"experts.local_experts.{offset + int(m.group(1))}.{m.group(2)}"
            self._split(m.group(2), 0, gated, self.etp, self.etp_rank)
            self.groups = ("expt_dp",)
        elif name.startswith("experts."):  # GroupedMLP: [experts, out, in]
            self.key, self.rows = name, slice(offset, offset + el)
            self._split(name[len("experts.") :], 1, gated, self.etp, self.etp_rank)
            self.groups = ("expt_dp",)
        elif name.startswith("shared_experts.linear_"):
            self.key = name
            self._split(name[len("shared_experts.") :], 0, gated, pg.tp_size, pg.tp_rank)
            self.groups = ("dp",)
        else:  # router, shared-expert gate: replicated, applied to sequence shards
            self.key = name
            self.groups = ("tp", "dp")

    def _split(self, rest, base, gated, size, rank):
        if rest == "linear_fc1.weight":
            self.dim, self.stride = base, 2 if gated else 1
        elif rest == "linear_fc2.weight":
            self.dim = base + 1
        self.size, self.rank = size, rank

    def shard(self, full):
        """This rank's part of ``full`` (the reference parameter or its gradient)."""
        from megatron.core.tensor_parallel.layers import shard_of

        if self.rows is not None:
            full = full[self.rows]
        if self.dim is None:
            return full
        return shard_of(full, self.dim, self.size, self.rank, self.stride)


def _build(cfg, pg):
    from megatron.core.transformer.moe.moe_layer import MoELayer

    torch.manual_seed(0)
    ref = MoELayer(cfg)
    torch.manual_seed(0)
    par = MoELayer(cfg, pg)
    specs = {name: _Spec(name, par, pg) for name, _ in par.named_parameters()}
    return ref, par, specs


def _replica_data(dp_rank, dtype, seed=0):
    gen = torch.Generator().manual_seed(100 * seed + dp_rank)
    x = torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=dtype)
    return x, torch.randn(SEQ, BATCH, HIDDEN, generator=gen, dtype=dtype)


def _ref_forward(ref, x, pg, per_shard):
    if not per_shard:
        return ref(x)[0]
    return torch.cat([ref(s)[0] for s in x.chunk(pg.tp_size, dim=0)])


def _local(x, pg):
    return x.chunk(pg.tp_size, dim=0)[pg.tp_rank]


def _check_parity(world, layout, dispatcher, case):
    from tests.unit_tests.transformer.moe.moe_helpers import make_config

    pg = _groups(world, LAYOUTS[layout][1])
    kwargs = dict(CASES[case])
    cfg = make_config(moe_token_dispatcher_type=dispatcher, add_bias_linear=False, **kwargs)
    ref, par, specs = _build(cfg, pg)
    ref.train(), par.train()
    params, ref_params = dict(par.named_parameters()), dict(ref.named_parameters())
    for name, spec in specs.items():  # layout-independent init: exact shards
        assert torch.equal(params[name], spec.shard(ref_params[spec.key])), f"init of {name}"
    per_shard = cfg.moe.drop_and_pad
    x, g = _replica_data(pg.dp_rank, torch.float64)
    xr = x.clone().requires_grad_()
    out_r = _ref_forward(ref, xr, pg, per_shard)
    out_r.backward(g)
    xl = _local(x, pg).clone().requires_grad_()
    out_p, _ = par(xl)
    torch.testing.assert_close(out_p, _local(out_r.detach(), pg), rtol=1e-12, atol=1e-12)
    out_p.backward(_local(g, pg))
    torch.testing.assert_close(xl.grad, _local(xr.grad, pg), rtol=1e-12, atol=1e-12)
    # Summed over the replicas, every parameter in the same order on every rank.
    ref_grads = _sum_each({n: p.grad for n, p in ref_params.items()}, dict.fromkeys(ref_params, ("dp",)), pg)
    grads = _sum_each({n: p.grad for n, p in params.items()}, {n: spec.groups for n, spec in specs.items()}, pg)
    for name, spec in specs.items():
        want = spec.shard(ref_grads[spec.key])
        got = grads[name]
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")


def _train(world, layout, dispatcher, iters):
    """fp32 SGD on sum((out - y)^2) / all elements over every replica: losses per step."""
    from tests.unit_tests.transformer.moe.moe_helpers import make_config

    pg = _groups(world, LAYOUTS[layout][1])
    cfg = make_config(
        dtype=torch.float32,
        moe_token_dispatcher_type=dispatcher,
        add_bias_linear=False,
        gated_linear_unit=True,
        moe_shared_expert_intermediate_size=6,
        moe_aux_loss_coeff=[0.01],
    )
    ref, par, specs = _build(cfg, pg)
    ref.train(), par.train()
    data = [_replica_data(d, torch.float32, seed=1) for d in range(pg.dp_size)]
    total = pg.dp_size * data[0][0].numel()
    params = dict(par.named_parameters())
    lr, losses = 0.05, []
    for _ in range(iters):
        ref.zero_grad()
        ref_loss = sum((ref(x)[0] - y).square().sum() for x, y in data) / total
        ref_loss.backward()
        par.zero_grad()
        x, y = data[pg.dp_rank]
        loss = (par(_local(x, pg))[0] - _local(y, pg)).square().sum() / total
        loss.backward()
        grads = _sum_each({n: p.grad for n, p in params.items()}, {n: spec.groups for n, spec in specs.items()}, pg)
        with torch.no_grad():
            for name, p in params.items():
                p -= lr * grads[name]
            for p in ref.parameters():
                p -= lr * p.grad
        import torch.distributed as dist

        summed = loss.detach().clone()
        dist.all_reduce(summed)
        losses.append((summed.item(), ref_loss.item()))
    return losses


def _run_layouts(rank, world, layouts, iters):
    out = {}
    for layout in layouts:
        for dispatcher in ("alltoall", "allgather"):
            for case in CASES:
                try:
                    _check_parity(world, layout, dispatcher, case)
                except AssertionError as exc:
                    raise AssertionError(f"{layout} / {dispatcher} / {case}: {exc}") from exc
            out[layout, dispatcher] = _train(world, layout, dispatcher, iters)
    return out


def _assert_trains_like_one_process(results):
    for (layout, dispatcher), losses in results[0].items():
        assert len(losses) == 20
        assert losses[-1][1] < losses[0][1], (layout, dispatcher)  # it learns
        for par_loss, ref_loss in losses:
            assert abs(par_loss - ref_loss) <= 1e-5 * abs(ref_loss), (layout, dispatcher, par_loss, ref_loss)
    assert all(r == results[0] for r in results)


def test_tp2_with_etp2_and_etp1_match_one_process():
    """One spawn for both two-rank layouts: parity of every case, then 20 fp32 SGD steps."""
    _assert_trains_like_one_process(run_distributed(_run_layouts, 2, ["tp2", "tp2_etp1"], 20, timeout=300))


def test_tp2_times_ep2_matches_one_process():
    _assert_trains_like_one_process(run_distributed(_run_layouts, 4, ["tp2_ep2"], 20, timeout=300))


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_tp_without_sequence_parallel_is_refused(dispatcher):
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from tests.unit_tests.transformer.moe.moe_helpers import make_config

    pg = ProcessGroups(rank=0, world_size=2, device=torch.device("cpu"), ranks={"tp": [0, 1]})
    cfg = make_config(moe_token_dispatcher_type=dispatcher, add_bias_linear=False)
    with pytest.raises(ValueError, match="needs --sequence-parallel"):
        MoELayer(cfg, pg)
