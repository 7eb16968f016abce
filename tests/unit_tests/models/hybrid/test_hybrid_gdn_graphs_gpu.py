"""Graphed hybrid training with ``G`` layers equals eager training, on a GPU (``pytest -m gpu``).

Pattern ``M*G-M*G-``, deterministic mode (the PyTorch chunked gated delta rules, not
fla's kernels), dropout 0, bf16, GDN and GDN2. The same kernels run eagerly and inside
the graphs, so losses and every ``main_grad`` are compared with ``torch.equal``.
Scopes: ``attn`` (the ``*`` and ``G`` layers graphed), ``mamba attn mlp`` and whole
layers (every layer one graph, and the loss head).
"""

import pytest

from megatron.core.ssm.mamba_mixer import HAVE_MAMBA_SSM
from tests.unit_tests.models.hybrid.test_hybrid_graphs_gpu import SMALL, assert_same, train

pytestmark = pytest.mark.gpu

COMMON = (
    "--hybrid-layer-pattern M*G-M*G- --lr 1e-4 --min-lr 1e-5 --lr-decay-style constant --seed 1234 "
    "--tokenizer-type NullTokenizer --vocab-size 32000 --mock-data --log-interval 1000000 --num-workers 0 "
    "--deterministic-mode --attention-dropout 0.0 --hidden-dropout 0.0 --bf16 --linear-key-head-dim 64 "
    "--linear-value-head-dim 64 --linear-num-key-heads 2 --linear-num-value-heads 4"
)
# Graphed regions per scope (8 layers; the loss head joins when the last layer, an MLP, is graphed).
SCOPES = {"attn": ("attn", 4), "mamba attn mlp": ("mamba attn mlp", 9), "layer": ("", 9)}


@pytest.mark.skipif(HAVE_MAMBA_SSM, reason="mamba-ssm's Triton kernels are not checked bitwise against eager here")
@pytest.mark.parametrize("variant", ["", "--experimental-attention-variant gdn2"], ids=["gdn", "gdn2"])
def test_g_hybrid_graphed_equals_eager_every_scope(variant):
    from megatron.core.transformer.cuda_graphs.pool import use_expandable_segments

    use_expandable_segments()  # eager on the allocator settings graphed runs use
    flags = f"{SMALL} {COMMON} {variant}"
    eager = train(flags, 8)
    assert eager[2]["active"] is False
    for scope, (value, regions) in SCOPES.items():
        graphed = train(f"{flags} --cuda-graph-impl local --cuda-graph-scope {value}".rstrip(), 8)
        facts = graphed[2]
        assert facts["captured"]
        assert len(facts["regions"]) == regions, facts["regions"]
        if scope == "attn":
            assert [r.removeprefix("decoder.layers.") for r in facts["regions"]] == [
                "1.layer",
                "2.layer",
                "5.layer",
                "6.layer",
            ]
        assert_same(eager, graphed, f"{variant or 'gdn'} scope {scope!r}")
