"""GPT models with gated delta net layers: which layer is what, checkpoint keys across TP, CUDA-graph scopes.

The TP = 2 ranks are built with fake groups (building needs no collectives); their
checkpoint entries (``sharded_state``) must assemble, element for element, to the
one-process model's tensors, each element written by exactly one rank.
"""

import warnings

import pytest
import torch

from megatron.core.ssm.gated_delta_net.layers import NOT_GRAPHED, GatedDeltaNetLayer, GatedDeltaNetMoELayer
from megatron.core.transformer.cuda_graphs import regions
from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
from megatron.core.transformer.transformer_layer import TransformerLayer
from megatron.training import sharded_state

GPT = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 63 --seed 7 --swiglu --normalization RMSNorm --disable-bias-linear"
)
GDN = (
    "--experimental-attention-variant gdn --linear-key-head-dim 8 --linear-value-head-dim 8 "
    "--linear-num-key-heads 2 --linear-num-value-heads 4"
)


def resolved(flags: str, world_size: int = 1):
    from megatron.training.arguments import parse_args

    cfg = parse_args(flags.split()).resolve(world_size=world_size)
    cfg.validate()
    return cfg


def layer_classes(flags: str) -> list[type]:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs

    return [spec.module for spec in get_gpt_decoder_layer_specs(resolved(flags).model)]


def test_linear_attention_freq_picks_the_gdn_layers_and_moe_layer_freq_the_moe_ones():
    G, A, GM, AM = GatedDeltaNetLayer, TransformerLayer, GatedDeltaNetMoELayer, MoETransformerLayer
    assert layer_classes(f"{GPT} {GDN} --linear-attention-freq 2") == [G, A, G, A]
    assert layer_classes(f"{GPT} {GDN} --linear-attention-freq ([0]+[1]*3)") == [A, G, G, G]
    moe = "--num-experts 4 --moe-router-topk 2 --moe-layer-freq ([1]*2+[0]*2)"
    assert layer_classes(f"{GPT} {GDN} {moe} --linear-attention-freq 2") == [GM, AM, G, A]
    assert layer_classes(f"{GPT} --linear-attention-freq 2") == [A] * 4  # no variant: the flag is ignored


