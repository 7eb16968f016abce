"""TP, TP + SP, DP with the distributed optimizer and TP x DP follow the single-process run.

Each layout trains the same small GPT (fp32, dropout 0, 20 iterations) through
``pretrain(argv)`` on gloo CPU processes; its loss and gradient-norm curves must match
one process's within 1e-5 relative. They cannot match bitwise: the sums run in another
order (partial products all-reduced over TP, the softmax denominator summed over
vocabulary shards, gradients reduced over DP instead of accumulated over
micro-batches). The vocabulary (255 ids + end of document = 256) pads to 256 at TP = 1
and TP = 2 alike, so every layout trains the same model from the same full weights.

The two-rank layouts run one after another in one set of processes (interpreter
start-up is most of a run's cost on two cores); each still gets its own test.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 20 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1"
)
ITERS = 20
RTOL = 1e-5
TWO_RANK_LAYOUTS = {
    "tp2": "--tensor-model-parallel-size 2",
    "tp2_sp": "--tensor-model-parallel-size 2 --sequence-parallel",
    "dp2_distopt_overlap": "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
    "--ddp-bucket-size 4000",
}


def _group_sums(pg):
    """Each group's sum of global ranks: which ranks a group really connects."""
    import torch
    import torch.distributed as dist

    out = {}
    for name in ("tp", "dp", "mp"):
        x = torch.tensor([float(pg.rank)])
        if getattr(pg, name) is not None:
            dist.all_reduce(x, group=getattr(pg, name))
        out[name] = x.item()
    return out


def _run(argv):
    """Trains; returns the curves and what this rank's optimizer holds."""
    import contextlib
    import io

    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        trainer = build_trainer(argv)
    trainer.history = trainer.train()
    groups = _group_sums(trainer.pg)
    parallel_state.destroy(trainer.pg)
    opt = trainer.optimizer
    info = {
        "curves": [(r["lm loss"], r["grad-norm"]) for r in trainer.history],
        "group_sums": groups,
        "param_numel": sum(p.numel() for p in trainer.model.module.parameters()),
        "count_lines": [line for line in printed.getvalue().splitlines() if "number of parameters" in line],
        "buffer_numel": trainer.model.grad_buffer.numel,
        "optimized_numel": sum(p.numel() for p in opt.main_params),
        "adam_state_numel": sum(
            v.numel() for s in opt.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
        ),
    }
    return info


def _rank_runs(rank, world_size, argvs):
    return {name: _run(argv) for name, argv in argvs.items()}


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory):
    """One index cache for every run here: the mock data's indices are built once."""
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def single(data_cache):
    return run_distributed(_rank_runs, 1, {"single": _argv("", data_cache)})[0]["single"]


@pytest.fixture(scope="module")
def two_rank_runs(data_cache):
    argvs = {name: _argv(flags, data_cache) for name, flags in TWO_RANK_LAYOUTS.items()}
    return run_distributed(_rank_runs, 2, argvs, timeout=300)


def _assert_close(got, want, what):
    assert len(got) == len(want) == ITERS
    for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
        assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{what}, iteration {i + 1}: loss {loss} vs {ref_loss}"
        assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), (
            f"{what}, iteration {i + 1}: grad norm {norm} vs {ref_norm}"
        )
    assert want[-1][0] < want[0][0] - 0.1, "the loss should clearly decrease"


@pytest.mark.parametrize("name", list(TWO_RANK_LAYOUTS))
def test_two_rank_layout_matches_single_process(single, two_rank_runs, name):
    for rank, runs in enumerate(two_rank_runs):
        _assert_close(runs[name]["curves"], single["curves"], f"{TWO_RANK_LAYOUTS[name]} (rank {rank})")


def test_tp2_holds_half_of_every_split_weight(single, two_rank_runs):
    # Replicated: norms (2 per layer + final, weight + bias) and the row-parallel biases (2 per layer).
    h, layers = 32, 2
    replicated = (2 * layers + 1) * 2 * h + 2 * layers * h + 16 * h  # + the position table
    for runs in two_rank_runs:
        split = runs["tp2"]["param_numel"] - replicated
        assert split * 2 + replicated == single["param_numel"]


def test_distributed_optimizer_state_is_sharded_over_dp(single, two_rank_runs):
    runs = [r["dp2_distopt_overlap"] for r in two_rank_runs]
    total = single["param_numel"]
    assert single["adam_state_numel"] == 2 * total  # replicated: both moments of every element
    for r in runs:
        assert r["buffer_numel"] % 2 == 0
        # This rank optimizes its half of the (padded) buffer's parameter elements, no more.
        assert total // 2 - 64 * 8 <= r["optimized_numel"] <= r["buffer_numel"] // 2
        assert r["adam_state_numel"] == 2 * r["optimized_numel"]
    assert sum(r["optimized_numel"] for r in runs) == total  # the shards cover every element once


def test_tp2_dp2_distributed_optimizer_matches_single_process(single, data_cache):
    argv = _argv("--tensor-model-parallel-size 2 --use-distributed-optimizer", data_cache)
    runs = run_distributed(_rank_runs, 4, {"tp2_dp2": argv}, timeout=300)
    for rank, r in enumerate(runs):
        _assert_close(r["tp2_dp2"]["curves"], single["curves"], f"TP=2 x DP=2 (rank {rank})")
        # Megatron's grid: TP groups [0, 1] [2, 3], DP groups [0, 2] [1, 3].
        tp_rank = rank % 2
        assert r["tp2_dp2"]["group_sums"] == {
            "tp": 4.0 * (rank // 2) + 1,
            "dp": 2.0 * tp_rank + 2,
            "mp": float(2 * (rank - tp_rank) + 1),
        }
        # Megatron's parameter count line: from DP rank 0 of each model-parallel rank, its own share.
        want = f" > number of parameters on (tensor, pipeline) model parallel rank ({tp_rank}, 0): {r['tp2_dp2']['param_numel']}"
        assert r["tp2_dp2"]["count_lines"] == ([want] if rank < 2 else []), rank
    assert runs[0]["tp2_dp2"]["param_numel"] < single["param_numel"] == int(single["count_lines"][0].split()[-1])


def test_sequence_parallel_at_tp1_warns_and_trains(single, data_cache):
    from megatron.training.training import pretrain

    argv = _argv("--sequence-parallel", data_cache)
    argv[argv.index("--train-iters") + 1] = "3"
    with pytest.warns(UserWarning, match="--sequence-parallel has no effect with --tensor-model-parallel-size 1"):
        trainer = pretrain(argv)
    assert trainer.cfg.parallel.sequence_parallel is False
    losses = [r["lm loss"] for r in trainer.history]
    assert len(losses) == 3 and losses[0] == single["curves"][0][0]  # the same model and data (TP = 1)
