"""Model flags from Megatron command lines: recompute, layernorm-1p, squared ReLU, QK norm,
interleaved RoPE, attention backends (CPU)."""

import contextlib

import pytest
import torch
from torch.nn.attention import SDPBackend

from megatron.core.models.common.rotary import RotaryEmbedding, apply_rotary_pos_emb_interleaved
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.attention import sdpa_backends
from megatron.core.transformer.norm import build_norm
from megatron.core.transformer.recompute import recomputed_chunks
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from tests.conftest import count_forwards, run_config


def config(**kw):
    base = dict(num_layers=3, hidden_size=32, num_attention_heads=4, seq_length=8, hidden_dropout=0.1)
    base.update(kw)
    return TransformerConfig(**base).finalize()


def block_grads(cfg, x):
    torch.manual_seed(0)
    block = TransformerBlock(cfg, get_gpt_layer_local_spec(), device="cpu")
    torch.manual_seed(1)  # same dropout masks in every run
    out = block(x.clone().requires_grad_(True))
    out.square().mean().backward()
    return out.detach(), {n: p.grad.clone() for n, p in block.named_parameters()}


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
        dict(recompute_granularity="selective"),
    ],
    ids=["full-uniform", "full-block", "selective"],
)
def test_recompute_gives_the_same_outputs_and_gradients(recompute):
    x = torch.randn(8, 2, 32)
    ref_out, ref_grads = block_grads(config(attention_dropout=0.1), x)
    out, grads = block_grads(config(attention_dropout=0.1, **recompute), x)
    assert torch.equal(out, ref_out)  # same kernels on the same inputs, dropout RNG restored
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name


def test_recompute_chunks():
    uniform = config(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2)
    assert recomputed_chunks(uniform, 5) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    block = config(recompute_granularity="full", recompute_method="block", recompute_num_layers=2)
    assert recomputed_chunks(block, 5) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert recomputed_chunks(config(), 3) == [(0, 3, False)]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(recompute_granularity="full"), "--recompute-method"),
        (dict(recompute_granularity="full", recompute_method="uniform"), "--recompute-num-layers"),
        (dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=9), "exceeds"),
        (dict(squared_relu=True, gated_linear_unit=True), "--squared-relu"),
    ],
)
def test_bad_model_flags_name_the_flag(kw, message):
    with pytest.raises(ValueError, match=message):
        config(**kw).validate()


def test_recompute_method_without_granularity_is_ignored_as_upstream():
    cfg = config(recompute_method="uniform", recompute_num_layers=1)
    cfg.validate()  # upstream's gpt3_mcore_reruns_resume_check_grads passes them without a granularity
    assert recomputed_chunks(cfg, 3) == [(0, 3, False)]


@pytest.mark.parametrize("normalization", ["LayerNorm", "RMSNorm"])
def test_layernorm_1p_scales_by_one_plus_weight(normalization):
    plain = build_norm(config(normalization=normalization), 16, device="cpu")
    one_p = build_norm(config(normalization=normalization, apply_layernorm_1p=True), 16, device="cpu")
    assert torch.equal(one_p.weight, torch.zeros(16))
    x = torch.randn(4, 16)
    assert torch.equal(one_p(x), plain(x))  # weight 0 here is weight 1 there
    with torch.no_grad():
        one_p.weight.fill_(0.5)
        plain.weight.fill_(1.5)
    torch.testing.assert_close(one_p(x), plain(x), rtol=0, atol=1e-6)


def test_norm_epsilon_and_its_alias():
    from megatron.training.arguments import parse_args

    base = ["--mock-data", "--vocab-size", "64"]
    assert parse_args(base + ["--norm-epsilon", "1e-6"]).model.norm_epsilon == 1e-6
    assert parse_args(base + ["--layernorm-epsilon", "1e-3"]).model.norm_epsilon == 1e-3
    assert build_norm(config(norm_epsilon=1e-3), 8, device="cpu").eps == 1e-3


def test_squared_relu_mlp():
    from megatron.core.transformer.mlp import MLP

    torch.manual_seed(0)
    mlp = MLP(config(squared_relu=True, add_bias_linear=False), device="cpu")
    x = torch.randn(4, 2, 32)
    expected = mlp.linear_fc2(torch.relu(mlp.linear_fc1(x)[0]) ** 2)[0]
    torch.testing.assert_close(mlp(x)[0], expected)


def test_qk_layernorm_normalizes_each_head():
    from megatron.core.transformer.attention import SelfAttention

    attn = SelfAttention(config(qk_layernorm=True, normalization="RMSNorm"), 1, device="cpu")
    names = {n for n, _ in attn.named_parameters()}
    assert {"q_layernorm.weight", "k_layernorm.weight"} <= names
    assert attn.q_layernorm.weight.shape == (8,)  # kv channels
    assert attn(torch.randn(8, 2, 32))[0].shape == (8, 2, 32)


