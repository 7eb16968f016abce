"""Checkpoints: layout, bitwise resume, load options, crash safety and clear errors (CPU)."""

import glob
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from megatron.core import parallel_state
from megatron.core.config_utils import thawed_copy
from megatron.training import checkpoint_config, checkpointing
from megatron.training.checkpointing import get_checkpoint_name, read_tracker, tracker_path
from megatron.training.train_state import TrainState
from megatron.training.training import build_trainer, pretrain
from tests.unit_tests.dist_utils import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
# Hidden dropout on: a resumed run only matches if the RNG state was restored.
FLAGS = (
    "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 4 --lr 1e-3 --min-lr 1e-4 --lr-warmup-iters 1 --lr-decay-style cosine --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --num-workers 0 --log-interval 1 --attention-dropout 0.0 "
    "--hidden-dropout 0.1 --seed 1234 --ckpt-format torch"
).split()  # the torch format's layout (torch_dist: test_dist_checkpointing.py)


def run(*extra):
    return pretrain(FLAGS + [str(x) for x in extra])


def build(*extra):
    trainer = build_trainer(FLAGS + [str(x) for x in extra])
    parallel_state.destroy(trainer.pg)  # single process: nothing to tear down, keeps tests tidy
    return trainer


def losses(trainer):
    return [r["lm loss"] for r in trainer.history]


def load_file(checkpoints_dir, iteration):
    return torch.load(get_checkpoint_name(str(checkpoints_dir), iteration), weights_only=True)


def assert_state_equal(a, b):
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def adam_steps(trainer):
    """Adam's step count of every parameter (0 for fresh state, whether allocated eagerly or not)."""
    state = trainer.optimizer.optimizer.state
    return {
        int(float(state[m]["step"])) if m in state and "step" in state[m] else 0 for m in trainer.optimizer.main_params
    }


