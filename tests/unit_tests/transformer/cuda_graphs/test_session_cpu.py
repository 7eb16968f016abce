"""The session's recording pass, routing and lifecycle on a real GPT, on the CPU."""

import copy
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
from megatron.core.transformer.cuda_graphs.region import GraphedRegion, _leaves_reached
from megatron.core.transformer.cuda_graphs.session import GraphState
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.config import DDPConfig

LAYERS = 3


def tiny_gpt(rope=False, untie=False, layers=LAYERS, **config):
    """A GPT of ``layers`` layers, hidden 32, 16 tokens, vocabulary 64, no dropout; ``config``: more
    ``TransformerConfig`` fields."""
    cfg = TransformerConfig(
        num_layers=layers,
        hidden_size=32,
        num_attention_heads=4,
        seq_length=16,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        position_embedding_type="rope" if rope else "learned_absolute",
        untie_embeddings_and_output_weights=untie,
        **config,
    ).finalize()
    torch.manual_seed(0)
    return build_gpt_model(cfg, 64), cfg


def recorded(scopes, rope=False, microbatches=2, untie=False, postprocess=True):
    model, _ = tiny_gpt(rope, untie)
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes, cuda_graph_postprocess=postprocess)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        manager = cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)
    tokens = torch.randint(0, 64, (2, 16))
    losses = []
    for _ in range(microbatches):
        loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 16))
        loss.backward()
        losses.append(loss.detach())
    return manager, manager.make_plans()[0], losses, ddp


def test_whole_layer_record_order_and_handoffs():
    manager, plan, _, _ = recorded([])
    assert [r.name.split(".")[-1] for r in manager.regions] == ["layer"] * LAYERS + ["postprocess"]
    n = LAYERS + 1  # the loss head follows the last layer
    assert plan.cycle == [Event(FWD, i) for i in range(n)] + [Event(BWD, i) for i in reversed(range(n))]
    # Two micro-batches were recorded; the cycle is one of them.
    assert len(manager.order) == 2 * len(plan.cycle) and manager.cycles == {0: plan.cycle}
    # Region k+1 reads region k's output buffer; layer 0 reads the (eager) embedding output.
    assert manager.regions[0].sources[0].kind == "own"
    for k in range(1, n):
        assert manager.regions[k].sources[0].kind == "handoff"
        assert plan.owner(("input", k, 0)) == ("output", k - 1, 0)
        assert plan.owner(("grad_output", k - 1, 0)) == ("grad_input", k, 0)
    # The head's labels are its own input; its per-token loss escapes to eager code.
    head = manager.regions[-1]
    assert head.sources[1].kind == "own" and head.input_requires_grad == [True, False]
    assert plan.buffers[("output", LAYERS, 0)].release_after == plan.position(BWD, LAYERS)


@pytest.mark.parametrize("untie", [False, True])
def test_loss_head_shares_a_tied_embedding_weight_only(untie):
    manager, _, _, ddp = recorded([], untie=untie)
    head = manager.regions[-1]
    assert head.method_name == "_postprocess"
    expected = [] if untie else [ddp.module.embedding.word_embeddings.weight]
    assert [id(p) for p in head.shared_params] == [id(p) for p in expected]


@pytest.mark.parametrize("scopes,has_head", [([], True), (["mlp"], True), (["attn", "mlp"], True), (["attn"], False)])
def test_loss_head_is_graphed_only_after_a_graphed_region(scopes, has_head):
    manager, _, _, _ = recorded(scopes)
    assert (manager.regions[-1].name == "postprocess") == has_head
    manager, _, _, _ = recorded(scopes, postprocess=False)
    assert all(r.name != "postprocess" for r in manager.regions)


def test_rope_table_is_one_shared_buffer():
    manager, plan, _, _ = recorded([], rope=True)
    owners = {plan.owner(("input", r.index, 1)) for r in manager.regions[:LAYERS]}
    assert owners == {("shared", -1, 0)}


