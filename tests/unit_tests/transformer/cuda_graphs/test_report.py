"""The memory report on the CPU: analytic rows, a measured report from a recorded session
with fake capture figures and a fake allocator snapshot, budgets, rendering, the tool."""

import dataclasses
import json
import warnings

import pytest
import torch

from megatron.core.ssm import ssd_kernels, ssd_trace
from megatron.core.transformer.cuda_graphs import budgets
from megatron.core.transformer.cuda_graphs import report as report_lib
from megatron.core.transformer.cuda_graphs.activations import (
    Kernels,
    Shapes,
    region_activation_bytes,
    region_transient_bytes,
)
from megatron.core.transformer.cuda_graphs.region import SlotGraphs
from megatron.core.transformer.cuda_graphs.weak import make_weak_ref
from tests.unit_tests.transformer.cuda_graphs.test_session_cpu import recorded

TINY = (
    "--num-layers 3 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 64 --mock-data "
    "--lr 1e-3 --attention-dropout 0 --hidden-dropout 0"
)
MIB = 2**20


@pytest.fixture
def tool(load_tool):
    return load_tool("cuda_graph_memory_report")


def config(tool, flags):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return tool.analytic_config(flags.split())


def test_eager_report_rows_follow_the_scopes(tool):
    kernels = Kernels()
    whole = report_lib.eager_report(config(tool, f"{TINY} --cuda-graph-impl local"), kernels)
    assert [r.name for r in whole.regions] == [f"decoder.layers.{i}.layer" for i in range(3)] + ["postprocess"]
    assert whole.regions[0].kinds == ("attn", "mlp")
    assert all(layer.eager_part_bytes == 0 for layer in whole.layers)  # everything is in the pool

    cfg = config(tool, f"{TINY} --cuda-graph-impl local --cuda-graph-scope attn")
    attn = report_lib.eager_report(cfg, kernels)
    sh = Shapes.from_config(cfg)
    assert [r.scope for r in attn.regions] == ["attn"] * 3  # the loss head follows the MLP only
    assert attn.regions[0].activation_bytes == region_activation_bytes("attn", sh, kernels)
    # The MLP and the head stay eager: their activations are the layers' eager parts.
    assert attn.layers[0].eager_part_bytes == region_activation_bytes("mlp", sh, kernels)
    assert attn.layers[-1].name == "postprocess" and attn.layers[-1].eager_part_bytes > 0
    assert attn.totals["eager_activation_bytes"] == whole.totals["eager_activation_bytes"]
    assert attn.totals["graphed_activation_bytes"] == 3 * attn.regions[0].activation_bytes
    # Static buffers: the fp32 hidden state in and out, no RoPE table.
    assert attn.regions[0].static_input_bytes == attn.regions[0].static_output_bytes == 16 * 2 * 32 * 4


def test_eager_report_moe_scopes(tool):
    moe = "--num-experts 4 --moe-router-topk 2 --bf16"
    cfg = config(tool, f"{TINY} {moe} --cuda-graph-impl local --cuda-graph-scope moe_router moe_preprocess")
    rep = report_lib.eager_report(cfg, Kernels())
    # moe_postprocess (unpermute, shared-expert add, bias-dropout-add) comes with moe_preprocess.
    assert [r.scope for r in rep.regions] == ["moe_router", "moe_preprocess", "moe_postprocess"] * 3
    sh, k = Shapes.from_config(cfg), Kernels()
    # attn and the experts (dispatch, experts, combine, unpermute) stay eager.
    want = region_activation_bytes("attn", sh, k) + region_activation_bytes("moe_experts", sh, k)
    assert rep.layers[0].eager_part_bytes == want
    assert rep.layers[0].eager_bytes == region_activation_bytes("attn", sh, k) + region_activation_bytes("moe", sh, k)
    pre = rep.regions[1]
    assert pre.static_output_bytes > pre.static_input_bytes  # the permuted tokens (T * k rows)


