"""GPT-OSS's attention and MLP flags on a GPU (``pytest -m gpu``).

- The attention variants in bf16 on CUDA against the float64 loops of ``test_attention_variants``:
  sink attention (unfused) and the sliding window through SDPA with a mask, also under
  ``--attention-backend flash`` (flash kernels take no mask: the backend's other kernels run it).
  Tolerance: bf16 inputs and outputs, 3e-2 relative to the output's scale.
- Graphed training equals eager training bitwise with these flags (quick-GEGLU with offset and clamp,
  learnable sinks, windows on every other layer, MoE experts), deterministic mode, dropout 0: the same
  kernels run eagerly and inside the graphs, so losses and every ``main_grad`` are compared with
  ``torch.equal``.
"""

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.training.data import build_data_iterators
from megatron.training.training import build_trainer
from tests.unit_tests.transformer.test_attention_variants import reference

pytestmark = pytest.mark.gpu

OSS = (
    "--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value 7.0 --softmax-type learnable "
    "--window-size 63,0 --window-attn-skip-freq 2 --position-embedding-type rope --disable-bias-linear"
)
COMMON = (
    "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--seq-length 256 --max-position-embeddings 256 --micro-batch-size 2 --global-batch-size 2 --lr 1e-4 "
    "--lr-decay-style constant --seed 1234 --tokenizer-type NullTokenizer --vocab-size 32000 --mock-data "
    "--log-interval 1000000 --num-workers 0 --deterministic-mode --attention-dropout 0.0 --hidden-dropout 0.0 --bf16"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 256 --moe-token-dispatcher-type alltoall"


@pytest.mark.parametrize(
    "kw, left, backend",
    [
        (dict(softmax_type="learnable", window_size="15,0"), 15, "auto"),
        (dict(softmax_type="off-by-one"), None, "auto"),
        (dict(window_size="15,0"), 15, "flash"),
        (dict(window_size="15,0"), 15, "auto"),
    ],
)
def test_attention_variants_bf16_cuda_match_float64_reference(kw, left, backend):
    cfg = TransformerConfig(
        num_layers=2, hidden_size=128, num_attention_heads=4, attention_dropout=0.0, attention_backend=backend, **kw
    ).finalize()
    torch.manual_seed(0)
    attn = SelfAttention(cfg, layer_number=1, device="cuda")
    with torch.no_grad():
        for name, p in attn.named_parameters():
            if p.dim() == 1 and "softmax_offset" not in name:
                p.normal_(std=0.1)
    attn = attn.to(torch.bfloat16)
    ref_attn = SelfAttention(cfg, layer_number=1, device="cpu").double()
    ref_attn.load_state_dict({k: v.double().cpu() for k, v in attn.state_dict().items()})  # the bf16 values
    x = torch.randn(40, 2, 128).to(torch.bfloat16)
    sink = None
    if cfg.softmax_type == "learnable":
        sink = ref_attn.core_attention.softmax_offset.detach()
    elif cfg.softmax_type == "off-by-one":
        sink = torch.zeros(4, dtype=torch.float64)
    want = reference(ref_attn, cfg, x.double(), left=left, sink=sink)
    out, _ = attn(x.cuda())
    assert (out.double().cpu() - want).abs().max().item() <= 3e-2 * want.abs().max().item()


def _train(flags: str, iters: int):
    trainer = build_trainer(f"{flags} --train-iters {iters}".split())
    try:
        it = build_data_iterators(trainer.cfg, trainer.tokenizer, trainer.pg, 0)[0]
        trainer.model.train()
        losses, grads = [], None
        for i in range(1, iters + 1):
            losses.append(trainer.train_step(it)[0].detach().clone())
            if i == 3:
                grads = [p.main_grad.detach().clone() for p in trainer.model.module.parameters()]
        torch.cuda.synchronize()
        return losses, grads, trainer.graphs.captured
    finally:
        parallel_state.destroy(trainer.pg)
        trainer.graphs.close()


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gpt_oss_flags_graphed_equal_eager(moe):
    flags = f"{COMMON} {OSS} {MOE if moe else ''}"
    eager_losses, eager_grads, _ = _train(flags, 6)
    scope = "attn moe_router" if moe else "attn mlp"
    losses, grads, captured = _train(f"{flags} --cuda-graph-impl local --cuda-graph-scope {scope}", 6)
    assert captured
    for i, (a, b) in enumerate(zip(eager_losses, losses)):
        assert torch.equal(a, b), f"lm loss differs at iteration {i + 1}: eager {a.item()!r} graphed {b.item()!r}"
    for k, (a, b) in enumerate(zip(eager_grads, grads)):
        assert torch.equal(a, b), f"main_grad of parameter {k} differs (max diff {(a - b).abs().max().item()})"
