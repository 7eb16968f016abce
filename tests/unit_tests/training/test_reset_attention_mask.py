"""--reset-attention-mask: Megatron's document mask, from the data loader to every attention layer."""

import re

import pytest
import torch

import pretrain_hybrid
from megatron.core import parallel_state
from megatron.core.datasets.builder import build_train_valid_test_datasets
from megatron.core.datasets.gpt_dataset import document_mask
from megatron.training.arguments import parse_args
from megatron.training.training import build_trainer

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 2 --train-iters 2 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 64 --num-workers 0 --log-interval 1 --hidden-dropout 0 --attention-dropout 0"
)


def _trainer(extra: str = ""):
    argv = f"{FLAGS} {extra}".split()
    trainer = build_trainer(argv, **pretrain_hybrid.providers(argv))  # pretrain_hybrid.py's model with its flag
    parallel_state.destroy(trainer.pg)
    return trainer


@pytest.mark.parametrize(
    "extra",
    [
        "",
        "--window-size 3,0",
        "--recompute-granularity selective",
        "--num-experts 4 --moe-router-topk 2",
        "--softmax-type learnable --window-size 3,0",
    ],
    ids=["plain", "window", "recompute", "moe", "sink"],
)
def test_packed_documents_attend_as_if_each_were_alone(extra):
    """With RoPE (relative positions) a sequence of two documents under their document mask gives
    each document the logits it gets alone; without the mask the second one sees the first."""
    trainer = _trainer(f"--position-embedding-type rope {extra}")
    model, eod = trainer.model.module, trainer.tokenizer.eod
    torch.manual_seed(0)
    first = torch.cat([torch.randint(0, eod, (5,)), torch.tensor([eod])])
    second = torch.randint(0, eod, (10,))
    packed = torch.cat([first, second])[None]
    mask = document_mask(packed[0], eod)[None]  # [1, 1, s, s]
    with torch.no_grad():
        together = model(packed, None, None, mask)
        alone = torch.cat([model(first[None]), model(second[None])], dim=1)
        unmasked = model(packed)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(unmasked[:, 6:], alone[:, 6:], atol=1e-3)
    trainer.close()


def test_hybrid_attention_layers_take_the_mask():
    """A hybrid stack of attention and MLP layers (no positions, no Mamba) gives packed documents their
    own logits under the mask, as the GPT does; Mamba layers take no mask (their scan runs on, as upstream's)."""
    trainer = _trainer("--hybrid-layer-pattern *-*- --position-embedding-type none --mamba-num-groups 1")
    model, eod = trainer.model.module, trainer.tokenizer.eod
    torch.manual_seed(0)
    first = torch.cat([torch.randint(0, eod, (7,)), torch.tensor([eod])])
    second = torch.randint(0, eod, (8,))
    packed = torch.cat([first, second])[None]
    with torch.no_grad():
        together = model(packed, None, None, document_mask(packed[0], eod)[None])
        alone = torch.cat([model(first[None]), model(second[None])], dim=1)
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    trainer.close()
    mamba = _trainer("--hybrid-layer-pattern M* --mamba-num-groups 1 --reset-attention-mask")
    assert len(mamba.train()) == 2
    mamba.close()


def test_the_mask_reaches_the_batches_and_the_run_trains():
    cfg = parse_args(f"{FLAGS} --reset-attention-mask".split()).resolve()
    trainer = _trainer("--reset-attention-mask")
    train, _, _ = build_train_valid_test_datasets(
        cfg.data, trainer.tokenizer, seq_length=16, seed=1, num_samples=(8, 0, 0)
    )
    item = train[0]
    assert torch.equal(item["attention_mask"][0], document_mask(item["tokens"], trainer.tokenizer.eod)[0])
    history = trainer.train()
    assert len(history) == 2 and all(torch.isfinite(torch.tensor(r["lm loss"])) for r in history)
    trainer.close()


@pytest.mark.parametrize(
    ("extra", "world", "named"),
    [
        ("--no-create-attention-mask-in-dataloader", 1, "--no-create-attention-mask-in-dataloader"),
        ("--hybrid-layer-pattern G* --mamba-num-groups 1", 1, "gated delta net layers"),
    ],
)
def test_what_the_mask_cannot_reach_is_refused_naming_the_flag(extra, world, named):
    argv = f"{FLAGS} --reset-attention-mask {extra}".split()
    with pytest.raises(ValueError, match=re.escape(f"--reset-attention-mask with {named}")):
        parse_args(argv).resolve(world_size=world).validate()


def test_graphed_attention_takes_the_mask_as_one_static_input_shared_by_every_layer():
    """Recorded on the CPU (as before a capture): each attention region gets the micro-batch's mask
    as an input; every layer reads the same tensor, so the plan gives it one buffer per cycle, filled
    by one copy at replay (the GPU test compares graphed with eager)."""
    from megatron.core.transformer import cuda_graphs
    from megatron.core.transformer.cuda_graphs.config import CudaGraphConfig

    trainer = _trainer("--position-embedding-type rope")
    model, eod = trainer.model.module, trainer.tokenizer.eod
    session = cuda_graphs.attach(
        model, CudaGraphConfig(cuda_graph_impl="local", cuda_graph_scope=["attn"]), record_without_cuda=True
    )
    try:
        tokens = torch.randint(0, eod + 1, (2, 16))
        mask = torch.stack([document_mask(t, eod) for t in tokens])
        model(tokens, None, tokens, mask).sum().backward()
        plan = session.make_plans()[0]
        shared = {region.sources[2] for region in session.regions}
        assert len(session.regions) == 2 and len(shared) == 1 and next(iter(shared)).kind == "shared"
        assert len([k for k in plan.buffers if k[0] == "shared"]) == 2  # the mask and the RoPE table
    finally:
        session.close()
        trainer.close()