def fake_capture(session, growth_mib, strong_output=False):
    """Capture figures as capture.py records them: reserved/live after each event, buffers."""
    cycle = session.cycles[0]
    reserved = live = 0
    for event in cycle:
        region = session.regions[event.region]
        graphs = region.slots.setdefault(0, SlotGraphs())
        reserved += growth_mib[event] * MIB
        live = reserved // 2
        graphs.pool_reserved_after[event.phase] = reserved
        graphs.pool_live_after[event.phase] = live
    buffers = {}
    keep = []
    for region in session.regions:
        out = torch.zeros(1024, 256)  # 1 MiB
        keep.append(out)
        buffers[("output", region.index, 0)] = out if strong_output else make_weak_ref(out, allow_cpu=True)
    session.buffers = {0: buffers}

    class Pool:
        handle, device = (7, 1), 0

    session.pools = {0: Pool()}
    return keep, reserved


SNAPSHOT = [
    {
        "device": 0,
        "segment_pool_id": (7, 1),
        "total_size": 6 * MIB,
        "blocks": [{"size": 2 * MIB, "state": "active_allocated"}, {"size": 4 * MIB, "state": "inactive"}],
    },
    {
        "device": 0,
        "segment_pool_id": (0, 0),
        "total_size": 50 * MIB,
        "blocks": [{"size": 50 * MIB, "state": "active_allocated"}],
    },
    {"device": 1, "segment_pool_id": (7, 1), "total_size": 9 * MIB, "blocks": []},
]


def graphed(tool, scopes, growth, strong_output=False, flags=""):
    session, _, _, _ = recorded(scopes)
    cfg = config(tool, f"{TINY} --cuda-graph-impl local {flags}")
    cfg.model.vocab_size = 64  # recorded() builds its GPT with 64 rows
    growth_mib = {e: growth(e) for e in session.cycles[0]}
    keep, _ = fake_capture(session, growth_mib, strong_output)
    rep = report_lib.graphed_report(session, cfg, Kernels.probe("cpu"), ["--fake"], segments=SNAPSHOT, sm_count=132)
    return rep, keep


def test_graphed_report_attributes_growth_and_buffers(tool):
    # Growth in MiB per event: within the default segment allowance of tiny regions.
    rep, _keep = graphed(tool, [], lambda e: 3 if e.phase == "fwd" else (1 if e.region == 3 else 0))
    names = [r.name for r in rep.regions]
    assert names == [f"decoder.layers.{i}.layer" for i in range(3)] + ["postprocess"]
    assert [r.pool_reserved_growth_bytes for r in rep.regions] == [3 * MIB, 3 * MIB, 3 * MIB, 4 * MIB]
    # Live after each forward: half of reserved, so each forward adds 1.5 MiB.
    assert rep.regions[1].pool_live_after_fwd_delta_bytes == 3 * MIB // 2
    assert all(r.strong_bytes == 0 and r.weak_bytes == MIB for r in rep.regions)
    assert rep.layers[0].graphed_pool_bytes == 3 * MIB and rep.layers[-1].graphed_pool_bytes == 4 * MIB
    # Totals from the snapshot: only our pool's segments on our device.
    assert rep.totals["pool_reserved_bytes"] == 6 * MIB and rep.totals["pool_live_bytes"] == 2 * MIB
    assert rep.totals["weak_bytes"] == 4 * MIB and rep.totals["strong_bytes"] == 0
    assert rep.totals["forward_transient_ops"] == 0  # one slot: no forward transients routed
    assert "forward_transient_ops: 0" in report_lib.format_table(rep)
    budgets.check_budgets(rep)  # tiny regions: kilobytes of budget plus nothing held


def test_budget_names_the_region_holding_buffers(tool):
    rep, _keep = graphed(tool, [], lambda e: 0, strong_output=True)
    with pytest.raises(budgets.BudgetExceeded) as err:
        budgets.check_budgets(rep)
    text = str(err.value)
    assert "decoder.layers.0.layer (slot 0): 1.00 MiB of static buffers held strongly" in text
    assert "1.00 MiB too much" in text and text.count("held strongly") == 4