def _entries(flags: str, tp: int) -> list[dict[str, tuple]]:
    """Each TP rank's model entries: ``{key: (full shape, writes, [(offsets, tensor)])}``."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model
    from megatron.core.parallel_state import ProcessGroups

    out = []
    for rank in range(tp):
        cfg = resolved(flags + (f" --tensor-model-parallel-size {tp}" if tp > 1 else ""), world_size=tp)
        pg = ProcessGroups(rank=rank, world_size=tp, device=torch.device("cpu"), ranks={"tp": list(range(tp))})
        torch.manual_seed(7)
        model = build_gpt_model(cfg.model, 64, pg=pg, device="cpu")
        out.append(
            {
                e.key: (e.full_shape, e.write, [(c.offsets, c.view.detach().clone()) for c in e.chunks])
                for e in sharded_state.model_entries(model, pg)
            }
        )
    return out


@pytest.mark.parametrize("extra", ["", " --attention-output-gate --group-query-attention --num-query-groups 2"])
def test_tp2_checkpoint_entries_assemble_to_the_one_process_tensors(extra):
    flags = f"{GPT} {GDN} --linear-attention-freq 2{extra}"
    (one,), ranks = _entries(flags, 1), _entries(flags, 2)
    for held in ranks:
        assert sorted(held) == sorted(one)
    split = ("in_proj.weight", "conv1d.weight", "A_log", "dt_bias")
    gdn_keys = [k for k in one if k.endswith(split)]
    assert len(gdn_keys) == 2 * 4  # the TP-split gated delta net tensors of layers 0 and 2
    for key, (shape, _, [(_, want)]) in one.items():
        full = torch.full(shape, float("nan"))
        count = torch.zeros(shape, dtype=torch.int)
        for held in ranks:
            got_shape, write, chunks = held[key]
            assert got_shape == shape, key
            for offsets, view in chunks:
                box = tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))
                if write:
                    full[box] = view
                    count[box] += 1
                else:  # a replica: the same values as the writer's
                    assert torch.equal(view, want[box]), key
        assert (count == 1).all(), f"{key}: elements written {count.min()}..{count.max()} times"
        assert torch.equal(full, want), key  # layout-free initialisation and keys


def test_cuda_graph_attn_scope_graphs_only_the_softmax_attention_layers():
    classes = [GatedDeltaNetLayer, TransformerLayer, GatedDeltaNetLayer, TransformerLayer]
    plan = regions.resolve(["attn"], classes)
    assert [s.name for s in plan[TransformerLayer]] == ["attn"] and plan[GatedDeltaNetLayer] == ()
    plan = regions.resolve(["attn", "mlp"], classes)
    assert plan[TransformerLayer] == (regions.WHOLE,)
    assert [s.name for s in plan[GatedDeltaNetLayer]] == ["mlp"]  # its attention stays eager
    moe_config = resolved(f"{GPT} {GDN} --linear-attention-freq 2 --num-experts 4 --moe-router-topk 2").model
    moe_plan = regions.resolve(["moe_router"], [GatedDeltaNetMoELayer, MoETransformerLayer], moe_config)
    assert [s.name for s in moe_plan[GatedDeltaNetMoELayer]] == ["moe_router"]


def test_cuda_graph_scopes_a_gdn_model_cannot_have_are_refused_with_the_reason():
    with pytest.raises(ValueError, match=f"--cuda-graph-scope attn: not available with this model: {NOT_GRAPHED}"):
        regions.resolve(["attn"], [GatedDeltaNetLayer, GatedDeltaNetLayer])
    with pytest.raises(ValueError, match=f"GatedDeltaNetLayer cannot be captured whole: {NOT_GRAPHED}"):
        regions.resolve([], [GatedDeltaNetLayer, TransformerLayer])


def test_the_memory_report_plans_the_regions_of_the_gdn_layers():
    from megatron.core.transformer.cuda_graphs.report import planned_regions

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = resolved(f"{GPT} {GDN} --linear-attention-freq 2 --cuda-graph-impl local --cuda-graph-scope attn")
    assert [(name, cls, scope) for name, cls, scope in planned_regions(cfg)] == [
        ("decoder.layers.1", TransformerLayer, "attn"),
        ("decoder.layers.3", TransformerLayer, "attn"),
    ]


def test_pipeline_stages_hold_the_one_process_gdn_layers():
    """PP = 2: each stage builds the layers of its global indices (the pattern is global)."""
    from tests.unit_tests.training.test_sharded_state import _stage_entries

    flags = f"{GPT} {GDN} --linear-attention-freq ([1]+[0]+[1]*2)"
    one, stages = _stage_entries(flags, 1), _stage_entries(flags, 2)
    assert sorted(stages) == sorted(one)
    assert "model.decoder.layers.3.self_attention.A_log" in stages
    assert "model.decoder.layers.1.self_attention.linear_qkv.weight" in stages
    for key, held in stages.items():
        writers = [tensor for _, write, tensor in held if write]
        assert len(writers) == 1 and torch.equal(writers[0], one[key][0][2]), key


def test_flops_count_the_gated_delta_net_layers_and_the_output_gate():
    from megatron.training.logging_utils import num_floating_point_operations

    def flops(flags):
        return num_floating_point_operations(resolved(flags).model, batch_size=1, seq_length=16, vocab_size=64)

    dense = flops(GPT)
    # h = 32, a = g = 4, d = 8, s = 16: one softmax attention's forward per token, then its output gate.
    attention = 2 * 32 * (32 + 2 * 32) + 2 * 16 * 32 + 2 * 32 * 32
    gate = 2 * 32 * 32
    # kh = 2, dk = 8, vh = 4, dv = 8, conv 4: in_proj, conv, rule, out_proj.
    gdn = 2 * 32 * (2 * 16 + 2 * 32 + 2 * 4) + 2 * 4 * (2 * 16 + 32) + 2 * 4 * 8 * 8 * 4 + 2 * 32 * 32
    assert flops(f"{GPT} --attention-output-gate") == dense + 3 * 16 * 4 * gate
    with_gdn = flops(f"{GPT} {GDN} --linear-attention-freq 2 --attention-output-gate")
    assert with_gdn == dense + 3 * 16 * (2 * gate + 2 * (gdn - attention))


def test_recording_session_wraps_only_the_softmax_attention_of_a_gdn_gpt():
    """``attach`` on a built model (recording pass on the CPU): the GDN layers' attention runs eagerly,
    losses equal the eager model's."""
    from megatron.core.distributed.distributed_data_parallel import DistributedDataParallel
    from megatron.core.models.gpt.gpt_model import build_gpt_model
    from megatron.core.models.gpt.loss import masked_mean_loss
    from megatron.core.parallel_state import ProcessGroups
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig
    from megatron.training.config import DDPConfig

    cfg = resolved(f"{GPT} {GDN} --linear-attention-freq 2 --hidden-dropout 0 --attention-dropout 0").model
    tokens = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def loss_of(scopes):
        torch.manual_seed(7)
        model = build_gpt_model(cfg, 64, device="cpu")
        ddp = DistributedDataParallel(model, config=DDPConfig(), pg=ProcessGroups.single())
        manager = None
        if scopes is not None:
            config = CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=scopes)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                manager = cuda_graphs.attach(model, config, grad_sinks=[ddp], record_without_cuda=True)
        loss, _ = masked_mean_loss(ddp(tokens, None, tokens), torch.ones(2, 16))
        return loss.detach(), manager

    eager, _ = loss_of(None)
    recorded, manager = loss_of(["attn"])
    assert [r.name for r in manager.regions] == ["decoder.layers.1.attn", "decoder.layers.3.attn"]
    assert torch.equal(recorded, eager)
    with pytest.raises(ValueError, match="GatedDeltaNetLayer cannot be captured whole"):
        loss_of([])
