"""Hybrid models at TP = 2 train like one process: ``*G-G`` (GDN and GDN2 ``G`` layers) and ``M*M-``.

20 fp32 iterations of ``pretrain_hybrid.py``'s model through the trainer on gloo, at
TP = 2 and TP = 2 with sequence parallelism; loss and gradient-norm curves within 1e-5
relative of one process's (the sums run in another order: partial out-projections
all-reduced over TP, shared norm gradients summed over TP). Mamba and gated delta net
weights are drawn in the one-process layout and each rank keeps its slice of every
section, so every layout trains the same model from iteration 1. Without labels, GPT and hybrid
models at TP = 2 return the logits of the whole vocabulary, as one process does.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed, train_curves
from tests.unit_tests.training.test_parallel_layouts import _assert_close

FLAGS = (
    "--hybrid-layer-pattern *G-G --hidden-size 32 --num-attention-heads 4 --mamba-state-dim 8 --mamba-head-dim 8 "
    "--mamba-num-groups 2 --linear-key-head-dim 8 --linear-value-head-dim 8 --linear-num-key-heads 2 "
    "--linear-num-value-heads 4 --swiglu --position-embedding-type none --normalization RMSNorm "
    "--disable-bias-linear --seq-length 16 --micro-batch-size 2 --global-batch-size 4 --train-iters 20 --lr 3e-3 "
    "--min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type "
    "NullTokenizer --vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1"
)
VARIANTS = {"gdn": "", "gdn2": "--experimental-attention-variant gdn2", "mamba": "--hybrid-layer-pattern M*M-"}
TP2 = {"tp2": "--tensor-model-parallel-size 2", "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel"}


def _argv(extra: str, cache: str) -> list[str]:
    return f"{FLAGS} {extra}".split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("hybrid_tp_cache"))
    single = {v: _argv(flags, cache) for v, flags in VARIANTS.items()}
    tp2 = {f"{v}_{t}": _argv(f"{flags} {tp}", cache) for v, flags in VARIANTS.items() for t, tp in TP2.items()}
    one = run_distributed(train_curves, 1, single, True, timeout=300)[0]
    return one, run_distributed(train_curves, 2, tp2, True, timeout=500)


@pytest.mark.parametrize("layout", list(TP2))
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_hybrid_at_tp2_matches_single_process(runs, variant, layout):
    single, tp2 = runs
    for rank, r in enumerate(tp2):
        _assert_close(r[f"{variant}_{layout}"], single[variant], f"{variant} {layout} (rank {rank})")


def logits_of(rank: int, world_size: int, argvs: dict, hybrid: dict) -> dict:
    """For ``run_distributed``: each command line's freshly built model (``pretrain_hybrid.py``'s where
    ``hybrid[name]``) on two fixed sequences without labels: ``{name: logits [b, s, vocab]}``."""
    import torch

    import pretrain_hybrid
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    out = {}
    for name, argv in argvs.items():
        providers = (pretrain_hybrid.model_provider, pretrain_hybrid.forward_step) if hybrid[name] else ()
        trainer = build_trainer(argv, *providers)
        tokens = torch.arange(32).reshape(2, 16) * 7 % 255
        with torch.no_grad():
            out[name] = trainer.model.module(tokens)
        parallel_state.destroy(trainer.pg)
    return out


def test_logits_without_labels_span_the_whole_vocabulary_at_tp2(tmp_path):
    """Without labels the model returns logits over the whole (padded) vocabulary on every TP rank,
    as one process does: the loss head gathers the output layer's vocabulary shards. GPT and hybrid
    share that head; the hybrid model once returned its rank's shard."""
    shared = [f"--{f.strip()}" for f in FLAGS.split("--")[1:] if not f.startswith(("hybrid", "mamba", "linear"))]
    lines = {"gpt": " ".join(["--num-layers 2", *shared]), "mamba": f"{FLAGS} {VARIANTS['mamba']}"}
    hybrid = {"gpt": False, "mamba": True}

    def argvs(tp: str) -> dict:
        return {name: f"{line} {tp}".split() + ["--data-cache-path", str(tmp_path)] for name, line in lines.items()}

    single = run_distributed(logits_of, 1, argvs(""), hybrid)[0]
    for layout, tp in TP2.items():
        for rank, got in enumerate(run_distributed(logits_of, 2, argvs(tp), hybrid, timeout=300)):
            for name, want in single.items():
                what = f"{name} {layout} (rank {rank})"
                assert got[name].shape == want.shape == (2, 16, 256), f"{what}: logits {tuple(got[name].shape)}"
                assert (got[name] - want).abs().max() <= 1e-5 * want.abs().max(), what
