"""``--moe-token-dispatcher-type flex``: Megatron's flags and refusals, and the run is the alltoall run.

Here flex runs the all-to-all dispatcher (``token_dispatcher.build_token_dispatcher`` says why it
is the same computation), so an fp32 run with flex must equal the same run with alltoall bitwise:
loss, gradient norm and every final parameter, at EP = 1 and EP = 2 (gloo). The flag checks follow
upstream's ``TransformerConfig.__post_init__`` and ``MoEFlexTokenDispatcher``.
"""

import pytest

from megatron.training.arguments import parse_args
from megatron.training.logging_utils import startup_lines
from tests.unit_tests.dist_utils import run_distributed

BASE = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 8 --micro-batch-size 1 "
    "--num-experts 4 --mock-data --tokenizer-type NullTokenizer --vocab-size 32"
)
EP2 = "--expert-model-parallel-size 2"


def _cfg(extra: str, world: int = 1, base: str = BASE):
    cfg = parse_args((base + " " + extra).split()).resolve(world_size=world)
    cfg.validate()
    return cfg


@pytest.mark.parametrize(
    "extra, world, backend, kernels",
    [
        (f"--moe-token-dispatcher-type flex {EP2}", 2, "deepep", "DeepEP's"),
        # ETP = TP = 2 at EP = 1
        ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend deepep "
         "--tensor-model-parallel-size 2 --sequence-parallel --disable-bias-linear", 2, "deepep", "DeepEP's"),
        ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep", 1, "hybridep", "HybridEP's"),
        (f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend ncclep {EP2}", 2, "ncclep", "NCCL EP's"),
        (f"--moe-token-dispatcher-type flex --moe-enable-deepep {EP2}", 2, "deepep", "DeepEP's"),
        (f"--moe-token-dispatcher-type flex --moe-enable-deepep --moe-flex-dispatcher-backend ncclep {EP2}", 2,
         "deepep", "DeepEP's"),  # Megatron: --moe-enable-deepep sets the backend to deepep
    ],
)  # fmt: skip
def test_flex_validates_and_says_it_runs_alltoall(extra, world, backend, kernels):
    cfg = _cfg(extra, world)
    assert cfg.moe.moe_token_dispatcher_type == "flex" and cfg.moe.flex_backend == backend
    line = f"> --moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend {backend}): running the alltoall"
    (said,) = [s for s in startup_lines(cfg) if s.startswith(line)]
    assert said.endswith(f"instead of {kernels} kernels")
    assert any("--moe-enable-deepep is deprecated" in s for s in startup_lines(cfg)) == ("enable-deepep" in extra)


def test_flex_kernel_knobs_are_accepted_and_named():
    knobs = (
        "--moe-flex-dispatcher-num-sms 24 --moe-deepep-num-sms 20 --moe-hybridep-num-sms 16 "
        "--moe-permute-fusion-into-hybridep --moe-hybridep-pad-uneven-dispatch-inputs "
        "--moe-hybridep-num-blocks-permute 8 --moe-hybridep-num-blocks-unpermute 8 "
        "--moe-hybridep-num-sms-preprocessing 64 --moe-dispatch-fwd-dtype bf16 --moe-combine-bwd-dtype bf16"
    )
    # Conflicting deprecated SM counts are fine next to --moe-flex-dispatcher-num-sms (it wins in Megatron).
    cfg = _cfg(f"--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep {knobs}")
    assert cfg.moe.moe_flex_dispatcher_num_sms == 24 and cfg.moe.moe_deepep_num_sms == 20
    assert cfg.ignored_flags == [
        "--moe-permute-fusion-into-hybridep",
        "--moe-hybridep-pad-uneven-dispatch-inputs",
        "--moe-hybridep-num-blocks-permute",
        "--moe-hybridep-num-blocks-unpermute",
        "--moe-hybridep-num-sms-preprocessing",
        "--moe-dispatch-fwd-dtype",
        "--moe-combine-bwd-dtype",
    ]
    lines = startup_lines(cfg)
    assert "> --moe-flex-dispatcher-num-sms --moe-deepep-num-sms --moe-hybridep-num-sms: no effect, no flex " \
        "kernels run here" in lines  # fmt: skip
    # One deprecated count alone is accepted; other dispatchers ignore the backend (deepep / hybridep).
    _cfg("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep --moe-deepep-num-sms 20")
    alltoall = _cfg("--moe-token-dispatcher-type alltoall --moe-flex-dispatcher-backend hybridep")
    assert not any("flex" in s for s in startup_lines(alltoall))


