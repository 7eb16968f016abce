"""The MoE block against a token-by-token float64 reference, in every configuration the
dispatchers distinguish (dropless, dropping, drop-and-pad), plus the layer's regions."""

import contextlib

import pytest
import torch

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_moe_layer_local_spec
from megatron.core.transformer.moe.experts import GroupedMLP, SequentialMLP
from megatron.core.transformer.moe.moe_layer import (
    MoELayer,
    MoETransformerLayer,
    collect_moe_metrics,
    moe_after_optimizer_step,
    per_layer_moe_metrics,
    set_aux_loss_scale,
)
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_layer import TransformerLayer
from tests.unit_tests.transformer.moe.moe_helpers import make_config, reference_moe

CASES = {
    "dropless-swiglu": dict(gated_linear_unit=True, add_bias_linear=False),
    "dropless-gelu-bias": dict(add_bias_linear=True),
    "grouped": dict(moe_grouped_gemm=True, gated_linear_unit=True),
    "grouped-bias": dict(moe_grouped_gemm=True, add_bias_linear=True),
    "sigmoid-top3": dict(moe_router_score_function="sigmoid", moe_router_topk=3),
    "shared": dict(moe_shared_expert_intermediate_size=10, gated_linear_unit=True),
    "shared-gate": dict(moe_shared_expert_intermediate_size=10, moe_shared_expert_gate=True),
    "drop": dict(moe_expert_capacity_factor=0.5),
    "drop-position": dict(moe_expert_capacity_factor=0.75, moe_token_drop_policy="position"),
    "drop-and-pad": dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
    "pad-big-capacity": dict(moe_expert_capacity_factor=4.0, moe_pad_expert_input_to_capacity=True),
    "probs-on-input": dict(
        moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True, gated_linear_unit=True
    ),
    "probs-on-input-grouped": dict(
        moe_router_topk=1, moe_router_pre_softmax=True, moe_apply_probs_on_input=True, moe_grouped_gemm=True
    ),
}


def _layer(dispatcher, **kw):
    torch.manual_seed(1)
    cfg = make_config(moe_token_dispatcher_type=dispatcher, **kw)
    layer = MoELayer(cfg)
    with torch.no_grad():  # biases start at zero; make them matter
        for name, p in layer.named_parameters():
            if name.endswith("bias"):
                p.normal_()
    return layer


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", list(CASES))
def test_moe_layer_matches_float64_reference(dispatcher, case):
    layer = _layer(dispatcher, **CASES[case])
    x = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    out, stats = layer(x)
    probs, routing_map, _ = layer.route(x)
    ref = reference_moe(layer, x.reshape(-1, 8), probs, routing_map).view(6, 2, 8)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    # Backward against the reference's backward (expert, router and input gradients).
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [x] + list(layer.parameters()), g, allow_unused=True)
    ref_grads = torch.autograd.grad(ref, [x] + list(layer.parameters()), g, allow_unused=True)
    for (name, _), a, b in zip([("input", None)] + list(layer.named_parameters()), grads, ref_grads):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", ["dropless-swiglu", "dropless-gelu-bias", "drop"])
