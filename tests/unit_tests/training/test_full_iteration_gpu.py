"""``--cuda-graph-impl full_iteration`` equals eager training, on a GPU (``pytest -m gpu``).

The graph replays the kernels the eager iteration ran (deterministic mode), so losses
and every ``main_grad`` are compared with ``torch.equal``. One warm-up iteration
(``--cuda-graph-warmup-steps 1``): iteration 2 captures, every later one replays.
"""

import gc

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.conftest import assert_bitwise_same
from tests.unit_tests.models.hybrid import test_hybrid_graphs_gpu as hybrid
from tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu import COMMON, DENSE8, NO_DROPOUT, SMALL

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

FULL = "--cuda-graph-impl full_iteration --cuda-graph-warmup-steps 1"


def run(flags: str, iters: int, providers=()):
    """(losses, main_grads after iteration 3 on the host, graphs captured, peak reserved bytes above the start)."""
    gc.collect()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(f"{flags} --train-iters {iters}".split(), *providers)
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses, grads = [], None
        for i in range(1, iters + 1):
            losses.append(trainer.train_step(it)[0].detach().clone())
            if i == 3:
                grads = [p.main_grad.detach().cpu() for p in trainer.model.module.parameters()]
        torch.cuda.synchronize()
        graphs = 0 if trainer.full_graph is None else trainer.full_graph.num_graphs
        return losses, grads, graphs, torch.cuda.max_memory_reserved() - base
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.close()
        del trainer


def assert_same(eager, graphed, what: str) -> None:
    """``train()``'s results of two runs equal bit for bit (losses, and main_grads after iteration 3)."""
    assert_bitwise_same(eager[:2], graphed[:2], what)


@pytest.mark.parametrize(
    "extra",
    [
        "",
        "--global-batch-size 8",
        "--global-batch-size 8 --calculate-per-token-loss",
        "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    ],
    ids=["one-micro-batch", "four-micro-batches", "per-token-loss", "full-recompute"],
)
def test_small_full_iteration_equals_eager(extra):
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 {extra}"
    eager = run(flags, 6)
    graphed = run(f"{flags} {FULL}", 6)
    assert eager[2] == 0 and graphed[2] == 1
    assert_same(eager, graphed, f"full iteration {extra or 'one micro-batch'}")


def test_dropout_draws_as_eager():
    """Dropout inside the graph: each replay advances the generator as eager does."""
    flags = f"{SMALL} {COMMON} --attention-dropout 0.1 --hidden-dropout 0.1 --bf16 --global-batch-size 4"
    eager = run(flags, 6)
    graphed = run(f"{flags} {FULL}", 6)
    assert graphed[2] == 1
    assert_same(eager, graphed, "full iteration with dropout")


def test_changed_micro_batch_count_captures_a_graph_per_count(capsys):
    """--rampup-batch-size 2 2 8 to 6: 1, 1, 2, 3, 3, 3 micro-batches per step; the counts 1, 2
    and 3 each get a graph (one shared pool)."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 6 --rampup-batch-size 2 2 8 --log-interval 1"
    eager = build_trainer(f"{flags} --train-iters 6".split()).train()
    trainer = build_trainer(f"{flags} --train-iters 6 {FULL} --log-memory-interval 6".split())
    graphed = trainer.train()
    out = capsys.readouterr().out
    for n in (1, 2, 3):  # train() closes the trainer, and with it the graphs: their capture lines tell
        assert out.count(f"full-iteration CUDA graph captured for {n} micro-batch(es)") == 1, out
    assert "(after 6 iterations)" in out and "graphs: 3" in out, out  # the memory line counts them
    for a, b in zip(eager, graphed, strict=True):
        assert a["lm loss"] == b["lm loss"], (a, b)


def test_dense8_full_iteration_equals_eager_and_peak_within_2_percent():
    use_expandable_segments()  # both runs on the allocator settings graphs use
    flags = f"{DENSE8} {COMMON} {NO_DROPOUT} --bf16 --global-batch-size 4"
    eager = run(flags, 6)
    graphed = run(f"{flags} {FULL}", 6)
    assert_same(eager, graphed, "dense8 full iteration")
    assert graphed[3] <= eager[3] * 1.02, (
        f"full-iteration peak reserved {graphed[3] / 2**20:.0f} MiB > eager {eager[3] / 2**20:.0f} MiB + 2%"
    )


@pytest.mark.parametrize(
    "extra", ["", "--recompute-granularity full --recompute-method uniform --recompute-num-layers 2"]
)
def test_hybrid_full_iteration_equals_eager(extra):
    """The hybrid model in one graph, also with its layers recomputed inside it (Mamba scans included)."""
    import pretrain_hybrid

    providers = (pretrain_hybrid.model_provider, pretrain_hybrid.forward_step)
    flags = f"{hybrid.SMALL} {hybrid.COMMON} {extra}"
    eager = run(flags, 5, providers)
    graphed = run(f"{flags} {FULL}", 5, providers)
    assert graphed[2] == 1
    assert_same(eager, graphed, f"hybrid full iteration {extra}")
    if extra:  # and as without recompute
        assert_same(run(f"{hybrid.SMALL} {hybrid.COMMON}", 5, providers), eager, "hybrid recompute")


def test_transformer_engine_impl_is_the_local_graphs():
    """``--cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp`` captures the local
    partial graphs: bitwise equal to eager, as ``local`` is."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16"
    eager = run(flags, 4)
    trainer = build_trainer(
        f"{flags} --train-iters 4 --cuda-graph-impl transformer_engine --cuda-graph-modules attn mlp".split()
    )
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses = [trainer.train_step(it)[0].detach().clone() for _ in range(4)]
        assert trainer.graphs.captured and trainer.full_graph is None
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.graphs.close()
        trainer.close()
    for i, (a, b) in enumerate(zip(eager[0], losses, strict=True)):
        assert torch.equal(a, b), f"iteration {i + 1}: eager {a.item()!r} graphed {b.item()!r}"
