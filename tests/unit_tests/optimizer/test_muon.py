"""Muon: one update against a hand-written float64 reference, Megatron's param split, training (CPU).

Tolerance of the float32 update against float64: 1e-5 relative (``--muon-fp32-matmul-prec
high``; on the CPU float32 matmuls).
"""

import copy
import types

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.optimizer.muon import MatrixInfo, Muon
from megatron.core.optimizer.newton_schulz import coefficients
from megatron.training.training import build_trainer
from tests.unit_tests.optimizer.test_newton_schulz import reference


def config(**kw):
    base = dict(
        lr=0.02, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, muon_momentum=0.9,
        muon_nesterov=False, muon_split_qkv=True, muon_scale_mode="spectral", muon_fp32_matmul_prec="high",
        muon_coefficient_type="quintic", muon_num_ns_steps=5, muon_tp_mode="duplicated", muon_extra_scale_factor=0.2,
        muon_scalar_optimizer="adam", lion_beta1=0.95, lion_beta2=0.98,
    )  # fmt: skip
    base.update(kw)
    return types.SimpleNamespace(**base)


def reference_update(w, m, g, cfg, split):
    """float64: decoupled decay, EMA momentum, (Nesterov), per-part Newton-Schulz and scale."""
    w = w * (1 - cfg.lr * cfg.weight_decay)
    m = m + (1 - cfg.muon_momentum) * (g - m)
    u = g + cfg.muon_momentum * (m - g) if cfg.muon_nesterov else m
    schedule = list(coefficients(cfg.muon_coefficient_type, cfg.muon_num_ns_steps))
    rows, cols = u.shape
    if split:
        groups = u.reshape(rows // sum(split), sum(split), cols)
        parts = []
        for part in torch.split(groups, list(split), dim=1):
            mat = part.reshape(-1, cols)
            scale = max(mat.shape) ** 0.5 * cfg.muon_extra_scale_factor
            parts.append((reference(mat, schedule) * scale).reshape(part.shape))
        o = torch.cat(parts, dim=1).reshape(rows, cols)
    else:
        o = reference(u, schedule) * max(rows, cols) ** 0.5 * cfg.muon_extra_scale_factor
    return w - cfg.lr * o, m


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("split", [None, (8, 4, 4)])
def test_two_steps_match_float64_reference(nesterov, split):
    torch.manual_seed(0)
    cfg = config(muon_nesterov=nesterov)
    w = torch.randn(32, 24)
    bias = torch.randn(32)
    main = w.clone()
    info = MatrixInfo(tuple(w.shape), split)
    groups = [
        {"params": [main], "weight_decay": cfg.weight_decay, "use_muon": True},
        {"params": [bias], "weight_decay": 0.0, "use_muon": False},
    ]
    opt = Muon(groups, config=cfg, info_of=lambda t: info)
    adam_bias = bias.clone().requires_grad_(False)
    adam = torch.optim.AdamW([adam_bias], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, foreach=True)
    ref_w, ref_m = w.double(), torch.zeros_like(w, dtype=torch.float64)
    for step in range(2):
        g = torch.randn(32, 24)
        gb = torch.randn(32)
        main.grad, bias.grad, adam_bias.grad = g, gb, gb.clone()
        opt.step()
        adam.step()
        ref_w, ref_m = reference_update(ref_w, ref_m, g.double(), cfg, split)
        err = ((main.double() - ref_w).norm() / ref_w.norm()).item()
        assert err < 1e-5, (step, err)
        assert torch.equal(bias, adam_bias)  # the Adam groups: torch's AdamW, untouched
    assert set(opt.state[main]) == {"momentum_buffer"} and set(opt.state[bias]) == {"step", "exp_avg", "exp_avg_sq"}


def test_state_dict_round_trip_keeps_both_kinds():
    torch.manual_seed(1)
    cfg = config()

    def build():
        w, b = torch.zeros(16, 8), torch.zeros(16)
        groups = [
            {"params": [w], "weight_decay": 0.1, "use_muon": True},
            {"params": [b], "weight_decay": 0.0, "use_muon": False},
        ]
        return Muon(groups, config=cfg, info_of=lambda t: MatrixInfo((16, 8))), w, b

    a, wa, ba = build()
    grads = [(torch.randn(16, 8), torch.randn(16)) for _ in range(3)]
    wa.grad, ba.grad = grads[0]
    a.step()
    b, wb, bb = build()
    wb.copy_(wa), bb.copy_(ba)
    b.load_state_dict(copy.deepcopy(a.state_dict()))  # torch would alias the live tensors
    for g in grads[1:]:
        wa.grad, ba.grad = g
        wb.grad, bb.grad = g[0].clone(), g[1].clone()
        a.step()
        b.step()
    assert torch.equal(wa, wb) and torch.equal(ba, bb)
    assert b.scalar.state is b.state and b.scalar.param_groups[0] is b.param_groups[1]


FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 255 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 --optimizer muon "
    "--muon-extra-scale-factor 0.2 --rerun-mode disabled"
).split()


