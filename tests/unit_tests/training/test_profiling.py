"""Megatron's profiling flags (``--profile`` and friends): when profiling starts and stops,
the torch.profiler trace of a real run, ranks, and the errors for CUDA-only flags."""

import gzip
import json

import pytest
import torch

from megatron.core import parallel_state
from megatron.training import profiling
from megatron.training.arguments import parse_args
from megatron.training.profiling import ProfilingConfig


def test_flags_parse_with_megatrons_defaults():
    cfg = parse_args(["--mock-data", "--vocab-size", "64"]).profiling
    assert (cfg.profile, cfg.profile_step_start, cfg.profile_step_end, cfg.profile_ranks) == (False, 10, 12, [])
    assert cfg.memory_snapshot_path == "snapshot.pickle" and not cfg.use_pytorch_profiler
    cfg = parse_args(
        "--mock-data --vocab-size 64 --profile --use-pytorch-profiler --profile-step-start 3 --profile-step-end 5 "
        "--profile-ranks 0 2 --pytorch-profiler-collect-shapes --nvtx-ranges --record-shapes".split()
    ).profiling
    assert (cfg.profile_step_start, cfg.profile_step_end, cfg.profile_ranks) == (3, 5, [0, 2])
    assert cfg.use_pytorch_profiler and cfg.pytorch_profiler_collect_shapes and cfg.nvtx_ranges and cfg.record_shapes


@pytest.mark.parametrize(
    "flags,match",
    [
        ("--profile --profile-step-start 5 --profile-step-end 5", "--profile-step-end \\(5\\) must be greater"),
        ("--profile --profile-step-start -1", "--profile-step-start must be >= 0"),
    ],
)
def test_bad_steps_name_the_flag(flags, match):
    cfg = parse_args(f"--mock-data --vocab-size 64 {flags}".split()).resolve()
    with pytest.raises(ValueError, match=match):
        cfg.validate()


def test_nsys_range_covers_iterations_start_plus_one_to_end(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "_nsys_start", lambda: calls.append("start"))
    monkeypatch.setattr(profiling, "_nsys_stop", lambda: calls.append("stop"))
    prof = profiling.StepProfiler(ProfilingConfig(profile=True), rank=0, tensorboard_dir=None, cuda=True)
    prof.start()
    for done in range(20):  # the training loop: before iteration done + 1, after it
        prof.before_iteration(done)
        calls.append(done + 1)
        prof.after_iteration(done + 1)
    assert calls[calls.index("start") - 1] == 10 and calls[calls.index("start") + 1] == 11
    assert calls[calls.index("stop") - 1] == 12
    assert calls.count("start") == calls.count("stop") == 1
    prof.stop()  # idempotent: training's end after the range
    assert calls.count("stop") == 1


def test_an_unfinished_range_stops_at_close(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "_nsys_start", lambda: calls.append("start"))
    monkeypatch.setattr(profiling, "_nsys_stop", lambda: calls.append("stop"))
    cfg = ProfilingConfig(profile=True, profile_step_start=2, profile_step_end=50)
    prof = profiling.StepProfiler(cfg, rank=0, tensorboard_dir=None, cuda=True)
    for done in range(5):
        prof.before_iteration(done)
        prof.after_iteration(done + 1)
    assert calls == ["start"]
    prof.stop()
    assert calls == ["start", "stop"]


def test_other_ranks_do_not_profile(monkeypatch):
    calls = []
    monkeypatch.setattr(profiling, "_nsys_start", lambda: calls.append("start"))
    cfg = ProfilingConfig(profile=True, profile_step_start=0, profile_step_end=1, profile_ranks=[1, 3])
    for rank, expected in ((0, []), (3, ["start"])):
        calls.clear()
        prof = profiling.StepProfiler(cfg, rank=rank, tensorboard_dir=None, cuda=True)
        prof.before_iteration(0)
        assert calls == expected


def test_cuda_only_flags_say_so_on_the_cpu():
    with pytest.raises(ValueError, match="--profile without --use-pytorch-profiler .* add --use-pytorch-profiler"):
        profiling.StepProfiler(ProfilingConfig(profile=True), rank=0, tensorboard_dir=None, cuda=False)
    with pytest.raises(ValueError, match="--record-memory-history .* needs a CUDA run"):
        profiling.StepProfiler(ProfilingConfig(record_memory_history=True), rank=0, tensorboard_dir=None, cuda=False)


def test_pytorch_profiler_traces_the_chosen_iterations_of_a_run(tmp_path, tiny_argv):
    from megatron.training.training import pretrain

    tb = tmp_path / "run" / "tb"
    argv = tiny_argv(
        f"--train-iters 6 --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 4 "
        f"--pytorch-profiler-collect-shapes --tensorboard-dir {tb}"
    )
    trainer = pretrain(argv)
    assert trainer.iteration == 6
    trace = tmp_path / "run" / "torch_profile" / "rank-0.json.gz"
    with gzip.open(trace, "rt") as f:
        events = json.load(f)["traceEvents"]
    steps = sorted({e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")})
    # The profiler is stepped at the top of every iteration: its steps 2 and 3 are iterations 3 and 4.
    assert steps == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(e.get("name") == "aten::mm" and e.get("args", {}).get("Input Dims") for e in events)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_memory_history_snapshots_at_log_lines(tmp_path, tiny_argv):
    from megatron.training.training import build_trainer

    path = tmp_path / "mem.pickle"
    trainer = build_trainer(tiny_argv(f"--train-iters 4 --record-memory-history --memory-snapshot-path {path}"))
    try:
        assert trainer.device.type == "cuda"
        trainer.train()
    finally:
        parallel_state.destroy(trainer.pg)
        torch.cuda.memory._record_memory_history(enabled=None)
    snapshot = tmp_path / "mem_0.pickle"
    assert snapshot.is_file() and snapshot.stat().st_size > 0
