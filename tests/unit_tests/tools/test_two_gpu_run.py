"""tools/two_gpu_run.py on the CPU: the parser on the trainer's own lines, hung and timed-out
runs, graph bounds, the checks, and a few runs of the table with --cpu-smoke (gloo)."""

import datetime
import io
import json
import os
import sys
import textwrap
import time
import types
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tools"))
import two_gpu_logs  # noqa: E402
import two_gpu_plan  # noqa: E402
import two_gpu_proc  # noqa: E402
import two_gpu_run  # noqa: E402

from megatron.core.transformer.cuda_graphs.session import GraphSession  # noqa: E402
from megatron.training import logging_utils  # noqa: E402
from megatron.training.training_log import IterationLogging  # noqa: E402

# A line as the trainer printed it in a --cpu-smoke run (TP=2 + SP, rank 1).
REAL_ITERATION_LINE = (
    " [2026-12-04 12:25:37.092884] iteration        1/       3 | consumed samples:            8 | elapsed time "
    "per iteration (ms): 570.1 | learning rate: 1.000000E-04 | global batch size:     8 | lm loss: 5.569382E+00 | "
    "loss scale: 1.0 | grad norm: 1.283 | number of skipped iterations:   0 | number of nan iterations:   0 |"
)
MB = 2**20


def _graph_stats(graphs=18):
    return {
        "graphs": graphs,
        "pool_reserved_bytes": 1304 * MB,
        "pool_live_bytes": 0,
        "strong_bytes": 2 * MB,
        "capture_seconds": 0.5,
    }


def _trainer_like(rank, pp_rank, pp_size, iteration=30, graphs=18, device_memory_used=False):
    """What IterationLogging._log_memory / _memory_record read of a trainer, on a (pretend) GPU."""
    stats = _graph_stats(graphs)
    return types.SimpleNamespace(
        cfg=types.SimpleNamespace(logging=types.SimpleNamespace(log_device_memory_used=device_memory_used)),
        device=torch.device("cuda"),
        pg=types.SimpleNamespace(dp_rank=0, rank=rank, pp_rank=pp_rank, pp_size=pp_size),
        graphs=types.SimpleNamespace(captured=True, stats=lambda: stats),
        iteration=iteration,
    )


@pytest.fixture
def fake_allocator(monkeypatch):
    stats = {"allocated_mb": 100.0, "max_allocated_mb": 4000.5, "reserved_mb": 4100.0, "max_reserved_mb": 4520.25}
    monkeypatch.setattr(logging_utils, "memory_stats_mb", lambda device: dict(stats))


def test_iteration_lines_real_and_formatted():
    formatted = logging_utils.format_iteration_line(
        iteration=30,
        train_iters=30,
        consumed_samples=480,
        elapsed_ms=61.25,
        lr=1e-4,
        global_batch_size=16,
        losses={"lm loss": 10.123456789, "load_balancing_loss": 1.5},
        loss_scale=1.0,
        grad_norm=2.0,
        skipped_iters=0,
        nan_iters=0,
        throughput_tflops=300.0,
        timestamp=datetime.datetime(2026, 12, 4),
    )
    rows = two_gpu_logs.parse_iteration_lines(f"noise\n{REAL_ITERATION_LINE}\n[Rank 0] other\n{formatted}\n")
    assert rows == [
        {"iteration": 1, "train_iters": 3, "ms": 570.1, "lm_loss": 5.569382},
        {"iteration": 30, "train_iters": 30, "ms": 61.2, "lm_loss": 10.12346},
    ]


def test_memory_lines_of_each_rank_as_the_trainer_prints_them(fake_allocator):
    out = io.StringIO()
    with redirect_stdout(out):
        IterationLogging._log_memory(_trainer_like(0, 0, 2, iteration=1, graphs=99))  # an earlier line
        IterationLogging._log_memory(_trainer_like(0, 0, 2, graphs=16))
        IterationLogging._log_memory(_trainer_like(1, 1, 2, graphs=10))
    per_rank = two_gpu_logs.parse_memory_lines(out.getvalue())
    assert per_rank[0] == {
        "after_iterations": 30,
        "max_allocated_mb": 4000.5,
        "max_reserved_mb": 4520.25,
        "source": "memory line",
        "graphs": 16,
        "pool_reserved_mb": 1304.0,
    }
    assert per_rank[1]["graphs"] == 10


