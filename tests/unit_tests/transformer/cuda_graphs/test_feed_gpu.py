"""The embedding's forward in the backward graphs' pool (``cuda_graphs/feed.py``), on a GPU (``pytest -m gpu``)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import LanguageModelEmbedding
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu import COMMON, NO_DROPOUT, SMALL, train

pytestmark = pytest.mark.gpu


def segment_pool(ptr: int) -> tuple[int, int]:
    """The allocator pool id of the segment holding ``ptr`` ((0, 0): the eager cache)."""
    (segment,) = [s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]]
    return tuple(segment["segment_pool_id"])


def test_the_embedding_allocates_in_the_backward_pool_once_captured():
    """Iteration 1 records (the eager cache); from iteration 2 on the embedding's output lies in the
    backward graphs' pool, and training goes on bit for bit as eagerly."""
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16"
    eager = train(flags, 4)
    trainer = build_trainer(f"{flags} --train-iters 4 --cuda-graph-impl local".split())
    try:
        (embedding,) = [m for m in trainer.model.modules() if isinstance(m, LanguageModelEmbedding)]
        pools = []
        embedding.register_forward_hook(lambda module, args, out: pools.append(segment_pool(out.data_ptr())))
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
        trainer.model.train()
        losses = [trainer.train_step(it)[0].detach().clone() for _ in range(4)]
        session = trainer.graphs
        assert session.feed_open and "embedding in the backward pool" in session.summary_line()
        assert session.stats()["embedding_in_backward_pool"]
        assert pools == [(0, 0)] + [session.backward_pool.handle] * 3
        assert torch.equal(torch.stack(losses), torch.stack(eager[0]))
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.graphs.close()
