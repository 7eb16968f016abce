"""Checkpoints across pipeline and expert-parallel layouts (gloo, CPU, fp32).

torch_dist: a checkpoint is read back as full tensors by DCP's own planner
(``_read_full``), so the comparisons do not go through the chunk code under test. A run
that loads a checkpoint saves it again at once (before any step): that save must hold
exactly the tensors it loaded, bitwise, whatever the two layouts; PP=1 / EP=1 names are
the one-process model's, so a round trip through them checks the mapping itself. Cases:
PP=2 x VPP=2 (both spellings) <-> PP=1, two --pipeline-model-parallel-layout strings
(uneven PP=2 -> PP=2 x VPP=3 with chunks of no layers), TP=2 x PP=2 -> PP=2 x DP=2 with
the distributed optimizer -> one process, TP=2 x PP=2 x DP=2 with the distributed
optimizer (8 ranks) <-> one process, EP=2 x expert-DP=2 with the distributed optimizer
<-> EP=1.

torch format with EP: the EP=2 files hold EP rank e's local expert i as global expert
2e + i (checked against the EP=1 file directly); EP=2 -> EP=1 trains on the EP=1 curve,
and EP=1 -> EP=2 -> EP=1 gives back the EP=1 file, model and optimizer, bitwise.

Same-layout resumes are bitwise (PP=2 x VPP=2, EP=2); across layouts the losses agree
within 1e-5 relative (sums run in another order, as in test_parallel_layouts.py).
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
            trainer = build_trainer([*step[1], "--save", str(step[2])])  # the config is frozen once built
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


def test_torch_dist_moves_between_pipeline_layout_strings(tmp_path, cache):
    """--pipeline-model-parallel-layout Et*3|tL (PP=2, 3 + 1 layers) -> E|tt||t|t|L (PP=2 x VPP=3,
    chunks of no layers): the loaded state is the saved one, bitwise, and trains on the saving
    layout's uninterrupted curve."""
    uneven, moved = tmp_path / "uneven", tmp_path / "moved"
    pp2 = "--pipeline-model-parallel-size 2 --pipeline-model-parallel-layout"
    full, first, loaded = zip(
        *run_distributed(
            _steps,
            2,
            [
                ("train", _argv(f"{pp2} Et*3|tL", cache)),
                ("train", _interrupted(f"{pp2} Et*3|tL", uneven, cache)),
                ("resave", _argv(f"{pp2} E|tt||t|t|L --load {uneven}", cache), str(moved)),
            ],
            timeout=300,
        )
    )
    assert first[-1] == full[-1][:SAVE_AT]
    _assert_same_checkpoint(_iter(moved), _iter(uneven), "layout Et*3|tL -> E|tt||t|t|L")
    _assert_close(loaded[-1], full[-1][SAVE_AT:], "layout E|tt||t|t|L after loading the Et*3|tL checkpoint")


def _resave_here(argv, folder):
    """Loads ``argv``'s ``--load`` in this process, saves it into ``folder`` at once, trains on."""
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    loader = build_trainer([*argv, "--save", str(folder)])  # the config is frozen once built
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


TP2_PP2_DP2 = (
    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 3000"
)


