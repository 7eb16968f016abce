"""``--num-distributed-optimizer-instances 2`` at DP = 4 through the trainer (gloo, 4 processes).

- The loss and gradient-norm curves match one process's within 1e-5 relative (fp32;
  the same tolerance and reason as ``test_parallel_layouts.py``: sums in another order),
  with overlapped gradient reduction and parameter gathers, dense and MoE (EP = 2).
- Each rank optimizes 1 / (DP / N) = 1/2 of the parameter elements; the two ranks of an
  instance cover every element once, and both instances hold the same state.
- Checkpoints saved with N = 2 (torch_dist and torch formats) load with N = 1 (at DP = 4
  with the distributed optimizer, and in one process with and without it): the full
  model and optimizer state after loading equal the saving run's, bitwise, and the
  run goes on along the curve of a run that never stopped (1e-5 relative). In
  torch_dist checkpoints only instance 0 writes optimizer state. Both formats also load
  with N = 2 again (every instance reads instance 0's state).
"""

import pytest

from tests.unit_tests.dist_utils import run_distributed
from tests.unit_tests.training.test_checkpoint_layouts import (
    _assemble,
    _assert_equal_states,
    _snapshot,
)

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 12 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1"
)
MOE = "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall"
N2 = "--use-distributed-optimizer --num-distributed-optimizer-instances 2"
OVERLAP = "--overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 4000"
SAVED_AT = 4
RTOL = 1e-5


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


def _curves(trainer):
    return [(r["lm loss"], r["grad-norm"]) for r in trainer.history]


def _state_sizes(trainer) -> dict:
    """Elements of this rank's model and of what its optimizer holds, dense and expert apart."""
    from megatron.core.distributed.distributed_data_parallel import is_expert_param

    opt, pg = trainer.optimizer, trainer.pg
    params = list(trainer.model.module.parameters())
    return {
        "instance": pg.inter_dp_rank,
        "shard_over": (pg.intra_dp_size, pg.intra_expt_dp_size),
        "param_numel": [sum(p.numel() for p in params if is_expert_param(p) == e) for e in (False, True)],
        "optimized_numel": [sum(b - a for p, a, b in opt.shards if is_expert_param(p) == e) for e in (False, True)],
        "main_numel": sum(p.numel() for p in opt.main_params),
        "adam_numel": sum(
            v.numel() for s in opt.optimizer.state.values() for k, v in s.items() if k in ("exp_avg", "exp_avg_sq")
        ),
    }


def _optimizer_writes(trainer) -> bool:
    """Whether this rank writes any optimizer entry of a torch_dist checkpoint."""
    from megatron.core.pipeline_parallel.schedules import model_chunks
    from megatron.training import sharded_state

    chunks = [getattr(c, "module", c) for c in model_chunks(trainer.model)]
    return any(e.write for e in sharded_state.optimizer_entries(trainer.optimizer, chunks, trainer.pg))


def _four_ranks(rank, world_size, argvs):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer, pretrain

    out = {}
    for name in ("dense", "moe"):
        trainer = pretrain(argvs[name])
        out[name] = (_curves(trainer), _state_sizes(trainer))
    for fmt in ("torch_dist", "torch"):
        saver = pretrain(argvs[f"save_{fmt}"])  # trains SAVED_AT iterations, saves, exits
        out[f"saved_{fmt}"] = (_snapshot(saver), _optimizer_writes(saver))
    for name in ("n1", "n2_torch_dist", "n2_torch"):  # N = 1 at DP = 4, and N = 2 again, read N = 2's
        loader = build_trainer(argvs[f"load_{name}"])
        out[f"loaded_{name}"] = _snapshot(loader)
        loader.history = loader.train()
        parallel_state.destroy(loader.pg)
        out[f"rest_{name}"] = [r["lm loss"] for r in loader.history]
    return out


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


@pytest.fixture(scope="module")
def runs(cache, tmp_path_factory):
    folder = tmp_path_factory.mktemp("ckpt")
    save = f"--exit-interval {SAVED_AT} --save-interval {SAVED_AT}"
    argvs = {
        "dense": _argv(f"{N2} {OVERLAP}", cache),
        "moe": _argv(f"{N2} {OVERLAP} {MOE} --expert-model-parallel-size 2", cache),
        "save_torch_dist": _argv(f"{N2} {save} --save {folder / 'torch_dist'}", cache),
        "save_torch": _argv(f"{N2} {save} --ckpt-format torch --save {folder / 'torch'}", cache),
        "load_n1": _argv(f"--use-distributed-optimizer --load {folder / 'torch_dist'}", cache),
        "load_n2_torch_dist": _argv(f"{N2} --load {folder / 'torch_dist'}", cache),
        "load_n2_torch": _argv(f"{N2} --ckpt-format torch --load {folder / 'torch'}", cache),
    }
    results = run_distributed(_four_ranks, 4, argvs, timeout=600)
    return results, folder


