"""Pipeline layouts follow the single-process run: PP, interleaved PP, uneven PP, TP x PP (x DP),
and PP x DP in Megatron's tp-pp-dp rank order (``--use-tp-pp-dp-mapping``).

The embedding/loss-accounted split and ``--pipeline-model-parallel-layout`` strings (with model
chunks that hold no transformer layer) run through the trainer too.

Each layout trains the same small GPT (fp32, dropout 0, 4 layers, 4 micro-batches of 2,
20 iterations) through the trainer on gloo CPU processes; its loss and gradient-norm
curves must match one process's within 1e-5 relative (the same tolerance and the same
reason as ``training/test_parallel_layouts.py``: sums run in another order, e.g. the
gradient norm is a sum of per-stage sums). Initial weights must be equal to the
single process's, element for element, whatever the stage split (layout-free
initialisation), and a run saved per stage at iteration 10 (torch format) resumes onto
the same curve.

Runs of one world size share one set of processes: interpreter start-up is most of a
run's cost on two cores.
"""

import re

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 20 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 "
    "--ckpt-format torch --eval-iters 1"
)
HYBRID = (
    "--hidden-size 32 --num-attention-heads 4 --mamba-state-dim 8 --mamba-head-dim 8 "
    "--mamba-num-groups 2 --position-embedding-type none --normalization RMSNorm --disable-bias-linear "
    "--seq-length 16 --micro-batch-size 2 --global-batch-size 8 --lr 3e-3 --lr-warmup-iters 2 "
    "--lr-decay-style constant --train-iters 12 --mock-data --vocab-size 64 --tokenizer-type NullTokenizer "
    "--num-workers 0 --hidden-dropout 0.0 --attention-dropout 0.0 --log-interval 1 --eval-iters 0 --seed 7"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 --moe-token-dispatcher-type alltoall"
RTOL = 1e-5
PP2 = "--pipeline-model-parallel-size 2"
TWO_RANK = {
    "pp2": PP2,
    "pp2_vpp2": PP2 + " --num-virtual-stages-per-pipeline-rank 2",
    "pp2_vpp2_layers_per_stage": PP2 + " --num-layers-per-virtual-pipeline-stage 1",
    "pp2_uneven": PP2 + " --decoder-first-pipeline-num-layers 1",
    "pp2_untied": PP2 + " --untie-embeddings-and-output-weights",
    # 4 layers + embedding + loss over 2 stages: [2, 2] (the counts themselves: test_layout.py).
    "pp2_account_for_embedding_and_loss": PP2
    + " --account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split",
    # Layout strings: 3 + 1 layers; VPP = 2 with chunks of 1, 1, 2 and 0 layers; and VPP = 3 with
    # chunks of no layers (rank 0: E, nothing, layer 4; rank 1: layers 1-2, layer 3, the loss alone).
    "pp2_layout_uneven": PP2 + " --pipeline-model-parallel-layout Et*3|tL",
    "pp2_vpp2_layout_uneven": PP2 + " --pipeline-model-parallel-layout Et|t|tt|L",
    "pp2_vpp3_layout_empty_stages": PP2 + " --pipeline-model-parallel-layout E|tt||t|t|L",
}


def _global_weights(trainer):
    """This rank's parameters under their PP = 1 names (global layer numbers), as numpy arrays."""
    from megatron.core.pipeline_parallel import layout
    from megatron.core.pipeline_parallel.schedules import model_chunks

    cfg = trainer.cfg
    offsets = layout.chunk_layers(cfg.parallel, cfg.model.num_layers, trainer.pg.pp_rank)
    out = {}
    for chunk, (offset, _) in zip(model_chunks(trainer.model), offsets, strict=True):
        for name, param in getattr(chunk, "module", chunk).named_parameters():
            match = re.match(r"decoder\.layers\.(\d+)\.(.*)", name)
            if match:
                name = f"decoder.layers.{offset + int(match[1])}.{match[2]}"
            out[name] = param.detach().numpy().copy()  # numpy: pickled by value across processes
    return out


def _run(argv, hybrid=False):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    kwargs = {}
    if hybrid:
        import pretrain_hybrid

        kwargs = dict(model_provider=pretrain_hybrid.model_provider, forward_step=pretrain_hybrid.forward_step)
    trainer = build_trainer(argv, **kwargs)
    weights = _global_weights(trainer) if trainer.pg.tp_size == 1 else None
    trainer.history = trainer.train()
    parallel_state.destroy(trainer.pg)
    return {
        "curves": [(r["lm loss"], r["grad-norm"]) for r in trainer.history],
        "aux": [r.get("load_balancing_loss") for r in trainer.history],
        "weights": weights,
        "groups": {name: trainer.pg.ranks[name] for name in ("tp", "pp", "dp")},
    }


def _rank_runs(rank, world_size, argvs):
    return {name: _run(argv, hybrid=name.startswith("hybrid")) for name, argv in argvs.items()}


def _argv(extra: str, cache: str, base: str = FLAGS) -> list[str]:
    return (base + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def single(data_cache):
    argvs = {
        "tied": _argv("", data_cache),
        "untied": _argv("--untie-embeddings-and-output-weights", data_cache),
        "hybrid": _argv("--hybrid-layer-pattern M*M-", data_cache, HYBRID),  # '|' needs PP > 1
        "moe": _argv(MOE, data_cache),
        "masked": _argv("--reset-attention-mask", data_cache),
    }
    return run_distributed(_rank_runs, 1, argvs)[0]


@pytest.fixture(scope="module")
def two_rank_runs(data_cache, tmp_path_factory):
    save = str(tmp_path_factory.mktemp("pp2_checkpoint"))
    argvs = {name: _argv(flags, data_cache) for name, flags in TWO_RANK.items()}
    argvs["pp2_first_half"] = _argv(f"{PP2} --save {save} --save-interval 10 --lr-decay-iters 20", data_cache)
    argvs["pp2_first_half"][argvs["pp2_first_half"].index("--train-iters") + 1] = "10"
    argvs["pp2_resumed"] = _argv(f"{PP2} --load {save}", data_cache)
    argvs["hybrid_pp2"] = _argv(PP2 + " --hybrid-layer-pattern M*|M-", data_cache, HYBRID)
    # No '|': Megatron's (deprecated) auto-split, here uneven.
    argvs["hybrid_pp2_first1"] = _argv(
        PP2 + " --hybrid-layer-pattern M*M- --decoder-first-pipeline-num-layers 1", data_cache, HYBRID
    )
    argvs["moe_pp2"] = _argv(f"{PP2} {MOE}", data_cache)
    argvs["masked_pp2"] = _argv(f"{PP2} --reset-attention-mask", data_cache)
    return run_distributed(_rank_runs, 2, argvs, timeout=400)


def _assert_close(got, want, what):
    assert len(got) == len(want)
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what}, iteration {i + 1}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), f"{what}, iteration {i + 1}: norm {norm} vs {ref_norm}"
    assert want[-1][0] < want[0][0] - 0.1, "the loss should clearly decrease"


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_two_stage_layout_matches_single_process(single, two_rank_runs, name):
    want = single["untied" if "untied" in name else "tied"]
    for rank, runs in enumerate(two_rank_runs):
        _assert_close(runs[name]["curves"], want["curves"], f"{TWO_RANK[name]} (rank {rank})")


