"""Graph memory stays within budgets derived from the analytic activations (``pytest -m gpu``).

For every scope of every model family: train two iterations (iteration 1 records and
captures), build the memory report and check it (``budgets.check_budgets``): the pool's
growth, region by region in capture order, stays within the analytic activations of the
regions captured so far plus their static buffers and one backward's temporaries, and
after capture no region holds static buffers beyond what it must keep. A failure names
the region and the excess. The degraded plan (every static buffer held strongly, no weak
references, as graphs were before upstream Megatron's #5451) must be caught.
"""

import pytest
import torch

import pretrain_hybrid
from megatron.core import parallel_state
from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM
from megatron.core.transformer.cuda_graphs import budgets
from megatron.core.transformer.cuda_graphs import capture as capture_lib
from megatron.core.transformer.cuda_graphs import report as report_lib
from megatron.core.transformer.cuda_graphs.activations import Kernels
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer

pytestmark = pytest.mark.gpu

COMMON = (
    "--lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer "
    "--vocab-size 32000 --mock-data --log-interval 1000000 --num-workers 0 --bf16 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --micro-batch-size 2 --global-batch-size 2"
)
DENSE = (
    "--num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 1024 "
    "--max-position-embeddings 1024"
)
MOE = (
    "--num-layers 4 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024 --num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
    "--swiglu --disable-bias-linear"
)
DROP_AND_PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
HYBRID = (
    "--hybrid-layer-pattern M*-M*- --hidden-size 512 --num-attention-heads 8 --seq-length 1024 "
    "--max-position-embeddings 1024"
)
CASES = {
    "dense-layer": (DENSE, ""),
    "dense-attn": (DENSE, "attn"),
    "dense-mlp": (DENSE, "mlp"),
    "dense-attn-mlp": (DENSE, "attn mlp"),
    "moe-attn": (MOE, "attn"),
    "moe-router-preprocess": (MOE, "moe_router moe_preprocess"),
    "moe-attn-router-preprocess": (MOE, "attn moe_router moe_preprocess"),
    "moe-drop-and-pad": (f"{MOE} {DROP_AND_PAD}", "moe"),
    "hybrid-mamba": (HYBRID, "mamba"),
    "hybrid-attn": (HYBRID, "attn"),
    "hybrid-mlp": (HYBRID, "mlp"),
}


def graphed_report(model_flags: str, scope: str, iters: int = 2, schedule=None, extra: str = ""):
    flags = f"{model_flags} {COMMON} {extra} --cuda-graph-impl local --cuda-graph-scope {scope}".rstrip()
    torch.cuda.empty_cache()
    argv = f"{flags} --train-iters {iters}".split()
    trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))
    if schedule is not None:
        trainer.schedule = schedule
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        for _ in range(iters):
            trainer.train_step(it)
        torch.cuda.synchronize()
        assert trainer.graphs.captured, f"{scope!r}: nothing was captured"
        hybrid = trainer.cfg.mamba.hybrid_layer_pattern is not None
        kernels = Kernels.probe(
            trainer.device,
            cross_entropy_fusion=trainer.cfg.model.cross_entropy_loss_fusion,
            fused_mamba=hybrid and HAVE_MAMBA_SSM,
        )
        report = report_lib.graphed_report(trainer.graphs, trainer.cfg, kernels, flags.split())
        trainer.graphs.close()
        return report
    finally:
        parallel_state.destroy(trainer.pg)


@pytest.mark.parametrize("case", sorted(CASES))
def test_graph_memory_within_analytic_budget(case):
    model_flags, scope = CASES[case]
    report = graphed_report(model_flags, scope)
    print(report_lib.format_table(report))
    assert report.regions and all(
        r.pool_reserved_growth_bytes is not None for r in report.regions if r.scope != "shared"
    )
    assert report.totals["pool_reserved_bytes"] > 0
    budgets.check_budgets(report)
    # Between steps the pool holds only what regions must keep (tied wgrad buffers).
    keep = sum(r.must_keep_bytes for r in report.regions)
    assert report.totals["pool_live_bytes"] <= keep + budgets.SEGMENT_SLACK, report.totals


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_interleaved_slots_within_analytic_budget(pp_rank):
    """Two chunks of two layers in rank ``pp_rank``'s interleaved order (2 stages, 4
    micro-batches): slots serve both chunks, and a slot's pool must hold its largest run,
    not the runs side by side (``check_budgets``' per-slot check)."""
    import functools

    from megatron.core.pipeline_parallel import simulate

    schedule = functools.partial(simulate.forward_backward_chunks, num_chunks=2, pp_size=2, pp_rank=pp_rank)
    extra = "--global-batch-size 8 --untie-embeddings-and-output-weights"  # after COMMON's batch size
    report = graphed_report(DENSE, "", schedule=schedule, extra=extra)
    print(report_lib.format_table(report))
    chunks_per_slot = {}
    for r in report.regions:
        if r.scope != "shared":
            chunks_per_slot.setdefault(r.slot, set()).add(r.chunk)
    assert any(len(c) == 2 for c in chunks_per_slot.values()), chunks_per_slot
    budgets.check_budgets(report)


@pytest.mark.parametrize("case", ["dense-layer", "dense-attn", "moe-router-preprocess", "hybrid-mamba"])
def test_degraded_plan_is_caught(case, monkeypatch):
    """Every static buffer held strongly (no weak references): the check must fail and say where."""
    monkeypatch.setattr(capture_lib, "make_weak_ref", lambda t: t)
    model_flags, scope = CASES[case]
    report = graphed_report(model_flags, scope)
    with pytest.raises(budgets.BudgetExceeded) as err:
        budgets.check_budgets(report)
    text = str(err.value)
    print(text)
    held = [r for r in report.regions if r.strong_bytes and r.strong_bytes > r.must_keep_bytes]
    assert held, "the degraded plan should hold static buffers"
    for r in held:
        assert f"{r.name} (slot {r.slot}): " in text and "held strongly" in text
        # At least the region's own output buffers are held past its backward.
        assert r.strong_bytes - r.must_keep_bytes >= r.static_output_bytes // 2
