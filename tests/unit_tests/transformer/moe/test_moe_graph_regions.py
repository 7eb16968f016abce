"""MoE layers' graph regions on a real MoE GPT, recorded on the CPU (no capture).

What each scope list graphs per MoE layer, in forward order, and where every region's
inputs come from: ``moe_router moe_preprocess`` graphs the router and the dispatcher's
preprocessing, leaves dispatch, experts and combine eager, and graphs the postprocess
(``moe_postprocess``, selected with ``moe_preprocess``), which reads the preprocess
graph's ``token_idx`` and the eager combine's output.
"""

import warnings

import pytest
import torch

from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
from megatron.core.models.gpt.gpt_model import build_gpt_model
from megatron.core.models.gpt.loss import masked_mean_loss
from megatron.core.parallel_state import ProcessGroups
from megatron.core.transformer import cuda_graphs
from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
from megatron.core.transformer.cuda_graphs.plan import BWD, FWD, Event
from megatron.core.transformer.cuda_graphs.regions import resolve
from megatron.core.transformer.moe.moe_config import MoEConfig
from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import DDPConfig

LAYERS = 2
PAD = dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True)


def _config(shared=False, **moe):
    moe.setdefault("moe_aux_loss_coeff", [0.01])
    if shared:
        moe["moe_shared_expert_intermediate_size"] = 16
    return TransformerConfig(
        num_layers=LAYERS,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        gated_linear_unit=True,
        add_bias_linear=False,
        moe=MoEConfig(num_moe_experts=4, moe_router_topk=2, moe_token_dispatcher_type="alltoall", **moe),
    ).finalize()


def _recorded(scopes, shared=False, head=False, **moe):
    cfg = _config(shared, **moe)
    torch.manual_seed(0)
    model = build_gpt_model(cfg, 32)
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes, cuda_graph_postprocess=head)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(model, config, model_config=cfg, grad_sinks=[ddp], record_without_cuda=True)
    tokens = torch.randint(0, 32, (2, 8))
    loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 8))
    loss.backward()
    return session, session.make_plans()[0], model


def _names(session):
    return [r.name.removeprefix("decoder.layers.") for r in session.regions]


def test_postprocess_is_selected_with_moe_preprocess_and_follows_its_rules():
    cfg = _config()
    plan = resolve(["moe_router", "moe_preprocess"], [MoETransformerLayer], cfg)[MoETransformerLayer]
    assert [s.name for s in plan] == ["moe_router", "moe_preprocess", "moe_postprocess"]
    assert [s.name for s in resolve(["moe_router"], [MoETransformerLayer], cfg)[MoETransformerLayer]] == ["moe_router"]
    padded = _config(**PAD)
    assert [s.name for s in resolve(["moe"], [MoETransformerLayer], padded)[MoETransformerLayer]] == ["moe"]
    with pytest.raises(ValueError, match="unknown scope 'moe_postprocess'"):
        resolve(["moe_router", "moe_postprocess"], [MoETransformerLayer], cfg)
    glob = _config(moe_router_load_balancing_type=["global_aux_loss"])
    with pytest.raises(ValueError, match="global_aux_loss"):
        resolve(["moe_router", "moe_preprocess"], [MoETransformerLayer], glob)


@pytest.mark.parametrize(
    "scopes, moe, per_layer",
    [
        (["attn", "moe_router", "moe_preprocess"], {}, ["attn", "moe_router", "moe_preprocess", "moe_postprocess"]),
        (["moe_router", "moe_preprocess"], {}, ["moe_router", "moe_preprocess", "moe_postprocess"]),
        (["moe_router"], {}, ["moe_router"]),
        (["attn"], {}, ["attn"]),
        (["moe"], PAD, ["moe"]),
    ],
)
def test_session_records_the_moe_regions_in_forward_order(scopes, moe, per_layer):
    session, plan, _ = _recorded(scopes, **moe)
    assert _names(session) == [f"{i}.{name}" for i in range(LAYERS) for name in per_layer]
    n = len(session.regions)
    assert plan.cycle == [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]
    session.close()


@pytest.mark.parametrize(
    "scopes, moe, head",
    [
        (["attn", "moe_router", "moe_preprocess"], {}, False),  # the layer ends in eager-fed moe_postprocess
        (["moe_router", "moe_preprocess"], {}, False),
        (["attn"], {}, False),
        (["moe"], PAD, True),  # the last layer's MoE block is graphed: the loss head follows
    ],
)
def test_loss_head_joins_only_after_a_graphed_moe_block(scopes, moe, head):
    """The region counts the GPU test expects (8 layers there, 2 here)."""
    session, _, _ = _recorded(scopes, head=True, **moe)
    assert (_names(session)[-1] == "postprocess") == head
    session.close()


@pytest.mark.parametrize("shared", [False, True])
def test_postprocess_reads_token_idx_from_the_preprocess_graph_and_combine_from_eager(shared):
    session, plan, model = _recorded(["attn", "moe_router", "moe_preprocess"], shared=shared)
    names = _names(session)
    for layer in range(LAYERS):
        regions = ("attn", "moe_router", "moe_preprocess", "moe_postprocess")
        attn, router, pre, post = (names.index(f"{layer}.{r}") for r in regions)
        region = session.regions[post]
        combined, token_idx, residual = region.sources[:3]
        assert combined.kind == "own"  # the eager combine's output, copied in
        assert (token_idx.kind, token_idx.region, token_idx.index) == ("handoff", pre, 2)
        assert (residual.kind, residual.region, residual.index) == ("handoff", attn, 0)
        assert region.input_requires_grad[:3] == [True, False, True]
        extra = region.sources[3]  # shared_output: the router graph's 5th output, or None (no tensor)
        if shared:
            assert (extra.kind, extra.region, extra.index) == ("handoff", router, 4)
        else:
            assert extra.kind != "handoff"
        # The next layer's attention reads the postprocess output (the layer's output).
        if layer + 1 < LAYERS:
            nxt = session.regions[names.index(f"{layer + 1}.attn")]
            assert (nxt.sources[0].kind, nxt.sources[0].region) == ("handoff", post)
        # token_idx is kept for the postprocess graph's forward: released no earlier than it.
        key = plan.owner(("input", post, 1))
        assert key == ("output", pre, 2)
        assert plan.buffers[key].release_after is None or plan.buffers[key].release_after >= plan.position(FWD, post)
    session.close()


def test_moe_gpt_with_postprocess_regions_matches_eager_on_cpu():
    """Recording routes every region through the session; the losses equal a plain model's."""
    session, _, model = _recorded(["moe_router", "moe_preprocess"])
    session.close()
    cfg = _config()
    torch.manual_seed(0)
    plain = build_gpt_model(cfg, 32)
    torch.manual_seed(1)
    tokens = torch.randint(0, 32, (2, 8))
    for a, b in zip(model.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b)
    assert torch.equal(model(tokens, None, tokens), plain(tokens, None, tokens))