@pytest.mark.parametrize(
    "extra, world",
    [
        ("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep "
         "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity", 1),
        (f"--moe-token-dispatcher-type flex {EP2} --moe-expert-capacity-factor 1.0", 2),
        (f"--moe-token-dispatcher-type flex {EP2} --moe-shared-expert-overlap "
         "--moe-shared-expert-intermediate-size 32", 2),
        (f"--moe-token-dispatcher-type flex {EP2} --overlap-moe-expert-parallel-comm --bf16", 2),
        # Megatron builds no flex dispatcher without experts: the layout rule does not apply.
        ("--moe-token-dispatcher-type flex", 1),
    ],
)  # fmt: skip
def test_flex_combinations_megatron_allows(extra, world):
    base = BASE.replace("--num-experts 4 ", "") if extra == "--moe-token-dispatcher-type flex" else BASE
    _cfg(extra, world, base)


FLEX = "--moe-token-dispatcher-type flex"
SIZES = "needs --expert-tensor-parallel-size x --expert-model-parallel-size > 1"


@pytest.mark.parametrize(
    "extra, world, message",
    [
        (FLEX, 1, f"flex with the deepep backend {SIZES}"),
        (f"{FLEX} --moe-enable-deepep", 1, f"flex with the deepep backend {SIZES}"),
        (f"{FLEX} --moe-flex-dispatcher-backend ncclep", 1, f"flex with the ncclep backend {SIZES}"),
        (f"{FLEX} --tensor-model-parallel-size 2 --sequence-parallel --expert-tensor-parallel-size 1", 2,
         f"deepep backend {SIZES}"),
        (f"{FLEX} {EP2} --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity", 2,
         "flex with the deepep backend does not support --moe-pad-expert-input-to-capacity"),
        (f"{FLEX} {EP2} --moe-enable-deepep --moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity",
         2, "flex with the deepep backend does not support --moe-pad-expert-input-to-capacity"),
        (f"{FLEX} {EP2} --moe-flex-dispatcher-backend ncclep --moe-expert-capacity-factor 1.0", 2,
         "ncclep does not support token dropping"),
        (f"{FLEX} {EP2} --moe-flex-dispatcher-backend ncclep --moe-ncclep-zero-copy", 2,
         "--moe-ncclep-zero-copy needs --moe-expert-rank-capacity-factor"),
        ("--moe-token-dispatcher-type alltoall --moe-enable-deepep", 1,
         "--moe-enable-deepep needs --moe-token-dispatcher-type flex"),
        (f"{FLEX} {EP2} --moe-enable-deepep --moe-flex-dispatcher-backend hybridep", 2,
         "--moe-enable-deepep cannot be combined with --moe-flex-dispatcher-backend hybridep"),
        ("--moe-token-dispatcher-type alltoall --moe-flex-dispatcher-backend ncclep", 1,
         "--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex"),
        (f"{FLEX} {EP2} --moe-deepep-num-sms 20 --moe-hybridep-num-sms 16", 2,
         "--moe-deepep-num-sms 20 and --moe-hybridep-num-sms 16 conflict"),
        (f"{FLEX} {EP2} --moe-flex-dispatcher-backend hybridep --moe-expert-rank-capacity-factor 1.2", 2,
         r"--moe-expert-rank-capacity-factor \(a per-rank token budget.*is not supported yet"),
        (f"{FLEX} {EP2} --moe-dispatch-fwd-dtype mxfp8", 2, "--moe-dispatch-fwd-dtype mxfp8 is not supported"),
        (f"{FLEX} {EP2} --moe-combine-bwd-dtype mxfp8", 2, "--moe-combine-bwd-dtype mxfp8 is not supported"),
    ],
)  # fmt: skip
def test_flex_refusals_name_the_flag_and_the_fix(extra, world, message):
    with pytest.raises(ValueError, match=message):
        _cfg(extra, world)