def test_budget_names_the_first_region_whose_growth_is_over(tool):
    # Layer 1's forward capture takes 5 MiB: far over a tiny layer's kilobytes.
    rep, _keep = graphed(tool, [], lambda e: 5 if (e.phase == "fwd" and e.region == 1) else 0)
    budget = sum(r.activation_bytes + r.static_input_bytes + r.static_output_bytes for r in rep.regions[:2])
    limit = 1.1 * budget + 2 * max(r.activation_bytes for r in rep.regions) + MIB
    match = r"decoder\.layers\.1\.layer \(slot 0\): the pool grew to 5\.0 MiB"
    with pytest.raises(budgets.BudgetExceeded, match=match) as err:
        budgets.check_budgets(rep, slack_bytes=MIB)
    assert f"by {(5 * MIB - limit) / MIB:.1f} MiB" in str(err.value)
    assert "layers.2" not in str(err.value)
    budgets.check_budgets(rep, slack_bytes=5 * MIB)  # within a larger allowance


def test_check_budgets_refuses_an_eager_report(tool):
    rep = report_lib.eager_report(config(tool, f"{TINY} --cuda-graph-impl local"), Kernels())
    with pytest.raises(ValueError, match="needs a graphed report"):
        budgets.check_budgets(rep)


def test_rendering_table_json_png(tool, tmp_path):
    rep, _keep = graphed(tool, ["attn"], lambda e: 1)
    text = report_lib.format_table(rep)
    assert "CUDA graph memory report (graphed)" in text and "decoder.layers.2.attn" in text
    assert "pool_reserved_bytes: 6.0 MiB" in text
    data = json.loads(rep.to_json())
    assert data["mode"] == "graphed" and len(data["regions"]) == 3
    assert (
        data["layers"][0]["graphed_bytes"]
        == data["layers"][0]["graphed_pool_bytes"] + data["layers"][0]["eager_part_bytes"]
    )
    png = tmp_path / "r.png"
    report_lib.plot_layers(rep, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tool_on_the_cpu_is_eager_only(tool, tmp_path, capsys):
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    rc = tool.main(["--json", str(out_json), "--png", str(out_png), "--", *f"{TINY} --cuda-graph-impl local".split()])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "(eager-only)" in printed and "No CUDA device" in printed
    data = json.loads(out_json.read_text())
    assert data["mode"] == "eager-only" and data["regions"][-1]["name"] == "postprocess"
    assert out_png.stat().st_size > 0
    assert tool.main(["--check", "--", *TINY.split()]) == 1  # nothing captured: nothing to check


def test_tool_arguments(tool):
    with pytest.raises(SystemExit):
        tool.parse([])  # no training flags
    with pytest.raises(SystemExit):
        tool.parse(["--iters", "1", "--", *TINY.split()])
    args, train = tool.parse(["--iters", "4", "--", "--num-layers", "2"])
    assert args.iters == 4 and train == ["--num-layers", "2"]
    assert tool._providers(["--hybrid-layer-pattern", "M*"])[0].__module__ == "pretrain_hybrid"
    assert tool._providers(TINY.split())[0].__module__ == "pretrain_gpt"


def test_deterministic_mode_splits_the_flash_dq_accumulator(tool):
    dense8 = (
        "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
        "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer "
        "--vocab-size 32001 --mock-data --bf16 --lr 1e-4 --cuda-graph-impl local --cuda-graph-scope attn"
    )
    default = report_lib.eager_report(config(tool, dense8), Kernels(), sm_count=132).totals
    det = report_lib.eager_report(config(tool, f"{dense8} --deterministic-mode"), Kernels(), sm_count=132).totals
    # [b=2, s=2048, n=16, d=64] fp32 = 16 MiB; deterministic: ceil(132 / 32) = 5 copies.
    assert default["attn_bwd_dq_accumulator_bytes"] == 16 * MIB and default["attn_bwd_dq_accumulator_splits"] == 1
    assert det["attn_bwd_dq_accumulator_bytes"] == 80 * MIB and det["attn_bwd_dq_accumulator_splits"] == 5
    hybrid = f"{TINY} --hybrid-layer-pattern M- --mamba-head-dim 16 --mamba-num-groups 2 --mamba-state-dim 16"
    assert "attn_bwd_dq_accumulator_bytes" not in report_lib.eager_report(config(tool, hybrid), Kernels()).totals


@pytest.mark.parametrize("scopes", [[], ["attn"], ["attn", "mlp"]])
def test_chunk_activation_bytes_weigh_graph_slots(tool, scopes):
    """The weights the pipelined schedule sizes graph slots by: per model chunk, the analytic
    bytes its graphed regions keep; the loss head makes the last chunk heavier when graphed."""
    session, _, _, ddp = recorded(scopes)
    cfg = config(tool, f"{TINY} --cuda-graph-impl local --cuda-graph-scope {' '.join(scopes)}".rstrip())
    cfg.model.vocab_size = 64  # recorded() builds its GPT with 64 rows
    model, kernels, sh = ddp.module, Kernels.probe("cpu"), Shapes.from_config(cfg)
    layers = model.decoder.layers

    class Chunk:  # what a model chunk offers: its modules (the head region's is the model)
        def __init__(self, *modules):
            self.modules = lambda: iter(modules)

    chunks = [Chunk(layers[0]), Chunk(*layers[1:], model)]
    weights = report_lib.chunk_activation_bytes(session, chunks, cfg, kernels)
    per_layer = sum(region_activation_bytes(k, sh, kernels) for k in (scopes or ["attn", "mlp"]))
    head = region_activation_bytes("postprocess", sh, kernels) if not scopes or "mlp" in scopes else 0
    assert weights == [per_layer, 2 * per_layer + head]


def test_check_budgets_wants_a_slot_serving_two_chunks_to_hold_its_largest_run():
    """A slot whose runs alternate between two chunks of four layers: each run is checked
    against its own regions, and the slot's whole growth against the largest run's budget
    (the later run reuses the earlier one's memory); a pool that holds both runs side by
    side is caught."""

    def report(per_layer_c0, per_layer_c1):
        rows = [
            report_lib.RegionMemory(
                f"c{c}.layer{i}",
                f"c{c}.layer{i}",
                "layer",
                ("attn", "mlp"),
                100 * MIB,
                0,
                0,
                0,
                growth,
                None,
                0,
                0,
                0,
                c,
            )
            for c, growth in ((0, per_layer_c0), (1, per_layer_c1))
            for i in range(4)
        ]
        return report_lib.MemoryReport([], "graphed", "", rows, [], {})

    budgets.check_budgets(report(100 * MIB, 0))  # the second run reused the first run's blocks
    budgets.check_budgets(report(100 * MIB, 10 * MIB))
    with pytest.raises(budgets.BudgetExceeded, match=r"slot 0 \(model chunks 0, 1\).*did not reuse") as err:
        budgets.check_budgets(report(100 * MIB, 100 * MIB))  # both runs side by side
    assert "layer" not in str(err.value)  # each run alone is within its budget
    with pytest.raises(budgets.BudgetExceeded, match=r"c1.layer0 \(slot 0\): the pool grew"):
        budgets.check_budgets(report(0, 800 * MIB))  # one run alone over its budget


def test_check_budgets_counts_the_eager_turn_shaped_into_the_pool():
    """The first eager turn's allocations are shaped into the backward pool at the first backward
    capture (``turn.shape_pool``): eager memory moved, not graph memory added, so that region's
    budget takes them; its growth past them is still caught."""

    def report(growth, turn_bytes):
        row = report_lib.RegionMemory("layers.1.attn", "layers.1", "attn", ("attn",), 100 * MIB, 0, 0, 0, growth)
        row.turn_bytes = turn_bytes
        return report_lib.MemoryReport([], "graphed", "", [row], [], {})

    with pytest.raises(budgets.BudgetExceeded, match=r"layers.1.attn \(slot 0\): the pool grew to 400.0 MiB"):
        budgets.check_budgets(report(400 * MIB, 0))
    budgets.check_budgets(report(400 * MIB, 300 * MIB))
    with pytest.raises(budgets.BudgetExceeded, match="eager turn"):
        budgets.check_budgets(report(800 * MIB, 300 * MIB))


def test_slot_weights_fall_back_to_layers_for_an_unknown_layer_class(tool):
    """A model family's own layer class has no activation model: the trainer passes no
    weights, and the pipelined schedule weighs chunks by their layers."""
    import types

    from megatron.training.training import Trainer

    cfg = config(tool, f"{TINY} --cuda-graph-impl local")
    layer = torch.nn.Linear(2, 2)
    region = types.SimpleNamespace(name="decoder.layers.0.layer", method_name="forward", module=layer)
    trainer = types.SimpleNamespace(device=torch.device("cpu"), cfg=cfg, graphs=types.SimpleNamespace(regions=[region]))
    assert Trainer._slot_weights(trainer, torch.nn.Sequential(layer)) is None


def test_mamba_regions_carry_the_scans_backward_working_memory(tool, monkeypatch):
    """The PyTorch Mamba scan's backward recomputes a slice under autograd: its traced peak is
    the Mamba region's working memory (none elsewhere), and the budget gives it room, no more.
    On the scan's Triton kernels (the default where they run) it is theirs, traced the same way."""
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "torch")
    hybrid = (
        "--hybrid-layer-pattern M*- --hidden-size 64 --num-attention-heads 4 --mamba-head-dim 16 "
        "--mamba-num-groups 2 --mamba-state-dim 16 --seq-length 64 --max-position-embeddings 64 "
        "--micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 64 --mock-data "
        "--lr 1e-3 --bf16 --cuda-graph-impl local"
    )
    cfg = config(tool, hybrid)
    rep = report_lib.eager_report(cfg, Kernels())
    mamba, *others = rep.regions
    assert mamba.kinds == ("mamba",) and [r.kinds for r in others] == [("attn",), ("mlp",), ("postprocess",)]
    assert mamba.transient_bytes == ssd_trace.captured_backward_peak_bytes(2, 64, 8, 16, 2, 16, 64, torch.bfloat16)
    assert mamba.transient_bytes > 2 * mamba.activation_bytes  # more than TEMPORARIES_FACTOR allows alone
    assert all(r.transient_bytes == 0 for r in others)
    assert region_transient_bytes(("mamba",), Shapes.from_config(cfg), Kernels(fused_mamba=True)) == 0  # theirs
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "triton")
    on_kernels = region_transient_bytes(("mamba",), Shapes.from_config(cfg), Kernels())
    assert on_kernels == ssd_trace.captured_backward_peak_bytes(2, 64, 8, 16, 2, 16, 64, torch.bfloat16)
    assert 0 < on_kernels and (on_kernels < mamba.transient_bytes) == ssd_kernels.HAVE_TRITON
    monkeypatch.setenv(ssd_kernels.ENV_SWITCH, "torch")
    # With the Mamba layer eager the loss head stays eager too, as attach decides.
    mlp = report_lib.eager_report(config(tool, f"{hybrid} --cuda-graph-scope mlp"), Kernels())
    assert [r.name for r in mlp.regions] == ["decoder.layers.2.layer"]  # an MLP layer is whole in its scope

    def graphed(growth):
        row = dataclasses.replace(mamba, pool_reserved_growth_bytes=growth, strong_bytes=0)
        return report_lib.MemoryReport([], "graphed", "", [row], [], {})

    static = mamba.static_input_bytes + mamba.static_output_bytes
    temporaries = mamba.activation_bytes + mamba.transient_bytes
    room = 1.1 * (mamba.activation_bytes + static) + temporaries + budgets.SEGMENT_SLACK
    budgets.check_budgets(graphed(int(room) - 1))
    with pytest.raises(budgets.BudgetExceeded, match=r"decoder.layers.0.layer \(slot 0\): the pool grew"):
        budgets.check_budgets(graphed(int(room) + 1))
