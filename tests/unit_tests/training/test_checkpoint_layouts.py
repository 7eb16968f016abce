"""Checkpoints across parallel layouts and with the distributed optimizer.

torch_dist: a checkpoint saved at TP=2 x DP=2 with the distributed optimizer (4 gloo
processes) loads at TP=1 x DP=1 and one saved at TP=1 loads at TP=2 x DP=2: the full
weights and the optimizer state (exp_avg, exp_avg_sq, step, fp32 main params) after
loading equal the saving run's bitwise (they are copies), and training goes on with the
losses of a run that never stopped, within 1e-5 relative (fp32: other layouts sum in
another order, see test_parallel_layouts.py). The full tensors are assembled here from
each rank's local tensors with ``full_from_shards``, independently of the chunk code.

torch (legacy): the distributed optimizer's state is gathered per model-parallel rank
into the non-distributed layout, so a DP=2 checkpoint resumes at DP=2 bitwise and loads
at DP=1 without the flag.
"""

import pytest
import torch

from megatron.core.tensor_parallel.layers import full_from_shards
from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 8 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 --swiglu"
)
TP2_DP2 = "--tensor-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 3000"
RTOL = 1e-5


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


def _losses(trainer):
    return [r["lm loss"] for r in trainer.history]


def _snapshot(trainer) -> dict:
    """This rank's local model and optimizer tensors, with what it takes to assemble them."""
    model = trainer.model.module
    names = {id(p): n for n, p in model.named_parameters()}
    tensors = {}
    for name, p in model.state_dict(keep_vars=True).items():
        split = bool(getattr(p, "tensor_model_parallel", False)) and trainer.pg.tp_size > 1
        tensors[name] = (p.detach().clone(), split, getattr(p, "partition_dim", 0), getattr(p, "partition_stride", 1))
    pieces = []
    for piece in trainer.optimizer.state_pieces():
        state = {k: v.detach().clone() for k, v in piece.state.items()}
        state["main"] = piece.main.detach().clone()
        pieces.append((names[id(piece.param)], piece.start, piece.end, state))
    return {"tp_rank": trainer.pg.tp_rank, "dp_rank": trainer.pg.dp_rank, "model": tensors, "pieces": pieces}