@pytest.mark.parametrize(
    "extra, message",
    [
        ("--moe-enable-deepep", "--moe-enable-deepep needs --moe-token-dispatcher-type flex"),
        ("--moe-flex-dispatcher-backend ncclep", "--moe-flex-dispatcher-backend ncclep needs"),
        ("--moe-deepep-num-sms 20 --moe-hybridep-num-sms 16", "conflict"),
    ],
)
def test_flex_flag_checks_hold_without_experts(extra, message):
    # Megatron runs these in TransformerConfig.__post_init__, MoE or not.
    with pytest.raises(ValueError, match=message):
        _cfg(extra, 1, BASE.replace("--num-experts 4 ", ""))


# ---------------------------------------------------------------- training: flex == alltoall, bitwise
TRAIN = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 3 --lr 3e-3 --lr-decay-style constant --seed 1234 "
    "--mock-data --tokenizer-type NullTokenizer --vocab-size 64 --hidden-dropout 0.0 --attention-dropout 0.0 "
    "--num-workers 0 --log-interval 1 --swiglu --disable-bias-linear --num-experts 4 --moe-router-topk 2 "
    "--moe-aux-loss-coeff 0.01 --moe-layer-freq ([0]+[1])"
)


def _train(argv):
    """Trains (fp32); returns the curves, every final parameter and the dispatcher's class name."""
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)
    history = trainer.train()
    layer = trainer.model.module.decoder.layers[1]
    out = {
        "type": trainer.cfg.moe.moe_token_dispatcher_type,
        "dispatcher": type(layer.mlp.token_dispatcher).__name__,
        "curves": [(r["lm loss"], r["grad-norm"]) for r in history],
        "params": {n: p.detach().clone() for n, p in trainer.model.module.named_parameters()},
    }
    parallel_state.destroy(trainer.pg)
    return out


def _rank_runs(rank, world_size, argvs):
    return {name: _train(argv) for name, argv in argvs.items()}


def _pairs(cache, world, cases):
    argvs = {}
    for name, (flex, common) in cases.items():
        for dispatcher in (f"flex {flex}", "alltoall"):
            argv = f"{TRAIN} {common} --moe-token-dispatcher-type {dispatcher}".split() + ["--data-cache-path", cache]
            argvs[(name, dispatcher.split()[0])] = argv
    return run_distributed(_rank_runs, world, argvs, timeout=400)


EP1_CASES = {
    "dropless": ("--moe-flex-dispatcher-backend hybridep", ""),
    "drop_and_pad": (
        "--moe-flex-dispatcher-backend hybridep",
        "--moe-expert-capacity-factor 1.0 --moe-pad-expert-input-to-capacity --moe-grouped-gemm",
    ),
}
EP2_CASES = {
    "dropless": ("", EP2),
    "dropping": ("--moe-flex-dispatcher-backend deepep", f"{EP2} --moe-expert-capacity-factor 1.0"),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("flex_cache"))


def _assert_bitwise(ranks, cases):
    import torch

    for rank, runs in enumerate(ranks):
        for name in cases:
            flex, alltoall = runs[(name, "flex")], runs[(name, "alltoall")]
            assert flex["type"] == "flex" and alltoall["type"] == "alltoall"
            assert flex["dispatcher"] == alltoall["dispatcher"] == "MoEAlltoAllTokenDispatcher"
            assert len(flex["curves"]) == 3 and flex["curves"] == alltoall["curves"], (name, rank)
            assert flex["params"].keys() == alltoall["params"].keys()
            for n, p in flex["params"].items():
                assert torch.equal(p, alltoall["params"][n]), (name, rank, n)
            # Not vacuous: the step changed the weights.
            assert flex["curves"][0] != flex["curves"][-1]


def test_flex_trains_bitwise_like_alltoall_at_ep1(cache):
    _assert_bitwise(_pairs(cache, 1, EP1_CASES), EP1_CASES)


def test_flex_trains_bitwise_like_alltoall_at_ep2(cache):
    _assert_bitwise(_pairs(cache, 2, EP2_CASES), EP2_CASES)