def trainer_for(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)
    return trainer


def muon_names(trainer):
    muon = {id(p) for g in trainer.optimizer.param_groups if g["use_muon"] for p in g["params"]}
    return {n for n, p in trainer.model.module.named_parameters() if id(p) in muon}


def test_param_split_follows_megatron():
    trainer = trainer_for("--train-iters", 3, "--untie-embeddings-and-output-weights", "--position-embedding-type",
                          "rope", "--num-experts", 2, "--moe-ffn-hidden-size", 16, "--moe-layer-freq", "[0,1]", "--moe-grouped-gemm")  # fmt: skip
    names = {n for n, p in trainer.model.module.named_parameters()}
    muon = muon_names(trainer)
    assert muon, "no Muon parameters"
    for name in names:
        param = dict(trainer.model.module.named_parameters())[name]
        hidden_matrix = (param.ndim == 2 and not name.endswith(".bias")) or (name.endswith("experts.linear_fc1.weight")
                         or name.endswith("experts.linear_fc2.weight"))  # fmt: skip
        embedding_or_output = name in ("embedding.word_embeddings.weight", "output_layer.weight")
        assert (name in muon) == (hidden_matrix and not embedding_or_output), name
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in muon
    assert "decoder.layers.1.mlp.router.weight" in muon
    assert any(".experts." in n and n.endswith("weight") for n in muon)  # stacked [experts, out, in]: per expert
    assert not any(n.endswith(".bias") for n in muon)


def test_tiny_gpt_trains_and_bf16_matches_fp32_closely():
    fp32 = [r["lm loss"] for r in trainer_for("--train-iters", 32).train()]
    assert fp32[-1] < fp32[0] - 0.05
    bf16 = [r["lm loss"] for r in trainer_for("--train-iters", 4, "--bf16").train()]
    assert bf16 == pytest.approx(fp32[:4], rel=1e-2)


def test_flags_are_megatrons_and_mistakes_name_the_flag():
    trainer = trainer_for("--train-iters", 3)
    o = trainer.cfg.optimizer
    assert (o.muon_momentum, o.muon_split_qkv, o.muon_nesterov, o.muon_scale_mode, o.muon_fp32_matmul_prec) == (
        0.9, True, False, "spectral", "medium",
    )  # fmt: skip
    assert (o.muon_coefficient_type, o.muon_num_ns_steps, o.muon_tp_mode, o.muon_extra_scale_factor) == (
        "quintic", 5, "duplicated", 0.2,
    )  # fmt: skip
    with pytest.raises(ValueError, match="--fp16"):
        build_trainer(FLAGS + ["--fp16", "--train-iters", "3"])
    with pytest.raises(ValueError, match="--muon-coefficient-type"):
        build_trainer(FLAGS + ["--muon-coefficient-type", "nope", "--train-iters", "3"])
    with pytest.raises(ValueError, match="--muon-fp32-matmul-prec low"):
        build_trainer(FLAGS + ["--muon-fp32-matmul-prec", "low", "--train-iters", "3"])
    no_split = trainer_for("--train-iters", 3, "--muon-no-split-qkv")
    assert no_split.cfg.optimizer.muon_split_qkv is False