def test_memory_line_with_log_device_memory_used(fake_allocator, monkeypatch):
    """--log-device-memory-used: Megatron's "total device memory used" right after "max reserved"."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1000 * MB, 5000 * MB))
    out = io.StringIO()
    with redirect_stdout(out):
        IterationLogging._log_memory(_trainer_like(0, 0, 1, device_memory_used=True))
    assert (
        "| max reserved: 4520.25 | total device memory used: 4000.00 | graph pool reserved: 1304.00 |" in out.getvalue()
    )


def test_pool_line_as_the_session_prints_it():
    session = types.SimpleNamespace(
        pool_stats=lambda: (1304 * MB, 0),
        num_graphs=lambda: 12,
        strong_bytes=lambda: 0,
        capture_seconds=0.25,
        pools={0: None, 1: None},
        backward_pool=object(),
        _turn=None,
        _scratch_open=False,
        scratch_captured=False,
        feed_open=False,
    )
    text = "> " + GraphSession.summary_line(session, stage=(1, 2)) + "\n> " + GraphSession.summary_line(session)
    assert two_gpu_logs.parse_pool_lines(text) == [
        {"pipeline_rank": 1, "graphs": 12, "reserved_mb": 1304.0},
        {"pipeline_rank": None, "graphs": 12, "reserved_mb": 1304.0},
    ]


def test_last_rank_memory_from_the_metrics_file_when_it_prints_no_memory_line(fake_allocator, tmp_path):
    record = {"iteration": 30, "lm loss": 5.0, **IterationLogging._memory_record(_trainer_like(1, 0, 1, graphs=32))}
    path = tmp_path / "run.jsonl"
    path.write_text(json.dumps(record) + "\n" + '{"iteration": 31, "lm lo')  # a torn last line
    records = two_gpu_logs.read_metrics(str(path))
    log = "[Rank 0] (after 30 iterations) memory (MB) | allocated: 1.00 | max allocated: 2.00 | reserved: 3.00 | max reserved: 4.00"
    per_rank = two_gpu_logs.per_rank_memory(log, records, world_size=2)
    assert per_rank[0]["max_reserved_mb"] == 4.0 and "graphs" not in per_rank[0]
    assert per_rank[1]["source"] == "metrics file"
    assert per_rank[1]["graphs"] == 32
    assert per_rank[1]["max_reserved_mb"] == pytest.approx(4520.25)
    assert per_rank[1]["pool_reserved_mb"] == pytest.approx(1304.0)
    # Losses: exact from the file, else the log line's 7 digits.
    assert two_gpu_logs.losses("", records) == ({30: 5.0}, "metrics file")
    assert two_gpu_logs.losses(REAL_ITERATION_LINE, []) == ({1: 5.569382}, "log (7 digits)")


def test_compare_losses_bitwise_relative_and_nan():
    assert two_gpu_logs.compare_losses({1: 2.0, 2: 3.0}, {1: 2.0, 2: 3.0})["bitwise"]
    c = two_gpu_logs.compare_losses({1: 2.0, 2: 3.003}, {1: 2.0, 2: 3.0, 3: 1.0})
    assert not c["bitwise"] and c["iterations"] == 2 and c["max_rel"] == pytest.approx(1e-3)
    assert two_gpu_logs.compare_losses({1: float("nan")}, {1: 1.0})["max_rel"] == float("inf")
    assert two_gpu_logs.compare_losses({1: 1.0}, {2: 1.0}) is None


def test_graph_bounds():
    runs = {r.name: r for r in two_gpu_plan.all_runs()}
    gpu = two_gpu_plan.GPU
    # No pipelining: 8 layer graphs + the head, forward and backward, one slot (as measured on one H200: 18).
    assert [two_gpu_plan.graph_bound(runs["tp2sp_layer"], gpu, r) for r in (0, 1)] == [18, 18]
    # 1F1B over 8 micro-batches: stage 0 has 2 in flight, the last stage 1 (and the head).
    assert [two_gpu_plan.graph_bound(runs["pp2_attn_mlp"], gpu, r) for r in (0, 1)] == [16, 10]
    # 2 chunks of 2 layers; a slot serves either chunk: 5 micro-batches in flight on stage 0, 3 on
    # the last (whose last chunk adds the head).
    assert [two_gpu_plan.graph_bound(runs["pp2vpp2_layer"], gpu, r) for r in (0, 1)] == [2 * 4 * 5, 2 * 5 * 3]
    # MoE: attention, router, permutation and postprocess per layer, head eager; ``moe``: block + head.
    assert two_gpu_plan.graph_bound(runs["ep2_attn_router_pre"], gpu, 1) == 2 * 4 * 4
    assert two_gpu_plan.graph_bound(runs["ep2_dp_moe"], gpu, 0) == 2 * (4 + 1)
    assert two_gpu_plan.graph_bound(runs["tp2sp_eager"], gpu, 0) is None
    # The full-iteration graph: one per rank (one micro-batch count).
    assert [two_gpu_plan.graph_bound(runs["tp2sp_full"], gpu, r) for r in (0, 1)] == [1, 1]
    assert "--cuda-graph-impl full_iteration" in " ".join(
        two_gpu_plan.argv(runs["tp2sp_full"], gpu, 30, metrics_file="m", ckpt_dir="c")
    )


@pytest.mark.parametrize("sizes", [two_gpu_plan.GPU, two_gpu_plan.SMOKE], ids=["h200_sizes", "smoke_sizes"])
def test_every_run_is_a_valid_command_line_and_the_plan_matches_the_trainers_config(sizes):
    """The flags of every run pass the trainer's validation at its world size, and what the
    graph bound assumes (micro-batches per rank, DP, regions per layer, head) is what the
    trainer's own config and scope resolver say."""
    from megatron.core.transformer.cuda_graphs import regions
    from megatron.core.transformer.moe.moe_layer import MoETransformerLayer
    from megatron.core.transformer.transformer_layer import TransformerLayer
    from megatron.training.arguments import parse_args

    for spec in two_gpu_plan.all_runs():
        argv = two_gpu_plan.argv(spec, sizes, 30, metrics_file="m.jsonl", ckpt_dir="ckpt")
        cfg = parse_args(argv).resolve(world_size=spec.nproc)
        cfg.validate()
        par = cfg.parallel
        assert (par.tensor_model_parallel_size, par.pipeline_model_parallel_size) == (spec.tp, spec.pp), spec.name
        assert par.data_parallel_size == spec.dp, spec.name
        assert cfg.num_microbatches == sizes.microbatches_per_rank(spec.model, spec.dp), spec.name
        assert cfg.cuda_graph.captures == spec.graphed, spec.name
        if spec.impl == "full_iteration":
            assert cfg.cuda_graph.full_iteration and spec.scope == "", spec.name
        elif spec.graphed:
            layer = TransformerLayer if spec.model == "dense" else MoETransformerLayer
            chosen = regions.resolve(cfg.cuda_graph.cuda_graph_scope, [layer], cfg.model)[layer]
            head = regions.head_follows(chosen, layer)
            assert two_gpu_plan.SCOPE_REGIONS[(spec.model, spec.scope)] == (len(chosen), head), spec.name


