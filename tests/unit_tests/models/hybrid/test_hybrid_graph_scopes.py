"""CUDA-graph scopes on hybrid models: the resolver's plan per layer kind, errors naming both flags."""

import pytest
import torch

from megatron.core.models.hybrid.hybrid_layers import AttentionLayer, MLPLayer
from megatron.core.models.hybrid.hybrid_model import build_hybrid_model, check_graph_scopes, pattern_layer_classes
from megatron.core.ssm.mamba_config import MambaConfig
from megatron.core.ssm.mamba_layer import MambaLayer
from megatron.core.transformer.cuda_graphs.regions import (
    WHOLE,
    graphable_layers,
    head_follows,
    head_joins,
    head_region,
    leaves_a_scan_eager,
    resolve,
)
from megatron.core.transformer.transformer_config import TransformerConfig

PATTERN = MambaConfig(hybrid_layer_pattern="M*M-M*M-", mamba_state_dim=8, mamba_head_dim=8, mamba_num_groups=2)


def names(plan):
    return {cls.__name__: [s.name for s in specs] for cls, specs in plan.items()}


def test_pattern_layer_classes():
    assert pattern_layer_classes(PATTERN) == [MambaLayer, AttentionLayer, MambaLayer, MLPLayer] * 2


@pytest.mark.parametrize(
    "scopes,expected",
    [
        ([], {"MambaLayer": ["layer"], "AttentionLayer": ["layer"], "MLPLayer": ["layer"]}),
        (["mamba"], {"MambaLayer": ["layer"], "AttentionLayer": [], "MLPLayer": []}),
        (["mamba", "attn", "mlp"], {"MambaLayer": ["layer"], "AttentionLayer": ["layer"], "MLPLayer": ["layer"]}),
        (["attn"], {"MambaLayer": [], "AttentionLayer": ["layer"], "MLPLayer": []}),
    ],
)
def test_scopes_resolve_per_layer_kind(scopes, expected):
    check_graph_scopes(scopes, PATTERN)
    assert names(resolve(scopes, pattern_layer_classes(PATTERN))) == expected


def test_mamba_scope_on_a_pattern_without_mamba_names_both_flags():
    with pytest.raises(ValueError, match="--cuda-graph-scope mamba.*--hybrid-layer-pattern '\\*-\\*-': it has no M"):
        check_graph_scopes(["mamba", "attn"], MambaConfig(hybrid_layer_pattern="*-*-"))
    with pytest.raises(ValueError, match="--cuda-graph-scope attn.*--hybrid-layer-pattern 'MM-': it has no \\*"):
        check_graph_scopes(["attn"], MambaConfig(hybrid_layer_pattern="MM-"))
    with pytest.raises(ValueError, match="--cuda-graph-scope moe: .*--hybrid-layer-pattern 'M\\*'"):
        check_graph_scopes(["moe"], MambaConfig(hybrid_layer_pattern="M*"))


def test_the_model_exposes_its_layers_and_loss_head_to_the_session():
    cfg = TransformerConfig(hidden_size=32, num_attention_heads=4, seq_length=8)
    PATTERN.resolve(cfg)
    PATTERN.validate(cfg)
    model = build_hybrid_model(cfg.finalize(), PATTERN, 64, device="cpu")
    layers = graphable_layers(model)
    assert layers == list(model.decoder.layers) and len(layers) == 8
    module, head = head_region(model)
    assert module is model and head.method == "_postprocess"
    assert head.shared_params(model) == [model.embedding.word_embeddings.weight]
    plan = resolve(["mamba", "attn", "mlp"], [type(x) for x in layers])
    assert head_follows(plan[type(layers[-1])], type(layers[-1]))  # last layer (MLP) whole: the head follows
    assert not head_follows(resolve(["mamba"], [MambaLayer, MLPLayer])[MLPLayer], MLPLayer)
    classes = pattern_layer_classes(PATTERN)
    for scopes, eager_mamba in ((["mlp"], True), (["attn", "mlp"], True), (["mamba", "mlp"], False), ([], False)):
        assert leaves_a_scan_eager(resolve(scopes, classes), classes) is eager_mamba, scopes
    assert not leaves_a_scan_eager(resolve(["mlp"], classes), [MLPLayer])  # a stage without Mamba layers
    assert head_joins(resolve(["mamba", "mlp"], classes), classes)
    assert not head_joins(resolve(["mlp"], classes), classes)  # eager Mamba layers keep the head eager
    assert not head_joins(resolve(["mlp"], classes), [])  # a stage without layers
    assert resolve([], [MambaLayer])[MambaLayer] == (WHOLE,)
    assert torch.isfinite(model(torch.randint(0, 64, (1, 8)), labels=torch.zeros(1, 8, dtype=torch.long))).all()


@pytest.mark.parametrize(
    "scopes,regions",
    [
        (["mamba"], ["0.layer", "2.layer", "4.layer", "6.layer"]),
        (["mamba", "attn", "mlp"], [f"{i}.layer" for i in range(8)] + ["postprocess"]),
        ([], [f"{i}.layer" for i in range(8)] + ["postprocess"]),
        (["attn"], ["1.layer", "5.layer"]),
        (["mlp"], ["3.layer", "7.layer"]),  # eager Mamba layers: the loss head stays eager (leaves_a_scan_eager)
        (["attn", "mlp"], ["1.layer", "3.layer", "5.layer", "7.layer"]),
    ],
)
def test_session_records_the_selected_regions_of_a_hybrid_model(scopes, regions):
    """The graph session attached to a hybrid model records its regions in order (CPU: record only)."""
    import warnings

    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.models.gpt.loss import masked_mean_loss
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
    from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, Event
    from megatron.training.config import DDPConfig

    cfg = TransformerConfig(hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0)
    PATTERN.resolve(cfg)
    PATTERN.validate(cfg)
    torch.manual_seed(0)
    model = build_hybrid_model(cfg.finalize(), PATTERN, 64, device="cpu")
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    check_graph_scopes(scopes, PATTERN, cfg)
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)
    assert [r.name.removeprefix("decoder.layers.") for r in session.regions] == regions
    tokens = torch.randint(0, 64, (2, 8))
    loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 8))
    loss.backward()
    n = len(regions)
    plan = session.make_plans()[0]  # slot 0: one micro-batch in flight
    assert plan.cycle == [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]
    session.close()


def test_moe_layers_bring_the_moe_scope_rules():
    from megatron.core.transformer.moe.moe_config import MoEConfig

    pattern = MambaConfig(hybrid_layer_pattern="M*E-")
    dropless = TransformerConfig(hidden_size=32, num_attention_heads=4, moe=MoEConfig(num_moe_experts=4))
    check_graph_scopes(["mamba", "moe_router", "moe_preprocess"], pattern, dropless)
    with pytest.raises(ValueError, match="--cuda-graph-scope moe: not available.*drop-and-pad"):
        check_graph_scopes(["moe"], pattern, dropless)
    with pytest.raises(ValueError, match="--cuda-graph-scope moe_preprocess needs moe_router"):
        check_graph_scopes(["moe_preprocess"], pattern, dropless)
