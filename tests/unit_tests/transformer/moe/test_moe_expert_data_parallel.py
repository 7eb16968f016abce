"""Expert grads in their own expert-DP buffer: EP = 2 x expert-DP = 2 trains like EP = 1.

A small MoE GPT (fp32, dropout 0, 20 iterations) goes through ``build_trainer`` on 4
gloo CPU processes with ``--expert-model-parallel-size 2`` (DP = 4, expert-DP = 2) and,
with ``--expert-model-parallel-size 4``, expert-DP = 1 (expert grads are only scaled);
its loss and gradient-norm curves must match one process (EP = 1) within 1e-5
relative. Variants: plain, ``--overlap-grad-reduce`` with small buckets and gradient
accumulation (2 micro-batches per rank), and the distributed optimizer. They cannot
match bitwise: the expert gradients are summed over ranks instead of micro-batches.
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --train-iters 20 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine --lr-warmup-iters 2 "
    "--seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 63 --hidden-dropout 0.0 "
    "--attention-dropout 0.0 --num-workers 0 --log-interval 1 --use-cpu --swiglu --disable-bias-linear "
    "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 "
    "--moe-ffn-hidden-size 24"
)
ITERS = 20
RTOL = 1e-5
LAYOUTS = {  # name: (flags, global batch size)
    "ep2": ("--expert-model-parallel-size 2", 8),
    "ep2_overlap_accumulate": ("--expert-model-parallel-size 2 --overlap-grad-reduce --ddp-bucket-size 300", 16),
    "ep2_distopt": (
        "--expert-model-parallel-size 2 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
        8,
    ),
    "ep4_allgather": ("--expert-model-parallel-size 4 --moe-token-dispatcher-type allgather", 8),
}


def _run(argv):
    from megatron.core import parallel_state
    from megatron.core.distributed.distributed_data_parallel import is_expert_param
    from megatron.training.training import build_trainer

    trainer = build_trainer(argv)
    trainer.history = trainer.train()
    pg = trainer.pg
    ddp = trainer.model
    info = {
        "curves": [(r["lm loss"], r["grad-norm"]) for r in trainer.history],
        "ep": pg.ep_size,
        "expt_dp": pg.expt_dp_size,
        "dp": pg.dp_size,
        "dense_expert_params": sum(is_expert_param(p) for p in ddp.grad_buffer.params),
        "expert_buffer_params": None
        if ddp.expert_grad_buffer is None
        else [is_expert_param(p) for p in ddp.expert_grad_buffer.params],
        "expert_buckets": 0 if ddp.expert_grad_buffer is None else len(ddp.expert_grad_buffer.buckets),
    }
    parallel_state.destroy(pg)
    return info


def _rank_runs(rank, world_size, argvs):
    return {name: _run(argv) for name, argv in argvs.items()}


def _argv(extra: str, gbs: int, cache: str) -> list[str]:
    return (FLAGS + f" --global-batch-size {gbs} " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cache = str(tmp_path_factory.mktemp("index_cache"))
    singles = {f"single_{g}": _argv("", g, cache) for g in sorted({g for _, g in LAYOUTS.values()})}
    single = run_distributed(_rank_runs, 1, singles, timeout=400)[0]
    argvs = {name: _argv(flags, gbs, cache) for name, (flags, gbs) in LAYOUTS.items()}
    return single, run_distributed(_rank_runs, 4, argvs, timeout=600)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_parallel_x_data_parallel_trains_like_one_process(runs, name):
    single, ranks = runs
    want = single[f"single_{LAYOUTS[name][1]}"]["curves"]
    assert len(want) == ITERS and want[-1][0] < want[0][0] - 0.1, "the loss should clearly decrease"
    for rank, by_name in enumerate(ranks):
        got = by_name[name]["curves"]
        assert len(got) == ITERS
        for i, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, want)):
            where = f"{name}, rank {rank}, iteration {i + 1}"
            assert abs(loss - ref_loss) <= RTOL * abs(ref_loss), f"{where}: loss {loss} vs {ref_loss}"
            assert abs(norm - ref_norm) <= RTOL * abs(ref_norm), f"{where}: grad norm {norm} vs {ref_norm}"


def test_expert_grads_live_in_their_own_buffer(runs):
    single, ranks = runs
    one = single["single_8"]
    assert one["dense_expert_params"] == 0 and all(one["expert_buffer_params"])
    for by_name in ranks:
        ep2, ep4 = by_name["ep2"], by_name["ep4_allgather"]
        assert (ep2["ep"], ep2["expt_dp"], ep2["dp"]) == (2, 2, 4)
        assert (ep4["ep"], ep4["expt_dp"], ep4["dp"]) == (4, 1, 4)
        for info in by_name.values():
            assert info["dense_expert_params"] == 0
            assert info["expert_buffer_params"] and all(info["expert_buffer_params"])
        assert by_name["ep2_overlap_accumulate"]["expert_buckets"] > 1  # small buckets: launched one by one