@pytest.mark.parametrize("fused", [False, True])
def test_padded_expert_rows_match_float64_reference(dispatcher, case, fused):
    """The experts' rows padded to multiples of 3 (on CUDA, to 128): the same MoE, forward
    and backward, against the float64 reference; ``fused``: the one-node loop, weight
    gradients in ``main_grad`` (no biases there)."""
    kw = dict(CASES[case], add_bias_linear=False) if fused else CASES[case]
    layer = _layer(dispatcher, **kw)
    layer.experts.row_multiple = 3
    if fused:
        for p in layer.experts.parameters():
            p.main_grad = torch.zeros_like(p)
    x = torch.randn(7, 2, 8, dtype=torch.float64, requires_grad=True)
    out, _ = layer(x)
    probs, routing_map, _ = layer.route(x)
    assert any(c % 3 for c in routing_map.sum(dim=0).tolist())  # some rows were padded
    ref = reference_moe(layer, x.reshape(-1, 8), probs, routing_map).view(7, 2, 8)
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(out)
    params = [p for _, p in layer.named_parameters()]
    ref_grads = torch.autograd.grad(ref, [x] + params, g, allow_unused=True)
    out.backward(g)
    got = [x.grad] + [p.main_grad if fused and hasattr(p, "main_grad") else p.grad for p in params]
    for (name, _), a, b in zip([("input", None)] + list(layer.named_parameters()), got, ref_grads):
        if b is None:
            assert a is None or a.abs().max() == 0, name
            continue
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_grouped_and_sequential_experts_agree_on_the_same_weights():
    kw = dict(gated_linear_unit=True, add_bias_linear=False)
    seq, grp = _layer("alltoall", **kw), _layer("alltoall", moe_grouped_gemm=True, **kw)
    assert isinstance(seq.experts, SequentialMLP) and isinstance(grp.experts, GroupedMLP)
    with torch.no_grad():
        grp.router.weight.copy_(seq.router.weight)
        for e, mlp in enumerate(seq.experts.local_experts):
            grp.experts.linear_fc1.weight[e].copy_(mlp.linear_fc1.weight)
            grp.experts.linear_fc2.weight[e].copy_(mlp.linear_fc2.weight)
    x = torch.randn(5, 2, 8, dtype=torch.float64)
    torch.testing.assert_close(seq(x)[0], grp(x)[0], rtol=1e-13, atol=1e-13)


def test_expert_parameters_are_marked_and_named_as_megatron():
    layer = _layer("alltoall", moe_shared_expert_intermediate_size=4, moe_shared_expert_gate=True)
    names = dict(layer.named_parameters())
    assert "router.weight" in names and "experts.local_experts.3.linear_fc2.weight" in names
    assert "shared_experts.linear_fc1.weight" in names and "shared_experts.gate_weight" in names
    for name, p in names.items():
        expert = name.startswith("experts.")
        assert getattr(p, "is_expert", False) == expert, name
        assert getattr(p, "allreduce", True) == (not expert), name
    grouped = _layer("alltoall", moe_grouped_gemm=True)
    assert dict(grouped.named_parameters())["experts.linear_fc1.weight"].shape == (4, 12, 8)


@contextlib.contextmanager
def _no_host_sync():
    """Fails on the usual host reads of tensor data."""
    names = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "nonzero")
    saved = {n: getattr(torch.Tensor, n) for n in names}

    def refuse(name):
        def fn(*a, **k):
            raise AssertionError(f"host sync: Tensor.{name}")

        return fn

    for n in names:
        setattr(torch.Tensor, n, refuse(n))
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_drop_and_pad_block_has_no_host_sync(dispatcher):
    layer = _layer(dispatcher, moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)
    x = torch.randn(6, 2, 8, dtype=torch.float64, requires_grad=True)
    with _no_host_sync():
        out, _ = layer(x)
        out.sum().backward()


def test_dropless_router_and_preprocess_have_no_host_sync():
    layer = _layer("alltoall", moe_aux_loss_coeff=[0.01], moe_z_loss_coeff=0.1)
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    with _no_host_sync():
        probs, routing_map, stats = layer.route(x)
        outs = layer.preprocess(x, probs, routing_map)
    assert outs[0].shape == (6 * 2 * 2, 8)  # T * k rows: static
    with pytest.raises(AssertionError, match="host sync"), _no_host_sync():
        layer.dispatch_experts_combine(*outs[:2], outs[3], 12)  # the loop of experts reads the counts
    combined = layer.dispatch_experts_combine(*outs[:2], outs[3], 12)
    with _no_host_sync():  # the postprocess region reads nothing on the host either
        out = layer.postprocess(combined, outs[2], x.shape)
    assert out.shape == x.shape


def _moe_transformer_layer(**kw):
    torch.manual_seed(2)
    cfg = make_config(**kw)
    return build_module(get_gpt_moe_layer_local_spec(), config=cfg, layer_number=1), cfg


