"""Where the trainer lets the CUDA graphs' eager turns open (``GraphSession.eager_turn_allowed``):
not where a collective could run inside a turn (tensor parallelism; gradient reduction that
overlaps the backward with DP > 1), nor in pipelines or MoE models; in models with Mamba layers they
do (their scan's forward working memory turns too: cuda_graphs/scratch.py). Two gloo ranks on the CPU."""

import pytest

from tests.unit_tests.dist_utils import run_distributed

BASE = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 1 --global-batch-size 2 --mock-data --tokenizer-type NullTokenizer --vocab-size 128 "
    "--lr 1e-4 --train-iters 1 --num-workers 0"
)
LAYOUTS = {
    "dp2": ("", True),
    "dp2 overlapped": ("--overlap-grad-reduce", False),
    "tp2": ("--tensor-model-parallel-size 2", False),
    "pp2": ("--pipeline-model-parallel-size 2", False),
    "moe": ("--num-experts 2 --moe-router-topk 2", False),
    "hybrid": ("--hybrid-layer-pattern M* --mamba-num-groups 2 --mamba-head-dim 16", True),
    "hybrid without mamba": ("--hybrid-layer-pattern *-", True),
}


def _allowed(rank: int, world_size: int, extra: str) -> bool:
    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    argv = f"{BASE} {extra}".split()
    trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))  # as pretrain_hybrid.py builds it
    try:
        return trainer.graphs.eager_turn_allowed
    finally:
        parallel_state.destroy(trainer.pg)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_turns_stay_closed_where_a_collective_could_run_inside_one(layout):
    extra, allowed = LAYOUTS[layout]
    assert run_distributed(_allowed, 2, extra) == [allowed, allowed]