@pytest.mark.parametrize("name", list(TWO_RANK))
def test_initial_weights_do_not_depend_on_the_stage_split(single, two_rank_runs, name):
    import numpy as np

    want = single["untied" if "untied" in name else "tied"]["weights"]
    seen = set()
    for rank, runs in enumerate(two_rank_runs):
        for key, value in runs[name]["weights"].items():
            if key == "output_layer.weight" and key not in want:  # the last stage's tied copy
                assert rank == 1 and np.array_equal(value, want["embedding.word_embeddings.weight"])
                continue
            assert np.array_equal(value, want[key]), f"{name}: {key} on rank {rank}"
            seen.add(key)
    assert seen == set(want)  # the stages hold every parameter once


def test_per_stage_checkpoint_resumes_onto_the_same_curve(two_rank_runs):
    for rank, runs in enumerate(two_rank_runs):
        full = runs["pp2"]["curves"]
        _assert_close(runs["pp2_first_half"]["curves"], full[:10], f"first half (rank {rank})")
        resumed = runs["pp2_resumed"]["curves"]
        assert len(resumed) == 10
        for (loss, norm), (ref_loss, ref_norm) in zip(resumed, full[10:]):
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss) and abs(norm - ref_norm) <= RTOL * abs(ref_norm)


@pytest.mark.parametrize("name, first_of_rank_1", [("hybrid_pp2", 2), ("hybrid_pp2_first1", 1)])
def test_hybrid_pattern_stages_match_single_process(single, two_rank_runs, name, first_of_rank_1):
    import numpy as np

    want = single["hybrid"]
    for rank, runs in enumerate(two_rank_runs):
        _assert_close(runs[name]["curves"], want["curves"], f"hybrid {name} (rank {rank})")
    weights = [runs[name]["weights"] for runs in two_rank_runs]
    layers = [{int(k.split(".")[2]) for k in part if k.startswith("decoder.layers.")} for part in weights]
    assert layers == [set(range(first_of_rank_1)), set(range(first_of_rank_1, 4))]
    assert "embedding.word_embeddings.weight" in weights[0]
    for part in weights:
        for key, value in part.items():
            if key in want["weights"]:
                assert np.array_equal(value, want["weights"][key]), key


