"""Graphed training equals eager training with bf16 main_grad buffers (``--grad-reduce-in-bf16``, GPU).

The backward graphs add weight gradients into bf16 ``main_grad`` with the same kernels
eager runs (the fused wgrad GEMM into main_grad's dtype, or ``add_`` of the bf16 gradient
that DDP's fold also uses), so in ``--deterministic-mode`` losses and every ``main_grad``
are compared with ``torch.equal``, as in ``test_graphs_gpu.py``.
"""

import pytest
import torch

from tests.unit_tests.transformer.cuda_graphs.test_graphs_gpu import (
    COMMON,
    NO_DROPOUT,
    SMALL,
    assert_same,
    graph_flags,
    train,
)

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("fusion", ["", "--no-gradient-accumulation-fusion"], ids=["fused-wgrad", "unfused-wgrad"])
@pytest.mark.parametrize("scope", ["layer", "attn mlp"])
def test_graphed_equals_eager_with_bf16_grad_buffers(scope, fusion):
    # 3 micro-batches accumulate in the bf16 buffer; overlap launches buckets from graph events.
    flags = (
        f"{SMALL} {COMMON} {NO_DROPOUT} --bf16 --grad-reduce-in-bf16 --global-batch-size 6 --overlap-grad-reduce "
        f"{fusion}"
    )
    eager = train(flags, 8)
    graphed = train(f"{flags} {graph_flags(scope)}", 8)
    assert graphed[2].graphs.captured
    for _, grads, trainer in (eager, graphed):
        assert {g.dtype for g in grads} == {torch.bfloat16}
        assert {b.data.dtype for b in trainer.model.grad_buffers} == {torch.bfloat16}
    assert_same(eager, graphed, f"--grad-reduce-in-bf16, scope {scope!r} {fusion}")