def test_interleaved_rope_rotates_adjacent_pairs():
    rope = RotaryEmbedding(kv_channels=4)
    freqs = rope(3, "cpu")
    t = torch.randn(3, 1, 1, 4)
    out = apply_rotary_pos_emb_interleaved(t, freqs)
    inv = 1.0 / (10000 ** (torch.arange(0, 4, 2).float() / 4))
    for pos in range(3):
        for pair in range(2):
            angle = pos * inv[pair]
            a, b = t[pos, 0, 0, 2 * pair], t[pos, 0, 0, 2 * pair + 1]
            c, s = torch.cos(angle), torch.sin(angle)
            torch.testing.assert_close(out[pos, 0, 0, 2 * pair], a * c - b * s)
            torch.testing.assert_close(out[pos, 0, 0, 2 * pair + 1], b * c + a * s)


def test_attention_backend_mapping():
    assert sdpa_backends("auto", "cuda") is None
    assert sdpa_backends("flash", "cuda") == (SDPBackend.FLASH_ATTENTION,)
    assert sdpa_backends("fused", "cuda") == (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert sdpa_backends("unfused", "cuda") == sdpa_backends("local", "cuda") == (SDPBackend.MATH,)
    assert SDPBackend.MATH in sdpa_backends("fused", "cpu")


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "local"])
def test_attention_backends_agree_on_the_cpu(backend):
    from megatron.core.transformer.attention import SelfAttention

    x = torch.randn(8, 2, 32)
    torch.manual_seed(0)
    ref = SelfAttention(config(attention_dropout=0.0), 1, device="cpu")
    torch.manual_seed(0)
    other = SelfAttention(config(attention_dropout=0.0, attention_backend=backend), 1, device="cpu")
    torch.testing.assert_close(other(x)[0], ref(x)[0], rtol=1e-5, atol=1e-5)  # kernels differ in summation order


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_full_recompute_trains_like_no_recompute_with_fused_wgrad(model, tmp_path):
    """Through the trainer, where the weight gradients go straight into ``main_grad`` (Megatron's
    gradient-accumulation fusion, on by default): recomputation gives the same losses bit for bit,
    and each layer's forward runs again in backward. (Recomputation hands the saved weights back as
    plain tensors; the wgrad must still find the parameter's ``main_grad``.)"""
    from megatron.training.training import build_trainer

    argv = (
        "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
        f"--tokenizer-type NullTokenizer --vocab-size 64 --lr 1e-3 --log-interval 1 --data-cache-path {tmp_path}"
    ).split()
    if model == "moe":
        argv += "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.01".split()
    recompute = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
    losses, calls = [], []
    for extra in ([], recompute):
        trainer = build_trainer(argv + extra)
        count = count_forwards(trainer.model.module.decoder.layers)
        losses.append([r["lm loss"] for r in trainer.train()])
        calls.append(count)
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    assert calls == [[3 * 2] * 2, [2 * 3 * 2] * 2]  # iterations x micro-batches, twice with recompute


@pytest.mark.parametrize(
    "model,modules",
    [
        ("dense", "core_attn mlp layernorm"),
        ("moe", "moe layernorm"),
        ("moe_grouped", "moe_act shared_experts layernorm core_attn"),
    ],
)
def test_selective_recompute_modules_train_like_no_recompute(model, modules, tmp_path):
    """--recompute-modules through the trainer (dropout on, weight gradients into main_grad): the
    same losses, gradient norms and final weights bit for bit as without recompute."""
    from megatron.training.training import pretrain

    argv = (
        "--mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
        "--max-position-embeddings 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 3 "
        f"--tokenizer-type NullTokenizer --vocab-size 64 --lr 1e-3 --log-interval 1 --data-cache-path {tmp_path}"
    ).split()
    if model != "dense":
        argv += "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 --moe-aux-loss-coeff 0.01".split()
    if model == "moe_grouped":
        argv += "--moe-grouped-gemm --moe-shared-expert-intermediate-size 32 --swiglu".split()
    recompute = ["--recompute-granularity", "selective", "--recompute-modules", *modules.split()]
    runs = [pretrain(argv + extra) for extra in ([], recompute)]
    for key in ("lm loss", "grad-norm"):
        values = [[r[key] for r in run.history] for run in runs]
        assert len(values[0]) == 3 and values[0] == values[1], key
    for (name, a), (_, b) in zip(*(run.model.module.named_parameters() for run in runs)):
        assert torch.equal(a, b), name
    recomputed = runs[1].model.module.decoder.layers[0]
    assert recomputed.recompute_layernorm and recomputed.self_attention.recompute_core_attention == (
        "core_attn" in modules
    )


GRAPHS = "--cuda-graph-impl local --cuda-graph-scope"
MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32"
DROP_PAD = "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity"