def test_tp2_pp2_matches_single_process(single, data_cache):
    argv = _argv(f"{PP2} --tensor-model-parallel-size 2 --sequence-parallel", data_cache)
    runs = run_distributed(_rank_runs, 4, {"tp2_pp2": argv}, timeout=400)
    for rank, r in enumerate(runs):
        _assert_close(r["tp2_pp2"]["curves"], single["tied"]["curves"], f"TP=2 x PP=2 (rank {rank})")


def test_tp2_pp2_dp2_distributed_optimizer_matches_single_process(single, data_cache):
    argv = _argv(f"{PP2} --tensor-model-parallel-size 2 --use-distributed-optimizer", data_cache)
    mapped = _argv(f"{PP2} --tensor-model-parallel-size 2 --use-tp-pp-dp-mapping", data_cache)
    runs = run_distributed(_rank_runs, 8, {"tp2_pp2_dp2": argv, "tp_pp_dp": mapped}, timeout=900)
    for rank, r in enumerate(runs):
        _assert_close(r["tp2_pp2_dp2"]["curves"], single["tied"]["curves"], f"TP=2 x PP=2 x DP=2 (rank {rank})")
        _assert_close(r["tp_pp_dp"]["curves"], single["tied"]["curves"], f"tp-pp-dp TP=2 x PP=2 x DP=2 (rank {rank})")
        # Megatron's tp-cp-pp-dp: rank = tp + 2 * (pp + 2 * dp).
        tp, pp, dp = rank % 2, rank // 2 % 2, rank // 4
        assert r["tp_pp_dp"]["groups"] == {
            "tp": [rank - tp, rank - tp + 1],
            "pp": [tp + 4 * dp, tp + 4 * dp + 2],
            "dp": [tp + 2 * pp, tp + 2 * pp + 4],
        }


def test_tp_pp_dp_mapping_pp2_dp2_matches_single_process(single, data_cache):
    """Pipeline stages of a replica on neighbouring ranks: PP groups [0, 1] [2, 3], DP groups [0, 2] [1, 3]
    (the default order has them the other way round); with two distributed-optimizer instances too."""
    argvs = {
        "tp_pp_dp": _argv(f"{PP2} --use-tp-pp-dp-mapping", data_cache),
        "tp_pp_dp_n2": _argv(
            f"{PP2} --use-tp-pp-dp-mapping --use-distributed-optimizer --num-distributed-optimizer-instances 2",
            data_cache,
        ),
    }
    runs = run_distributed(_rank_runs, 4, argvs, timeout=400)
    for rank, r in enumerate(runs):
        for name in argvs:
            _assert_close(r[name]["curves"], single["tied"]["curves"], f"{name} PP=2 x DP=2 (rank {rank})")
            pp, dp = rank % 2, rank // 2
            assert r[name]["groups"] == {"tp": [rank], "pp": [2 * dp, 2 * dp + 1], "dp": [pp, pp + 2]}


def test_moe_stages_match_single_process_with_the_aux_loss_of_every_stage(single, two_rank_runs):
    """MoE layers on both stages: the logged load-balancing loss is the mean over all MoE
    layers, reduced over the stages (Megatron's tracker), not the last stage's own."""
    want = single["moe"]
    assert all(a is not None and a > 0 for a in want["aux"])
    for rank, runs in enumerate(two_rank_runs):
        got = runs["moe_pp2"]
        _assert_close(got["curves"], want["curves"], f"MoE PP=2 (rank {rank})")
        for i, (a, b) in enumerate(zip(got["aux"], want["aux"], strict=True)):
            assert abs(a - b) <= RTOL * abs(b), f"MoE PP=2 rank {rank}, iteration {i + 1}: aux {a} vs {b}"


def test_document_mask_reaches_every_stage(single, two_rank_runs):
    """--reset-attention-mask: each stage's attention reads the batch's document mask."""
    for rank, runs in enumerate(two_rank_runs):
        _assert_close(runs["masked_pp2"]["curves"], single["masked"]["curves"], f"document mask PP=2 (rank {rank})")