def _assert_plain(value, where="config"):
    if isinstance(value, dict):
        for k, v in value.items():
            assert isinstance(k, str), where
            _assert_plain(v, f"{where}.{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _assert_plain(v, f"{where}[{i}]")
    else:
        assert value is None or type(value) in (str, int, float, bool), f"{where} is a {type(value).__name__}"


def test_paths():
    assert get_checkpoint_name("/c", 5) == "/c/iter_0000005/mp_rank_00/model_optim_rng.pt"
    assert get_checkpoint_name("/c", 1234567, tp_rank=1, pp_rank=2, pp_size=4) == (
        "/c/iter_1234567/mp_rank_01_002/model_optim_rng.pt"
    )
    assert get_checkpoint_name("/c", 0, release=True) == "/c/release/mp_rank_00/model_optim_rng.pt"
    assert tracker_path("/c") == "/c/latest_checkpointed_iteration.txt"


def test_config_to_dict_is_plain():
    import dataclasses
    import enum

    class Kind(enum.IntEnum):
        DENSE = 3

    @dataclasses.dataclass
    class Inner:
        dtype: torch.dtype = torch.bfloat16
        kind: Kind = Kind.DENSE
        scopes: tuple = ("attn", "mlp")

    @dataclasses.dataclass
    class Outer:
        inner: Inner = dataclasses.field(default_factory=Inner)
        flag: bool = True

    plain = checkpoint_config.config_to_dict(Outer())
    assert plain == {"inner": {"dtype": "torch.bfloat16", "kind": 3, "scopes": ["attn", "mlp"]}, "flag": True}
    assert type(plain["inner"]["kind"]) is int  # not the IntEnum: weights_only could not load it
    _assert_plain(plain)


def test_save_interval_layout_and_content(tmp_path):
    d = tmp_path / "ckpt"
    trainer = run("--train-iters", 7, "--save", d, "--save-interval", 3)
    # Every 3 iterations, plus the end of training (as Megatron); nothing half-written left.
    assert sorted(os.listdir(d)) == [
        "iter_0000003",
        "iter_0000006",
        "iter_0000007",
        "latest_checkpointed_iteration.txt",
    ]
    assert (d / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert read_tracker(str(d)) == (7, False)
    state = load_file(d, 7)  # weights_only: plain values and tensors only
    assert state["checkpoint_version"] == checkpointing.CHECKPOINT_VERSION
    assert state["iteration"] == 7 and state["consumed_samples"] == 28
    assert_state_equal(state["model"], trainer.model.state_dict())
    assert state["opt_param_scheduler"]["num_steps"] == 7
    assert len(state["optimizer"]["optimizer"]["state"]) == len(trainer.optimizer.model_params)
    assert len(state["rng_state"]) == 1 and set(state["rng_state"][0]) >= {
        "random_rng_state",
        "np_rng_state",
        "torch_rng_state",
    }
    config = state["config"]
    _assert_plain(config)
    assert config["model"]["hidden_size"] == 32 and config["model"]["params_dtype"] == "torch.float32"
    assert config["training"]["train_iters"] == 7 and config["checkpoint"]["save_interval"] == 3
    assert load_file(d, 3)["iteration"] == 3


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resume_is_bitwise_equal_to_uninterrupted(tmp_path, precision):
    extra = ["--bf16"] if precision == "bf16" else []
    full = run(*extra, "--train-iters", 10)
    part = run(*extra, "--train-iters", 10, "--exit-interval", 5, "--save", tmp_path / "c")
    assert part.iteration == 5 and read_tracker(str(tmp_path / "c")) == (5, False)
    metrics = tmp_path / "m.jsonl"
    resumed = run(*extra, "--train-iters", 10, "--load", tmp_path / "c", "--metrics-file", metrics)
    assert losses(part) == losses(full)[:5]
    assert losses(resumed) == losses(full)[5:]  # bitwise: floats compared with ==
    assert [r["iteration"] for r in resumed.history] == [6, 7, 8, 9, 10]
    assert resumed.consumed_samples == full.consumed_samples == 40
    assert_state_equal(resumed.model.state_dict(), full.model.state_dict())
    for a, b in zip(resumed.optimizer.main_params, full.optimizer.main_params):
        assert torch.equal(a, b)
    assert '"iteration": 6' in metrics.read_text().splitlines()[0]


def test_loading_keeps_parameter_and_main_grad_storage(tmp_path):
    run("--bf16", "--train-iters", 2, "--save", tmp_path / "c")
    trainer = build("--bf16", "--train-iters", 4)
    params = trainer.optimizer.model_params
    before = [
        (p.data_ptr(), p.main_grad.data_ptr(), m.data_ptr()) for p, m in zip(params, trainer.optimizer.main_params)
    ]
    trainer.cfg = thawed_copy(trainer.cfg)  # the trainer's config is frozen; this test loads later
    trainer.cfg.checkpoint.load = str(tmp_path / "c")
    assert trainer.load_checkpoint() == 2
    after = [
        (p.data_ptr(), p.main_grad.data_ptr(), m.data_ptr()) for p, m in zip(params, trainer.optimizer.main_params)
    ]
    assert before == after
    assert_state_equal(trainer.model.state_dict(), load_file(tmp_path / "c", 2)["model"])


def test_load_options(tmp_path):
    c = tmp_path / "c"
    run("--bf16", "--train-iters", 10, "--exit-interval", 5, "--save", c)
    saved = load_file(c, 5)
    saved_rng = saved["rng_state"][0]["torch_rng_state"]

    def check_weights(trainer):
        assert_state_equal(trainer.model.state_dict(), saved["model"])
        for p, m in zip(trainer.optimizer.model_params, trainer.optimizer.main_params):
            assert torch.equal(m.to(p.dtype), p)  # fp32 masters follow the loaded bf16 weights

    full = build("--bf16", "--train-iters", 10, "--load", c)
    check_weights(full)
    assert (full.iteration, full.consumed_samples, full.scheduler.num_steps) == (5, 20, 5)
    assert adam_steps(full) == {5}
    assert torch.equal(torch.get_rng_state(), saved_rng)
    assert random.getstate()[1] == tuple(saved["rng_state"][0]["random_rng_state"][1])

    no_optim = build("--bf16", "--train-iters", 10, "--load", c, "--no-load-optim")
    check_weights(no_optim)
    assert (no_optim.iteration, no_optim.consumed_samples) == (5, 20)
    assert adam_steps(no_optim) == {0}
    assert no_optim.scheduler.num_steps == 5  # the LR schedule stays at the loaded iteration
    assert no_optim.optimizer.param_groups[0]["lr"] == full.optimizer.param_groups[0]["lr"]

    no_rng = build("--bf16", "--train-iters", 10, "--load", c, "--no-load-rng")
    assert no_rng.iteration == 5 and adam_steps(no_rng) == {5}
    assert not torch.equal(torch.get_rng_state(), saved_rng)

    finetune = build("--bf16", "--train-iters", 10, "--load", c, "--finetune")
    check_weights(finetune)
    assert (finetune.iteration, finetune.consumed_samples, finetune.scheduler.num_steps) == (0, 0, 0)
    assert adam_steps(finetune) == {0}
    assert not torch.equal(torch.get_rng_state(), saved_rng)
    trained = run("--bf16", "--train-iters", 3, "--load", c, "--finetune")
    assert [r["iteration"] for r in trained.history] == [1, 2, 3]


def test_pretrained_checkpoint_when_load_holds_none(tmp_path):
    # Megatron's --pretrained-checkpoint: with no checkpoint in --load, its weights only, from iteration 0;
    # once --save has written into --load, the run resumes from that instead.
    pre, run_dir = tmp_path / "pre", tmp_path / "run"
    run("--train-iters", 4, "--save", pre)
    saved = load_file(pre, 4)
    first = build("--train-iters", 10, "--pretrained-checkpoint", pre, "--load", run_dir, "--save", run_dir)
    assert_state_equal(first.model.state_dict(), saved["model"])
    assert (first.iteration, first.consumed_samples) == (0, 0) and adam_steps(first) == {0}
    assert first.cfg.checkpoint.finetune and first.cfg.checkpoint.load == str(pre)
    run("--train-iters", 10, "--exit-interval", 2, "--pretrained-checkpoint", pre, "--load", run_dir, "--save", run_dir)
    resumed = build("--train-iters", 10, "--pretrained-checkpoint", pre, "--load", run_dir, "--save", run_dir)
    assert resumed.iteration == 2 and not resumed.cfg.checkpoint.finetune
    assert_state_equal(resumed.model.state_dict(), load_file(run_dir, 2)["model"])
    no_load = build("--train-iters", 10, "--pretrained-checkpoint", pre)  # --load unset: the pretrained one
    assert_state_equal(no_load.model.state_dict(), saved["model"])
    with pytest.raises(ValueError, match=r"no checkpoint in --load .* nor in --pretrained-checkpoint"):
        build("--pretrained-checkpoint", tmp_path / "empty", "--load", run_dir / "none")


# A child that trains with saves every 2 iterations and is SIGKILLed during the second save.
_CHILD = r"""
import io, os, signal, sys
import torch
from megatron.training import checkpointing
from megatron.training.training import pretrain

where, argv = sys.argv[1], sys.argv[2:]
real_save, real_tracker = torch.save, checkpointing._write_tracker
calls = []

def dying_save(obj, f, *args, **kwargs):
    calls.append(1)
    if len(calls) < 2:
        return real_save(obj, f, *args, **kwargs)
    buf = io.BytesIO()
    real_save(obj, buf)
    data = buf.getvalue()
    f.write(data[: len(data) // 2])  # half the file reaches the disk, then the process dies
    f.flush()
    os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)

def dying_tracker(checkpoints_dir, iteration):
    if iteration >= 4:  # the iteration folder is in place, the tracker not yet updated
        os.kill(os.getpid(), signal.SIGKILL)
    real_tracker(checkpoints_dir, iteration)

if where == "file":
    torch.save = dying_save
else:
    checkpointing._write_tracker = dying_tracker
pretrain(argv)
"""


@pytest.mark.parametrize("where", ["file", "tracker"])
def test_kill_during_save_leaves_previous_checkpoint(tmp_path, where):
    c = tmp_path / "c"
    child = tmp_path / "child.py"
    child.write_text(_CHILD)
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    argv = FLAGS + ["--train-iters", "6", "--save", str(c), "--save-interval", "2"]
    proc = subprocess.run(
        [sys.executable, str(child), where, *argv], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert read_tracker(str(c)) == (2, False)
    if where == "file":
        assert not (c / "iter_0000004").exists()
        (partial,) = glob.glob(str(c / "iter_0000004.tmp-*" / "mp_rank_00" / "model_optim_rng.pt"))
        assert os.path.getsize(partial) > 0
        with pytest.raises((RuntimeError, EOFError, OSError)):
            torch.load(partial, weights_only=True)  # really truncated
    else:
        assert (c / "iter_0000004").is_dir()  # complete, but not what the tracker says
    assert build("--train-iters", 6, "--load", c).iteration == 2
    # Resuming re-saves iteration 4 over whatever is there and clears the leftovers.
    resumed = run("--train-iters", 6, "--load", c, "--save", c, "--save-interval", 2)
    assert [r["iteration"] for r in resumed.history] == [3, 4, 5, 6]
    assert sorted(os.listdir(c)) == [
        "iter_0000002",
        "iter_0000004",
        "iter_0000006",
        "latest_checkpointed_iteration.txt",
    ]
    assert load_file(c, 4)["iteration"] == 4


def test_resave_killed_between_renames_falls_back_to_the_old_folder(tmp_path):
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    os.replace(c / "iter_0000002", c / "iter_0000002.old-4242")
    assert build("--train-iters", 4, "--load", c).iteration == 2
    import shutil

    shutil.rmtree(c / "iter_0000002.old-4242")
    with pytest.raises(
        ValueError, match=r"points at iteration 2, but .*iter_0000002/mp_rank_00/model_optim_rng.pt does not exist"
    ):
        build("--train-iters", 4, "--load", c)


def test_other_model_shape_names_file_and_field(tmp_path):
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    flags = [f if f != "32" else "64" for f in FLAGS]  # --hidden-size 32 -> 64 (and --seq-length)
    with pytest.raises(ValueError) as info:
        build_trainer(flags + ["--train-iters", "3", "--load", str(c)])
    msg = str(info.value)
    assert get_checkpoint_name(str(c), 2) in msg
    assert "was saved with hidden_size=32, this run has 64" in msg
    assert "max_position_embeddings=32, this run has 64" in msg
    with pytest.raises(ValueError, match=r"gated_linear_unit=False, this run has True \(--swiglu\)"):
        build("--train-iters", 2, "--load", c, "--swiglu")


@pytest.mark.parametrize(
    "field, flag",
    [
        ("tensor_model_parallel_size", "--tensor-model-parallel-size"),
        ("pipeline_model_parallel_size", "--pipeline-model-parallel-size"),
    ],
)
def test_torch_format_refuses_another_tp_or_pp_naming_the_flag_and_torch_dist(tmp_path, field, flag):
    trainer = build("--train-iters", 2)
    saved = checkpoint_config.config_to_dict(trainer.cfg)
    saved["parallel"][field] = 2  # as a file saved at TP=2 (or PP=2) would hold
    with pytest.raises(ValueError) as info:
        checkpoint_config.check_config(saved, trainer.cfg, "/c/iter_0000002/mp_rank_01")
    msg = str(info.value)
    assert f"{field}=2, this run has 1 ({flag})" in msg
    assert "--ckpt-format torch_dist" in msg
    saved = checkpoint_config.config_to_dict(trainer.cfg)
    saved["model"]["hidden_size"] = 64  # another model, same layout: no word of torch_dist
    with pytest.raises(ValueError) as info:
        checkpoint_config.check_config(saved, trainer.cfg, "/c")
    assert "torch_dist" not in str(info.value)


def test_load_of_no_checkpoint_starts_from_scratch_unless_that_would_save_over_one(tmp_path, capsys):
    """Megatron's first run of --load X --save Y (and of --load X --save X): a warning, then from
    scratch; an error with --exit-on-missing-checkpoint, and where --save already holds checkpoints."""
    (tmp_path / "empty").mkdir()
    for load, save in [("nope", "out"), ("empty", None), ("empty", "empty")]:
        fresh = build("--train-iters", 2, "--load", tmp_path / load, *(("--save", tmp_path / save) if save else ()))
        assert fresh.iteration == 0
        assert f"WARNING: could not find the metadata file {tmp_path / load}/latest_checkpointed_iteration.txt" in (
            capsys.readouterr().out
        )
    with pytest.raises(ValueError, match=r"--load .*nope does not exist .* --exit-on-missing-checkpoint asks for one"):
        build("--train-iters", 2, "--load", tmp_path / "nope", "--exit-on-missing-checkpoint")
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    with pytest.raises(ValueError, match=r"--load .*empty holds no checkpoint .*, but --save .*c holds checkpoints"):
        build("--train-iters", 4, "--load", tmp_path / "empty", "--save", c)


def test_load_errors(tmp_path):
    c = tmp_path / "c"
    run("--train-iters", 2, "--save", c)
    tracker = c / "latest_checkpointed_iteration.txt"
    tracker.write_text("two\n")
    with pytest.raises(ValueError, match=r"tracker file .*latest_checkpointed_iteration.txt is corrupt"):
        build("--train-iters", 4, "--load", c)
    tracker.unlink()
    with pytest.raises(ValueError, match=r"tracker file .* is missing\. It holds iter_0000002"):
        build("--train-iters", 4, "--load", c)
    tracker.write_text("2")
    ckpt = get_checkpoint_name(str(c), 2)
    with open(ckpt, "r+b") as f:
        f.truncate(os.path.getsize(ckpt) // 3)
    with pytest.raises(ValueError, match=r"checkpoint .*model_optim_rng.pt cannot be read"):
        build("--train-iters", 4, "--load", c)


def test_missing_data_path_names_it(tmp_path):
    flags = [f for f in FLAGS if f != "--mock-data"]
    missing = str(tmp_path / "no" / "corpus_text_document")
    with pytest.raises(ValueError, match=f"--data-path {missing}"):
        pretrain(flags + ["--train-iters", "2", "--data-path", missing])


def _dp2_resume(rank, world_size, folder):
    flags = FLAGS + ["--global-batch-size", "8"]
    full = pretrain(flags + ["--train-iters", "6"])
    pretrain(flags + ["--train-iters", "6", "--exit-interval", "3", "--save", folder])
    resumed = pretrain(flags + ["--train-iters", "6", "--load", folder])
    state = torch.load(get_checkpoint_name(folder, 3), weights_only=True)
    return losses(full), losses(resumed), len(state["rng_state"])


def test_data_parallel_save_and_resume(tmp_path):
    results = run_distributed(_dp2_resume, 2, str(tmp_path / "c"), timeout=240)
    for full, resumed, n_rng in results:
        assert resumed == full[3:]
        assert n_rng == 2  # one RNG state per data-parallel rank
    assert results[0][:2] == results[1][:2]
    assert sorted(os.listdir(tmp_path / "c")) == ["iter_0000003", "latest_checkpointed_iteration.txt"]


@pytest.mark.gpu
def test_resume_then_capture_cuda_graphs_gpu(tmp_path):
    # Loading copies into the existing parameters, so graphs captured after it read the
    # loaded weights: the resumed graphed run continues the uninterrupted one bitwise.
    flags = ["--bf16", "--deterministic-mode", "--hidden-dropout", "0.0", "--train-iters", "8",
             "--cuda-graph-impl", "local", "--cuda-graph-scope", "attn", "mlp"]  # fmt: skip
    full = run(*flags)
    run(*flags, "--exit-interval", 4, "--save", tmp_path / "c")
    resumed = run(*flags, "--load", tmp_path / "c")
    assert resumed.graphs.capture_seconds > 0  # captured (pretrain closed the session at the end)
    assert losses(resumed) == losses(full)[4:]
    assert_state_equal(resumed.model.state_dict(), full.model.state_dict())


class _Counter:
    """A minimal Stateful (not a module, not an optimizer)."""

    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def test_save_and_load_any_stateful_objects(tmp_path):
    from megatron.training.arguments import parse_args

    cfg = parse_args(["--mock-data", "--save", str(tmp_path), "--load", str(tmp_path)])
    pg = parallel_state.ProcessGroups.single(torch.device("cpu"))
    model = torch.nn.Linear(3, 2)
    train = TrainState(iteration=7, consumed_samples=56, skipped_iters=1, nan_iters=2)
    state = {"model": model, "optimizer": _Counter(3), "opt_param_scheduler": _Counter(4), "train_state": train}
    torch.manual_seed(5)
    expected_draw = torch.rand(3)
    torch.manual_seed(5)
    path = checkpointing.save_checkpoint(state, cfg, pg)
    assert path == get_checkpoint_name(str(tmp_path), 7) and read_tracker(str(tmp_path)) == (7, False)
    contents = torch.load(path, weights_only=True)
    # Megatron's top-level keys, in Megatron's order; the counters follow.
    assert list(contents) == [
        "checkpoint_version", "iteration", "consumed_samples", "model", "optimizer", "opt_param_scheduler",
        "rng_state", "config", "consumed_valid_samples", "skipped_train_samples", "skipped_iterations",
        "nan_iterations",
    ]  # fmt: skip
    assert contents["optimizer"] == {"value": 3} and contents["opt_param_scheduler"] == {"value": 4}

    fresh_model = torch.nn.Linear(3, 2)
    weight_ptr = fresh_model.weight.data_ptr()
    fresh = {"model": fresh_model, "optimizer": _Counter(), "opt_param_scheduler": _Counter(), "train_state": None}
    fresh["train_state"] = TrainState()
    torch.manual_seed(99)
    loaded = checkpointing.load_checkpoint(fresh, cfg, pg)
    assert loaded.iteration == 7 and loaded.loaded == {"model", "optimizer", "opt_param_scheduler", "train_state"}
    assert fresh_model.weight.data_ptr() == weight_ptr and torch.equal(fresh_model.weight, model.weight)
    assert (fresh["optimizer"].value, fresh["opt_param_scheduler"].value) == (3, 4)
    t = fresh["train_state"]
    assert (t.iteration, t.consumed_samples, t.skipped_iters, t.nan_iters) == (7, 56, 1, 2)
    assert torch.equal(torch.rand(3), expected_draw)  # the RNG continues where the save left it

    cfg.checkpoint.no_load_optim = True
    skipped = {"model": fresh_model, "optimizer": _Counter(), "opt_param_scheduler": _Counter(), "train_state": t}
    loaded = checkpointing.load_checkpoint(skipped, cfg, pg)
    assert loaded.loaded == {"model", "train_state"} and skipped["optimizer"].value == 0