def test_torch_dist_round_trip_between_tp2_pp2_dp2_distributed_optimizer_and_one_process(tmp_path, cache):
    """The issue's round trip on 8 ranks: TP=2 x PP=2 x DP=2 with the distributed optimizer
    <-> TP=1 x PP=1. Both directions hold bitwise the saving run's full weights and optimizer
    state after loading and train on the uninterrupted one-process curve within 1e-5."""
    from megatron.training.training import pretrain

    one, big, one_to_big, big_to_one = (tmp_path / n for n in ("one", "big", "one_to_big", "big_to_one"))
    never_stopped = [r["lm loss"] for r in pretrain(_argv(f"--save {one} --save-interval {SAVE_AT}", cache)).history]
    (one / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    first, loaded = zip(
        *run_distributed(
            _steps,
            8,
            [
                ("train", _interrupted(TP2_PP2_DP2, big, cache)),
                ("resave", _argv(f"{TP2_PP2_DP2} --load {one}", cache), str(one_to_big)),
            ],
            timeout=600,
        )
    )
    _assert_close(first[-1], never_stopped[:SAVE_AT], "TP=2 x PP=2 x DP=2 before its save")
    # TP=1 x PP=1 -> TP=2 x PP=2 x DP=2: what the 8 ranks loaded is the one-process checkpoint.
    _assert_same_checkpoint(_iter(one_to_big), _iter(one), "TP=1 x PP=1 -> TP=2 x PP=2 x DP=2")
    _assert_close(loaded[-1], never_stopped[SAVE_AT:], "TP=2 x PP=2 x DP=2 after loading the one-process checkpoint")
    # TP=2 x PP=2 x DP=2 -> TP=1 x PP=1.
    losses = _resave_here(_argv(f"--load {big}", cache), big_to_one)
    _assert_same_checkpoint(_iter(big_to_one), _iter(big), "TP=2 x PP=2 x DP=2 -> TP=1 x PP=1")
    _assert_close(losses, never_stopped[SAVE_AT:], "one process after loading the TP=2 x PP=2 x DP=2 checkpoint")


# ---------------------------------------------------------------------- expert parallelism

MOE = (
    "--num-layers 2 --hidden-size 16 --num-attention-heads 2 --seq-length 16 --max-position-embeddings 16 "
    "--micro-batch-size 2 --global-batch-size 8 --train-iters 6 --lr 3e-3 --min-lr 3e-4 --lr-decay-style cosine "
    "--lr-warmup-iters 2 --seed 1234 --mock-data --tokenizer-type NullTokenizer --vocab-size 63 "
    "--hidden-dropout 0.0 --attention-dropout 0.0 --num-workers 0 --log-interval 1 --swiglu --disable-bias-linear "
    "--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 0.01 "
    "--moe-ffn-hidden-size 24"
)
MOE_EXPERTS = 4
EP2 = "--expert-model-parallel-size 2 --use-distributed-optimizer --ddp-bucket-size 300"  # 4 ranks: expert-DP 2


def _moe(extra: str, cache: str) -> list[str]:
    return (MOE + " " + extra).split() + ["--data-cache-path", cache]


@pytest.fixture(scope="module")
def ep_runs(tmp_path_factory, cache):
    """EP=1 references here, then EP=2 x DP=4 (expert-DP 2, distributed optimizer) on 4 ranks."""
    from megatron.training.training import pretrain

    root = tmp_path_factory.mktemp("ep")
    names = ("one", "one_torch", "ep2", "ep2_torch", "one_to_ep2", "one_to_ep2_grouped", "one_to_ep2_torch")
    dirs = {n: root / n for n in names}
    never_stopped = {}
    for fmt, name in (("torch_dist", "one"), ("torch", "one_torch")):
        argv = _moe(f"--ckpt-format {fmt} --save {dirs[name]} --save-interval {SAVE_AT}", cache)
        never_stopped[fmt] = [r["lm loss"] for r in pretrain(argv).history]
        (dirs[name] / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    interrupted = f"--save-interval {SAVE_AT} --exit-interval {SAVE_AT}"
    steps = [
        ("train", _moe(EP2, cache)),
        ("train", _moe(f"{EP2} --save {dirs['ep2']} {interrupted}", cache)),
        ("train", _moe(f"{EP2} --load {dirs['ep2']}", cache)),
        ("resave", _moe(f"{EP2} --load {dirs['one']}", cache), str(dirs["one_to_ep2"])),
        ("resave", _moe(f"{EP2} --moe-grouped-gemm --load {dirs['one']}", cache), str(dirs["one_to_ep2_grouped"])),
        ("train", _moe(f"{EP2} --ckpt-format torch --save {dirs['ep2_torch']} {interrupted}", cache)),
        ("resave", _moe(f"{EP2} --ckpt-format torch --load {dirs['one_torch']}", cache), str(dirs["one_to_ep2_torch"])),
    ]
    results = run_distributed(_steps, 4, steps, timeout=400)
    return dirs, never_stopped, results


def test_torch_dist_moves_between_ep2_expert_dp2_distributed_optimizer_and_ep1(ep_runs, tmp_path, cache):
    dirs, never_stopped, results = ep_runs
    for full, first, resumed, loaded, *_ in results:
        assert first + resumed == full  # EP=2 resumes bitwise
        _assert_close(full, never_stopped["torch_dist"], "EP=2 against EP=1")
        _assert_close(loaded, never_stopped["torch_dist"][SAVE_AT:], "EP=2 after loading the EP=1 checkpoint")
    _assert_same_checkpoint(_iter(dirs["one_to_ep2"]), _iter(dirs["one"]), "EP=1 -> EP=2 x expert-DP=2")
    losses = _resave_here(_moe(f"--load {dirs['ep2']}", cache), tmp_path / "ep2_to_one")
    _assert_same_checkpoint(_iter(tmp_path / "ep2_to_one"), _iter(dirs["ep2"]), "EP=2 x expert-DP=2 -> EP=1")
    _assert_close(losses, results[0][2], "EP=1 after loading the EP=2 checkpoint")


def _as_loop_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A full state with ``--moe-grouped-gemm``'s ``[E, ...]`` expert tensors as one tensor per
    expert (the loop's keys); the grouped tensor's one ``step`` is every expert's."""
    import re

    out = {}
    for key, value in state.items():
        match = re.match(r"^(.*\.experts\.)(linear_fc[12]\.(?:weight|bias))$", key)
        if match is None:
            out[key] = value
            continue
        experts = MOE_EXPERTS if value.dim() == 0 else value.shape[0]
        for g in range(experts):
            out[f"{match[1]}local_experts.{g}.{match[2]}"] = value if value.dim() == 0 else value[g]
    return out


def test_torch_dist_loads_across_moe_grouped_gemm_on_and_off(ep_runs, tmp_path, cache):
    """Grouped ``[E, ...]`` expert weights and the loop's per-expert ones are the same tensors:
    EP=1 loop -> EP=2 grouped (4 ranks, distributed optimizer), loop -> grouped -> loop in one
    process, bitwise, and the grouped run trains on the loop run's curve within 1e-5."""
    dirs, never_stopped, results = ep_runs
    one = _read_full(_iter(dirs["one"]))
    grouped = _read_full(_iter(dirs["one_to_ep2_grouped"]))
    assert any(k.endswith(".experts.linear_fc1.weight") for k in grouped)
    loop_form = _as_loop_experts(grouped)
    assert set(loop_form) == set(one)
    for key in one:
        assert torch.equal(loop_form[key], one[key]), f"EP=1 loop -> EP=2 grouped: {key}"
    for rank_results in results:
        _assert_close(rank_results[4], never_stopped["torch_dist"][SAVE_AT:], "EP=2 grouped after loading EP=1 loop")
    (dirs["one_to_ep2_grouped"] / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))
    losses = _resave_here(_moe(f"--load {dirs['one_to_ep2_grouped']}", cache), tmp_path / "back")
    _assert_same_checkpoint(_iter(tmp_path / "back"), _iter(dirs["one"]), "loop -> grouped -> loop")
    _assert_close(losses, never_stopped["torch_dist"][SAVE_AT:], "loop after loading the grouped checkpoint")
    losses = _resave_here(_moe(f"--moe-grouped-gemm --load {dirs['one']}", cache), tmp_path / "grouped")
    _assert_same_checkpoint(_iter(tmp_path / "grouped"), _iter(dirs["one_to_ep2_grouped"]), "loop -> grouped, EP=1")
    _assert_close(losses, never_stopped["torch_dist"][SAVE_AT:], "grouped after loading the loop checkpoint")


def _torch_file(folder, rank_dir):
    return torch.load(_iter(folder) / rank_dir / "model_optim_rng.pt", weights_only=True)


def _expert_rows(state: dict, key: str) -> tuple[str, int] | None:
    import re

    match = re.match(r"(.*\.local_experts\.)(\d+)(\..*)", key)
    return None if match is None else (match[1] + "{}" + match[3], int(match[2]))


def test_torch_format_files_per_ep_rank_hold_experts_by_global_index(ep_runs, tmp_path, cache):
    dirs, never_stopped, results = ep_runs
    one = _torch_file(dirs["one_torch"], "mp_rank_00")
    per_ep = [_torch_file(dirs["one_to_ep2_torch"], f"mp_rank_00_{e:03d}") for e in range(2)]
    assert not (_iter(dirs["one_to_ep2_torch"]) / "mp_rank_00").exists()
    for e, saved in enumerate(per_ep):  # EP rank e's local expert i is global expert 2e + i
        assert set(saved["model"]) == {k for k in one["model"] if (_expert_rows(one, k) or ("", 0))[1] < 2}
        for key, value in saved["model"].items():
            where = _expert_rows(saved, key)
            want = one["model"][key if where is None else where[0].format(2 * e + where[1])]
            assert torch.equal(value, want), f"EP rank {e}: {key}"
    for *_, loaded_torch in results:
        _assert_close(loaded_torch, never_stopped["torch"][SAVE_AT:], "EP=2 after loading the EP=1 torch file")
    # EP=2 -> EP=1, and the EP=1 -> EP=2 save back to EP=1: the same file as the EP=1 run's.
    losses = _resave_here(_moe(f"--ckpt-format torch --load {dirs['ep2_torch']}", cache), tmp_path / "to_one")
    _assert_close(losses, never_stopped["torch"][SAVE_AT:], "EP=1 after loading the EP=2 torch files")
    back = tmp_path / "back"
    (dirs["one_to_ep2_torch"] / "latest_checkpointed_iteration.txt").write_text(str(SAVE_AT))  # the save at loading
    _resave_here(_moe(f"--ckpt-format torch --load {dirs['one_to_ep2_torch']}", cache), back)
    got = _torch_file(back, "mp_rank_00")
    for what in ("model", "optimizer"):
        _assert_same_tree(got[what], one[what], what)


def _assert_same_tree(got, want, where):
    if torch.is_tensor(want):
        assert torch.equal(got, want), where
    elif isinstance(want, dict):
        assert set(got) == set(want), f"{where}: {sorted(set(got) ^ set(want), key=str)[:6]}"
        for k in want:
            _assert_same_tree(got[k], want[k], f"{where}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (a, b) in enumerate(zip(got, want)):
            _assert_same_tree(a, b, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} vs {want!r}"


@pytest.mark.parametrize("ckpt_format", ["torch_dist", "torch"])
@pytest.mark.parametrize(
    "changed, flag",
    [("--num-experts 2", "--num-experts"), ("--num-layers 1", "--num-layers")],
    ids=["experts", "layers"],
)
def test_a_checkpoint_of_another_model_is_refused_naming_the_flag(tmp_path, cache, ckpt_format, changed, flag):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    saver = build_trainer(_moe(f"--ckpt-format {ckpt_format} --save {tmp_path}", cache))
    saver.save_checkpoint()
    saver.close()
    parallel_state.destroy(saver.pg)
    with pytest.raises(ValueError, match=flag):
        build_trainer(_moe(f"--ckpt-format {ckpt_format} --load {tmp_path} {changed}", cache))


@pytest.mark.parametrize("saved, loaded", [("", "--moe-grouped-gemm"), ("--moe-grouped-gemm", "")])
def test_torch_format_refuses_the_other_expert_form_naming_the_flag_and_torch_dist(tmp_path, cache, saved, loaded):
    from megatron.core import parallel_state
    from megatron.training.training import build_trainer

    saver = build_trainer(_moe(f"--ckpt-format torch {saved} --save {tmp_path}", cache))
    saver.save_checkpoint()
    saver.close()
    parallel_state.destroy(saver.pg)
    with pytest.raises(ValueError, match=r"--moe-grouped-gemm.*--ckpt-format torch_dist"):
        build_trainer(_moe(f"--ckpt-format torch {loaded} --load {tmp_path}", cache))
