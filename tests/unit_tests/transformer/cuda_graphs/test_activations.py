"""The analytic activation formulas against the bytes autograd really saves, on the CPU.

Each region method of a small model runs under ``saved_tensors_hooks``; the bytes of the
distinct storages it saves (parameters left out) must equal the formula for the CPU's
kernels, exactly where every saved tensor is a shape product the formula names, and
within a stated tolerance for Mamba's scan (its formula counts the fp32 intermediates
by kind, not one by one).
"""

import weakref

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.transformer.cuda_graphs.activations import Kernels, Shapes, region_activation_bytes
from megatron.training.training import build_trainer


@pytest.fixture(autouse=True)
def default_algorithms():
    """The formulas model the default kernels; a run with --deterministic-mode earlier in the
    process leaves torch's deterministic algorithms on (a process-wide setting), and those
    save other tensors (e.g. for index_add)."""
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(False)
    yield
    torch.use_deterministic_algorithms(before)


BASE = (
    "--num-layers 1 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 "
    "--micro-batch-size 2 --global-batch-size 2 --tokenizer-type NullTokenizer --vocab-size 64 --mock-data "
    "--lr 1e-3 --num-workers 0 --train-iters 1 --attention-dropout 0 --hidden-dropout 0"
)


def _held_by_functions(outputs) -> list[torch.Tensor]:
    """Tensors custom autograd Functions hold for their backward outside
    ``save_for_backward`` (``ctx.saved``, e.g. the MoE expert loop, which frees each one
    after its last use in backward): saved-tensor hooks never see them, yet the graph
    keeps them alive like saved tensors."""
    leaves = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    stack = [t.grad_fn for t in leaves if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, held = set(), []
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        held += [t for t in (getattr(node, "saved", None) or ()) if isinstance(t, torch.Tensor)]
        stack += [fn for fn, _ in node.next_functions]
    return held


def saved_bytes(model, fn, *args) -> int:
    """Bytes of the distinct storages the graph of ``fn`` still holds once it returns.

    A tensor saved by a node that is dropped before ``fn`` returns (a discarded branch)
    is freed, and its address may be reused by a later one; only the saved tensors still
    alive at the end are counted, so the sum does not depend on the allocator."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = []

    def pack(t):
        saved.append(weakref.ref(t))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        outputs = fn(*args)
    live = [ref() for ref in saved] + _held_by_functions(outputs)
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in live if t is not None}
    return sum(n for ptr, n in storages.items() if ptr not in params)


def build(flags, hybrid=False):
    kwargs = {}
    if hybrid:
        import pretrain_hybrid

        kwargs = dict(model_provider=pretrain_hybrid.model_provider)
    trainer = build_trainer(f"{BASE} {flags}".split(), **kwargs)
    trainer.model.module.train()
    return trainer


def measure(trainer, kinds):
    """{kind: saved bytes} of the first layer offering each region kind, and the head."""
    model = trainer.model.module
    cfg = trainer.cfg
    s, b, h = cfg.model.seq_length, cfg.training.micro_batch_size, cfg.model.hidden_size
    torch.manual_seed(0)
    x = torch.randn(s, b, h, dtype=cfg.model.params_dtype, requires_grad=True)
    rope = model.rotary_pos_emb(s, x.device) if getattr(model, "rotary_pos_emb", None) is not None else None
    methods = {
        "attn": ("_forward_attention", (x, rope)),
        "mlp": ("_forward_mlp", (x,)),
        "layer": ("forward", (x, rope)),
        "moe": ("_forward_moe", (x,)),
        "moe_router": ("_forward_moe_router", (x,)),
        "mamba": ("_forward_mamba", (x,)),
    }
    out = {}
    for kind in kinds:
        if kind == "postprocess":
            labels = torch.randint(0, 64, (b, s))
            out[kind] = saved_bytes(model, model._postprocess, x, labels)
            continue
        if kind == "moe_preprocess":  # its inputs are the router region's outputs
            layer = model.decoder.layers[0]
            ln_out, probs, routing_map = layer._forward_moe_router(x)[:3]
            out[kind] = saved_bytes(model, layer._forward_moe_preprocess, ln_out, probs, routing_map)
            continue
        method, args = methods[kind]
        for layer in model.decoder.layers:
            regions = getattr(type(layer), "graph_regions", None)
            names = {spec.name for spec in regions.specs} | ({"layer"} if regions.whole else set())
            if kind in names:
                out[kind] = saved_bytes(model, getattr(layer, method), *args)
                break
    return out


def formulas(trainer, kinds):
    shapes = Shapes.from_config(trainer.cfg)
    kernels = Kernels.probe("cpu", cross_entropy_fusion=trainer.cfg.model.cross_entropy_loss_fusion)
    return {kind: region_activation_bytes(kind, shapes, kernels) for kind in kinds}


DENSE = ("attn", "mlp", "layer", "postprocess")
CASES = {
    "gpt-fp32": ("", DENSE),
    "gpt-bf16-rope-swiglu-rmsnorm-gqa": (
        "--bf16 --position-embedding-type rope --swiglu --normalization RMSNorm --group-query-attention "
        "--num-query-groups 2 --disable-bias-linear",
        DENSE,
    ),
    "gpt-bf16-rope-mha-squared-relu-dropout": (
        "--bf16 --position-embedding-type rope --squared-relu --hidden-dropout 0.1",
        ("attn", "mlp"),
    ),
    "moe-drop-and-pad": (
        "--bf16 --num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1 "
        "--moe-pad-expert-input-to-capacity --swiglu --disable-bias-linear --ffn-hidden-size 128",
        ("attn", "moe_router", "moe"),
    ),
    "moe-alltoall-drop-and-pad": (
        "--bf16 --num-experts 4 --moe-router-topk 2 --moe-expert-capacity-factor 1 "
        "--moe-pad-expert-input-to-capacity --moe-token-dispatcher-type alltoall --ffn-hidden-size 128",
        ("moe_router", "moe_preprocess", "moe"),
    ),
    "moe-alltoall-dropless-swiglu": (
        "--bf16 --num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --swiglu "
        "--disable-bias-linear --ffn-hidden-size 128",
        ("moe_router", "moe_preprocess", "moe"),
    ),
    "moe-dropless-gelu": ("--bf16 --num-experts 4 --moe-router-topk 2 --ffn-hidden-size 128", ("moe_router", "moe")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_formula_equals_saved_bytes(case):
    flags, kinds = CASES[case]
    trainer = build(flags)
    try:
        measured, expected = measure(trainer, kinds), formulas(trainer, kinds)
    finally:
        parallel_state.destroy(trainer.pg)
    assert measured.keys() == set(kinds)
    assert expected == measured


@pytest.mark.parametrize("seq", [32, 320])
def test_mamba_formula_within_tolerance(seq):
    # seq 320 with the mixer's chunk of 128: three chunks, the last one padded.
    flags = (
        f"--bf16 --hybrid-layer-pattern M*- --seq-length {seq} --max-position-embeddings {seq} "
        "--mamba-state-dim 16 --mamba-head-dim 16 --mamba-num-groups 2"
    )
    trainer = build(flags, hybrid=True)
    try:
        measured, expected = measure(trainer, ["mamba", "attn", "mlp"]), formulas(trainer, ["mamba", "attn", "mlp"])
    finally:
        parallel_state.destroy(trainer.pg)
    assert expected["attn"] == measured["attn"] and expected["mlp"] == measured["mlp"]
    assert expected["mamba"] == measured["mamba"], (expected, measured)


def test_kernels_probe_on_cpu():
    k = Kernels.probe("cpu")
    assert k == Kernels(
        norm_stats_fp32=False,
        fused_rms_norm=False,
        sdpa_context_copy=False,
        fused_cross_entropy=False,
        dropout_mask_bytes=2,
    )


def test_unknown_kind_is_a_clear_error():
    shapes = Shapes(seq=4, micro_batch=1, hidden=8, heads=2, groups=2, kv_channels=4, ffn=16, vocab=8, element_bytes=2)
    with pytest.raises(ValueError, match="no activation formula for region kind 'fc3'"):
        region_activation_bytes("fc3", shapes, Kernels())
