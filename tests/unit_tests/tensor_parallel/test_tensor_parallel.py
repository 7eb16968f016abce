"""TP = 2 on two gloo ranks: the collectives, layout-independent init, vocab-parallel cross entropy.

Everything runs in one set of two processes (start-up dominates on two cores); each
test reads its part of the results. The fused (Triton) cross entropy runs in Triton's
interpreter on the CPU (``TRITON_INTERPRET=1``, read when the kernels are defined, so
it is set before the processes start).
"""

import importlib.util
import os

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

HAVE_TRITON = importlib.util.find_spec("triton") is not None


def _pg(rank, world, sequence_parallel=False):
    from megatron.core.parallel_config import ParallelConfig
    from megatron.core.parallel_state import build_groups

    cfg = ParallelConfig(world_size=world, tensor_model_parallel_size=2, sequence_parallel=sequence_parallel).resolve()
    cfg.validate()
    return build_groups(cfg, rank=rank, world_size=world, device=torch.device("cpu"))


def _gather(t, pg, dim, stride=1):
    import torch.distributed as dist

    from megatron.core.tensor_parallel.layers import full_from_shards

    shards = [torch.empty_like(t) for _ in range(pg.tp_size)]
    dist.all_gather(shards, t.contiguous(), group=pg.tp)
    return full_from_shards(shards, dim, stride)