@pytest.mark.parametrize("scope,method", [("attn", "_forward_attention"), ("mlp", "_forward_mlp")])
def test_sub_layer_scope_graphs_only_that_region(scope, method):
    manager, plan, _, _ = recorded([scope])
    layers = manager.regions[:LAYERS]
    assert all(r.method_name == method for r in layers)
    # The other half of the layer runs eagerly between graphs: nothing is handed off,
    # except from the last MLP to the loss head right after it.
    assert all(src.kind != "handoff" for r in layers for src in r.sources)
    assert len(manager.regions) == LAYERS + (scope == "mlp")
    layer = manager.regions[0].module
    other = "_forward_mlp" if scope == "attn" else "_forward_attention"
    assert other not in vars(layer), "the region left eager must not be routed"
    assert method in vars(layer)


def test_attn_and_mlp_together_is_one_layer_graph():
    manager, _, _, _ = recorded(["attn", "mlp"])
    assert [r.method_name for r in manager.regions] == ["forward"] * LAYERS + ["_postprocess"]


def test_recording_does_not_change_numerics():
    _, _, losses, ddp = recorded([])
    model, _ = tiny_gpt()
    ref = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    # tiny_gpt() reseeded and initialised exactly as in recorded(): same tokens follow.
    tokens = torch.randint(0, 64, (2, 16))
    for expected in losses:
        loss, _ = masked_mean_loss(ref(tokens, None, tokens), torch.ones(2, 16))
        loss.backward()
        assert torch.equal(loss.detach(), expected)
    for a, b in zip(ddp.module.parameters(), ref.module.parameters()):
        assert torch.equal(a.main_grad, b.main_grad)


def test_cpu_flags_accepted_with_one_warning_and_eager_run():
    model, _ = tiny_gpt()
    with pytest.warns(UserWarning, match="CUDA is not available"):
        manager = cuda_graphs.attach(model, CudaGraphConfig(cuda_graph_impl="local"))
    assert not manager.active and not any(vars(layer).get("forward") for layer in model.decoder.layers)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens, None, tokens).mean().backward()
    manager.end_of_iteration()
    assert not manager.active and manager.recorder.order == []


def test_scope_without_region_in_model_is_rejected():
    model, _ = tiny_gpt()
    with pytest.raises(ValueError, match="no 'moe' region"):
        cuda_graphs.attach(model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=["moe"]))


def test_parameter_discovery_sees_fused_weights_that_get_no_autograd_grad():
    model, _ = tiny_gpt()
    DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())  # main_grad: fused wgrads
    tokens = torch.randint(0, 64, (2, 16))
    out = model(tokens, None, tokens)
    reached = _leaves_reached([out])
    params = list(model.parameters())
    assert all(id(p) in reached for p in params)
    grads = torch.autograd.grad(out.sum(), params, allow_unused=True)
    fused = [name for (name, _), g in zip(model.named_parameters(), grads) if g is None]
    assert fused and all(name.endswith("weight") and "layernorm" not in name for name in fused), fused


def test_region_call_binding_fills_defaults_and_keywords():
    """Every call of a region becomes the same positional tuple, however it was spelled."""

    class Layer(torch.nn.Module):
        def forward(self, hidden_states, rotary_pos_emb=None):
            return hidden_states

    x, r = torch.zeros(1), torch.ones(1)
    layer = Layer()
    region = GraphedRegion(layer, "forward", layer.forward, "layer", 0)
    assert region.bind((x,), {}) == (x, None)  # default filled
    assert region.bind((x, r), {}) == (x, r)
    assert region.bind((x,), {"rotary_pos_emb": r}) == (x, r)
    assert region.bind((), {"rotary_pos_emb": r, "hidden_states": x}) == (x, r)
    with pytest.raises(TypeError):
        region.bind((x,), {"other": r})