def _assemble(snaps: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's snapshot: TP shards by stride, DP pieces by flat range."""
    by_tp = {}
    for s in snaps:
        by_tp.setdefault(s["tp_rank"], []).append(s)
    out = {}
    for name, (_, split, dim, stride) in by_tp[0][0]["model"].items():
        shards = [by_tp[r][0]["model"][name][0] for r in sorted(by_tp)]
        out["model." + name] = full_from_shards(shards, dim, stride) if split else shards[0]
        for what in ("exp_avg", "exp_avg_sq", "main"):
            locals_ = []
            for r, shard in zip(sorted(by_tp), shards):
                local = torch.full((shard.numel(),), float("nan"))
                for s in by_tp[r]:
                    for n, start, end, state in s["pieces"]:
                        if n == name:
                            local[start:end] = state[what].reshape(-1).float()
                locals_.append(local.view(shard.shape))
            out[f"{what}.{name}"] = full_from_shards(locals_, dim, stride) if split else locals_[0]
        steps = {float(state["step"]) for s in snaps for n, _, _, state in s["pieces"] if n == name}
        out[f"step.{name}"] = torch.tensor(sorted(steps))
    return out


def _assert_equal_states(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for key in want:
        assert not torch.isnan(want[key]).any(), f"{what}: {key} not fully covered by the saving ranks"
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs"


def _assert_close(got, want, what):
    assert len(got) == len(want) > 0, what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"{what}, loss {i}: {a} vs {b}"


def _four_ranks(rank, world_size, argv_save, argv_load):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer, pretrain

    saver = pretrain(argv_save)  # trains 4 iterations, saves, exits
    loader = build_trainer(argv_load)
    loaded = _snapshot(loader)
    loader.history = loader.train()
    parallel_state.destroy(loader.pg)
    return _snapshot(saver), _losses(saver), loaded, _losses(loader)


def map_results(fn, world_size, *args):
    return run_distributed(fn, world_size, *args, timeout=400)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


def _read_full(folder: str) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint at its full shape, read by DCP's own planner,
    under ``_assemble``'s names (fp32: the main params are the weights)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(folder).read_metadata().state_dict_metadata
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.items()}
    dcp.load(state, checkpoint_id=folder, no_dist=True)
    out = {}
    for key, value in state.items():
        if key.startswith("model."):
            out[key] = value
            out["main." + key[len("model.") :]] = value
        else:
            what, name = key[len("optimizer.state.") :].split(".", 1)
            out[f"{what}.{name}"] = value.reshape(1) if what == "step" else value
    return out


def test_torch_dist_checkpoint_moves_between_tp2_dp2_distributed_optimizer_and_one_process(tmp_path, cache):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer, pretrain

    tp1_dir, tp2_dir = tmp_path / "tp1", tmp_path / "tp2"
    # TP=1 without the distributed optimizer, never stopped; its save at iteration 4 is loaded below.
    never_stopped = _losses(pretrain(_argv(f"--save-interval 4 --save {tp1_dir}", cache)))
    (tp1_dir / "latest_checkpointed_iteration.txt").write_text("4")
    tp2_saved, tp2_first, tp2_loaded, tp2_rest = zip(
        *map_results(
            _four_ranks,
            4,
            _argv(f"{TP2_DP2} --exit-interval 4 --save-interval 4 --save {tp2_dir}", cache),
            _argv(f"{TP2_DP2} --load {tp1_dir}", cache),
        )
    )
    # TP=1 -> TP=2 x DP=2: the loaded shards assemble to the TP=1 checkpoint's full tensors.
    _assert_equal_states(_assemble(list(tp2_loaded)), _read_full(str(tp1_dir / "iter_0000004")), "TP=1 -> TP=2x DP=2")
    for losses in tp2_rest:
        _assert_close(losses, never_stopped[4:], "TP=2 x DP=2 after loading the TP=1 checkpoint")
    for losses in tp2_first:
        _assert_close(losses, never_stopped[:4], "TP=2 x DP=2 before its save")
    # TP=2 x DP=2 -> TP=1, here with the distributed optimizer (at DP=1).
    loader = build_trainer(_argv(f"--use-distributed-optimizer --load {tp2_dir}", cache))
    _assert_equal_states(_assemble([_snapshot(loader)]), _assemble(list(tp2_saved)), "TP=2 x DP=2 -> TP=1")
    loader.history = loader.train()
    parallel_state.destroy(loader.pg)
    _assert_close(_losses(loader), never_stopped[4:], "TP=1 after loading the TP=2 x DP=2 checkpoint")


def _dp2_legacy(rank, world_size, argv_full, argv_first, argv_second):
    from megatron.training.training import pretrain

    full, first, second = pretrain(argv_full), pretrain(argv_first), pretrain(argv_second)
    return _losses(full), _losses(first), _losses(second), _snapshot(first)


def test_torch_format_distributed_optimizer_resumes_and_loads_without_the_flag(tmp_path, cache):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    first_dir, second_dir = str(tmp_path / "first"), str(tmp_path / "second")
    dp2 = "--ckpt-format torch --use-distributed-optimizer --bf16 --ddp-bucket-size 3000 --global-batch-size 8"
    results = map_results(
        _dp2_legacy,
        2,
        _argv(dp2, cache),
        _argv(f"{dp2} --save {first_dir} --save-interval 4 --exit-interval 4", cache),
        _argv(f"{dp2} --load {first_dir} --save {second_dir}", cache),
    )
    for full, first, second, _ in results:
        assert first + second == full  # bitwise: the same layout resumes exactly
    # DP=1 without --use-distributed-optimizer reads the state gathered at DP=2.
    loader = build_trainer(_argv(f"--ckpt-format torch --bf16 --global-batch-size 8 --load {first_dir}", cache))
    parallel_state.destroy(loader.pg)
    saved = _assemble([r[3] for r in results])
    _assert_equal_states(_assemble([_snapshot(loader)]), saved, "DP=2 distributed optimizer -> DP=1")
    assert all(v.dtype == torch.bfloat16 for k, v in saved.items() if k.startswith("model."))