def _init_checks(pg):
    """Max |difference| between the TP = 1 weights and the gathered TP = 2 weights, per model."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model
    from megatron.core.transformer.transformer_config import TransformerConfig

    variants = {
        "gelu_mha_tied": dict(),
        "swiglu_gqa_rope_untied": dict(
            gated_linear_unit=True,
            group_query_attention=True,
            num_query_groups=2,
            position_embedding_type="rope",
            untie_embeddings_and_output_weights=True,
            add_bias_linear=False,
            normalization="RMSNorm",
        ),
    }
    out = {}
    for name, kw in variants.items():
        cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, **kw).finalize()
        torch.manual_seed(1234)
        ref = build_gpt_model(cfg, 64)
        torch.manual_seed(1234)
        tp = build_gpt_model(cfg, 64, pg=pg)
        ref_params = dict(ref.named_parameters())
        worst = 0.0
        names = []
        for pname, p in tp.named_parameters():
            full = p.detach()
            if getattr(p, "tensor_model_parallel", False):
                full = _gather(full, pg, p.partition_dim, getattr(p, "partition_stride", 1))
            worst = max(worst, (full - ref_params[pname].detach()).abs().max().item())
            names.append(pname)
        out[name] = (worst, sorted(names) == sorted(ref_params))
    return out


def _mapping_checks(pg):
    from megatron.core.tensor_parallel import mappings as m

    g, r = pg.tp, pg.tp_rank
    out = {}
    full = torch.arange(24.0).view(4, 2, 3)  # the same on both ranks
    mine = (full + 100 * r).requires_grad_()
    y = m.reduce_from_tensor_model_parallel_region(mine * 1.0, g)
    y.backward(torch.ones_like(y))
    out["reduce"] = torch.equal(y, 2 * full + 100) and torch.equal(mine.grad, torch.ones_like(full))
    x = full.clone().requires_grad_()
    y = m.copy_to_tensor_model_parallel_region(x, g)
    y.backward(torch.full_like(y, float(r + 1)))
    out["copy"] = torch.equal(y, full) and torch.equal(x.grad, torch.full_like(full, 3.0))
    x = full.clone().requires_grad_()
    y = m.gather_from_sequence_parallel_region(x[r * 2 : (r + 1) * 2], g)
    y.backward(torch.ones_like(y) * (r + 1))
    out["sp_gather"] = torch.equal(y, full) and torch.equal(x.grad[r * 2 : (r + 1) * 2], torch.full((2, 2, 3), 3.0))
    x = (full * (r + 1)).requires_grad_()
    y = m.reduce_scatter_to_sequence_parallel_region(x, g)
    y.backward(torch.ones_like(y))
    out["sp_reduce_scatter"] = torch.equal(y, 3 * full[r * 2 : (r + 1) * 2]) and torch.equal(
        x.grad, torch.ones_like(full)
    )
    x = full.clone().requires_grad_()
    y = m.scatter_to_sequence_parallel_region(x, g)
    y.backward(torch.ones_like(y))
    out["sp_scatter"] = torch.equal(y, full[r * 2 : (r + 1) * 2]) and torch.equal(x.grad, torch.ones_like(full))
    wide = torch.arange(16.0).view(2, 8)
    x = wide.clone().requires_grad_()
    y = m.scatter_to_tensor_model_parallel_region(x, g)
    z = m.gather_from_tensor_model_parallel_region(y, g)
    z.backward(torch.ones_like(z))
    out["last_dim"] = torch.equal(y, wide[:, r * 4 : (r + 1) * 4]) and torch.equal(z, wide)
    # gather's backward keeps this rank's chunk of the ones, scatter's gathers both chunks back.
    out["last_dim_grad"] = torch.equal(x.grad, torch.ones_like(wide))
    return out


def _cross_entropy_checks(pg, fused):
    import torch.nn.functional as F

    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    torch.manual_seed(0)
    full = 4 * torch.randn(6, 3, 10)
    target = torch.randint(0, 10, (6, 3))
    grad_w = torch.rand(6, 3)
    ref_logits = full.clone().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, 10), target.view(-1), reduction="none").view(6, 3)
    ref.backward(grad_w)
    r = pg.tp_rank
    shard = full[..., r * 5 : (r + 1) * 5].contiguous().requires_grad_()
    logits = shard * 1.0  # the fused backward writes over its input: not the leaf
    loss = vocab_parallel_cross_entropy(logits, target, pg=pg, fused=fused)
    loss.backward(grad_w)
    return (
        (loss - ref).abs().max().item(),
        (shard.grad - ref_logits.grad[..., r * 5 : (r + 1) * 5]).abs().max().item(),
        loss.dtype == torch.float32,
    )


def _sequence_parallel_checks(rank, world):
    """The GPT loss and its gathered gradients with SP equal those without (same weights, same batch)."""
    from megatron.core.models.gpt.gpt_model import build_gpt_model
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.0, attention_dropout=0.0
    ).finalize()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(3))
    labels = torch.roll(ids, -1, 1)
    results = []
    for sp in (False, True):
        pg = _pg(rank, world, sequence_parallel=sp)
        torch.manual_seed(1234)
        model = build_gpt_model(cfg, 64, pg=pg)
        loss = model(ids, labels=labels).mean()
        loss.backward()
        grads = {}
        for name, p in model.named_parameters():
            g = p.grad
            if getattr(p, "sequence_parallel", False):  # what DDP's finish_grad_sync sums over TP
                g = g.clone()
                torch.distributed.all_reduce(g, group=pg.tp)
            grads[name] = g
        marked = sorted(n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False))
        results.append((loss.item(), grads, marked))
    (loss0, grads0, _), (loss1, grads1, marked) = results
    worst = max((grads0[n] - grads1[n]).abs().max().item() for n in grads0)
    return abs(loss0 - loss1), worst, marked


def _all_checks(rank, world):
    torch.set_num_threads(1)
    pg = _pg(rank, world)
    out = {
        "init": _init_checks(pg),
        "mappings": _mapping_checks(pg),
        "ce": _cross_entropy_checks(pg, fused=False),
        "sp": _sequence_parallel_checks(rank, world),
    }
    if HAVE_TRITON:
        out["ce_fused"] = _cross_entropy_checks(pg, fused=True)
    return out


@pytest.fixture(scope="module")
def results():
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        return run_distributed(_all_checks, 2, timeout=300)
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous


@pytest.mark.parametrize("variant", ["gelu_mha_tied", "swiglu_gqa_rope_untied"])
def test_same_seed_gives_the_same_full_weights_at_tp2(results, variant):
    for r in results:
        worst, same_names = r["init"][variant]
        assert same_names
        assert worst == 0.0  # the same draws, sharded: bitwise equal


def test_collectives_forward_and_backward(results):
    for r in results:
        assert r["mappings"] == {k: True for k in r["mappings"]}, r["mappings"]


@pytest.mark.parametrize("path", ["ce", "ce_fused"])
def test_vocab_parallel_cross_entropy_matches_full_vocabulary(results, path):
    if path not in results[0]:
        pytest.skip("needs triton")
    for r in results:
        loss_err, grad_err, fp32 = r[path]
        assert fp32
        assert loss_err < 1e-5 and grad_err < 1e-6, (loss_err, grad_err)


def test_sequence_parallel_gpt_matches_plain_tp(results):
    for r in results:
        loss_err, grad_err, marked = r["sp"]
        assert loss_err < 1e-6 and grad_err < 1e-6, (loss_err, grad_err)
        # Norms and row-parallel biases see one sequence shard; split weights do not.
        assert "decoder.final_layernorm.weight" in marked
        assert "decoder.layers.0.self_attention.linear_proj.bias" in marked
        assert not any("linear_qkv" in n or "linear_fc1" in n or "embedding" in n for n in marked)