def test_only_names_and_order():
    runs = two_gpu_plan.all_runs()
    assert [r.name for r in runs[:3]] == ["tp2sp_eager", "tp2sp_layer", "tp2sp_attn_mlp"]
    assert runs[-1].name == "tp2sp_full" and runs[-1].describe() == "TP=2 SP full iteration"
    picked = two_gpu_plan.select(runs, ["ckpt_save_tp2", "tp2sp_eager"])
    assert [r.name for r in picked] == ["tp2sp_eager", "ckpt_save_tp2"]
    with pytest.raises(ValueError, match="--only: unknown run"):
        two_gpu_plan.select(runs, ["tp3"])


def _row(name, losses, ranks, status="ok", ms=50.0):
    return {
        "name": name,
        "what": name,
        "status": status,
        "nproc": 2,
        "last_iteration": max(losses, default=0),
        "losses": {str(k): v for k, v in losses.items()},
        "ms_per_iter": ms,
        "ranks": ranks,
        "wall_s": 20.0,
    }


def test_checks_flag_non_bitwise_losses_graph_counts_memory_and_failures():
    runs = {r.name: r for r in two_gpu_plan.all_runs()}
    gpu = two_gpu_plan.GPU
    mem = lambda peak, graphs=None: {
        "max_reserved_mb": peak,
        **({"graphs": graphs, "pool_reserved_mb": 300.0} if graphs is not None else {}),
    }
    iters = 3  # the checkpoint runs: saved after 1, loaded for 2 and 3
    rows = {
        "tp2sp_eager": _row("tp2sp_eager", {1: 10.0, 2: 9.0, 3: 8.0}, {"0": mem(1000.0), "1": mem(2000.0)}),
        "gpu1_eager": _row("gpu1_eager", {1: 10.0, 2: 9.05, 3: 8.0}, {"0": mem(1500.0)}),
    }
    good = _row("tp2sp_layer", {1: 10.0, 2: 9.0, 3: 8.0}, {"0": mem(1010.0, 18), "1": mem(1990.0, 18)}, ms=40.0)
    two_gpu_run.compare(runs["tp2sp_layer"], good, rows, gpu, iters)
    assert good["verdict"] == "ok"
    assert good["checks"]["ms_vs_eager"] == pytest.approx(0.8)
    assert good["checks"]["memory_vs_eager"] == {"0": pytest.approx(0.01), "1": pytest.approx(-0.005)}
    assert good["checks"]["vs_one_gpu"]["max_rel"] == pytest.approx(0.05 / 9.05)
    bad = _row("tp2sp_layer", {1: 10.0, 2: 9.2, 3: 8.0}, {"0": mem(1000.0, 19), "1": mem(1000.0, 0)})
    two_gpu_run.compare(runs["tp2sp_layer"], bad, rows, gpu, iters)
    assert bad["problems"] == [
        "not bitwise as tp2sp_eager",
        "loss off 1 GPU beyond 0.01",
        "rank 0: 19 graphs > bound 18",
        "rank 1: no graphs captured",
    ]
    short = _row("tp2sp_layer", {1: 10.0, 2: 9.0}, {"0": mem(1000.0)})
    two_gpu_run.compare(runs["tp2sp_layer"], short, rows, gpu, iters)
    assert short["problems"] == [
        "logged 2 of 3 iterations",
        "rank 0: no graph count reported",
        "rank 1: no graph count reported",
    ]
    hung = _row("tp2sp_attn_mlp", {1: 10.0, 2: 9.0, 3: 8.0}, {}, status="hung")
    two_gpu_run.compare(runs["tp2sp_attn_mlp"], hung, rows, gpu, iters)
    assert hung["problems"] == ["hung at iteration 3"]
    failed = dict(_row("pp2_eager", {}, {}, status="failed"), rc=1, error="ValueError: --foo: bad")
    two_gpu_run.compare(runs["pp2_eager"], failed, rows, gpu, iters)
    assert failed["verdict"] == "failed (rc 1): ValueError: --foo: bad"
    load = _row("ckpt_load_pp2", {2: 9.0, 3: 8.0}, {})
    two_gpu_run.compare(runs["ckpt_load_pp2"], load, rows, gpu, iters)
    assert load["verdict"] == "ok" and load["checks"]["vs_eager"]["iterations"] == 2
    late = _row("ckpt_load_tp1", {1: 10.0, 2: 9.0, 3: 8.0}, {})
    two_gpu_run.compare(runs["ckpt_load_tp1"], late, rows, gpu, iters)
    assert late["problems"] == ["logged 3 of 2 iterations", "did not resume at iteration 2 (first 1)"]
    table = two_gpu_run.table([rows["tp2sp_eager"], good, bad, hung, load])
    assert "| tp2sp_layer | tp2sp_layer | ok | 3 | bitwise | rel 5.5e-03 | 40.0 | 0.800 | 0.99/1.94 |" in table
    assert "| +1.0%/-0.5% | 18/18 (18/18) | 300/300 | 20 | ok |" in table
    assert "| 19/0 (18/18) |" in table