@pytest.mark.parametrize("shared", [False, True])
def test_moe_transformer_layer_regions_compose_to_forward(shared):
    kw = dict(moe_shared_expert_intermediate_size=6) if shared else {}
    layer, cfg = _moe_transformer_layer(moe_aux_loss_coeff=[0.01], **kw)
    assert isinstance(layer, MoETransformerLayer) and isinstance(layer.mlp, MoELayer)
    x = torch.randn(6, 2, 8, dtype=torch.float64)
    out = layer(x)
    h = layer._forward_attention(x)
    routed = layer._forward_moe_router(h)
    assert all(isinstance(t, torch.Tensor) for t in routed) and len(routed) == (5 if shared else 4)
    pre = layer._forward_moe_preprocess(*routed[:3])
    assert all(isinstance(t, torch.Tensor) for t in pre)
    combined = layer.mlp.dispatch_experts_combine(pre[0], pre[1], pre[3], 12)
    manual = layer._forward_moe_postprocess(combined, pre[2], h, *routed[4:])
    torch.testing.assert_close(out, manual, rtol=0, atol=0)
    # The MoE branch is the MoE block on the pre-MLP norm, added to the residual.
    ref, _ = layer.mlp(layer.pre_mlp_layernorm(h))
    torch.testing.assert_close(out, h + ref, rtol=1e-12, atol=1e-12)
    whole, stats = layer._forward_moe(h)
    torch.testing.assert_close(whole, out, rtol=0, atol=0)
    assert stats.shape == (1 + 4,)


def test_metrics_and_aux_loss_scale_reach_the_model_level():
    layer, cfg = _moe_transformer_layer(moe_aux_loss_coeff=[0.01], moe_z_loss_coeff=1e-3)
    model = torch.nn.ModuleList([layer])
    model.train()
    for _ in range(2):  # two micro-batches
        layer(torch.randn(6, 2, 8, dtype=torch.float64))
    values = collect_moe_metrics(model, num_microbatches=2)
    assert list(values) == ["load_balancing_loss", "z_loss"]
    assert all(v > 0 for v in values.values())
    assert collect_moe_metrics(model, num_microbatches=2)["z_loss"] == 0  # reset after reading
    set_aux_loss_scale(model, 0.25)
    assert layer.mlp.router.aux_loss_scale.item() == 0.25


def test_per_layer_metrics_name_each_moe_layer_and_average_to_the_logged_value():
    # --moe-per-layer-logging: Megatron's moe/<name>_layer_<i> scalars (i 0-based), read before the reset.
    torch.manual_seed(2)
    cfg = make_config(num_layers=3, moe_aux_loss_coeff=[0.01], moe_z_loss_coeff=1e-3)
    spec = get_gpt_moe_layer_local_spec()
    model = torch.nn.ModuleList([build_module(spec, config=cfg, layer_number=n) for n in (1, 3)])  # layer 2 dense
    model.train()
    for _ in range(2):
        for layer in model:
            layer(torch.randn(6, 2, 8, dtype=torch.float64))
    names = ["load_balancing_loss", "z_loss"]
    per_layer = per_layer_moe_metrics(model, 3, num_microbatches=2, names=names)
    assert sorted(per_layer) == sorted(f"moe/{n}_layer_{i}" for n in names for i in (0, 2))
    for i, layer in zip((0, 2), model):
        for j, n in enumerate(names):
            assert per_layer[f"moe/{n}_layer_{i}"] == layer.mlp.metrics[j] / 2
    logged = collect_moe_metrics(model, num_microbatches=2)  # the mean over MoE layers
    for n in names:
        mean = (per_layer[f"moe/{n}_layer_0"] + per_layer[f"moe/{n}_layer_2"]) / 2
        torch.testing.assert_close(logged[n], mean, rtol=1e-6, atol=0)


def test_expert_bias_update_after_step():
    layer, cfg = _moe_transformer_layer(
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_router_topk=1
    )
    model = torch.nn.ModuleList([layer])
    layer(torch.randn(6, 2, 8, dtype=torch.float64))
    counts = layer.mlp.tokens_per_expert.clone()
    assert counts.sum() == 12
    moe_after_optimizer_step(model)
    expected = torch.sign(counts.mean() - counts) * cfg.moe.moe_router_bias_update_rate
    torch.testing.assert_close(layer.mlp.router.expert_bias, expected)
    assert layer.mlp.tokens_per_expert.sum() == 0


def test_decoder_specs_follow_moe_layer_freq():
    cfg = make_config(num_layers=4, moe_layer_freq="([0]*1+[1]*3)")
    kinds = [spec.module for spec in get_gpt_decoder_layer_specs(cfg)]
    assert kinds == [TransformerLayer, MoETransformerLayer, MoETransformerLayer, MoETransformerLayer]
    cfg = make_config(num_layers=3, moe_layer_freq=2)
    assert [s.module for s in get_gpt_decoder_layer_specs(cfg)] == [
        MoETransformerLayer,
        TransformerLayer,
        MoETransformerLayer,
    ]