@pytest.mark.parametrize(
    "extra",
    [
        f"{GRAPHS} --recompute-granularity selective --attention-dropout 0",  # whole layers, core_attn
        f"{GRAPHS} attn mlp --recompute-granularity selective --recompute-modules core_attn mlp layernorm "
        "--attention-dropout 0",
        f"{GRAPHS} attn --recompute-granularity selective --recompute-modules mlp layernorm",
        f"{GRAPHS} mlp --recompute-granularity selective --recompute-modules core_attn mlp layernorm",  # dropout 0.1
        f"{GRAPHS} attn moe_router moe_preprocess --recompute-granularity selective --recompute-modules "
        f"core_attn shared_experts moe_act --attention-dropout 0 {MOE} --moe-grouped-gemm "
        "--moe-shared-expert-intermediate-size 32",
        f"{GRAPHS} attn moe --recompute-granularity selective --recompute-modules moe layernorm "
        f"--attention-dropout 0 {MOE} {DROP_PAD}",
        f"{GRAPHS} attn --recompute-granularity selective --recompute-modules moe layernorm {MOE}",
    ],
)
def test_selective_recompute_is_accepted_with_graphs_where_each_module_is_in_or_out_of_a_region(extra):
    cfg = run_config(extra)
    cfg.validate()
    assert cfg.cuda_graph.enabled and cfg.model.recompute_granularity == "selective"


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            f"{GRAPHS} attn --recompute-granularity full --recompute-method block --recompute-num-layers 1",
            "--recompute-granularity full with --cuda-graph-impl local",
        ),
        (f"{GRAPHS} attn --recompute-granularity selective", "needs --attention-dropout 0"),
        (f"{GRAPHS} --recompute-granularity selective --attention-dropout 0.1", "needs --attention-dropout 0"),
        (
            f"{GRAPHS} attn moe_router --recompute-granularity selective --recompute-modules moe {MOE}",
            "recomputing an MoE layer would replay its router graph",
        ),
        (
            f"{GRAPHS} moe_router moe_preprocess --recompute-granularity selective --recompute-modules layernorm {MOE}",
            "pre-MLP norm runs in the router graph",
        ),
    ],
)
def test_recompute_that_would_cross_a_graph_is_refused_with_the_flags_and_the_fix(extra, needle):
    cfg = run_config(extra)
    with pytest.raises(ValueError, match=needle) as err:
        cfg.validate()
    assert "--recompute-" in str(err.value) and ("Drop" in str(err.value) or "drop" in str(err.value))


def test_output_discarder_keeps_no_output_and_recomputes_it():
    """The linear saves a marker instead of the norm output, which its backward recomputes; the
    norm itself keeps only its input (a checkpoint). Loss and gradients equal the plain run (fp64,
    bitwise)."""
    from megatron.core.transformer.recompute import OutputDiscarder

    torch.manual_seed(0)
    norm = torch.nn.LayerNorm(8, dtype=torch.float64)
    lin = torch.nn.Linear(8, 4, dtype=torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    ref = lin(norm(x)).square().sum()
    ref_grads = torch.autograd.grad(ref, [x, norm.weight, lin.weight])
    calls = []

    def counted(t):
        calls.append(torch.is_grad_enabled())
        return norm(t)

    discarder = OutputDiscarder()
    with discarder.hooks():
        y = lin(discarder.run(counted, x))
    loss = y.square().sum()
    assert calls == [True]
    grads = torch.autograd.grad(loss, [x, norm.weight, lin.weight])
    # Backward: once without autograd for the linear's saved input, once in the norm's checkpoint.
    assert sorted(calls) == [False, True, True]
    assert torch.equal(loss, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))


def test_output_discarder_does_not_mistake_a_freed_outputs_memory_for_it():
    """A loop whose activations are freed after their reader ran (the next one may land in the same
    memory, as the allocator decides): only live outputs are discarded, loss and gradients equal the
    plain loop's (fp64, bitwise)."""
    from megatron.core.transformer.recompute import OutputDiscarder

    torch.manual_seed(0)
    w1, w2 = (torch.randn(6, 6, dtype=torch.float64, requires_grad=True) for _ in range(2))
    xs = [torch.randn(4, 6, dtype=torch.float64) for _ in range(3)]

    def forward(discarder):
        outs = []
        hs = [x @ w1 for x in xs]
        with contextlib.nullcontext() if discarder is None else discarder.hooks():
            for h in hs:
                act = torch.nn.functional.silu(h) if discarder is None else discarder.run(torch.nn.functional.silu, h)
                outs.append(act @ w2)
                del act  # the next activation may land in its memory
        return torch.cat(outs).square().sum()

    ref = forward(None)
    ref_grads = torch.autograd.grad(ref, [w1, w2])
    loss = forward(OutputDiscarder())
    grads = torch.autograd.grad(loss, [w1, w2])
    assert torch.equal(loss, ref) and all(torch.equal(a, b) for a, b in zip(grads, ref_grads))