def test_attach_twice_raises_and_close_restores_the_model():
    manager, _, _, ddp = recorded(["mlp"])
    model = ddp.module
    layer = model.decoder.layers[0]
    assert "_forward_mlp" in vars(layer)
    with pytest.raises(RuntimeError, match="already routed through a CUDA graph session"):
        cuda_graphs.attach(model, manager.config, record_without_cuda=True)
    manager.close()
    assert manager.state is cuda_graphs.GraphState.CLOSED and not manager.active
    assert all("_forward_mlp" not in vars(layer) for layer in model.decoder.layers)
    assert "_postprocess" not in vars(model)
    again = cuda_graphs.attach(model, manager.config, record_without_cuda=True)  # attachable again
    assert len(again.regions) == len(manager.regions)


def test_deep_copy_runs_its_own_weights_eagerly():
    manager, _, _, ddp = recorded(["mlp"])
    model = ddp.module
    clone = copy.deepcopy(model)
    for layer in clone.decoder.layers:
        torch.nn.init.zeros_(layer.mlp.linear_fc2.weight)
        layer.mlp.linear_fc2.bias.data.zero_()
    x = torch.randn(16, 2, 32)
    ours = clone.decoder.layers[0]
    assert torch.equal(ours._forward_mlp(x), x), "the copy's zeroed MLP must add nothing to the residual"
    with torch.no_grad():  # no-grad calls of the original run eagerly too
        assert not torch.equal(model.decoder.layers[0]._forward_mlp(x), x)
    before = len(manager.recorder.order)
    tokens = torch.randint(0, 64, (2, 16))
    clone(tokens, None, tokens).mean().backward()
    assert len(manager.recorder.order) == before, "the copy must not record into the original's session"
    with pytest.raises(RuntimeError, match="cannot be copied"):
        copy.deepcopy(manager)


def test_micro_batch_slots_are_recorded():
    model, _ = tiny_gpt()
    ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
    config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=["mlp"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        session = cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)
    tokens = torch.randint(0, 64, (2, 16))
    losses = {}
    for slot in (0, 1):  # two micro-batches in flight: both forwards, then both backwards
        with session.micro_batch(slot):
            losses[slot], _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 16))
    for slot in (0, 1):
        losses[slot].backward()
    plans = session.make_plans()
    assert sorted(plans) == [0, 1]
    n = len(session.regions)
    assert [e.slot for e in session.order] == [0] * n + [1] * n + [0] * n + [1] * n
    assert plans[0].cycle == [Event(e.phase, e.region) for e in plans[1].cycle]


def test_new_micro_batch_count_after_capture_replays_the_one_slot_cycle_that_often():
    """Batch-size ramp-up with graphs, no pipelining: 2 recorded micro-batches, then 3 (and 1)
    replay the slot's cycle 3 (1) times; a replay past that or an iteration cut short raises."""
    manager, plan, _, _ = recorded(["mlp"], microbatches=2)
    manager.recorded_microbatches = 2  # what the schedule told the recording iteration
    manager.state = GraphState.CAPTURED  # the order check is pure Python (no graph replays on the CPU)
    manager.cursor = 0
    cycle = [Event(e.phase, e.region, 0) for e in plan.cycle]
    manager.expect_microbatches(3)
    assert manager.order == cycle * 3 and manager.recorded_microbatches == 3
    for e in cycle * 3:
        manager._advance(e, manager.regions[e.region])
    with pytest.raises(RuntimeError, match="past the recorded iteration"):
        manager._advance(cycle[0], manager.regions[cycle[0].region])
    manager.end_of_iteration()
    manager.expect_microbatches(1)
    for e in cycle[:-1]:
        manager._advance(e, manager.regions[e.region])
    with pytest.raises(RuntimeError, match="ended after"):
        manager.end_of_iteration()
    manager.cursor = 0
    with pytest.raises(RuntimeError, match="out of capture order"):
        manager._advance(cycle[1], manager.regions[cycle[1].region])