def _plan(scopes, classes, **moe):
    from megatron.core.transformer.cuda_graphs.regions import resolve

    cfg = make_config(**moe)
    return {c.__name__: [s.name for s in specs] for c, specs in resolve(scopes, classes, cfg).items()}


PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def test_region_declarations_resolve():
    both = [TransformerLayer, MoETransformerLayer]
    assert _plan(["attn", "moe_router", "moe_preprocess"], [MoETransformerLayer]) == {
        "MoETransformerLayer": ["attn", "moe_router", "moe_preprocess", "moe_postprocess"]
    }
    assert _plan(["moe_router"], both) == {"TransformerLayer": [], "MoETransformerLayer": ["moe_router"]}
    assert _plan(["moe"], [MoETransformerLayer], **PAD) == {"MoETransformerLayer": ["moe"]}
    assert _plan(["attn", "moe"], [MoETransformerLayer], **PAD) == {"MoETransformerLayer": ["layer"]}
    assert _plan([], both, **PAD) == {"TransformerLayer": ["layer"], "MoETransformerLayer": ["layer"]}
    assert _plan(["mlp"], both) == {"TransformerLayer": ["mlp"], "MoETransformerLayer": []}


@pytest.mark.parametrize(
    "scopes, classes, moe, message",
    [
        (["moe", "moe_router"], [MoETransformerLayer], PAD, "moe_router cannot be combined with moe"),
        (["moe_preprocess"], [MoETransformerLayer], {}, "moe_preprocess needs moe_router"),
        (["moe"], [MoETransformerLayer], {}, "moe: not available with this model: it needs drop-and-pad"),
        ([], [MoETransformerLayer], {}, "cannot be captured whole: it needs drop-and-pad"),
        (["mlp"], [MoETransformerLayer], {}, "has no 'mlp' region"),
        (["moe_router"], [TransformerLayer], {}, "has no 'moe_router' region"),  # a model without experts
        (["moe"], [TransformerLayer], {}, "has no 'moe' region"),
        (
            ["moe_router"],
            [MoETransformerLayer],
            dict(moe_router_load_balancing_type=["global_aux_loss"], moe_aux_loss_coeff=[0.1]),
            "global_aux_loss",
        ),
    ],
)
def test_region_validation_errors(scopes, classes, moe, message):
    with pytest.raises(ValueError, match=message):
        _plan(scopes, classes, **moe)


def _grouped_pair(dtype, device, counts_kind, hidden=8, ffn=12):
    torch.manual_seed(3)
    cfg = make_config(
        dtype=dtype, hidden=hidden, ffn=ffn, moe_grouped_gemm=True, gated_linear_unit=True, add_bias_linear=True
    )
    experts = GroupedMLP(cfg, 4, device=device)
    with torch.no_grad():
        experts.linear_fc1.bias.normal_()
        experts.linear_fc2.bias.normal_()
    counts = [3, 0, 5, 2] if counts_kind == "ragged" else [4, 4, 4, 4]
    tokens = torch.randn(sum(counts), hidden, dtype=dtype, device=device)
    probs = torch.rand(sum(counts), dtype=dtype, device=device)
    return experts, tokens, counts, probs


@pytest.mark.parametrize("counts_kind", ["ragged", "static"])
def test_grouped_mm_path_matches_the_loop_on_cpu_forward(counts_kind):
    experts, tokens, counts, probs = _grouped_pair(torch.float32, "cpu", counts_kind)
    try:
        with torch.no_grad():
            grouped = experts._grouped(tokens, counts, probs)
    except (RuntimeError, AttributeError) as exc:  # grouped_mm is a CUDA kernel; some builds have a CPU one
        pytest.skip(f"no CPU grouped_mm here: {exc}")
    with torch.no_grad():
        loop = experts._loop(tokens, counts, probs)
        tensor_counts = experts._grouped(tokens, torch.tensor(counts), probs)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tensor_counts, loop, rtol=1e-5, atol=1e-5)


