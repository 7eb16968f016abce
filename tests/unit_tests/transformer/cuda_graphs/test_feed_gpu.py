"""The embedding's forward in the backward graphs' pool (``cuda_graphs/feed.py``), on a GPU (``pytest -m gpu``)."""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_model import LanguageModelEmbedding
from megatron.core.transformer.cuda_graphs.plan import FWD
from megatron.core.transformer.cuda_graphs.session import ONE_POOL_SWITCH
from megatron.core.transformer.cuda_graphs.weak import is_weak_ref
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu import COMMON, NO_DROPOUT, SMALL, train

pytestmark = pytest.mark.gpu


def segment_pool(ptr: int) -> tuple[int, int]:
    """The allocator pool id of the segment holding ``ptr`` ((0, 0): the eager cache)."""
    (segment,) = [s for s in torch.cuda.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]]
    return tuple(segment["segment_pool_id"])


@pytest.mark.parametrize("one_pool", [False, True], ids=["backward pool", "one pool"])
def test_the_embedding_allocates_in_the_backward_pool_once_captured(one_pool, monkeypatch):
    """Iteration 1 records (the eager cache); from iteration 2 on the embedding's output lies in the
    backward graphs' pool (with MEGATRON_CG_ONE_POOL=1: the slot's only pool, which the backward graphs
    share), and training goes on bit for bit as eagerly."""
    monkeypatch.setenv(ONE_POOL_SWITCH, "1" if one_pool else "0")
    flags = f"{SMALL} {COMMON} {NO_DROPOUT} --bf16"
    eager = train(flags, 4)
    trainer = build_trainer(f"{flags} --train-iters 4 --cuda-graph-impl local".split())
    try:
        (embedding,) = [m for m in trainer.model.modules() if isinstance(m, LanguageModelEmbedding)]
        pools, spans = [], []

        def note(module, args, out):
            pools.append(segment_pool(out.data_ptr()))
            storage = out.untyped_storage()
            spans.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))

        embedding.register_forward_hook(note)
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0).train
        trainer.model.train()
        losses = [trainer.train_step(it)[0].detach().clone() for _ in range(4)]
        session = trainer.graphs
        where = "graph" if one_pool else "backward"
        assert session.feed_open and f"embedding in the {where} pool" in session.summary_line()
        assert session.stats()["embedding_in_graph_pool"]
        assert (session.backward_pool is None) == one_pool
        assert pools == [(0, 0)] + [(session.pools[0] if one_pool else session.backward_pool).handle] * 3
        assert torch.equal(torch.stack(losses), torch.stack(eager[0]))
        # The first graph's replay copies into its static inputs after the embedding ran. With one pool
        # they are held (else the embedding could allocate there); its output lay across none of them.
        first = next(e.region for e in session.order if e.phase == FWD)
        statics = [static for _, static, copy in session.regions[first].slots[0].replay_inputs if copy]
        assert statics and (not one_pool or not any(is_weak_ref(t) for t in statics))
        held = [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in statics]
        assert not any(begin < ptr + size and ptr < end for begin, end in spans[1:] for ptr, size in held)
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.graphs.close()