FAKE_RUN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    # A worker in a session of its own, as torchrun starts them.
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    open(sys.argv[1], "w").write(str(child.pid))
    print(sys.argv[2], flush=True)
    if sys.argv[3] == "exit":
        time.sleep(1.0)  # a launcher lives longer than one poll (0.25 s) of the runner
        sys.exit(3)
    time.sleep(600)
    """
)


def _line(iteration, total):
    return REAL_ITERATION_LINE.replace("iteration        1/       3", f"iteration {iteration:8d}/{total:8d}")


def _fake(tmp_path, line, then):
    pid_file = tmp_path / f"child_{then}.pid"
    cmd = [sys.executable, "-c", FAKE_RUN, str(pid_file), line, then]
    return cmd, pid_file


def _gone(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if two_gpu_proc._start_time(pid) is None:
            return True
        time.sleep(0.1)
    return False


def test_a_run_that_does_not_exit_after_its_last_iteration_is_reported_hung_and_killed(tmp_path):
    cmd, pid_file = _fake(tmp_path, _line(3, 3), "sleep")
    log = tmp_path / "hung.log"
    outcome = two_gpu_proc.run_command(cmd, str(log), timeout_s=60, hang_grace_s=1.0)
    assert outcome.status == "hung" and outcome.rc is None and outcome.last_iteration == 3
    assert outcome.wall_s < 30
    assert _gone(int(pid_file.read_text())), "the worker in its own session survived"


def test_timeout_stall_before_the_last_iteration_and_a_failed_run(tmp_path):
    cmd, pid_file = _fake(tmp_path, _line(1, 3), "sleep")
    outcome = two_gpu_proc.run_command(cmd, str(tmp_path / "slow.log"), timeout_s=3, hang_grace_s=1.0)
    assert (outcome.status, outcome.last_iteration, outcome.final_after_s) == ("timeout", 1, None)
    assert _gone(int(pid_file.read_text()))
    cmd, pid_file = _fake(tmp_path, _line(1, 3), "sleep")
    outcome = two_gpu_proc.run_command(cmd, str(tmp_path / "stall.log"), timeout_s=60, hang_grace_s=1.0, stall_s=1.0)
    assert (outcome.status, outcome.last_iteration) == ("stalled", 1) and outcome.wall_s < 30
    assert _gone(int(pid_file.read_text()))
    cmd, pid_file = _fake(tmp_path, _line(3, 3), "exit")
    outcome = two_gpu_proc.run_command(cmd, str(tmp_path / "failed.log"), timeout_s=60, hang_grace_s=30)
    assert (outcome.status, outcome.rc) == ("failed", 3)
    assert _gone(int(pid_file.read_text())), "a worker left behind by a launcher that exited"


@pytest.mark.slow
def test_cpu_smoke_subset(tmp_path, capsys):
    """TP=2+SP eager and graphed (eager on the CPU), the one-process reference, a TP=2 save
    and a TP=1 x DP=2 load, 3 iterations each: every check passes (fp32, 1e-5 across layouts)."""
    out = tmp_path / "out"
    names = ["tp2sp_eager", "tp2sp_attn_mlp", "gpu1_eager", "ckpt_save_tp2", "ckpt_load_tp1"]
    rc = two_gpu_run.main(["--cpu-smoke", "--out", str(out), "--iters", "3", "--only", *names])
    printed = capsys.readouterr().out
    result = json.loads((out / "two_gpu.json").read_text())
    runs = {r["name"]: r for r in result["runs"]}
    assert rc == 0, printed
    assert list(runs) == names
    assert all(r["verdict"] == "ok" and r["status"] == "ok" for r in runs.values()), printed
    assert len(runs["tp2sp_eager"]["losses"]) == 3 and runs["tp2sp_eager"]["loss_source"] == "metrics file"
    assert runs["tp2sp_attn_mlp"]["checks"]["vs_eager"]["bitwise"]
    assert runs["tp2sp_eager"]["checks"]["vs_one_gpu"]["max_rel"] <= 1e-5
    assert list(runs["ckpt_save_tp2"]["losses"]) == ["1"]
    assert list(runs["ckpt_load_tp1"]["losses"]) == ["2", "3"]
    assert runs["ckpt_load_tp1"]["checks"]["vs_eager"]["max_rel"] <= 1e-5
    assert os.path.exists(out / "ckpt_load_tp1.log")
    assert printed.splitlines()[-2].startswith("loss vs eager:")


def test_runs_that_do_not_fit_the_budget_are_skipped_and_reported(tmp_path, capsys):
    out = tmp_path / "out"
    rc = two_gpu_run.main(["--cpu-smoke", "--out", str(out), "--budget-s", "1", "--only", "tp2sp_eager,ckpt_load_pp2"])
    runs = json.loads((out / "two_gpu.json").read_text())["runs"]
    assert rc == 1
    assert [r["status"] for r in runs] == ["skipped", "skipped"]
    assert runs[0]["verdict"].startswith("time budget (1 s left")
    assert runs[1]["verdict"].startswith("needs a saved checkpoint (ckpt_save_tp2")
    assert not (out / "tp2sp_eager.log").exists()
    assert "| tp2sp_eager | TP=2 SP eager | skipped |" in capsys.readouterr().out


def test_pace_scales_the_estimates_by_the_finished_runs():
    estimates = {"a": 10.0, "b": 20.0, "c": 30.0, "d": 5.0}
    assert two_gpu_run.pace({}, estimates) == 1.0
    rows = {"a": {"status": "ok", "wall_s": 15.0}, "b": {"status": "ok", "wall_s": 30.0}, "d": {"status": "hung"}}
    assert two_gpu_run.pace(rows, estimates) == 1.5
    assert two_gpu_run.pace({"a": {"status": "ok", "wall_s": 100.0}}, estimates) == 3.0


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_two_gpu_subset_reports_every_rank_gpu(tmp_path, capsys):
    """On two GPUs: TP=2+SP and MoE EP=2 (drop-and-pad), eager and graphed, 6 iterations.
    Graphed losses equal eager's bit for bit, and every rank has a peak and a graph count
    within its bound; at EP=2 rank 1 prints no memory line, so its numbers come from the
    metrics file."""
    out = tmp_path / "out"
    names = ["tp2sp_eager", "tp2sp_layer", "ep2_dp_eager", "ep2_dp_moe"]
    rc = two_gpu_run.main(["--out", str(out), "--iters", "6", "--only", *names])
    printed = capsys.readouterr().out
    runs = {r["name"]: r for r in json.loads((out / "two_gpu.json").read_text())["runs"]}
    assert rc == 0, printed
    for name in names:
        assert set(runs[name]["ranks"]) == {"0", "1"}, (name, printed)
        assert all(m["max_reserved_mb"] > 0 for m in runs[name]["ranks"].values()), name
    for name in ("tp2sp_layer", "ep2_dp_moe"):
        assert runs[name]["checks"]["vs_eager"]["bitwise"], name
        assert all(0 < g["graphs"] <= g["bound"] for g in runs[name]["checks"]["graphs"].values()), name
    assert runs["ep2_dp_moe"]["ranks"]["1"]["source"] == "metrics file"
    assert runs["tp2sp_layer"]["ranks"]["1"]["source"] == "memory line"