@pytest.fixture(scope="module")
def single(cache):
    from megatron.training.training import pretrain

    return {"dense": _curves(pretrain(_argv("", cache))), "moe": _curves(pretrain(_argv(MOE, cache)))}


def _assert_close(got, want, what):
    assert len(got) == len(want) > 0, what
    for i, (a, b) in enumerate(zip(got, want)):
        for x, y, kind in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,), "ln"):
            assert abs(x - y) <= RTOL * abs(y), f"{what}, iteration {i + 1} ({kind}): {x} vs {y}"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_two_instances_match_single_process(runs, single, name):
    results, _ = runs
    for rank, r in enumerate(results):
        _assert_close(r[name][0], single[name], f"DP=4, N=2 {name} (rank {rank})")
    assert single[name][-1][0] < single[name][0][0] - 0.1, "the loss should clearly decrease"


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_each_rank_holds_one_instance_share_of_the_state(runs, name):
    """Dense state: 1 / (DP / N) = 1/2 per rank. Expert state with EP = 2: expert-DP is 2,
    so 1 / (expert-DP / N) = all of this rank's experts."""
    results, _ = runs
    sizes = [r[name][1] for r in results]
    assert [s["instance"] for s in sizes] == [0, 0, 1, 1]  # instances of consecutive ranks
    assert all(s["shard_over"] == ((2, 1) if name == "moe" else (2, 2)) for s in sizes)
    for s in sizes:
        assert s["main_numel"] == sum(s["optimized_numel"])
        assert s["adam_numel"] == 2 * s["main_numel"]
        for kind, share in zip((0, 1), s["shard_over"]):
            # Padding: every bucket is rounded up to a multiple of 64 x the shard count.
            assert abs(s["optimized_numel"][kind] - s["param_numel"][kind] / share) <= 64 * 8, (kind, s)
    for instance in (0, 1):  # each instance's ranks cover their model's dense elements once
        mine = [s for s in sizes if s["instance"] == instance]
        assert sum(s["optimized_numel"][0] for s in mine) == mine[0]["param_numel"][0]


def test_only_instance_zero_writes_optimizer_state(runs):
    results, _ = runs
    assert [r["saved_torch_dist"][1] for r in results] == [True, True, False, False]


def _load_in_one_process(argv):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    loader = build_trainer(argv)
    snap = _snapshot(loader)
    loader.history = loader.train()
    parallel_state.destroy(loader.pg)
    return snap, [r["lm loss"] for r in loader.history]


@pytest.mark.parametrize("fmt", ["torch_dist", "torch"])
@pytest.mark.parametrize("distopt", [True, False])
def test_checkpoint_of_two_instances_loads_in_one_process(runs, single, cache, fmt, distopt):
    results, folder = runs
    saved = _assemble([r[f"saved_{fmt}"][0] for r in results])
    flags = ("--use-distributed-optimizer " if distopt else "") + f"--ckpt-format {fmt} --load {folder / fmt}"
    snap, rest = _load_in_one_process(_argv(flags, cache))
    _assert_equal_states(_assemble([snap]), saved, f"{fmt}: N=2 at DP=4 -> DP=1, distributed optimizer {distopt}")
    _assert_close(rest, [loss for loss, _ in single["dense"][SAVED_AT:]], f"{fmt} resumed at DP=1")


@pytest.mark.parametrize("name, fmt", [("n1", "torch_dist"), ("n2_torch_dist", "torch_dist"), ("n2_torch", "torch")])
def test_checkpoint_of_two_instances_loads_at_dp4(runs, single, name, fmt):
    """With one instance (the whole state sharded over DP = 4) and with two again."""
    results, _ = runs
    saved = _assemble([r[f"saved_{fmt}"][0] for r in results])
    _assert_equal_states(_assemble([r[f"loaded_{name}"] for r in results]), saved, f"{fmt}: N=2 -> {name} at DP=4")
    for rank, r in enumerate(results):
        want = [loss for loss, _ in single["dense"][SAVED_AT:]]
        _assert_close(r[f"rest_{name}"], want, f"{name} resumed (rank {rank})")
