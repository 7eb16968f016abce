"""Graphed MoE GPT training equals eager training, on a GPU (``pytest -m gpu``).

The issue's config: 8 MoE layers, hidden 1024, FFN 4096, 16 heads, sequence 2048, micro
batch 2, 8 experts top-2, alltoall, SwiGLU, no linear biases, bf16, dropout 0,
``--deterministic-mode``, 50 iterations. Scopes ``attn moe_router moe_preprocess``,
``moe_router moe_preprocess`` and ``attn`` run dropless (dispatch, experts and combine
eager: the same kernels on the same, padded, token counts as in eager); ``moe`` runs with
drop-and-pad (``--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity``)
against an eager drop-and-pad run. The same kernels run eagerly and inside the graphs,
so every lm loss and every ``main_grad`` (after iterations 3 and 50, copied to the host
so the copies do not count as device memory) are compared with ``torch.equal``.

Peak device memory is ``torch.cuda.max_memory_allocated`` (graph pools included) over
each run alone, the previous run's model freed first; every scope must stay within
eager + 2%.
"""

import gc

import pytest
import torch

from megatron.core import parallel_state
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.conftest import assert_bitwise_same

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

ISSUE = (
    "--num-layers 8 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 2 --global-batch-size 2 --num-experts 8"
)
SMALL = (
    "--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4 --seq-length 256 "
    "--max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2 --num-experts 4"
)
COMMON = (
    "--moe-router-topk 2 --moe-token-dispatcher-type alltoall --swiglu --disable-bias-linear --bf16 "
    "--attention-dropout 0.0 --hidden-dropout 0.0 --deterministic-mode --lr 1e-4 --min-lr 1e-5 "
    "--lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data "
    "--log-interval 1000000 --num-workers 0"
)
DROP_AND_PAD = "--moe-expert-capacity-factor 1 --moe-pad-expert-input-to-capacity"
# scope -> (--cuda-graph-scope value, needs drop-and-pad, graphed regions of each MoE layer, loss head graphed)
SCOPES = {
    "attn moe_router moe_preprocess": (False, ["attn", "moe_router", "moe_preprocess", "moe_postprocess"], False),
    "moe_router moe_preprocess": (False, ["moe_router", "moe_preprocess", "moe_postprocess"], False),
    "attn": (False, ["attn"], False),
    "moe": (True, ["moe"], True),  # the last layer's block is graphed: the loss head follows
}
SNAPSHOTS = (3,)  # and the last iteration


def _free_device_memory():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def train(flags: str, iters: int) -> dict:
    """Trains ``iters`` iterations; returns losses, host copies of every main_grad after the
    snapshot iterations, region names and the run's peak allocated bytes. The trainer and
    its graphs are gone when it returns."""
    _free_device_memory()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(f"{flags} --train-iters {iters}".split())
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses, grads, peak = [], {}, 0
        for i in range(1, iters + 1):
            loss = trainer.train_step(it)[0]  # (loss, grad_norm, success, non_finite)
            losses.append(loss.detach().clone())
            if i in SNAPSHOTS or i == iters:
                torch.cuda.synchronize()
                peak = max(peak, torch.cuda.max_memory_allocated())  # before the host copies
                grads[i] = [p.main_grad.detach().to("cpu") for p in trainer.model.module.parameters()]
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
        peak = max(peak, torch.cuda.max_memory_allocated())
        result = dict(
            losses=[x.cpu() for x in losses],
            grads=grads,
            peak=peak - start,
            active=trainer.graphs.active,
            captured=trainer.graphs.captured,
            regions=[r.name.removeprefix("decoder.layers.") for r in trainer.graphs.regions],
        )
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.graphs.close()
    del trainer
    _free_device_memory()
    return result


def assert_same(eager, graphed, what):
    """Two runs' losses, and their main_grads at each iteration they were taken after, equal bit for bit."""
    assert eager["grads"].keys() == graphed["grads"].keys()
    for at in eager["grads"]:
        assert_bitwise_same(
            (eager["losses"], eager["grads"][at]), (graphed["losses"], graphed["grads"][at]), what, grads_after=at
        )


def run_scopes(size: str, num_layers: int, iters: int, memory_margin: float | None):
    flags = f"{size} {COMMON}"
    if memory_margin is not None:
        train(flags, 2)  # what a process's first run makes and later runs reuse goes in no run's peak
    eager = {}
    for pad in (False, True):
        run = train(f"{flags} {DROP_AND_PAD}" if pad else flags, iters)
        assert run["active"] is False
        eager[pad] = run
    peaks = {}
    for scope, (pad, per_layer, head) in SCOPES.items():
        base = f"{flags} {DROP_AND_PAD}" if pad else flags
        graphed = train(f"{base} --cuda-graph-impl local --cuda-graph-scope {scope}", iters)
        assert graphed["captured"], scope
        expected = [f"{i}.{name}" for i in range(num_layers) for name in per_layer] + (["postprocess"] if head else [])
        assert graphed["regions"] == expected, (scope, graphed["regions"])
        assert_same(eager[pad], graphed, f"scope {scope!r}")
        peaks[scope] = (graphed["peak"], eager[pad]["peak"])
        del graphed
    if memory_margin is not None:
        for scope, (peak, base) in peaks.items():
            assert peak <= base * (1 + memory_margin), (
                f"scope {scope!r}: peak allocated {peak / 2**20:.0f} MiB > eager {base / 2**20:.0f} MiB "
                f"+ {memory_margin:.0%} (all scopes: "
                + ", ".join(f"{s}: {p / 2**20:.0f}/{b / 2**20:.0f} MiB" for s, (p, b) in peaks.items())
                + ")"
            )


def test_small_moe_gpt_graphed_equals_eager_every_scope():
    run_scopes(SMALL, 2, 8, memory_margin=None)


def test_issue_config_50_iterations_bitwise_and_peak_memory_within_2_percent():
    """The issue's check: every scope's losses and main_grads torch.equal to eager over 50
    iterations, peak allocated <= eager + 2%."""
    run_scopes(ISSUE, 8, 50, memory_margin=0.02)


@pytest.mark.parametrize("draw", ["--moe-router-force-load-balancing", "--moe-input-jitter-eps 0.1"])
@pytest.mark.parametrize("scope", ["moe_router moe_preprocess", "moe"])
def test_random_draws_in_the_router_graphed_equal_eager(scope, draw):
    """--moe-router-force-load-balancing draws the router's logits, --moe-input-jitter-eps the
    jitter of its input, inside the captured router: each replay draws anew from the default
    generator, in the eager step's order."""
    pad, _, _ = SCOPES[scope]
    flags = f"{SMALL} {COMMON} {draw}" + (f" {DROP_AND_PAD}" if pad else "")
    eager = train(flags, 6)
    graphed = train(f"{flags} --cuda-graph-impl local --cuda-graph-scope {scope}", 6)
    assert graphed["captured"]
    assert_same(eager, graphed, f"{draw}, scope {scope!r}")