def test_grouped_mm_needs_16_byte_strides():
    from megatron.core.transformer.moe.experts import grouped_mm_shapes_conform

    assert grouped_mm_shapes_conform(1024, 4096, torch.bfloat16)
    assert grouped_mm_shapes_conform(16, 24, torch.bfloat16)
    assert not grouped_mm_shapes_conform(8, 12, torch.bfloat16)  # 24-byte activation rows
    assert not grouped_mm_shapes_conform(12, 16, torch.bfloat16)
    assert grouped_mm_shapes_conform(12, 16, torch.float32)  # 4-byte elements: multiples of 4
    cfg = make_config(dtype=torch.bfloat16, hidden=8, ffn=12, moe_grouped_gemm=True)
    experts = GroupedMLP(cfg, 4)
    assert (experts.hidden_size, experts.ffn_hidden_size) == (8, 12)
    x = torch.zeros(3, 8, dtype=torch.bfloat16)
    assert not experts.uses_grouped_mm(x) and experts.needs_host_counts(x)  # CPU: the loop
    out = experts(x, [1, 0, 2, 0], torch.ones(3, dtype=torch.bfloat16))
    assert experts.last_path == "loop" and out.shape == (3, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("counts_kind", ["ragged", "static"])
def test_grouped_mm_path_matches_the_loop_on_cuda_bf16(counts_kind):
    """Shapes the kernel accepts (16-byte strides): the grouped path runs and matches the loop."""
    experts, tokens, counts, probs = _grouped_pair(torch.bfloat16, "cuda", counts_kind, hidden=16, ffn=24)
    tokens.requires_grad_()
    assert experts.uses_grouped_mm(tokens) and not experts.needs_host_counts(tokens)
    out = experts(tokens, torch.tensor(counts, device="cuda") if counts_kind == "ragged" else counts, probs)
    assert experts.last_path == "grouped"
    ref = experts._loop(tokens, counts, probs)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)  # bf16 GEMMs, different kernels
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, [tokens, experts.linear_fc1.weight, experts.linear_fc2.bias], g)
    want = torch.autograd.grad(ref, [tokens, experts.linear_fc1.weight, experts.linear_fc2.bias], g)
    for a, b in zip(got, want):
        torch.testing.assert_close(a.float(), b.float(), rtol=3e-2, atol=3e-2)


@pytest.mark.gpu
def test_grouped_mm_falls_back_to_the_loop_for_unaligned_shapes_on_cuda(recwarn):
    """hidden 8, ffn 12 in bf16: 24-byte activation rows, which the kernel refuses: the loop runs."""
    from megatron.core.transformer.moe import experts as experts_module

    experts_module._fallback_said = False
    experts, tokens, counts, probs = _grouped_pair(torch.bfloat16, "cuda", "ragged")
    assert not experts.uses_grouped_mm(tokens) and experts.needs_host_counts(tokens)
    out = experts(tokens, counts, probs)
    assert experts.last_path == "loop"
    torch.testing.assert_close(out, experts._loop(tokens, counts, probs), rtol=0, atol=0)
    experts(tokens, counts, probs)
    said = [w for w in recwarn.list if "--moe-grouped-gemm" in str(w.message)]
    assert len(said) == 1, [str(w.message) for w in recwarn.list]


@pytest.mark.gpu
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_drop_and_pad_moe_block_captures_and_replays_on_cuda(dispatcher):
    """The ``moe`` region of a drop-and-pad layer is capturable: replay == eager, bitwise."""
    torch.manual_seed(4)
    cfg = make_config(
        dtype=torch.bfloat16,
        moe_token_dispatcher_type=dispatcher,
        moe_grouped_gemm=True,
        moe_expert_capacity_factor=1.0,
        moe_pad_expert_input_to_capacity=True,
        moe_aux_loss_coeff=[0.01],
        hidden=64,
        ffn=128,
        heads=4,
    )
    layer = build_module(get_gpt_moe_layer_local_spec(), config=cfg, layer_number=1, device="cuda")
    static_in = torch.randn(32, 2, 64, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for _ in range(2):
            layer._forward_moe(static_in)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            static_out, static_stats = layer._forward_moe(static_in)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        x = torch.randn_like(static_in)
        static_in.copy_(x)
        graph.replay()
        with torch.no_grad():
            eager_out, eager_stats = layer._forward_moe(x)
        assert torch.equal(static_out, eager_out) and torch.equal(static_stats, eager_stats)
