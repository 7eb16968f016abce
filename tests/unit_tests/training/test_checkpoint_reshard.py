"""torch_dist checkpoints across pipeline (and expert) layouts.

A checkpoint is read back as full tensors by DCP's own planner (``_read_full``), so the
comparisons below do not go through the chunk code under test. A run that loads a
checkpoint saves it again at once (before any step): that save must hold exactly the
tensors it loaded, bitwise, whatever the two layouts. PP=1 names are the one-process
model's, so a PP=2 -> PP=1 -> save round trip checks the mapping itself.
"""

import pytest
import torch

from tests.unit_tests.dist_utils import run_distributed

FLAGS = (
    "--num-layers 4 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --lr 3e-3 --min-lr 3e-4 "
    "--lr-decay-style cosine --lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 255 --hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 --swiglu"
)
SAVE_AT = 3
RTOL = 1e-5


def _argv(extra: str, cache: str) -> list[str]:
    return (FLAGS + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("index_cache"))


def _steps(rank, world_size, steps):
    """Runs ``steps`` in order on every rank; returns each one's losses.

    ``("train", argv)``: ``pretrain``. ``("resave", argv, folder)``: build (``--load`` in
    argv), save the loaded state into ``folder`` before any step, then train on.
    """
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer, pretrain

    out = []
    for step in steps:
        if step[0] == "train":
            trainer = pretrain(step[1])
        else:
            trainer = build_trainer(step[1])
            trainer.cfg.checkpoint.save = step[2]
            trainer.save_checkpoint()
            trainer.history = trainer.train()
            trainer.close()
            parallel_state.destroy(trainer.pg)
        out.append([r["lm loss"] for r in trainer.history])
    return out


def _last_rank_losses(results):
    """The losses as the last pipeline stage (the last rank) logs them."""
    return results[-1]


def _read_full(folder) -> dict[str, torch.Tensor]:
    """Every tensor of a torch_dist checkpoint folder at its full shape, checked to be covered once."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    for key, md in metadata.items():
        covered = sum(torch.Size(c.sizes).numel() for c in md.chunks)
        assert covered == torch.Size(md.size).numel(), f"{key}: chunks cover {covered} of {md.size}"
    state = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype) for k, md in metadata.items()}
    dcp.load(state, checkpoint_id=str(folder), no_dist=True)
    return state


def _assert_same_checkpoint(got_folder, want_folder, what: str) -> None:
    got, want = _read_full(got_folder), _read_full(want_folder)
    assert set(got) == set(want), f"{what}: keys differ: {sorted(set(got) ^ set(want))[:6]}"
    for key in want:
        assert torch.equal(got[key], want[key]), f"{what}: {key} differs"


def _assert_close(got, want, what):
    assert len(got) == len(want) > 0, what
    for i, (a, b) in enumerate(zip(got, want)):
        assert abs(a - b) <= RTOL * abs(b), f"{what}, loss {i}: {a} vs {b}"


def _iter(folder, iteration=SAVE_AT):
    return folder / f"iter_{iteration:07d}"


def _interrupted(extra, folder, cache):
    return _argv(f"{extra} --save {folder} --save-interval {SAVE_AT} --exit-interval {SAVE_AT}", cache)


def test_torch_dist_moves_between_pp2_vpp2_and_one_process(tmp_path, cache):
    from megatron.training.training import pretrain

    one, pp2, one_to_pp2, pp2_to_one = (tmp_path / n for n in ("one", "pp2", "one_to_pp2", "pp2_to_one"))
    never_stopped = [r["lm loss"] for r in pretrain(_argv(f"--save {one} --save-interval {SAVE_AT}", cache)).history]
    (one / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    pp2_vpp = "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1"
    pp2_vpp_other_spelling = "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"
    full, first, second, loaded = zip(
        *run_distributed(
            _steps,
            2,
            [
                ("train", _argv(pp2_vpp, cache)),
                ("train", _interrupted(pp2_vpp, pp2, cache)),
                ("train", _argv(f"{pp2_vpp} --load {pp2}", cache)),
                ("resave", _argv(f"{pp2_vpp_other_spelling} --load {one}", cache), str(one_to_pp2)),
            ],
            timeout=300,
        )
    )
    # The same layout resumes bitwise.
    assert first[-1] + second[-1] == full[-1]
    _assert_close(full[-1], never_stopped, "PP=2 x VPP=2 against one process")
    # PP=1 -> PP=2 x VPP=2: what the pipeline loaded is the one-process checkpoint.
    _assert_same_checkpoint(_iter(one_to_pp2), _iter(one), "PP=1 -> PP=2 x VPP=2")
    _assert_close(loaded[-1], never_stopped[SAVE_AT:], "PP=2 x VPP=2 after loading the PP=1 checkpoint")
    # PP=2 x VPP=2 -> PP=1.
    losses = _resave_here(_argv(f"--load {pp2}", cache), pp2_to_one)
    _assert_same_checkpoint(_iter(pp2_to_one), _iter(pp2), "PP=2 x VPP=2 -> PP=1")
    _assert_close(losses, second[-1], "PP=1 after loading the PP=2 checkpoint")


def _resave_here(argv, folder):
    """Loads ``argv``'s ``--load`` in this process, saves it into ``folder`` at once, trains on."""
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    loader = build_trainer(argv)
    loader.cfg.checkpoint.save = str(folder)
    loader.save_checkpoint()
    loader.history = loader.train()
    loader.close()
    parallel_state.destroy(loader.pg)
    return [r["lm loss"] for r in loader.history]


def test_torch_dist_moves_from_tp2_pp2_to_pp2_dp2_distributed_optimizer_and_one_process(tmp_path, cache):
    tp2_pp2, pp2_dp2, one = (tmp_path / n for n in ("tp2_pp2", "pp2_dp2", "one"))
    pp2_dp2_flags = "--pipeline-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 3000"
    _, dp_losses = zip(
        *run_distributed(
            _steps,
            4,
            [
                (
                    "train",
                    _interrupted("--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2", tp2_pp2, cache),
                ),
                ("resave", _argv(f"{pp2_dp2_flags} --load {tp2_pp2}", cache), str(pp2_dp2)),
            ],
            timeout=300,
        )
    )
    # TP=2 x PP=2 -> PP=2 x DP=2 with the optimizer state sharded over DP.
    _assert_same_checkpoint(_iter(pp2_dp2), _iter(tp2_pp2), "TP=2 x PP=2 -> PP=2 x DP=2 distributed optimizer")
    # -> one process (from the save made right after loading, not the one at the end).
    (pp2_dp2 / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    losses = _resave_here(_argv(f"--load {pp2_dp2}", cache), one)
    _assert_same_checkpoint(_iter(one), _iter(tp2_pp2), "PP=2 x DP=2 distributed optimizer -> one process")
    _assert_close(losses, dp_losses[-1], "one process after loading, against PP=2 x DP=2 after loading")
